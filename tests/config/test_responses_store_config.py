"""server.responses.*: a response store that cannot be opened stops start-up with one line naming the key, exit 2,
before the model loads (a corrupt store is never replaced by an empty one)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO


def start(*overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "deltafin", *overrides], cwd=REPO, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "make,expect",
    [
        (lambda tmp: tmp / "no-such-folder" / "r.db", "does not exist"),
        (lambda tmp: (tmp / "junk.db").write_bytes(b"junk" * 500) and tmp / "junk.db", "not a database"),
    ],
)
def test_an_unusable_sqlite_store_is_a_config_error(tmp_path, make, expect):
    result = start("server.responses.store=sqlite", f"server.responses.path={make(tmp_path)}")
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("deltafin: config error: server.responses.path:") and expect in line
    if expect == "not a database":
        assert (tmp_path / "junk.db").read_bytes() == b"junk" * 500  # left as it was


@pytest.mark.parametrize(
    "override,key",
    [
        ("server.responses.store=disk", "server.responses.store"),
        ("server.responses.unsupported_tools=ignore", "server.responses.unsupported_tools"),
        ("server.responses.max_bytes=-1", "server.responses.max_bytes"),
    ],
)
def test_bad_values_name_their_key(override, key):
    result = start(override)
    assert result.returncode == 2 and f"config error: {key}:" in result.stderr
