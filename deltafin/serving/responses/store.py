"""Stored responses (`store`, `previous_response_id`, GET/DELETE /v1/responses/{id}), bounded and scoped.

A record is one response: the Response object, the input items of its request, and the conversation before
them (so a later `previous_response_id` rebuilds the whole conversation from this one record, even after older
records left the store). Records are kept as JSON bytes under the digest of the API key that created them; a
lookup with another key finds nothing (404), exactly as an unknown id. The store is bounded in records and in
bytes: the oldest records leave first; a record larger than the whole byte bound is not kept (and logged).

- `memory` (default): an in-process LRU-by-age, gone at restart.
- `sqlite`: the standard library's sqlite3 in write-ahead-log mode, kept across restarts. Opened at start-up:
  a file that is not a Deltafin store (or is corrupt) and a folder that does not exist are start-up errors
  naming `server.responses.path`, never an empty store that silently replaced the old one. A missing file in an
  existing folder is a new store (logged).
"""

from __future__ import annotations

import sqlite3
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Protocol

import msgspec
import structlog

from deltafin.config import ConfigError

log = structlog.get_logger("deltafin.responses")

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode
SCHEMA_VERSION = "1"


class ResponseStore(Protocol):
    #: the store's calls block (disk): run them off the event loop
    blocking: bool

    def put(self, owner: str, response_id: str, record: dict[str, Any]) -> bool: ...

    def get(self, owner: str, response_id: str) -> dict[str, Any] | None: ...

    def delete(self, owner: str, response_id: str) -> bool: ...

    def close(self) -> None: ...


class MemoryStore:
    blocking = False

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._records: OrderedDict[str, tuple[str, bytes]] = OrderedDict()
        self._bytes = 0

    def put(self, owner: str, response_id: str, record: dict[str, Any]) -> bool:
        body = _encode(record)
        if len(body) > self._max_bytes or self._max_entries == 0:
            log.warning("response_not_stored", response_id=response_id, bytes=len(body), max_bytes=self._max_bytes)
            return False
        self._drop(response_id)
        self._records[response_id] = (owner, body)
        self._bytes += len(body)
        while len(self._records) > self._max_entries or self._bytes > self._max_bytes:
            _, (_, oldest) = self._records.popitem(last=False)
            self._bytes -= len(oldest)
        return True

    def get(self, owner: str, response_id: str) -> dict[str, Any] | None:
        found = self._records.get(response_id)
        if found is None or found[0] != owner:
            return None
        return _decode(found[1])

    def delete(self, owner: str, response_id: str) -> bool:
        found = self._records.get(response_id)
        if found is None or found[0] != owner:
            return False
        self._drop(response_id)
        return True

    def _drop(self, response_id: str) -> None:
        old = self._records.pop(response_id, None)
        if old is not None:
            self._bytes -= len(old[1])

    def close(self) -> None:
        self._records.clear()


class SqliteStore:
    blocking = True

    def __init__(self, path: str, max_entries: int, max_bytes: int) -> None:
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        self._db = _open(Path(path))
        count, total = self._db.execute("SELECT count(*), coalesce(sum(size), 0) FROM deltafin_responses").fetchone()
        self._count, self._bytes = count, total

    def put(self, owner: str, response_id: str, record: dict[str, Any]) -> bool:
        body = _encode(record)
        if len(body) > self._max_bytes or self._max_entries == 0:
            log.warning("response_not_stored", response_id=response_id, bytes=len(body), max_bytes=self._max_bytes)
            return False
        with self._lock, self._db:
            self._delete(response_id)
            self._db.execute(
                "INSERT INTO deltafin_responses (id, owner, size, body) VALUES (?, ?, ?, ?)",
                (response_id, owner, len(body), body),
            )
            self._count += 1
            self._bytes += len(body)
            while self._count > self._max_entries or self._bytes > self._max_bytes:
                seq, size = self._db.execute("SELECT seq, size FROM deltafin_responses ORDER BY seq LIMIT 1").fetchone()
                self._db.execute("DELETE FROM deltafin_responses WHERE seq = ?", (seq,))
                self._count -= 1
                self._bytes -= size
        return True

    def get(self, owner: str, response_id: str) -> dict[str, Any] | None:
        with self._lock:
            row = self._db.execute(
                "SELECT body FROM deltafin_responses WHERE id = ? AND owner = ?", (response_id, owner)
            ).fetchone()
        return None if row is None else _decode(row[0])

    def delete(self, owner: str, response_id: str) -> bool:
        with self._lock, self._db:
            row = self._db.execute(
                "SELECT size FROM deltafin_responses WHERE id = ? AND owner = ?", (response_id, owner)
            ).fetchone()
            if row is None:
                return False
            self._delete(response_id)
        return True

    def _delete(self, response_id: str) -> None:
        row = self._db.execute("SELECT size FROM deltafin_responses WHERE id = ?", (response_id,)).fetchone()
        if row is not None:
            self._db.execute("DELETE FROM deltafin_responses WHERE id = ?", (response_id,))
            self._count -= 1
            self._bytes -= row[0]

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _open(path: Path) -> sqlite3.Connection:
    where = "server.responses.path"
    if not path.parent.is_dir():
        raise ConfigError(f"{where}: the folder {str(path.parent)!r} does not exist")
    if path.exists() and not path.is_file():
        raise ConfigError(f"{where}: {str(path)!r} is not a file")
    new = not path.exists() or path.stat().st_size == 0
    try:
        db = sqlite3.connect(path, check_same_thread=False, isolation_level="DEFERRED")
        if db.execute("PRAGMA quick_check").fetchone()[0] != "ok":
            raise sqlite3.DatabaseError("integrity check failed")
        tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if not new and "deltafin_meta" not in tables:
            raise sqlite3.DatabaseError("not a Deltafin response store (no deltafin_meta table)")
        mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if mode.lower() != "wal":
            raise sqlite3.DatabaseError(f"cannot use the write-ahead log (journal mode stays {mode})")
        db.execute("PRAGMA synchronous=NORMAL")  # with WAL: durable across a process crash, one sync a checkpoint
        with db:
            db.execute("CREATE TABLE IF NOT EXISTS deltafin_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
            db.execute(
                "CREATE TABLE IF NOT EXISTS deltafin_responses (seq INTEGER PRIMARY KEY AUTOINCREMENT, "
                "id TEXT UNIQUE NOT NULL, owner TEXT NOT NULL, size INTEGER NOT NULL, body BLOB NOT NULL)"
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


def open_store(config: Any) -> ResponseStore:
    """The store `server.responses` describes (ConfigError naming the key when it cannot be opened)."""
    if config.store == "sqlite":
        if not config.path:
            raise ConfigError("server.responses.path: server.responses.store=sqlite needs a file path")
        return SqliteStore(str(config.path), config.max_entries, config.max_bytes)
    return MemoryStore(config.max_entries, config.max_bytes)
