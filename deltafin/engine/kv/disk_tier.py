"""The prefix cache's disk tier: cached prefixes as blocks of `block_tokens` positions in files that outlive the
process (LMCache's chunks, llama.cpp's slot files, SGLang HiCache's storage tier).

Block j of a prompt holds positions [j*B, (j+1)*B): every attention layer's keys and values there and, when a
checkpoint of the recurrent state stands at its end, every state layer's state (`checkpoints`). Its name is a
chain hash: hash(name of block j-1, tokens of block j), seeded with the namespace (model, weights format, dtype,
chat template: what made the positions) and the cache scope, so a name stands for the whole prefix up to the
block's end and only an identical prefix of the same model and scope finds it. Lookup hashes the prompt's full
blocks and checks which files exist, from the first; a hit reads the consecutive run that exists.

Threads: the engine's owner thread only hashes, checks names (a stat per block) and queues work. One writer thread
writes blocks (to a temporary name, then an atomic rename, so a reader or a second process sharing the directory
sees a whole file or none) and keeps the directory under `max_bytes` (oldest files by modification time go first;
a hit touches its files). The queue of writes is bounded: a write that does not fit is dropped, never waited for.
One reader thread reads a hit's blocks into buffers shaped as the engine's cache wants them and calls back; the
engine keeps running its rows meanwhile. A file that fails its checks (`block_file.BadBlock`) is removed and the
hit ends before it. Neither thread runs a torch operation (an OpenMP team on another thread slows the engine's
steps): numpy copies, file I/O and the checksum release the GIL.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch

from deltafin.engine.kv import block_file
from deltafin.engine.kv.tier_stats import TierStats

log = structlog.get_logger("deltafin.engine.kv")

#: bytes of blocks the writer's queue may hold (they reference the entries' tensors, so this much may stay
#: allocated after RAM let an entry go); a write past it is dropped and counted
WRITE_QUEUE_BYTES = 512 << 20
#: the directory's use is brought down to this fraction of `max_bytes` when it is over (so it is not rescanned
#: at every write near the limit)
EVICT_TO = 0.9
#: a block file larger than this is not one (a block of 64 positions of a large model is tens of MB); it is never
#: read into memory
MAX_BLOCK_FILE = 4 << 30
#: seconds between two log lines about failed writes
FAILURE_LOG_S = 60.0
#: a temporary file older than this is a write that died with its process
STALE_TEMP_S = 600.0
SUFFIX = ".safetensors"


@dataclass(frozen=True)
class DiskSettings:
    root: str
    max_bytes: int
    block_tokens: int = 64
    #: what the positions were computed with (deltafin.engine.local.cache_identity): a digest, and the facts
    #: behind it (written beside the blocks, for whoever inspects the folder)
    namespace: str = ""
    facts: tuple[tuple[str, str], ...] = ()


@dataclass(eq=False)
class WriteGuard:
    """Blocks of one RAM entry still waiting for the writer to copy them: while any is, the entry's storage must
    not be written in place (`prefix_cache.SOLE_OWNER` is withheld)."""

    pending: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, n: int) -> None:
        with self.lock:
            self.pending += n

    def done(self) -> None:
        with self.lock:
            self.pending -= 1


@dataclass(frozen=True)
class BlockRef:
    name: str
    path: str
    start: int
    tokens: str  # the block's token ids, comma-separated (as its metadata holds them)
    parent: str
    states: bool


@dataclass
class DiskPlan:
    """A hit: the blocks to read, in order, and how many positions they stand for."""

    blocks: list[BlockRef]
    positions: int
    capacity: int  # positions the buffers are allocated for (the prompt, and room to append)


@dataclass
class Loaded:
    """What the reader made of a plan: buffers [1, H, capacity, D] per attention layer holding `positions`
    positions, and the state captures found at block ends (position -> `cache_layers.capture_states` form)."""

    positions: int
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]]
    captures: dict[int, list[Any]]
    nbytes: int


@dataclass
class _Write:
    ref: BlockRef
    kv: list[tuple[int, torch.Tensor, torch.Tensor]]
    states: list[Any] | None
    nbytes: int
    guard: WriteGuard


class DiskTier:
    def __init__(self, settings: DiskSettings, stats: TierStats, layer_kinds: list[str]) -> None:
        """`layer_kinds`: per layer of the model's cache, "kv", "state", "both" or "none"."""
        self.settings = settings
        self.stats = stats
        self.block = settings.block_tokens
        self.root = Path(settings.root)
        self.folder = self.root / hashlib.sha256(settings.namespace.encode()).hexdigest()[:16]
        self.layer_kinds = layer_kinds
        self.folder.mkdir(parents=True, exist_ok=True)
        _write_facts(self.folder, settings)
        self._seed = hashlib.sha256(f"deltafin-kv/1\0{settings.namespace}".encode()).digest()
        #: block files known to exist (written here, or found by a lookup), by path; the writer checks again
        self._known: set[str] = set()
        self._queued: set[str] = set()
        self._queued_bytes = 0
        # _queued_bytes and _waiting: added to by the engine's thread, taken off by the writer
        self._queue_lock = threading.Condition()
        self._waiting = 0  # writes queued and not finished
        self._sizes: dict[str, int] = {}
        self._writes: queue.SimpleQueue[_Write | None] = queue.SimpleQueue()
        self._reads: queue.SimpleQueue[tuple[DiskPlan, Callable[[Loaded | None], None]] | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="deltafin-kv-writer", daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name="deltafin-kv-reader", daemon=True)
        self._scanned = threading.Event()
        self._failure_logged = -FAILURE_LOG_S
        self._writer.start()
        self._reader.start()

    # --- the engine's thread ---

    def chain(self, ids: np.ndarray, scope: str, blocks: int) -> list[tuple[str, str]]:
        """(name, parent name) of the first `blocks` full blocks of `ids` under `scope`."""
        out: list[tuple[str, str]] = []
        previous = hashlib.sha256(self._seed + scope.encode()).digest()
        parent = "seed"
        words = ids.astype("<u4", copy=False)
        for j in range(blocks):
            digest = hashlib.sha256(previous + words[j * self.block : (j + 1) * self.block].tobytes()).digest()
            name = digest[:20].hex()
            out.append((name, parent))
            previous, parent = digest, name
        return out

    def path_of(self, name: str, states: bool) -> str:
        return str(self.folder / name[:2] / f"{name}.{'kvs' if states else 'kv'}{SUFFIX}")

    def probe(self, ids: np.ndarray, scope: str, limit: int, stateful: bool, capacity: int) -> DiskPlan | None:
        """The run of blocks on disk that starts the prompt, up to `limit` positions; for a model with state
        layers it ends at the last block holding a state. None when there is none."""
        blocks = min(limit, len(ids)) // self.block
        refs: list[BlockRef] = []
        usable = 0
        kinds = (True, False) if stateful else (False,)  # a block with states serves a hit that ends there
        for j, (name, parent) in enumerate(self.chain(ids, scope, blocks)):
            found = None
            for states in kinds:
                path = self.path_of(name, states)
                if path in self._known or os.path.exists(path):
                    tokens = ",".join(map(str, ids[j * self.block : (j + 1) * self.block].tolist()))
                    found = BlockRef(name, path, j * self.block, tokens, parent, states)
                    break
            if found is None:
                break
            self._known.add(found.path)
            refs.append(found)
            if found.states or not stateful:
                usable = len(refs)
        if not usable:
            return None
        return DiskPlan(refs[:usable], usable * self.block, max(capacity, usable * self.block))

    def load(self, plan: DiskPlan, done: Callable[[Loaded | None], None]) -> None:
        """Reads `plan` on the reader thread; `done(loaded)` is called there (None: nothing usable was read)."""
        self._reads.put((plan, done))

    def store(
        self,
        ids: np.ndarray,
        scope: str,
        kv: list[tuple[int, torch.Tensor, torch.Tensor]],
        captures: dict[int, list[Any]],
        guard: WriteGuard,
    ) -> None:
        """Queues the full blocks of an entry (`kv`: its attention tensors [1, H, >= len(ids), D]; `captures`: its
        states by position) that are not on disk yet. Each queued block references the entry's tensors; the
        guard counts those not copied yet."""
        blocks = len(ids) // self.block
        if not blocks:
            return
        jobs: list[_Write] = []
        for j, (name, parent) in enumerate(self.chain(ids, scope, blocks)):
            start, end = j * self.block, (j + 1) * self.block
            states = captures.get(end)
            path = self.path_of(name, states is not None)
            if path in self._known or path in self._queued:
                continue
            tokens = ",".join(map(str, ids[start:end].tolist()))
            pieces = [(layer, k[:, :, start:end], v[:, :, start:end]) for layer, k, v in kv]
            nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for _, k, v in pieces)
            with self._queue_lock:
                if self._queued_bytes + nbytes > WRITE_QUEUE_BYTES:
                    self.stats.disk_writes_dropped += 1
                    continue
                self._queued_bytes += nbytes
            self._queued.add(path)
            jobs.append(
                _Write(BlockRef(name, path, start, tokens, parent, states is not None), pieces, states, nbytes, guard)
            )
        guard.add(len(jobs))
        with self._queue_lock:
            self._waiting += len(jobs)
        for job in jobs:
            self._writes.put(job)

    def flush(self, timeout_s: float) -> bool:
        """Waits until every queued write is done (tests, benchmarks, shutdown); False if time ran out."""
        with self._queue_lock:
            return self._queue_lock.wait_for(lambda: self._waiting == 0, timeout_s)

    def close(self, wait_s: float = 10.0) -> None:
        """Lets queued writes finish (up to `wait_s`), then stops both threads."""
        self._writes.put(None)
        self._reads.put(None)
        self._writer.join(wait_s)
        self._reader.join(1.0)

    # --- the writer thread ---

    def _write_loop(self) -> None:
        self._scan(clean=True)
        self._scanned.set()
        while True:
            job = self._writes.get()
            if job is None:
                return
            try:
                self._write(job)
            except Exception as exc:  # a full disk or a vanished folder costs this block, never the engine
                self.stats.disk_write_failures += 1
                now = time.monotonic()
                if now - self._failure_logged > FAILURE_LOG_S:  # a full disk fails every write: one line a minute
                    self._failure_logged = now
                    log.warning(
                        "prefix_cache_write_failed",
                        path=job.ref.path,
                        error=str(exc),
                        failures=self.stats.disk_write_failures,
                    )
            finally:
                self._queued.discard(job.ref.path)
                with self._queue_lock:
                    self._queued_bytes -= job.nbytes
                    self._waiting -= 1
                    self._queue_lock.notify_all()

    def _write(self, job: _Write) -> None:
        ref = job.ref
        began = time.perf_counter()
        if os.path.exists(ref.path):  # another process (or an earlier write) has it
            job.guard.done()
            self._known.add(ref.path)
            return
        try:
            tensors: dict[str, tuple[str, np.ndarray]] = {}
            for layer, k, v in job.kv:
                for prefix, t in (("k", k), ("v", v)):
                    t = t if t.device.type == "cpu" else t.to("cpu")
                    tensors[f"{prefix}.{layer}"] = (block_file.dtype_name(t.dtype), block_file.as_array(t))
            facts: dict[str, Any] = {}
            if job.states is not None:
                for layer, captured in enumerate(job.states):
                    if captured is None:
                        continue
                    tables, state_facts = captured
                    for (table, i), t in tables.items():
                        t = t if t.device.type == "cpu" else t.to("cpu")
                        tensors[f"s.{layer}.{table}.{i}"] = (block_file.dtype_name(t.dtype), block_file.as_array(t))
                    facts[str(layer)] = _facts_json(state_facts)
            metadata = {
                "namespace": self.settings.namespace,
                "parent": ref.parent,
                "tokens": ref.tokens,
                "start": str(ref.start),
                "states": json.dumps(facts, separators=(",", ":")),
            }
            pieces = block_file.encode_block(tensors, metadata)  # copies the positions out of the entry
        finally:
            job.guard.done()
        folder = os.path.dirname(ref.path)
        os.makedirs(folder, exist_ok=True)
        temp = os.path.join(folder, f".tmp-{os.getpid()}-{threading.get_ident()}-{ref.name}")
        size = 0
        with open(temp, "wb") as handle:
            for piece in pieces:
                handle.write(piece)
                size += len(piece) if isinstance(piece, bytes) else piece.nbytes
        os.replace(temp, ref.path)  # atomic: a reader sees the whole file or none
        self._known.add(ref.path)
        self._sizes[ref.path] = size
        self.stats.disk_write_seconds += time.perf_counter() - began
        self.stats.disk_bytes_written += size
        self.stats.bytes_held["disk"] += size
        self.stats.entries["disk"] += 1
        if self.stats.bytes_held["disk"] > self.settings.max_bytes:
            self._evict()

    def _scan(self, *, clean: bool = False) -> list[tuple[float, str, int]]:
        """Every block file under the root (every namespace: the budget is the folder's), as (mtime, path, size);
        resets the byte count from it. Only this tier's layout is looked at (ROOT/<namespace>/<xx>/<block>), so
        a folder shared with other files costs a listing of its top level, and nothing else in it is touched.
        `clean`: temporary files of writes that died are removed."""
        found: list[tuple[float, str, int]] = []
        now = time.time()
        for namespace in _entries(self.root, _NAMESPACE):
            for shard in _entries(namespace.path, _SHARD):
                for entry in _entries(shard.path, None):
                    try:
                        st = entry.stat()
                    except OSError:
                        continue
                    if _TEMP.fullmatch(entry.name):
                        if clean and now - st.st_mtime > STALE_TEMP_S:
                            with contextlib.suppress(OSError):
                                os.unlink(entry.path)
                    elif _BLOCK.fullmatch(entry.name):
                        found.append((st.st_mtime, entry.path, st.st_size))
        self._sizes = {path: size for _, path, size in found}
        self.stats.bytes_held["disk"] = sum(self._sizes.values())
        self.stats.entries["disk"] = len(self._sizes)
        return found

    def _evict(self) -> None:
        """Removes the least recently used block files until the folder is under EVICT_TO of its budget."""
        files = sorted(self._scan())  # other processes sharing the folder write and evict too
        target = int(self.settings.max_bytes * EVICT_TO)
        total = self.stats.bytes_held["disk"]
        for _mtime, path, size in files:
            if total <= target:
                break
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            self._known.discard(path)
            self._sizes.pop(path, None)
            total -= size
            self.stats.evictions["disk"] += 1
        self.stats.bytes_held["disk"] = total
        self.stats.entries["disk"] = len(self._sizes)

    # --- the reader thread ---

    def _read_loop(self) -> None:
        while True:
            item = self._reads.get()
            if item is None:
                return
            plan, done = item
            loaded = None
            try:
                loaded = self._read(plan)
            except Exception:
                log.warning("prefix_cache_read_failed", exc_info=True)
            done(loaded)

    def _read(self, plan: DiskPlan) -> Loaded | None:
        began = time.perf_counter()
        kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        shapes: dict[str, tuple[tuple[int, ...], Any]] = {}
        captures: dict[int, list[Any]] = {}
        read = 0  # blocks read and sound
        nbytes = 0
        for ref in plan.blocks:
            expect = {"namespace": self.settings.namespace, "parent": ref.parent, "tokens": ref.tokens}
            try:
                with open(ref.path, "rb") as handle:
                    size = os.fstat(handle.fileno()).st_size
                    if size > MAX_BLOCK_FILE:
                        raise block_file.BadBlock(f"{size} bytes: larger than any block")
                    data = bytearray(size)
                    got = handle.readinto(data)
                if got != len(data):
                    raise block_file.BadBlock("short read")
                tensors = block_file.read_block(data, expect)
                metadata = block_file.metadata_of(data)
                self._check(tensors, shapes, ref)
            except FileNotFoundError:  # evicted since the lookup (by this process or another)
                self._known.discard(ref.path)
                break
            except (block_file.BadBlock, ValueError, KeyError) as exc:
                log.warning("prefix_cache_block_removed", path=ref.path, reason=str(exc))
                self._remove(ref.path)
                break
            end = ref.start + self.block
            for name, (_, array) in tensors.items():
                kind, layer = name.split(".")[:2]
                if kind not in ("k", "v"):
                    continue
                pair = kv.get(int(layer))
                if pair is None:
                    pair = kv[int(layer)] = (
                        self._buffer(tensors[f"k.{layer}"], plan.capacity),
                        self._buffer(tensors[f"v.{layer}"], plan.capacity),
                    )
                target = pair[0] if kind == "k" else pair[1]
                block_file.as_array(target)[:, :, ref.start : end] = array
            if ref.states:
                try:
                    captures[end] = self._captures(tensors, json.loads(metadata.get("states", "{}")))
                except (block_file.BadBlock, ValueError, KeyError, TypeError) as exc:
                    log.warning("prefix_cache_block_removed", path=ref.path, reason=str(exc))
                    self._remove(ref.path)
                    break
            with contextlib.suppress(OSError):
                os.utime(ref.path)  # a hit keeps its files recent (the folder is evicted oldest first)
            read += 1
            nbytes += len(data)
        stateful = any(kind in ("state", "both") for kind in self.layer_kinds)
        positions = max((p for p in captures), default=0) if stateful else read * self.block
        self.stats.disk_read_seconds += time.perf_counter() - began
        self.stats.disk_bytes_read += nbytes
        if not positions:
            return None
        return Loaded(positions, kv, {p: c for p, c in captures.items() if p <= positions}, nbytes)

    def _check(self, tensors: dict[str, tuple[torch.dtype, np.ndarray]], shapes: dict[str, Any], ref: BlockRef) -> None:
        """Every block of a hit must hold the same tensors, of the model's layers, B positions each."""
        expected = set()
        for layer, kind in enumerate(self.layer_kinds):
            if kind in ("kv", "both"):
                expected |= {f"k.{layer}", f"v.{layer}"}
        names = {name for name in tensors if not name.startswith("s.")}
        if names != expected:
            raise block_file.BadBlock("its layers are not this model's")
        for name, (dtype, array) in tensors.items():
            if name.startswith("s."):
                continue
            if array.ndim != 4 or array.shape[0] != 1 or array.shape[2] != self.block:
                raise block_file.BadBlock(f"{name}: shape {array.shape} is not [1, H, {self.block}, D]")
            known = shapes.setdefault(name, (array.shape, dtype))
            if known != (array.shape, dtype):
                raise block_file.BadBlock(f"{name}: shape differs from the hit's first block")
        if ref.states and not any(name.startswith("s.") for name in tensors):
            raise block_file.BadBlock("its states are missing")

    @staticmethod
    def _buffer(tensor: tuple[torch.dtype, np.ndarray], capacity: int) -> torch.Tensor:
        """An empty [1, H, capacity, D] buffer for a layer's keys or values (the block's dtype and shape)."""
        dtype, array = tensor
        _, heads, _, dim = array.shape
        return torch.empty(1, heads, capacity, dim, dtype=dtype)

    def _captures(self, tensors: dict[str, tuple[torch.dtype, np.ndarray]], facts: dict[str, Any]) -> list[Any]:
        """The block's states in `cache_layers.capture_states` form (copied out of the file's buffer)."""
        out: list[Any] = [None] * len(self.layer_kinds)
        for layer_key, layer_facts in facts.items():
            layer = int(layer_key)
            if not 0 <= layer < len(out) or self.layer_kinds[layer] not in ("state", "both"):
                raise block_file.BadBlock(f"states of layer {layer}, which holds none")
            tables = {}
            for name, (dtype, array) in tensors.items():
                parts = name.split(".")
                if parts[0] != "s" or int(parts[1]) != layer:
                    continue
                copy = torch.from_numpy(np.array(array))
                tables[(parts[2], int(parts[3]))] = copy.view(dtype) if dtype == torch.bfloat16 else copy
            out[layer] = (tables, _facts_from_json(layer_facts))
        return out

    def _remove(self, path: str) -> None:
        with contextlib.suppress(OSError):
            os.unlink(path)
        self._known.discard(path)
        self.stats.disk_files_removed += 1


