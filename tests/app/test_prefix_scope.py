"""Who reuses whose cached prompt prefix, through the app in process with the real default model and the official
openai client: `server.prefix_cache.scope=global` shares prefixes across API keys (usage's cached_tokens say so),
`api_key` keeps them to the key that sent them; /metrics counts hits by tier."""

from __future__ import annotations

import re

import openai
import pytest
from litestar.testing import TestClient

from deltafin.app import build_app
from deltafin.app.services import Services
from deltafin.engine import EngineFront
from deltafin.engine.local.build import prefix_cache_settings
from deltafin.engine.local.engine import LocalEngine
from tests.conftest import compose_config

SYSTEM = "You answer in one short sentence. " * 12


def app_client(loaded_model, scope: str, tmp_path):
    config = compose_config(
        [
            "server.api_keys=[k1,k2]",
            f"server.prefix_cache.scope={scope}",
            f"server.prefix_cache.disk_dir={tmp_path}",
            "server.memo.entries=0",
        ]
    )
    engine = LocalEngine(loaded_model, prefix_cache=prefix_cache_settings(config, loaded_model))
    front = EngineFront(engine, max_waiting=4, timeout_s=60, memo_entries=0)
    return TestClient(build_app(config, Services.from_engine(config, front)))


def ask(client, key: str, question: str) -> int:
    """The cached_tokens of one chat sent with `key`."""
    sdk = openai.OpenAI(base_url=f"{client.base_url}/v1", api_key=key, http_client=client, max_retries=0)
    answer = sdk.chat.completions.create(
        model="smollm2",
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        max_tokens=2,
        temperature=0,
    )
    return answer.usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("scope", ["global", "api_key"])
def test_a_prefix_is_shared_across_keys_only_under_global_scope(loaded_model, scope, tmp_path):
    with app_client(loaded_model, scope, tmp_path) as client:
        assert ask(client, "k1", "Name a river.") == 0
        assert ask(client, "k1", "Name a lake.") > 80  # the system prompt, from RAM
        other_key = ask(client, "k2", "Name a sea.")
        assert (other_key > 80) if scope == "global" else (other_key == 0)
        metrics = client.get("/metrics", headers={"authorization": "Bearer k1"}).text
        hits = {tier: _value(metrics, "deltafin_prefix_cache_tier_hits_total", tier) for tier in ("ram", "disk")}
        assert hits == {"ram": 2.0 if scope == "global" else 1.0, "disk": 0.0}
        assert _value(metrics, "deltafin_prefix_cache_bytes", "ram") > 0
        assert _value(metrics, "deltafin_prefix_cache_tier_hit_tokens_total", "ram") > 80


def _value(metrics: str, name: str, tier: str) -> float:
    match = re.search(rf'^{name}\{{model="SmolLM2-135M-Instruct",tier="{tier}"\}} (\S+)$', metrics, re.M)
    assert match, f"{name} for {tier} not in /metrics"
    return float(match.group(1))


def test_the_memo_follows_the_scope():
    """An identical deterministic request replays from the memo only within its scope: a replay is a timing
    side channel too."""
    from deltafin.engine import GenerationJob
    from deltafin.engine.memo import ResponseMemo
    from deltafin.protocol.sampling import SamplingParams

    memo = ResponseMemo(4)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    memo.put(GenerationJob((1, 2, 3), params, cache_scope="key-a"), ["recorded"])
    assert memo.get(GenerationJob((1, 2, 3), params, cache_scope="key-a")) == ("recorded",)
    assert memo.get(GenerationJob((1, 2, 3), params, cache_scope="key-b")) is None
    assert memo.get(GenerationJob((1, 2, 3), params)) is None


def test_metrics_carry_every_tier_series():
    """The collector renders what the disk tier counts (reads, writes, drops, removals) beside the tiers."""
    from deltafin.engine.kv.tier_stats import TierStats
    from deltafin.metrics import Metrics

    stats = TierStats(disk_read_seconds=0.25, disk_write_seconds=1.5, disk_writes_dropped=3, disk_files_removed=2)
    stats.hits["disk"], stats.hit_tokens["disk"], stats.evictions["ram"], stats.bytes_held["disk"] = 4, 256, 7, 9000
    metrics = Metrics()
    metrics.watch_prefix_caches(lambda: [("m", stats)])
    text = metrics.render().decode()
    for line in (
        'deltafin_prefix_cache_tier_hits_total{model="m",tier="disk"} 4.0',
        'deltafin_prefix_cache_tier_hit_tokens_total{model="m",tier="disk"} 256.0',
        'deltafin_prefix_cache_evictions_total{model="m",tier="ram"} 7.0',
        'deltafin_prefix_cache_bytes{model="m",tier="disk"} 9000.0',
        'deltafin_prefix_cache_disk_read_seconds_total{model="m"} 0.25',
        'deltafin_prefix_cache_disk_write_seconds_total{model="m"} 1.5',
        'deltafin_prefix_cache_disk_writes_dropped_total{model="m"} 3.0',
        'deltafin_prefix_cache_disk_files_removed_total{model="m"} 2.0',
    ):
        assert line in text
