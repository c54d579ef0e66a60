"""A file's content digest, read once per version of the file and remembered beside the cache.

What a converted or quantized copy of a checkpoint file is keyed on: its whole content (sha256), so a file
changed in place, even at the same size and with its modification time put back, never gets the old copy,
while identical copies (two virtualenvs holding the same wheel) share one. Reading a multi-GB file costs
seconds, so the digest is remembered in `INDEX` beside the cache, under the file's path and identity (size,
modification and change times, inode, device): a later boot reads only the file's metadata. Any write to
the file moves its change time (which no user call sets back), so a changed file is read again.

As git does with "racily clean" index entries, an entry is trusted only when the file's times are older than
the moment it was read by more than `SETTLED_NS` (filesystem clocks tick coarsely: a write right after the
reading may leave the times unchanged). A missing or damaged index is read again, never trusted.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from pathlib import Path

#: the remembered digests, in the cache folder
INDEX = "file-digests.json"
#: how much older than its reading a file's times must be for the remembered digest to be trusted
SETTLED_NS = 2_000_000_000
#: entries kept in the index (the oldest readings leave first)
MAX_ENTRIES = 256


def content_digest(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _identity(stat: os.stat_result) -> list[int]:
    return [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino, stat.st_dev]


def file_digest(path: Path, cache_dir: Path) -> str:
    """The sha256 of `path`'s content, from the index when the file is unchanged since it was read."""
    path = path.resolve()
    index_path = cache_dir / INDEX
    index = _read_index(index_path)
    stat = path.stat()
    entry = index.get(str(path))
    if (
        isinstance(entry, dict)
        and entry.get("identity") == _identity(stat)
        and isinstance(entry.get("digest"), str)
        and isinstance(entry.get("read_ns"), int)
        and max(stat.st_mtime_ns, stat.st_ctime_ns) + SETTLED_NS < entry["read_ns"]
    ):
        return entry["digest"]
    read_ns = time.time_ns()
    digest = content_digest(path)
    if path.stat().st_ctime_ns != stat.st_ctime_ns:  # written while it was read: the digest is of no one version
        return digest
    index[str(path)] = {"identity": _identity(stat), "digest": digest, "read_ns": read_ns}
    _write_index(index_path, index)
    return digest


def _read_index(index_path: Path) -> dict:
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        return {}
    return index if isinstance(index, dict) else {}


def _write_index(index_path: Path, index: dict) -> None:
    """Written whole to a temporary file and renamed, so a concurrent reader sees the old index or the new one.
    Two boots writing at once may lose one's entry: that file is read again next time, nothing worse."""
    newest = sorted(index.items(), key=lambda item: item[1].get("read_ns", 0) if isinstance(item[1], dict) else 0)
    kept = dict(newest[-MAX_ENTRIES:])
    try:
        index_path.parent.mkdir(parents=True, exist_ok=True)
        fd, staging = tempfile.mkstemp(prefix=".digests-", dir=index_path.parent)
        with os.fdopen(fd, "w") as out:
            json.dump(kept, out)
        os.replace(staging, index_path)
    except OSError:  # a read-only cache: the digest is still right, only not remembered
        pass