#: the names this tier writes: namespace folders, shard folders, block files, temporary files of a write
_NAMESPACE = re.compile(r"[0-9a-f]{16}")
_SHARD = re.compile(r"[0-9a-f]{2}")
_BLOCK = re.compile(r"[0-9a-f]{40}\.kvs?\.safetensors")
_TEMP = re.compile(r"\.tmp-\d+-\d+-[0-9a-f]{40}")


def _entries(folder: str | Path, pattern: re.Pattern[str] | None) -> list[os.DirEntry[str]]:
    """The entries of `folder` (folders matching `pattern`; files when it is None); none if it cannot be listed."""
    try:
        with os.scandir(folder) as listing:
            entries = list(listing)
    except OSError:
        return []
    if pattern is None:
        return [e for e in entries if e.is_file(follow_symlinks=False)]
    return [e for e in entries if pattern.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]


def _facts_json(facts: dict[str, Any]) -> dict[str, Any]:
    return {
        "flags": {name: {str(k): bool(v) for k, v in table.items()} for name, table in facts["flags"].items()},
        "conv_kernel_size": {str(k): v for k, v in facts["conv_kernel_size"].items()},
        "has_previous_state": {str(k): bool(v) for k, v in facts["has_previous_state"].items()},
        "dtype": None if facts["dtype"] is None else str(facts["dtype"]).removeprefix("torch."),
    }


def _facts_from_json(data: dict[str, Any]) -> dict[str, Any]:
    return {
        "flags": {name: {int(k): bool(v) for k, v in table.items()} for name, table in data["flags"].items()},
        "conv_kernel_size": {int(k): v for k, v in data["conv_kernel_size"].items()},
        "has_previous_state": {int(k): bool(v) for k, v in data["has_previous_state"].items()},
        "device": None,  # set to the engine's device when the state is restored
        "dtype": None if data["dtype"] is None else getattr(torch, data["dtype"]),
    }


def _write_facts(folder: Path, settings: DiskSettings) -> None:
    """What the namespace stands for, beside its blocks (for people; lookups use the names and metadata)."""
    path = folder / "namespace.json"
    if path.exists() or not settings.facts:
        return
    temp = folder / f".tmp-{os.getpid()}-namespace"
    temp.write_text(json.dumps(dict(settings.facts), indent=2))
    os.replace(temp, path)
