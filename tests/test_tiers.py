"""tests/tiers.py: which runs count as the whole suite, whose server starts are held to BOOT_BUDGET."""

from types import SimpleNamespace

import pytest

from tests.conftest import REPO
from tests.tiers import _whole_suite


def config(args, keyword="", markexpr=""):
    return SimpleNamespace(rootpath=REPO, args=args, option=SimpleNamespace(keyword=keyword, markexpr=markexpr))


@pytest.mark.parametrize("args", [[], ["tests"], [str(REPO / "tests")], ["."]])
def test_the_whole_suite(args, monkeypatch):
    monkeypatch.chdir(REPO)
    assert _whole_suite(config(args))


@pytest.mark.parametrize(
    "args, keyword, markexpr",
    [
        (["tests/e2e"], "", ""),
        (["tests/e2e/test_auth.py"], "", ""),
        (["tests::x"], "", ""),
        ([], "auth", ""),
        ([], "", "e2e"),
    ],
)
def test_a_part_of_it(args, keyword, markexpr, monkeypatch):
    monkeypatch.chdir(REPO)
    assert not _whole_suite(config(args, keyword, markexpr))


def test_a_whole_suite_past_the_budget_fails_and_a_part_of_it_does_not(monkeypatch):
    from deltafin.testing import LiveServer
    from tests import tiers

    monkeypatch.chdir(REPO)
    monkeypatch.setattr(LiveServer, "boots", [("server.port=0",)] * (tiers.BOOT_BUDGET + 1))
    for args, failed in (([], True), (["tests/e2e"], False)):
        session = SimpleNamespace(config=config(args), exitstatus=pytest.ExitCode.OK)
        tiers.pytest_sessionfinish(session)
        assert session.exitstatus == (pytest.ExitCode.TESTS_FAILED if failed else pytest.ExitCode.OK)
