"""Stored responses (`store`, `previous_response_id`, GET/DELETE /v1/responses/{id}), bounded and scoped.

A record is one response: the Response object, the input items of its request, and the conversation before
them (so a later `previous_response_id` rebuilds the whole conversation from this one record, even after older
records left the store). Records are kept as JSON bytes under the digest of the API key that created them; a
lookup with another key finds nothing (404), exactly as an unknown id.

Bounds, per API key and in total (records and bytes): a record over its key's byte bound is not kept (logged);
past its key's bound, that key's own oldest records leave. Each key's bound defaults to an equal share of the
total (`server.responses.max_*_per_key`), so keys never push out each other's records; past the total (keys
given more than their share), the oldest records of the key holding the most leave first.

- `memory` (default): in-process, gone at restart.
- `sqlite`: the standard library's sqlite3 in write-ahead-log mode, kept across restarts. Every count is the
  database's own (a table of each key's records and bytes, kept by triggers), read and changed in one write
  transaction, so several processes may share one file. Opened at start-up: a file that is not a Deltafin store
  (or is corrupt) and a folder that does not exist are start-up errors naming `server.responses.path`, never an
  empty store that silently replaced the old one. A missing file in an existing folder is a new store (logged).

Failures are typed: `StoreUnavailable` when the database cannot be read or written (locked by another process
past the busy timeout, disk full, I/O error), `DamagedRecord` for a stored record that is not one (the service
answers 404 for it, never a 500).
"""

from __future__ import annotations

import sqlite3
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import msgspec
import structlog

from deltafin.config import ConfigError

log = structlog.get_logger("deltafin.responses")

_encode = msgspec.json.Encoder().encode
SCHEMA_VERSION = "1"
#: how long a write waits for another connection's lock before the store counts as unavailable
BUSY_TIMEOUT_S = 5.0


class StoreUnavailable(Exception):
    """The store's database could not be read or written; `reason` says why, in a few words."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class DamagedRecord(Exception):
    """A stored record that cannot be read back as one."""


class _Record(msgspec.Struct):
    context: list[dict[str, Any]]
    input: list[dict[str, Any]]
    response: dict[str, Any]


def decode_record(body: bytes) -> dict[str, Any]:
    """A stored record's bytes as the record; DamagedRecord for anything else (bad JSON, another shape)."""
    try:
        record = msgspec.json.decode(body, type=_Record)
    except msgspec.DecodeError as exc:
        raise DamagedRecord(str(exc)) from None
    if not isinstance(record.response.get("output"), list):
        raise DamagedRecord("its response has no output list")
    return {"context": record.context, "input": record.input, "response": record.response}


@dataclass(frozen=True)
class Bounds:
    """Records and bytes kept at most, per API key and in total."""

    entries: int
    bytes: int
    entries_per_key: int
    bytes_per_key: int

    @classmethod
    def of(cls, config: Any, keys: int) -> Bounds:
        """`server.responses`' bounds; a per-key bound not given is an equal share of the total among `keys`."""
        share = max(1, keys)
        per_entries = config.max_entries_per_key
        per_bytes = config.max_bytes_per_key
        return cls(
            entries=config.max_entries,
            bytes=config.max_bytes,
            entries_per_key=config.max_entries // share if per_entries is None else per_entries,
            bytes_per_key=config.max_bytes // share if per_bytes is None else per_bytes,
        )

    def fits(self, size: int) -> bool:
        return self.entries_per_key > 0 and self.entries > 0 and size <= min(self.bytes, self.bytes_per_key)


class ResponseStore(Protocol):
    def put(self, owner: str, response_id: str, record: dict[str, Any]) -> bool:
        """Keep `record` (False: too large for the bounds, not kept); StoreUnavailable when it cannot be written."""
        ...

    def get_raw(self, owner: str, response_id: str) -> bytes | None: ...

    def get(self, owner: str, response_id: str) -> dict[str, Any] | None: ...

    def delete(self, owner: str, response_id: str) -> bool: ...

    def close(self) -> None: ...


def _too_large(response_id: str, size: int, bounds: Bounds) -> bool:
    log.warning(
        "response_not_stored",
        response_id=response_id,
        bytes=size,
        max_bytes=min(bounds.bytes, bounds.bytes_per_key),
        reason="larger than the store's bounds",
    )
    return False


