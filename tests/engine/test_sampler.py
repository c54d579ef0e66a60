import torch

from deltafin.engine.sampler import Sampler
from deltafin.protocol.sampling import SamplingParams

CPU = torch.device("cpu")


def sampler(**kwargs) -> Sampler:
    return Sampler(SamplingParams(max_tokens=1, **kwargs), 5, CPU, prompt_ids=[])


class TestSampler:
    def test_greedy_takes_the_argmax(self):
        assert sampler(temperature=0.0).sample(torch.tensor([0.0, 3.0, 1.0, 2.0, -1.0])) == 1

    def test_logit_bias_changes_the_greedy_choice(self):
        s = sampler(temperature=0.0, logit_bias=((2, 5.0),))
        assert s.sample(torch.tensor([0.0, 3.0, 1.0, 2.0, -1.0])) == 2

    def test_same_seed_same_draws(self):
        logits = torch.zeros(5)
        first = sampler(temperature=1.0, seed=7)
        second = sampler(temperature=1.0, seed=7)
        assert [first.sample(logits) for _ in range(20)] == [second.sample(logits) for _ in range(20)]

    def test_top_k_one_is_greedy(self):
        s = sampler(temperature=1.0, top_k=1, seed=1)
        assert {s.sample(torch.tensor([0.0, 3.0, 1.0, 2.0, -1.0])) for _ in range(20)} == {1}

    def test_top_p_keeps_only_the_nucleus(self):
        # softmax([10, 9, 0, 0, 0]) ~ [0.73, 0.27, ...]: top_p=0.5 keeps only token 0.
        s = sampler(temperature=1.0, top_p=0.5, seed=3)
        assert {s.sample(torch.tensor([10.0, 9.0, 0.0, 0.0, 0.0])) for _ in range(30)} == {0}

    def test_min_p_drops_unlikely_tokens(self):
        s = sampler(temperature=1.0, min_p=0.5, seed=3)
        assert {s.sample(torch.tensor([10.0, 9.5, 0.0, 0.0, 0.0])) for _ in range(50)} <= {0, 1}

    def test_frequency_penalty_pushes_away_a_repeated_token(self):
        s = sampler(temperature=0.0, frequency_penalty=2.0)
        logits = torch.tensor([1.0, 1.5, 0.0, 0.0, 0.0])
        assert s.sample(logits) == 1
        s.observe(1)
        assert s.sample(logits) == 0

    def test_repetition_penalty_covers_the_prompt(self):
        s = Sampler(SamplingParams(max_tokens=1, temperature=0.0, repetition_penalty=2.0), 5, CPU, prompt_ids=[1])
        assert s.sample(torch.tensor([1.0, 1.5, 0.0, 0.0, 0.0])) == 0

    def test_logprob_is_of_the_raw_distribution(self):
        s = sampler(temperature=0.0, logprobs=True, top_logprobs=2)
        logits = torch.tensor([0.0, 3.0, 1.0, 2.0, -1.0])
        entry = s.logprob(logits, 1)
        assert abs(entry.logprob - float(torch.log_softmax(logits, -1)[1])) < 1e-6
        assert [token for token, _ in entry.top] == [1, 3]
