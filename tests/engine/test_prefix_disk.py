"""The prefix cache's disk tier over real cache layers and real files: what a restarted process reads back, the
block files (safetensors, the reference reader as oracle), damaged and foreign files, the folder's budget, the
writer never holding up the engine, and two processes sharing one folder.

A "restart" is a second PrefixCache on the same folder with the same namespace: nothing but the files is shared."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers.cache_utils import DynamicLayer, LinearAttentionLayer

from deltafin.engine.kv import block_file, cache_layers, disk_tier
from deltafin.engine.kv.checkpoints import Capture, CheckpointBook, attach, book_of
from deltafin.engine.kv.disk_tier import DiskSettings
from deltafin.engine.kv.prefix_cache import SOLE_OWNER, PrefixCache, PrefixCacheSettings

BLOCK = 8
HEADS, DIM = 2, 4


def kv_layer(ids: list[int]) -> DynamicLayer:
    """[1, HEADS, S, DIM]: position p of head h holds 1000 * h + its token id (positions are told apart)."""
    values = torch.tensor(ids, dtype=torch.float32).view(1, 1, -1, 1)
    keys = (values + 1000 * torch.arange(HEADS).view(1, HEADS, 1, 1)).expand(1, HEADS, len(ids), DIM).contiguous()
    layer = DynamicLayer()
    layer.lazy_initialization(keys, keys)
    layer.keys, layer.values = keys, -keys
    return layer


def state_layer(length: int) -> LinearAttentionLayer:
    layer = LinearAttentionLayer()
    layer.conv_states[0] = torch.full((1, 3, 2), float(length))
    layer.recurrent_states[0] = torch.full((1, 2, 2, 2), float(length))
    layer.is_conv_states_initialized[0] = layer.is_recurrent_states_initialized[0] = True
    layer.has_previous_state[0] = True
    layer.conv_kernel_size[0] = 2
    return layer


def attention_cache(ids):
    return cache_layers.cache_of([kv_layer(ids)])


def hybrid_cache(ids, checkpoints):
    cache = cache_layers.cache_of([state_layer(len(ids)), kv_layer(ids)])
    book = CheckpointBook(BLOCK)
    for p in checkpoints:
        book.at[p] = Capture.of(cache_layers.cache_of([state_layer(p), kv_layer(ids[:p])]))
    attach(cache, book)
    return cache


def open_tier(
    folder: Path, *, hybrid=False, namespace="model-a", max_bytes=1 << 30, disk_max_bytes=1 << 30, min_tokens=2
):
    woke = threading.Event()
    new = (
        (lambda: cache_layers.cache_of([LinearAttentionLayer(), DynamicLayer()]))
        if hybrid
        else (lambda: cache_layers.cache_of([DynamicLayer()]))
    )
    settings = PrefixCacheSettings(
        min_tokens=min_tokens,
        max_bytes=max_bytes,
        state_every_tokens=BLOCK,
        disk=DiskSettings(str(folder), disk_max_bytes, block_tokens=BLOCK, namespace=namespace),
    )
    cache = PrefixCache(new, settings, wake=woke.set)
    cache.woke = woke  # type: ignore[attr-defined]
    return cache


def taken(cache: PrefixCache, ids, scope=""):
    """take + wait for a disk read + settle: (cache, cached tokens, tier)."""
    cache.woke.clear()
    reuse = cache.take(ids, scope)
    if not reuse.ready:
        assert cache.woke.wait(10), "the disk read never called back"
    got, cached = cache.settle(reuse)
    return got, cached, reuse.tier


def keys_of(cache) -> torch.Tensor:
    return next(layer.keys for layer in cache.layers if cache_layers.has_kv(layer))


def block_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob(f"*{disk_tier.SUFFIX}"))


@pytest.fixture
def folder(tmp_path) -> Path:
    return tmp_path / "kv"


def written(folder: Path, ids, *, hybrid=False, checkpoints=(), **kw) -> None:
    """A process that held `ids` and ended (its writes flushed)."""
    first = open_tier(folder, hybrid=hybrid, **kw)
    cache = hybrid_cache(ids, checkpoints) if hybrid else attention_cache(ids)
    first.give_back(cache, ids)
    assert first.flush(10)
    first.close()


class TestRestart:
    def test_a_new_process_reads_the_full_blocks_back(self, folder):
        ids = list(range(100, 142))  # 5 full blocks and 2 tokens
        written(folder, ids)
        later = open_tier(folder)
        cache, cached, tier = taken(later, [*ids, 7])
        assert tier == "disk" and cached == 40
        assert torch.equal(keys_of(cache), keys_of(attention_cache(ids))[:, :, :40])
        assert later.stats.hits["disk"] == 1 and later.stats.hit_tokens["disk"] == 40
        # the buffers have room for the rest of the prompt, and nothing else sees them: appended in place
        assert getattr(cache, SOLE_OWNER) and keys_of(cache).untyped_storage().nbytes() > keys_of(cache).nbytes
        later.close()

    def test_ram_serves_first_and_disk_only_when_it_holds_a_block_more(self, folder):
        ids = list(range(100, 142))
        tier = open_tier(folder)
        tier.give_back(attention_cache(ids), ids)
        assert tier.flush(10)
        _, cached, where = taken(tier, [*ids, 1])
        assert (cached, where) == (42, "ram")
        tier.close()

    def test_block_files_are_safetensors_holding_the_positions(self, folder):
        ids = list(range(100, 124))
        written(folder, ids)
        files = block_files(folder)
        assert len(files) == 3
        expected = keys_of(attention_cache(ids))
        starts = set()
        for path in files:
            with safe_open(str(path), framework="pt") as handle:  # the reference reader
                metadata = handle.metadata()
                start = int(metadata["start"])
                starts.add(start)
                assert metadata["namespace"] == "model-a" and metadata["format"] == block_file.FORMAT
                assert metadata["tokens"] == ",".join(map(str, ids[start : start + BLOCK]))
                assert torch.equal(handle.get_tensor("k.0"), expected[:, :, start : start + BLOCK])
                assert torch.equal(handle.get_tensor("v.0"), -expected[:, :, start : start + BLOCK])
        assert starts == {0, 8, 16}

    def test_another_scope_or_namespace_finds_nothing(self, folder):
        ids = list(range(100, 124))
        first = open_tier(folder)
        first.give_back(attention_cache(ids), ids, scope="key-a")
        assert first.flush(10)
        first.close()
        same = open_tier(folder)
        assert taken(same, [*ids, 1], scope="key-b")[1] == 0
        assert taken(same, [*ids, 1], scope="key-a")[1] == 24
        other_model = open_tier(folder, namespace="model-b")
        assert taken(other_model, [*ids, 1], scope="key-a")[1] == 0
        assert len(block_files(folder)) == 3  # not another model's to remove
        same.close()
        other_model.close()

    def test_a_hybrid_prefix_ends_at_the_last_block_holding_a_state(self, folder):
        ids = list(range(100, 140))  # blocks end at 8, 16, 24, 32; checkpoints at 8 and 24 only
        written(folder, ids, hybrid=True, checkpoints=(8, 24))
        later = open_tier(folder, hybrid=True)
        cache, cached, tier = taken(later, [*ids[:30], 5, 6])
        assert (cached, tier) == (24, "disk")
        assert cache.layers[0].recurrent_states[0].flatten()[0] == 24.0
        assert torch.equal(keys_of(cache), keys_of(attention_cache(ids))[:, :, :24])
        assert sorted(book_of(cache).at) == [8, 24]  # the prompt carries on with the checkpoints it read
        later.close()


def corrupt_truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-10])


def corrupt_flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40
    path.write_bytes(bytes(data))


def corrupt_garbage(path: Path) -> None:
    path.write_bytes(os.urandom(300))


def corrupt_empty(path: Path) -> None:
    path.write_bytes(b"")


class TestDamagedFiles:
    @pytest.mark.parametrize("damage", [corrupt_truncate, corrupt_flip, corrupt_garbage, corrupt_empty])
    def test_a_damaged_block_ends_the_hit_and_is_removed(self, folder, damage):
        ids = list(range(100, 132))  # 4 blocks
        written(folder, ids)
        later = open_tier(folder)
        third = next(p for p in block_files(folder) if block_file.metadata_of(p.read_bytes())["start"] == "16")
        damage(third)
        cache, cached, tier = taken(later, [*ids, 1])
        assert (cached, tier) == (16, "disk")  # the two blocks before it
        assert not third.exists() and later.stats.disk_files_removed == 1
        later.close()

    def test_a_foreign_block_under_this_name_is_removed(self, folder):
        """Another model's block renamed into this model's place: its namespace and parent say so."""
        ids = list(range(100, 116))
        written(folder, ids, namespace="model-b")
        written(folder, ids)
        mine = open_tier(folder)
        ours = [p for p in block_files(folder) if block_file.metadata_of(p.read_bytes())["namespace"] == "model-a"]
        theirs = [p for p in block_files(folder) if block_file.metadata_of(p.read_bytes())["namespace"] == "model-b"]
        first_ours = next(p for p in ours if block_file.metadata_of(p.read_bytes())["start"] == "0")
        first_theirs = next(p for p in theirs if block_file.metadata_of(p.read_bytes())["start"] == "0")
        first_ours.write_bytes(first_theirs.read_bytes())
        _, cached, _ = taken(mine, [*ids, 1])
        assert cached == 0 and not first_ours.exists() and mine.stats.disk_files_removed == 1
        mine.close()

    def test_a_block_with_other_layers_is_removed(self, folder):
        """Same namespace and chain, but tensors this model does not have (a hand-made file)."""
        ids = list(range(100, 116))
        written(folder, ids)
        path = block_files(folder)[0]
        meta = block_file.metadata_of(path.read_bytes())
        arrays = {
            "k.5": ("F32", torch.zeros(1, 2, BLOCK, 4).numpy()),
            "v.5": ("F32", torch.zeros(1, 2, BLOCK, 4).numpy()),
        }
        keep = {k: meta[k] for k in ("namespace", "parent", "tokens", "start", "states")}
        path.write_bytes(b"".join(bytes(piece) for piece in block_file.encode_block(arrays, keep)))
        later = open_tier(folder)
        _, cached, _ = taken(later, [*ids, 1])
        assert cached in (0, 8) and not path.exists()
        later.close()

    def test_files_that_are_not_blocks_are_left_alone(self, folder):
        written(folder, list(range(100, 116)))
        stranger = folder / "notes.txt"
        stranger.write_text("mine")
        later = open_tier(folder, disk_max_bytes=1)  # every block must go: the folder is over budget
        later.give_back(attention_cache(list(range(200, 216))), list(range(200, 216)))
        assert later.flush(10)
        assert stranger.read_text() == "mine"
        later.close()

    def test_stale_temporary_files_are_removed_at_start(self, folder):
        written(folder, list(range(100, 116)))
        shard = block_files(folder)[0].parent
        stale = shard / f".tmp-1-2-{'a' * 40}"
        fresh = shard / f".tmp-3-4-{'b' * 40}"
        foreign = folder / ".tmp-5-6-someone-elses"  # not where or how this tier writes: never touched
        for path in (stale, fresh, foreign):
            path.write_bytes(b"x")
        old = time.time() - 2 * disk_tier.STALE_TEMP_S
        for path in (stale, foreign):
            os.utime(path, (old, old))
        later = open_tier(folder)
        assert later._disk._scanned.wait(10)  # type: ignore[union-attr]
        assert not stale.exists() and fresh.exists() and foreign.exists()  # a live process's write stays
        later.close()


class TestBudgets:
    def test_the_folder_stays_under_disk_max_bytes_oldest_first(self, folder):
        one_block = None
        tier = open_tier(folder, disk_max_bytes=10 << 20)
        for n in range(12):
            ids = list(range(1000 * n, 1000 * n + 16))
            tier.give_back(attention_cache(ids), ids)
            assert tier.flush(10)
            if one_block is None:
                one_block = block_files(folder)[0].stat().st_size
        tier.close()
        budget = 5 * one_block
        small = open_tier(folder, disk_max_bytes=budget)
        recent = list(range(11000, 11016))
        assert taken(small, [*recent, 1])[1] == 16  # read: its files are the most recently used
        time.sleep(0.05)
        ids = list(range(50000, 50016))
        small.give_back(attention_cache(ids), ids)
        assert small.flush(10)
        total = sum(p.stat().st_size for p in block_files(folder))
        assert total <= budget and small.stats.evictions["disk"] > 0
        assert taken(small, [*recent, 1])[1] == 16  # survived: recently read
        assert small.stats.bytes_held["disk"] == total
        small.close()

    def test_an_entry_evicted_from_ram_is_served_from_disk(self, folder):
        per_entry = 2 * 16 * HEADS * DIM * 4
        tier = open_tier(folder, max_bytes=3 * per_entry)
        prompts = [list(range(1000 * n, 1000 * n + 16)) for n in range(8)]
        for ids in prompts:
            tier.give_back(attention_cache(ids), ids)
            assert tier.bytes_held <= 3 * per_entry
        assert tier.flush(10) and tier.stats.evictions["ram"] == 5
        cache, cached, where = taken(tier, [*prompts[0], 9])
        assert (cached, where) == (16, "disk")
        assert torch.equal(keys_of(cache), keys_of(attention_cache(prompts[0])))
        tier.close()

    def test_the_writer_never_holds_up_the_engine(self, folder, monkeypatch):
        """A writer stuck on a slow disk: give_back still returns at once; past the queue's bound writes are
        dropped and counted, and what was queued is written once the disk answers."""
        release = threading.Event()
        slow = disk_tier.DiskTier._write

        def stuck(self, job):
            release.wait(30)
            slow(self, job)

        monkeypatch.setattr(disk_tier.DiskTier, "_write", stuck)
        block_bytes = 2 * BLOCK * HEADS * DIM * 4
        monkeypatch.setattr(disk_tier, "WRITE_QUEUE_BYTES", 3 * block_bytes)
        tier = open_tier(folder)
        began = time.monotonic()
        for n in range(4):
            ids = list(range(1000 * n, 1000 * n + 16))  # two blocks each
            tier.give_back(attention_cache(ids), ids)
        assert time.monotonic() - began < 5  # generous: four give-backs of tiny caches, not a wait on the writer
        assert tier.stats.disk_writes_dropped == 5
        release.set()
        assert tier.flush(10) and len(block_files(folder)) == 3
        tier.close()

    def test_a_failing_disk_costs_only_its_blocks(self, folder):
        tier = open_tier(folder)
        assert tier._disk is not None and tier._disk._scanned.wait(10)
        shutil.rmtree(tier._disk.folder)
        tier._disk.folder.write_text("not a folder any more")  # every write now fails
        ids = list(range(100, 124))
        tier.give_back(attention_cache(ids), ids)
        assert tier.flush(10)
        assert tier.stats.disk_write_failures == 3 and tier.stats.entries["disk"] == 0
        assert taken(tier, [*ids, 1])[1:] == (24, "ram")  # RAM serves on
        tier.close()

    def test_an_entry_with_queued_writes_is_not_written_in_place(self, folder, monkeypatch):
        release = threading.Event()
        slow = disk_tier.DiskTier._write
        monkeypatch.setattr(disk_tier.DiskTier, "_write", lambda self, job: (release.wait(30), slow(self, job)))
        tier = open_tier(folder, min_tokens=8)
        ids = list(range(100, 140))
        entry = attention_cache(ids)
        tier.give_back(entry, ids)
        got, cached, _ = taken(tier, [*ids[:36], 1, 2])  # the tail (4 tokens) is cut off: the entry is handed out
        assert got is entry and cached == 36
        assert not getattr(got, SOLE_OWNER, False)  # the block 32-40 may still be copied from the cut storage
        release.set()
        assert tier.flush(10)
        tier.close()


def _share_folder(folder: str, seed: int, rounds: int) -> None:
    """One of two processes writing the same blocks and blocks of its own into one folder."""
    tier = open_tier(Path(folder), disk_max_bytes=1 << 30)
    shared = list(range(100, 164))
    for n in range(rounds):
        own = [*shared[:32], *range(10_000 * seed + 100 * n, 10_000 * seed + 100 * n + 32)]
        tier.give_back(attention_cache(shared), shared)
        tier.give_back(attention_cache(own), own)
        tier.clear()
    assert tier.flush(30)
    tier.close()


def test_two_processes_share_one_folder(folder):
    """Both write the same blocks at the same time (atomic renames: one whole file wins) and their own; a
    third reads every block back intact, and no temporary file is left."""
    folder.mkdir(parents=True)
    spawn = multiprocessing.get_context("spawn")
    processes = [spawn.Process(target=_share_folder, args=(str(folder), seed, 6)) for seed in (1, 2)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(120)
        assert process.exitcode == 0
    files = block_files(folder)
    assert len(files) == 8 + 2 * 6 * 4  # the shared prompt's 8 blocks once, each process's 4 own per round
    for path in files:
        meta = block_file.metadata_of(path.read_bytes())
        block_file.read_block(path.read_bytes(), {"namespace": "model-a", "tokens": meta["tokens"]})
    assert not [p for p in folder.rglob(".tmp-*")]
    reader = open_tier(folder)
    shared = list(range(100, 164))
    cache, cached, _ = taken(reader, [*shared, 1])
    assert cached == 64 and torch.equal(keys_of(cache), keys_of(attention_cache(shared)))
    reader.close()
