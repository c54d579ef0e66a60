"""A MoE served with an expert pool much smaller than its experts, over HTTP with the openai client: the
all-resident server's greedy tokens (alone and batched), moving metrics, the request log line's pool fields,
and anonymous memory bounded by dense + pool + a stated margin."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import httpx
import openai
import pytest

from deltafin.engine.experts.checkpoint import checkpoint_files, tensor_table
from deltafin.tiny.moe import MoeShape, write_moe
from tests.conftest import LiveServer
from tests.shared_server import shared_model

pytestmark = pytest.mark.e2e

#: 128 experts of 96 KiB: a pool of 2 MiB (21 slots) is a sixth of them, and holds 16 (4 rows x top-2, twice)
SMALL = MoeShape(experts=32, top_k=2, layers=5, hidden=128, intermediate=64)
#: 256 experts of 3 MiB (768 MiB): more than the margin below, so a process holding them would fail the bound
LARGE = MoeShape(experts=64, top_k=2, layers=5, hidden=512, intermediate=512)
#: what a serving process holds besides the weights: interpreter, torch, transformers, tokenizers, Litestar,
#: activations, the readers' scratch buffers (measured: ~300 MiB for a tiny model's server)
MARGIN_MIB = 400
PROMPTS = [
    "Tell me about the sea.",
    "What is the weather in Paris today?",
    "Hello, how can I help you?",
    "Let me think about this step by step.",
]


def start(overrides: list[str]) -> LiveServer:
    server = LiveServer(overrides)
    try:
        server.wait_ready()
    except BaseException:
        server.stop()
        raise
    return server


COMMON = ["model=qwen3", "engine.max_batch=4", "server.memo.entries=0"]


def _resident(root: Path) -> tuple[Path, list[str]]:
    folder = write_moe("qwen3_moe", root / "qwen3-moe", SMALL)
    return folder, [*COMMON, f"model.path={folder}"]


#: every expert resident: the reference, on the shared server (which serves no model with a pool, so its
#: /metrics has no pool series)
RESIDENT = shared_model("moe-resident", _resident)


@pytest.fixture(scope="module")
def servers(local_server):
    """(the shared server and the model name it serves the resident MoE as; a server of the same checkpoint
    with a 2 MiB pool, a process of its own: its metrics are the pool's)."""
    pooled = start([*COMMON, f"model.path={RESIDENT.folder}", "model.name=moe", "placement.experts.pool_mb=2"])
    try:
        yield (local_server, RESIDENT.name), (pooled, "moe")
    finally:
        pooled.stop()


def complete(server: tuple[LiveServer, str], prompt: str, out: list, at: int) -> None:
    live, model = server
    client = openai.OpenAI(base_url=f"{live.base_url}/v1", api_key="x", max_retries=0, timeout=120)
    response = client.chat.completions.with_raw_response.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    out[at] = (response.parse().choices[0].message.content, response.headers["x-request-id"])


def run(server: tuple[LiveServer, str], together: bool) -> list:
    out: list = [None] * len(PROMPTS)
    threads = [threading.Thread(target=complete, args=(server, p, out, i)) for i, p in enumerate(PROMPTS)]
    for thread in threads:
        thread.start()
        if not together:
            thread.join(120)
    for thread in threads:
        thread.join(120)
    return out


def metric(server: LiveServer, name: str, model: str = "moe") -> float:
    """A series of `model` (the pooled servers serve one model, `moe`)."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    match = re.search(rf'^{name}\{{model="{model}"\}} (\S+)$', text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def test_pooled_server_gives_the_resident_servers_tokens(servers):
    (resident, resident_model), (pooled, pooled_model) = servers
    reference = run((resident, resident_model), together=False)
    expected = [text for text, _ in reference]
    assert metric(pooled, "deltafin_expert_pool_slots") == 21  # of 128 experts
    misses, read = (
        metric(pooled, "deltafin_expert_pool_misses_total"),
        metric(pooled, "deltafin_expert_bytes_read_total"),
    )
    alone = run((pooled, pooled_model), together=False)
    batched = run((pooled, pooled_model), together=True)
    assert [text for text, _ in alone] == expected
    assert [text for text, _ in batched] == expected
    assert metric(pooled, "deltafin_expert_pool_misses_total") > misses
    assert metric(pooled, "deltafin_expert_bytes_read_total") > read
    assert metric(pooled, "deltafin_expert_pool_hits_total") > 0
    assert metric(pooled, "deltafin_expert_pool_occupancy") == 1.0
    line = pooled.request_log(batched[0][1])
    assert 0 <= line["expert_hit_rate"] <= 1 and line["expert_bytes_per_token"] > 0 and line["expert_prefill_bytes"] > 0
    assert "expert_hit_rate" not in resident.request_log(reference[0][1])
    assert "deltafin_expert_pool" not in httpx.get(f"{resident.base_url}/metrics", timeout=10).text


def rss_anon(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon")


def test_anonymous_memory_is_dense_plus_pool_plus_margin(tmp_path):
    folder = write_moe("qwen3_moe", tmp_path / "large", LARGE, stream=True)
    table = tensor_table(checkpoint_files(folder))
    experts = sum(entry.nbytes for name, entry in table.items() if ".experts." in name)
    dense = sum(entry.nbytes for name, entry in table.items() if ".experts." not in name)
    assert experts > MARGIN_MIB << 20 and dense < experts // 10
    server = start(
        [
            "model=qwen3",
            f"model.path={folder}",
            "model.name=moe",
            "engine.max_batch=2",
            "placement.experts.pool_mb=96",
            "server.memo.entries=0",
        ]
    )
    try:
        pool = metric(server, "deltafin_expert_pool_bytes")
        assert pool <= 96 << 20 and pool * 7 < experts
        run((server, "moe"), together=True)  # reads evict and refill every slot, several times over
        assert metric(server, "deltafin_expert_pool_misses_total") > 2 * metric(server, "deltafin_expert_pool_slots")
        used = rss_anon(server.process.pid)
        bound = dense + pool + (MARGIN_MIB << 20)
        assert used <= bound, (
            f"RssAnon {used >> 20} MiB > dense {dense >> 20} + pool {int(pool) >> 20} + {MARGIN_MIB} MiB"
        )
    finally:
        server.stop()