class MemoryStore:
    """Records of each owner oldest first; every call takes the lock (the service calls from worker threads)."""

    def __init__(self, bounds: Bounds) -> None:
        self.bounds = bounds
        self._lock = threading.Lock()
        self._owners: dict[str, OrderedDict[str, bytes]] = {}
        self._owner_bytes: dict[str, int] = {}
        self._where: dict[str, str] = {}  # response id -> owner
        self._seq: dict[str, int] = {}  # response id -> when it was stored (oldest first across owners)
        self._next = 0

    def put(self, owner: str, response_id: str, record: dict[str, Any]) -> bool:
        body = _encode(record)
        if not self.bounds.fits(len(body)):
            return _too_large(response_id, len(body), self.bounds)
        with self._lock:
            self._drop(response_id)
            records = self._owners.setdefault(owner, OrderedDict())
            records[response_id] = body
            self._owner_bytes[owner] = self._owner_bytes.get(owner, 0) + len(body)
            self._where[response_id] = owner
            self._seq[response_id], self._next = self._next, self._next + 1
            bounds = self.bounds
            while len(records) > bounds.entries_per_key or self._owner_bytes[owner] > bounds.bytes_per_key:
                self._drop(next(iter(records)))
            while True:
                over = self._over_total()
                if over is None:
                    break
                self._drop(next(iter(self._owners[over])))
        return True

    def _over_total(self) -> str | None:
        """The owner whose oldest record leaves next when the total is over a bound (the one holding most)."""
        if len(self._where) > self.bounds.entries:
            return max(self._owners, key=lambda o: (len(self._owners[o]), self._owner_bytes[o]))
        if sum(self._owner_bytes.values()) > self.bounds.bytes:
            return max(self._owners, key=lambda o: (self._owner_bytes[o], len(self._owners[o])))
        return None

    def get_raw(self, owner: str, response_id: str) -> bytes | None:
        with self._lock:
            records = self._owners.get(owner)
            return None if records is None else records.get(response_id)

    def get(self, owner: str, response_id: str) -> dict[str, Any] | None:
        body = self.get_raw(owner, response_id)
        return None if body is None else decode_record(body)

    def delete(self, owner: str, response_id: str) -> bool:
        with self._lock:
            if self._where.get(response_id) != owner:
                return False
            self._drop(response_id)
            return True

    def _drop(self, response_id: str) -> None:
        owner = self._where.pop(response_id, None)
        if owner is None:
            return
        self._seq.pop(response_id, None)
        body = self._owners[owner].pop(response_id)
        self._owner_bytes[owner] -= len(body)
        if not self._owners[owner]:
            del self._owners[owner], self._owner_bytes[owner]

    def close(self) -> None:
        with self._lock:
            self._owners.clear()
            self._owner_bytes.clear()
            self._where.clear()


class SqliteStore:
    def __init__(self, path: str, bounds: Bounds, *, busy_timeout_s: float = BUSY_TIMEOUT_S) -> None:
        self.bounds = bounds
        self._lock = threading.Lock()  # one connection, used by one thread at a time
        self._db = _open(Path(path), busy_timeout_s)

    def put(self, owner: str, response_id: str, record: dict[str, Any]) -> bool:
        body = _encode(record)
        if not self.bounds.fits(len(body)):
            return _too_large(response_id, len(body), self.bounds)
        # The write lock first (BEGIN IMMEDIATE): the counts read while evicting stay true until the commit.
        with self._lock, _unavailable_on_error("written"), _write_transaction(self._db):
            self._db.execute("DELETE FROM deltafin_responses WHERE id = ?", (response_id,))
            self._db.execute(
                "INSERT INTO deltafin_responses (id, owner, size, body) VALUES (?, ?, ?, ?)",
                (response_id, owner, len(body), body),
            )
            self._evict(owner)
        return True

    def _evict(self, owner: str) -> None:
        """Inside the write transaction: the owner's oldest past its bounds, then the largest holder's oldest past
        the total, every count read from the database (another process may have written since)."""
        db, bounds = self._db, self.bounds
        while True:
            entries, size = db.execute(
                "SELECT entries, bytes FROM deltafin_owners WHERE owner = ?", (owner,)
            ).fetchone() or (0, 0)
            if entries <= bounds.entries_per_key and size <= bounds.bytes_per_key:
                break
            self._drop_oldest(owner)
        while True:
            entries, size = db.execute(
                "SELECT coalesce(sum(entries), 0), coalesce(sum(bytes), 0) FROM deltafin_owners"
            ).fetchone()
            if entries > bounds.entries:
                order = "entries DESC, bytes DESC"
            elif size > bounds.bytes:
                order = "bytes DESC, entries DESC"
            else:
                break
            (largest,) = db.execute(f"SELECT owner FROM deltafin_owners ORDER BY {order} LIMIT 1").fetchone()
            self._drop_oldest(largest)

    def _drop_oldest(self, owner: str) -> None:
        self._db.execute(
            "DELETE FROM deltafin_responses WHERE seq = "
            "(SELECT seq FROM deltafin_responses WHERE owner = ? ORDER BY seq LIMIT 1)",
            (owner,),
        )

    def get_raw(self, owner: str, response_id: str) -> bytes | None:
        with self._lock, _unavailable_on_error("read"):
            row = self._db.execute(
                "SELECT body FROM deltafin_responses WHERE id = ? AND owner = ?", (response_id, owner)
            ).fetchone()
        if row is None:
            return None
        return row[0] if isinstance(row[0], bytes) else str(row[0]).encode("utf-8", "replace")

    def get(self, owner: str, response_id: str) -> dict[str, Any] | None:
        body = self.get_raw(owner, response_id)
        return None if body is None else decode_record(body)

    def delete(self, owner: str, response_id: str) -> bool:
        with self._lock, _unavailable_on_error("written"), _write_transaction(self._db):
            deleted = self._db.execute(
                "DELETE FROM deltafin_responses WHERE id = ? AND owner = ?", (response_id, owner)
            ).rowcount
        return deleted > 0

    def close(self) -> None:
        with self._lock:
            self._db.close()


