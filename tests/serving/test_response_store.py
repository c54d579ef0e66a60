"""The response store's bounds per API key and in total (one key's records never push out another's), its counts
kept by the database (several processes on one sqlite file), and its failures typed (a locked or full database
is StoreUnavailable, a damaged record DamagedRecord), for the memory and the sqlite store alike."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from types import SimpleNamespace

import msgspec
import pytest

from deltafin.serving.responses.store import (
    Bounds,
    DamagedRecord,
    MemoryStore,
    SqliteStore,
    StoreUnavailable,
    open_store,
)
from tests.conftest import REPO


def record(text: str = "hi") -> dict:
    return {
        "response": {"id": "r", "output": [{"type": "message", "role": "assistant", "content": text}]},
        "input": [],
        "context": [],
    }


SIZE = len(msgspec.json.encode(record()))


@pytest.fixture(params=["memory", "sqlite"])
def make(request, tmp_path):
    def make(bounds: Bounds, path: str = "responses.db"):
        if request.param == "memory":
            return MemoryStore(bounds)
        return SqliteStore(str(tmp_path / path), bounds)

    return make


def kept(store, owner: str, ids) -> list[bool]:
    return [store.get(owner, i) is not None for i in ids]


class TestBoundsPerKey:
    def test_each_key_gets_an_equal_share_of_the_total_by_default(self):
        config = SimpleNamespace(max_entries=1000, max_bytes=64 << 20, max_entries_per_key=None, max_bytes_per_key=None)
        assert Bounds.of(config, keys=4) == Bounds(1000, 64 << 20, 250, 16 << 20)
        assert Bounds.of(config, keys=0) == Bounds(1000, 64 << 20, 1000, 64 << 20)  # no keys: one scope
        config.max_entries_per_key = 600
        assert Bounds.of(config, keys=4).entries_per_key == 600  # given: over-committed on purpose

    def test_one_keys_flood_leaves_another_keys_records(self, make):
        """One key's 18 requests evicted every other key's stored responses: each key is bounded by itself."""
        store = make(
            Bounds.of(
                SimpleNamespace(max_entries=10, max_bytes=1 << 20, max_entries_per_key=None, max_bytes_per_key=None),
                keys=2,
            )
        )
        for i in range(3):
            store.put("alice", f"a{i}", record())
        for i in range(18):
            store.put("mallory", f"m{i}", record())
        assert kept(store, "alice", ["a0", "a1", "a2"]) == [True, True, True]
        assert kept(store, "mallory", [f"m{i}" for i in range(18)]) == [False] * 13 + [True] * 5  # its own oldest left

    def test_by_bytes_too(self, make):
        store = make(Bounds(entries=100, bytes=10 * SIZE, entries_per_key=100, bytes_per_key=5 * SIZE))
        store.put("alice", "a0", record())
        for i in range(12):
            store.put("mallory", f"m{i}", record())
        assert kept(store, "alice", ["a0"]) == [True]
        assert sum(kept(store, "mallory", [f"m{i}" for i in range(12)])) == 5

    def test_past_the_total_the_largest_holder_gives_first(self, make):
        """Keys given more than their share (per-key bounds over-committed): the total still holds, and the oldest
        records of the key holding the most leave, never those of a key holding less."""
        store = make(Bounds(entries=6, bytes=1 << 20, entries_per_key=6, bytes_per_key=1 << 20))
        store.put("alice", "a0", record())
        store.put("alice", "a1", record())
        for i in range(10):
            store.put("mallory", f"m{i}", record())
        assert kept(store, "alice", ["a0", "a1"]) == [True, True]
        assert sum(kept(store, "mallory", [f"m{i}" for i in range(10)])) == 4


class TestSharedSqliteFile:
    BOUNDS = Bounds(entries=10, bytes=1 << 20, entries_per_key=10, bytes_per_key=1 << 20)

    def count(self, path) -> int:
        return sqlite3.connect(path).execute("SELECT count(*) FROM deltafin_responses").fetchone()[0]

    def test_two_stores_on_one_file_keep_one_count(self, tmp_path):
        """Each process counted its own rows: after one deleted, everything the other stored was evicted at once,
        and together they held twice the bound."""
        path = tmp_path / "shared.db"
        first, second = SqliteStore(str(path), self.BOUNDS), SqliteStore(str(path), self.BOUNDS)
        for i in range(8):
            first.put("o", f"f{i}", record())
        for i in range(8):
            second.put("o", f"s{i}", record())
        assert self.count(path) == 10  # the bound holds for both together
        assert first.delete("o", "s7") and self.count(path) == 9
        second.put("o", "s8", record())
        assert self.count(path) == 10 and kept(first, "o", ["s5", "s6", "s8"]) == [True, True, True]

    def test_another_process_writing_the_same_file(self, tmp_path):
        path = tmp_path / "shared.db"
        store = SqliteStore(str(path), self.BOUNDS)
        for i in range(6):
            store.put("o", f"mine{i}", record())
        script = (
            "import sys\n"
            "from deltafin.serving.responses.store import Bounds, SqliteStore\n"
            "store = SqliteStore(sys.argv[1], Bounds(10, 1 << 20, 10, 1 << 20))\n"
            "record = {'response': {'id': 'r', 'output': []}, 'input': [], 'context': []}\n"
            "for i in range(6):\n"
            "    store.put('o', f'theirs{i}', record)\n"
        )
        subprocess.run([sys.executable, "-c", script, str(path)], cwd=REPO, check=True, timeout=120)
        assert self.count(path) == 10
        store.put("o", "mine6", record())  # this process's view of the count is the database's
        assert self.count(path) == 10 and kept(store, "o", ["theirs5", "mine6"]) == [True, True]

    def test_a_store_written_before_the_counts_were_kept_is_counted_once(self, tmp_path):
        path = tmp_path / "old.db"
        SqliteStore(str(path), self.BOUNDS).put("o", "r0", record())
        db = sqlite3.connect(path)
        db.executescript("DROP TRIGGER deltafin_counted; DROP TRIGGER deltafin_uncounted; DROP TABLE deltafin_owners;")
        db.close()
        store = SqliteStore(str(path), self.BOUNDS)
        for i in range(1, 12):
            store.put("o", f"r{i}", record())
        assert self.count(path) == 10 and kept(store, "o", ["r0", "r1", "r2"]) == [False, False, True]


class TestFailures:
    BOUNDS = Bounds(entries=10, bytes=1 << 20, entries_per_key=10, bytes_per_key=1 << 20)

    def test_a_lock_held_by_another_connection_is_store_unavailable(self, tmp_path):
        path = tmp_path / "locked.db"
        store = SqliteStore(str(path), self.BOUNDS, busy_timeout_s=0.1)
        store.put("o", "r0", record())
        other = sqlite3.connect(path, isolation_level=None)
        other.execute("BEGIN IMMEDIATE")  # another process's write, never committed
        try:
            with pytest.raises(StoreUnavailable, match="locked"):
                store.put("o", "r1", record())
            with pytest.raises(StoreUnavailable, match="locked"):
                store.delete("o", "r0")
            assert store.get("o", "r0") == record()  # readers are not blocked (write-ahead log)
        finally:
            other.execute("ROLLBACK")
        assert store.put("o", "r1", record())  # and it recovers once the lock is gone

    def test_a_full_disk_is_store_unavailable(self, tmp_path):
        store = SqliteStore(str(tmp_path / "full.db"), Bounds(10, 1 << 30, 10, 1 << 30))
        pages = store._db.execute("PRAGMA page_count").fetchone()[0]
        store._db.execute(f"PRAGMA max_page_count = {pages + 2}")  # what the filesystem allows from here
        with pytest.raises(StoreUnavailable, match="full"):
            store.put("o", "big", record("x" * 200_000))
        assert store.get("o", "big") is None and store.put("o", "small", record())

    @pytest.mark.parametrize(
        "body",
        [b"not json", b'{"context": [], "input": []}', b'{"context": 5, "input": [], "response": {}}', b"\xff\xfe"],
    )
    def test_a_damaged_record_is_damaged_record(self, tmp_path, body):
        path = tmp_path / "damaged.db"
        store = SqliteStore(str(path), self.BOUNDS)
        store.put("o", "r0", record())
        db = sqlite3.connect(path)
        db.execute("UPDATE deltafin_responses SET body = ? WHERE id = 'r0'", (body,))
        db.commit()
        with pytest.raises(DamagedRecord):
            store.get("o", "r0")
        assert store.delete("o", "r0")  # a damaged record can still be deleted


def test_open_store_shares_the_bounds_among_the_api_keys(tmp_path):
    config = SimpleNamespace(
        store="memory", path=None, max_entries=9, max_bytes=900, max_entries_per_key=None, max_bytes_per_key=None
    )
    assert open_store(config, api_keys=3).bounds == Bounds(9, 900, 3, 300)
