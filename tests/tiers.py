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
import re
from pathlib import Path

import pytest

TIERS = ("fast", "e2e", "llama_server", "vllm", "gpu", "wheel")


#: tiers whose tests start real servers: under pytest-xdist their modules run as one unit, in file order, on one
#: worker (`TierScheduling`)
SERVER_TIERS = ("e2e", "llama_server", "vllm", "gpu")
_MODULE_MARK = re.compile(r"^pytestmark\s*=.*\bpytest\.mark\.({})\b".format("|".join(SERVER_TIERS)), re.MULTILINE)


def server_modules(root: Path) -> frozenset[str]:
    """Test modules (as node ids name them) whose module-level `pytestmark` names a server tier. Read from the
    files, because xdist's controller schedules by node id alone; `pytest_collection_modifyitems` checks every
    collected test against it, so the two cannot drift."""
    return frozenset(
        path.relative_to(root).as_posix()
        for path in (root / "tests").rglob("test_*.py")
        if _MODULE_MARK.search(path.read_text())
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    servers = server_modules(config.rootpath)
    for item in items:
        if not any(item.get_closest_marker(tier) for tier in TIERS[1:]):
            item.add_marker(pytest.mark.fast)
        serves = any(item.get_closest_marker(tier) for tier in SERVER_TIERS)
        if serves != (item.nodeid.split("::")[0] in servers):
            raise pytest.UsageError(
                f"{item.nodeid}: a server tier is marked on a test, not its module's "
                f"pytestmark (tests/tiers.py schedules server tiers by module)"
            )


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`scripts/test` runs two pytest-xdist workers: the server tiers' modules are one unit of work, so their
    servers start from one zygote, their event-ordered tests keep their order and never run beside each other,
    and that unit, the longest, starts first (scopes go out largest first); every other module is a unit of its
    own, so its fixtures are built once. (xdist's own `loadgroup` cannot do this with pytest 9, whose node ids
    it can no longer suffix.)"""
    from xdist.scheduler import LoadScopeScheduling

    servers = server_modules(config.rootpath)

    class TierScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::")[0]
            return "server tiers" if module in servers else module

    return TierScheduling(config, log)


def unavailable(tier: str, reason: str) -> None:
    """Module level: `tier`'s component is missing. A skip, unless this run requires the tier."""
    if tier in os.environ.get("DELTAFIN_REQUIRE_TIERS", "").split(","):
        pytest.fail(f"{reason} (DELTAFIN_REQUIRE_TIERS requires the {tier} tier)", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


#: servers started by pytest-xdist's workers, reported to the controller as each worker ends
_WORKER_BOOTS: list[tuple[str, ...]] = []


#: servers a whole run may start: a test that needs a configuration of its own declares a model of a
#: shared server instead (tests/shared_server.py, tests/gateway/llama_tier.py, vllm_tier.py)
BOOT_BUDGET = 10


def pytest_sessionfinish(session: pytest.Session) -> None:
    from deltafin.testing import LiveServer

    if hasattr(session.config, "workeroutput"):  # an xdist worker: hand the count to the controller
        session.config.workeroutput["deltafin_boots"] = [list(boot) for boot in LiveServer.boots]
        return
    boots = len(LiveServer.boots) + len(_WORKER_BOOTS)
    if boots > BOOT_BUDGET and _whole_suite(session.config) and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _whole_suite(config: pytest.Config) -> bool:
    """This run is the whole suite: no -k, no -m, no paths but the test folder."""
    tests = config.rootpath / "tests"
    return (
        not config.option.keyword
        and not config.option.markexpr
        and all("::" not in arg and Path(arg).resolve() in (tests, config.rootpath) for arg in config.args)
    )


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    _WORKER_BOOTS.extend(tuple(boot) for boot in getattr(node, "workeroutput", {}).get("deltafin_boots", []))


def pytest_terminal_summary(terminalreporter) -> None:
    """How many real servers this run booted: each costs seconds of start-up."""
    from deltafin.testing import LiveServer

    boots = [*LiveServer.boots, *_WORKER_BOOTS]
    if boots and not hasattr(terminalreporter.config, "workeroutput"):
        terminalreporter.write_line(f"deltafin server boots: {len(boots)} ({len(set(boots))} distinct override sets)")
        if len(boots) > BOOT_BUDGET and _whole_suite(terminalreporter.config):
            terminalreporter.write_line(
                f"FAILED: the whole suite may start {BOOT_BUDGET} servers (tests/tiers.py "
                "BOOT_BUDGET): serve a new configuration as a model of a shared server",
                red=True,
            )
