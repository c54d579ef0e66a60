"""Reading experts from the checkpoint: byte ranges with `pread`, on threads that put misses before prefetches.

`os.preadv` reads straight into the destination's memory (a pool slot, or a per-thread scratch buffer when the
dtype changes) and releases the GIL, so reads overlap the engine thread's compute. Several threads keep several
requests in flight, which a fast disk needs to reach its bandwidth.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path

import torch

from deltafin.engine.experts.checkpoint import Piece

#: a miss the engine thread waits on goes before any prefetch
MISS, PREFETCH = 0, 1


class ExpertReader:
    """Open files and `pread` into caller memory; safe to use from several threads at once."""

    def __init__(self, files: Sequence[Path]) -> None:
        self._fds = [os.open(path, os.O_RDONLY) for path in files]
        self._scratch = threading.local()

    def read_into(self, piece: Piece, buffer: memoryview) -> None:
        """Exactly `piece.nbytes` bytes into `buffer` (pread may return fewer: loop)."""
        done = 0
        while done < piece.nbytes:
            got = os.preadv(self._fds[piece.file], [buffer[done:]], piece.offset + done)
            if got <= 0:
                raise OSError(f"short read at byte {piece.offset + done} of checkpoint file {piece.file}")
            done += got

    def read(self, piece: Piece) -> torch.Tensor:
        """The piece as a 1-D CPU tensor of its own dtype, in this thread's scratch buffer (valid until the
        thread's next read)."""
        scratch = getattr(self._scratch, "buffer", None)
        if scratch is None or len(scratch) < piece.nbytes:
            scratch = self._scratch.buffer = bytearray(piece.nbytes)
        view = memoryview(scratch)[: piece.nbytes]
        self.read_into(piece, view)
        return torch.frombuffer(view, dtype=piece.dtype)

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []


class ReadQueue:
    """A fixed set of daemon threads running jobs by priority (MISS before PREFETCH), FIFO within one."""

    def __init__(self, threads: int, name: str = "deltafin-experts") -> None:
        self._jobs: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def submit(self, priority: int, job: Callable[[], None]) -> Future:
        future: Future = Future()
        self._jobs.put((priority, next(self._order), job, future))
        return future

    def _run(self) -> None:
        # One torch thread here: a conversion or quantization on this thread must not start an OpenMP team
        # of its own beside the engine thread's (on few cores that halves the engine's speed).
        torch.set_num_threads(1)
        while True:
            _, _, job, future = self._jobs.get()
            if job is None:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                job()
            except BaseException as exc:  # the waiter sees it
                future.set_exception(exc)
            else:
                future.set_result(None)

    def close(self) -> None:
        for _ in self._threads:
            self._jobs.put((MISS - 1, next(self._order), None, None))
        for thread in self._threads:
            thread.join(timeout=5)
