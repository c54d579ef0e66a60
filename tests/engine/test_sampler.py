import torch

from deltafin.engine.local.sampler import Sampler
from deltafin.protocol.sampling import SamplingParams
from tests.engine.fakes import AllowList

CPU = torch.device("cpu")


def draw(s: Sampler, logits: torch.Tensor) -> int:
    return int(s.sample(logits))


def sampler(**kwargs) -> Sampler:
    return Sampler(SamplingParams(max_tokens=1, **kwargs), 5, CPU, prompt_ids=[])


class TestSampler:
    def test_greedy_takes_the_argmax(self):
        assert sampler(temperature=0.0).sample(torch.tensor([0.0, 3.0, 1.0, 2.0, -1.0])) == 1

    def test_logit_bias_changes_the_greedy_choice(self):
        s = sampler(temperature=0.0, logit_bias=((2, 5.0),))
        assert draw(s, torch.tensor([0.0, 3.0, 1.0, 2.0, -1.0])) == 2

    def test_same_seed_same_draws(self):
        logits = torch.zeros(5)
        first = sampler(temperature=1.0, seed=7)
        second = sampler(temperature=1.0, seed=7)
        assert [draw(first, logits) for _ in range(20)] == [draw(second, logits) for _ in range(20)]

    def test_top_k_one_is_greedy(self):
        s = sampler(temperature=1.0, top_k=1, seed=1)
        assert {draw(s, torch.tensor([0.0, 3.0, 1.0, 2.0, -1.0])) for _ in range(20)} == {1}

    def test_top_p_keeps_only_the_nucleus(self):
        # softmax([10, 9, 0, 0, 0]) ~ [0.73, 0.27, ...]: top_p=0.5 keeps only token 0.
        s = sampler(temperature=1.0, top_p=0.5, seed=3)
        assert {draw(s, torch.tensor([10.0, 9.0, 0.0, 0.0, 0.0])) for _ in range(30)} == {0}

    def test_min_p_drops_unlikely_tokens(self):
        s = sampler(temperature=1.0, min_p=0.5, seed=3)
        assert {draw(s, torch.tensor([10.0, 9.5, 0.0, 0.0, 0.0])) for _ in range(50)} <= {0, 1}

    def test_frequency_penalty_pushes_away_a_repeated_token(self):
        s = sampler(temperature=0.0, frequency_penalty=2.0)
        logits = torch.tensor([1.0, 1.5, 0.0, 0.0, 0.0])
        assert draw(s, logits) == 1
        s.observe(1)
        assert draw(s, logits) == 0

    def test_repetition_penalty_covers_the_prompt(self):
        s = Sampler(SamplingParams(max_tokens=1, temperature=0.0, repetition_penalty=2.0), 5, CPU, prompt_ids=[1])
        assert draw(s, torch.tensor([1.0, 1.5, 0.0, 0.0, 0.0])) == 0

    def test_logprob_is_of_the_raw_distribution(self):
        s = sampler(temperature=0.0, logprobs=True, top_logprobs=2)
        logits = torch.tensor([0.0, 3.0, 1.0, 2.0, -1.0])
        entry = s.logprob(logits, 1)
        assert abs(entry.logprob - float(torch.log_softmax(logits, -1)[1])) < 1e-6
        assert [token for token, _ in entry.top] == [1, 3]


class TestNonFiniteGuard:
    def test_tiny_repetition_penalty_samples_a_real_token(self):
        # Seen tokens with positive logits become +inf (x / 1e-300): softmax would give nan.
        s = Sampler(SamplingParams(max_tokens=1, temperature=1.0, repetition_penalty=1e-300, seed=1), 5, CPU, [1, 3])
        assert {draw(s, torch.tensor([0.5, 3.0, 1.0, 2.0, -1.0])) for _ in range(10)} <= {0, 1, 2, 3, 4}
        assert draw(s, torch.tensor([0.5, 3.0, 1.0, 2.0, -1.0])) in (1, 3)

    def test_extreme_logit_bias_and_temperature(self):
        s = sampler(temperature=1e-6, seed=2, logit_bias=((4, 3e38), (0, -3e38)))
        assert draw(s, torch.tensor([0.0, 3.0, 1.0, 2.0, 3e38])) == 4

    def test_everything_ruled_out_still_returns_a_token(self):
        s = sampler(temperature=1.0, seed=2, logit_bias=tuple((i, float("-inf")) for i in range(5)))
        assert 0 <= draw(s, torch.tensor([0.0, 3.0, 1.0, 2.0, -1.0])) < 5

    def test_nan_logits_never_reach_multinomial(self):
        s = sampler(temperature=0.7, top_p=0.9, seed=2)
        assert draw(s, torch.tensor([float("nan"), 3.0, float("nan"), 2.0, -1.0])) in (1, 3)


class TestConstraintHook:
    def test_only_allowed_tokens_are_sampled(self):
        allow = AllowList([2, 4], length=100)
        s = Sampler(SamplingParams(max_tokens=1, temperature=1.0, seed=5), 5, CPU, [], allow)
        for _ in range(30):
            token = draw(s, torch.tensor([0.0, 9.0, 1.0, 8.0, -1.0]))
            s.observe(token)
        assert set(allow.accepted) <= {2, 4} and len(allow.accepted) == 30

    def test_mask_comes_after_bias_and_before_greedy(self):
        # The bias makes token 0 the best, but the constraint forbids it.
        params = SamplingParams(max_tokens=1, temperature=0.0, logit_bias=((0, 50.0),))
        s = Sampler(params, 5, CPU, [], AllowList([3, 4], length=9))
        assert draw(s, torch.tensor([0.0, 9.0, 1.0, 2.0, -1.0])) == 3

    def test_logprobs_stay_those_of_the_raw_distribution(self):
        s = Sampler(SamplingParams(max_tokens=1, temperature=0.0, logprobs=True), 5, CPU, [], AllowList([3], length=9))
        logits = torch.tensor([0.0, 3.0, 1.0, 2.0, -1.0])
        token = draw(s, logits)
        assert token == 3 and abs(s.logprob(logits, token).logprob - float(torch.log_softmax(logits, -1)[3])) < 1e-6
        assert torch.isfinite(logits).all()  # the mask did not touch the model's logits

    def test_terminated_after_the_grammar_completes(self):
        allow = AllowList([1], length=2)
        s = Sampler(SamplingParams(max_tokens=1, temperature=0.0), 5, CPU, [], allow)
        s.observe(1)
        assert not s.terminated
        s.observe(1)
        assert s.terminated