@contextmanager
def _write_transaction(db: sqlite3.Connection) -> Iterator[None]:
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise


class _unavailable_on_error:
    """sqlite3's errors as StoreUnavailable (the lock held past the busy timeout, a full disk, an I/O error)."""

    def __init__(self, what: str) -> None:
        self.what = what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        if isinstance(exc, sqlite3.Error):
            log.error("response_store_failed", operation=self.what, error=str(exc))
            raise StoreUnavailable(f"the response store could not be {self.what}: {exc}") from None


_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS deltafin_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS deltafin_responses (seq INTEGER PRIMARY KEY AUTOINCREMENT, "
    "id TEXT UNIQUE NOT NULL, owner TEXT NOT NULL, size INTEGER NOT NULL, body BLOB NOT NULL)",
    "CREATE INDEX IF NOT EXISTS deltafin_responses_by_owner ON deltafin_responses (owner, seq)",
    # Each owner's records and bytes, kept by the database itself: every process sharing the file sees them.
    "CREATE TABLE IF NOT EXISTS deltafin_owners (owner TEXT PRIMARY KEY, entries INTEGER NOT NULL, "
    "bytes INTEGER NOT NULL)",
    "CREATE TRIGGER IF NOT EXISTS deltafin_counted AFTER INSERT ON deltafin_responses BEGIN "
    "INSERT INTO deltafin_owners (owner, entries, bytes) VALUES (new.owner, 1, new.size) "
    "ON CONFLICT (owner) DO UPDATE SET entries = entries + 1, bytes = bytes + new.size; END",
    "CREATE TRIGGER IF NOT EXISTS deltafin_uncounted AFTER DELETE ON deltafin_responses BEGIN "
    "UPDATE deltafin_owners SET entries = entries - 1, bytes = bytes - old.size WHERE owner = old.owner; "
    "DELETE FROM deltafin_owners WHERE owner = old.owner AND entries <= 0; END",
)


def _open(path: Path, busy_timeout_s: float) -> sqlite3.Connection:
    where = "server.responses.path"
    if not path.parent.is_dir():
        raise ConfigError(f"{where}: the folder {str(path.parent)!r} does not exist")
    if path.exists() and not path.is_file():
        raise ConfigError(f"{where}: {str(path)!r} is not a file")
    new = not path.exists() or path.stat().st_size == 0
    try:
        # isolation_level=None: transactions are this module's own (BEGIN IMMEDIATE where it writes)
        db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=busy_timeout_s)
        if db.execute("PRAGMA quick_check").fetchone()[0] != "ok":
            raise sqlite3.DatabaseError("integrity check failed")
        tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if not new and "deltafin_meta" not in tables:
            raise sqlite3.DatabaseError("not a Deltafin response store (no deltafin_meta table)")
        mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if mode.lower() != "wal":
            raise sqlite3.DatabaseError(f"cannot use the write-ahead log (journal mode stays {mode})")
        db.execute("PRAGMA synchronous=NORMAL")  # with WAL: durable across a process crash, one sync a checkpoint
        with _write_transaction(db):
            counted = "deltafin_owners" in tables
            for statement in _SCHEMA:
                db.execute(statement)
            if not counted:  # a store written before the counts were kept: count what it holds, once
                db.execute(
                    "INSERT INTO deltafin_owners (owner, entries, bytes) "
                    "SELECT owner, count(*), sum(size) FROM deltafin_responses GROUP BY owner"
                )
            db.execute("INSERT OR IGNORE INTO deltafin_meta (key, value) VALUES ('schema', ?)", (SCHEMA_VERSION,))
        version = db.execute("SELECT value FROM deltafin_meta WHERE key = 'schema'").fetchone()[0]
        if version != SCHEMA_VERSION:
            raise sqlite3.DatabaseError(f"store schema {version}, this Deltafin reads {SCHEMA_VERSION}")
    except sqlite3.Error as exc:
        raise ConfigError(f"{where}: {str(path)!r} cannot be used as the response store: {exc}") from None
    if new:
        log.info("response_store_created", path=str(path))
    return db


def open_store(config: Any, *, api_keys: int = 0) -> ResponseStore:
    """The store `server.responses` describes, each of `api_keys` keys bounded to its share (ConfigError naming
    the key when it cannot be opened)."""
    bounds = Bounds.of(config, api_keys)
    if config.store == "sqlite":
        if not config.path:
            raise ConfigError("server.responses.path: server.responses.store=sqlite needs a file path")
        return SqliteStore(str(config.path), bounds)
    return MemoryStore(bounds)
