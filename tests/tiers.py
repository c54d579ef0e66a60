"""The suite's tiers (pytest markers; README "Running the tests" has each tier's command and time).

- fast: in-process (the real default model and engine included, no server process); every test without another
  tier's marker is marked fast at collection.
- e2e: the real server as a process on loopback, real clients.
- llama_server / vllm: Deltafin in front of a real upstream (scripts/build-llama-server, scripts/install-vllm).
- gpu: CUDA placements; they run where torch sees a GPU.
- wheel: the built wheel installed outside the checkout.

A tier whose component is missing skips, saying how to get it; CI names the tiers it requires in
`DELTAFIN_REQUIRE_TIERS` (.ci/run), and there a missing component fails the run instead of hiding it.
"""

from __future__ import annotations

import os

import pytest

TIERS = ("fast", "e2e", "llama_server", "vllm", "gpu", "wheel")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if not any(item.get_closest_marker(tier) for tier in TIERS[1:]):
            item.add_marker(pytest.mark.fast)


def unavailable(tier: str, reason: str) -> None:
    """Module level: `tier`'s component is missing. A skip, unless this run requires the tier."""
    if tier in os.environ.get("DELTAFIN_REQUIRE_TIERS", "").split(","):
        pytest.fail(f"{reason} (DELTAFIN_REQUIRE_TIERS requires the {tier} tier)", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def pytest_terminal_summary(terminalreporter) -> None:
    """How many real servers this run booted (issue 17 counts them): each costs seconds of start-up."""
    from deltafin.testing import LiveServer

    if LiveServer.boots:
        terminalreporter.write_line(f"deltafin server boots: {len(LiveServer.boots)} "
                                    f"({len(set(LiveServer.boots))} distinct override sets)")
