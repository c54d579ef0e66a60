"""The expert pool on a generated MoE with 4.5 GiB of routed experts: tokens/s against its I/O bound,
accelerate's disk offload, every expert resident and llama.cpp, with and without prefetch, and under a memory
cap below the model's size.

    .venv/bin/python bench/experts.py                  # everything (generates the model and its GGUF once)
    .venv/bin/python bench/experts.py --only pool      # a subset: bandwidth pool int8 resident accelerate llama capped
    .venv/bin/python bench/experts.py --only bandwidth published published-capped   # the published formats
    # the published formats' targets alone, holding the bench lock for the whole run (not per variant):
    flock /tmp/deltafin-bench.lock env DELTAFIN_BENCH_LOCK_HELD=1 .venv/bin/python bench/experts.py \
        --only published-capped --variants "pool 1/8 prefetch" "bf16 pool 576MiB" "mxfp4 pool 576MiB" \
        "int4 pool 576MiB" "fp8 pool 576MiB"
    .venv/bin/python bench/experts.py --cleanup        # delete the generated model, GGUF and offload folder

The model: Qwen3-MoE (the real transformers class; llama.cpp's converter reads it too), 8 layers of 64 experts
of 9 MiB (hidden 1024, expert intermediate 768, float32), top-4 routing, random weights: 4.83 GB of routed
experts, ~0.1 GB dense. Token embeddings are drawn with std 1 (deltafin.tiny.moe `embedding_std`), so the
random routers route almost uniformly in every layer: the worst case for any cache of experts; a trained
model's skew raises every hit rate below. (At transformers' init, std 0.02, this model routes most tokens of
its deeper layers to the same 6-8 experts, and a 1/8 pool hits 87%.)

Every variant runs in a fresh process (`--child`), through Deltafin's engine (`LocalEngine`), one stream of
`--tokens` tokens (`ignore_eos`) after a short warm-up, `--reps` times with different prompts; tokens/s is over
the decode steps (first token to last). Tokens are sampled (temperature 1, a fixed seed: every variant gets the
same tokens), not greedy: a random model's greedy output repeats one token, whose hidden state, and so whose
experts, repeat every step, an easy 90% hit rate that real text does not give. The model's pages are dropped from the page cache
(posix_fadvise DONTNEED) before each variant. Only the timed part holds /tmp/deltafin-bench.lock.

- I/O bound: bytes the pool read per generated token / the checkpoint's sequential read bandwidth, measured
  cold (pages dropped) and warm (from the page cache). Runs without a cap keep what they read in the page
  cache (the machine has more memory than the model), so their misses mostly read memory: compare them with
  the warm bound; capped runs read the disk: compare them with the cold bound.
- accelerate: `placement.device_map=auto` with `max_memory` = dense + the 1/8 pool and an offload folder.
  Its offloaded weights are memory-mapped files: without a cap they stay in the page cache once read, so the
  uncapped run is nearly the resident speed; under the cap it reads them from disk every token (the offload
  folder's pages are dropped before each run, like the checkpoint's).
- capped: the process in a cgroup v1 memory group (`memory.limit_in_bytes`, root only) below the model's size;
  llama-server (same weights, f32 GGUF, mmap) under the same cap.
- int8: `placement.quantize=int8` with the 1/8 pool's MiB (about half of the experts as int8), misses read from
  the int8 copy of the experts (written to WORK/cache by the first such run) with O_DIRECT: their I/O bound is
  that file's O_DIRECT read bandwidth, capped or not.
- "from disk": /proc/self/io read_bytes per token, what the block layer read for the process (page-cache hits
  are not in it): what a variant really takes from the disk, whatever it asked for.
- published (`--only published published-capped`): the same model (the same float32 weights) written as a
  bfloat16 checkpoint and in the published quantized formats (`deltafin.tiny.quantized`: compressed-tensors
  MXFP4 and int4 routed experts, as Kimi K3 and K2-Thinking ship theirs; FP8 blocks on every Linear, as K2-Instruct),
  each served in its own form: pools of the same MiB as the float32 1/8 pool (576 MiB: a quarter of the
  bfloat16 experts, ~90% of the MXFP4 ones), and MXFP4 / int4 pools of an eighth of the experts (the I/O-heavy
  case), beside the float32 pool and the int8 copy of the same run. Packed pools read misses from the copy of
  their experts in the slots' records with O_DIRECT (written by their first run): their I/O bound is that file's
  O_DIRECT read bandwidth; the bfloat16 pool reads its checkpoint (cold bound capped, warm uncapped).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

WORK = Path(os.environ.get("DELTAFIN_BENCH_DIR", "/tmp/deltafin-bench-experts"))
MODEL = WORK / "qwen3-moe-4.8g-uniform"
#: the same model in other checkpoint formats: name -> (format for deltafin.tiny.quantized, its modules)
PUBLISHED = {
    "bf16": (None, "experts"),
    "mxfp4": ("mxfp4", "experts"),
    "int4": ("int4", "experts"),
    "fp8": ("fp8", "linear"),
}
GGUF = WORK / "qwen3-moe-4.8g-uniform-f32.gguf"
OFFLOAD = WORK / "offload"
#: model.cache_dir of every variant: the int8 copy of the experts (placement.quantize=int8) is written here
CACHE = WORK / "cache"
LOCK = "/tmp/deltafin-bench.lock"
CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
PROMPT = "The quick brown fox jumps over the lazy dog. What is the weather in Paris today? It is sunny and warm."
MIB = 1 << 20


def shape():
    from deltafin.tiny.moe import MoeShape

    return MoeShape(experts=64, top_k=4, layers=8, hidden=1024, intermediate=768, heads=8)


@contextlib.contextmanager
def bench_lock():
    if os.environ.get("DELTAFIN_BENCH_LOCK_HELD"):  # the caller holds it for the whole run (flock LOCK command)
        yield
        return
    with open(LOCK, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def checkpoint_files() -> list[Path]:
    from deltafin.engine.experts.checkpoint import checkpoint_files as files

    return files(MODEL)


def drop_page_cache(paths: list[Path]) -> None:
    """Evict these files' pages (only theirs: nothing else on the machine is touched)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_bandwidth(limit: int = 3 << 30) -> dict[str, float]:
    """Sequential read of the checkpoint's first `limit` bytes in 8 MiB reads: cold (pages dropped), then warm."""
    buffer = bytearray(8 * MIB)
    files = checkpoint_files()

    def once() -> float:
        done, started = 0, time.perf_counter()
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                while done < limit:
                    got = os.readv(fd, [buffer])
                    if not got:
                        break
                    done += got
            finally:
                os.close(fd)
            if done >= limit:
                break
        return done / (time.perf_counter() - started)

    drop_page_cache(files)
    with bench_lock():
        cold = once()
        warm = once()
        direct = direct_read_bandwidth()
    return {"cold_bytes_per_s": cold, "warm_bytes_per_s": warm, **direct}


def direct_read_bandwidth() -> dict[str, float]:
    """Sequential O_DIRECT read of each copy of the experts in slot records (what the int8 and packed pools
    read, bypassing the page cache), one thread, 8 MiB reads into page-aligned memory, up to 2 GiB of each:
    `direct_{kind}_bytes_per_s` (int8 also as `direct_bytes_per_s`); {} before a run has written one."""
    import mmap

    out = {}
    buffer = mmap.mmap(-1, 8 * MIB)  # page-aligned, as O_DIRECT wants
    for copy in sorted((CACHE / "experts").glob("*.bin")):
        kind = copy.name.rsplit("-", 2)[-2]
        fd = os.open(copy, os.O_RDONLY | os.O_DIRECT)
        done, started = 0, time.perf_counter()
        try:
            while done < (2 << 30) and (got := os.preadv(fd, [buffer], done)):
                done += got
        finally:
            os.close(fd)
        out[f"direct_{kind}_bytes_per_s"] = done / (time.perf_counter() - started)
    if "direct_int8_bytes_per_s" in out:
        out["direct_bytes_per_s"] = out["direct_int8_bytes_per_s"]
    return out


def published_model(name: str) -> Path:
    return WORK / f"{MODEL.name}-{name}"


def ensure_published() -> None:
    """The bench model as a bfloat16 checkpoint and in each published format (written once, from float32)."""
    import torch

    from deltafin.tiny.quantized import quantize_folder

    for name, (fmt, modules) in PUBLISHED.items():
        target = published_model(name)
        if (target / "config.json").exists():
            continue
        print(f"writing {target} ...", flush=True)
        started = time.perf_counter()
        staging = target.with_name(target.name + ".part")
        shutil.rmtree(staging, ignore_errors=True)
        quantize_folder(MODEL, staging, fmt, modules, cast=torch.bfloat16 if fmt is None else None)
        staging.rename(target)
        print(f"written in {time.perf_counter() - started:.0f} s", flush=True)


# --- one variant, in its own process -------------------------------------------------------------------------


def child(spec: dict) -> dict:
    import torch

    from deltafin.engine import EngineFront, Finished, GenerationJob, TextDelta
    from deltafin.engine.local.engine import LocalEngine
    from deltafin.engine.weights.loader import load_model
    from deltafin.protocol.sampling import SamplingParams
    from deltafin.testing import compose_config

    model = spec.get("model", str(MODEL))
    config = compose_config(
        ["model=qwen3", f"model.path={model}", "model.name=moe", f"model.cache_dir={CACHE}", *spec["overrides"]]
    )
    threads = config.placement.num_threads or torch.get_num_threads()
    torch.set_num_threads(1)  # as engine.local.build.build_local_engine: only the engine thread runs torch's team
    started = time.perf_counter()
    loaded = load_model(config.model, config.placement, max_batch=config.engine.max_batch)
    load_s = time.perf_counter() - started
    if loaded.experts is not None and config.placement.num_threads is None:  # as engine.local.build.build_local_engine
        threads = loaded.experts.compute_threads(threads)
    engine = LocalEngine(loaded, max_batch=config.engine.max_batch, threads=threads)
    front = EngineFront(engine, max_waiting=4, timeout_s=3600, memo_entries=0)
    prompts = [loaded.tokenizer(f"{i}. {PROMPT}").input_ids for i in range(spec["reps"] + 1)]
    pool = engine.experts

    async def generate(ids: list[int], tokens: int) -> dict:
        params = SamplingParams(max_tokens=tokens, temperature=1.0, seed=len(ids), ignore_eos=True)
        stream = await front.start([GenerationJob(tuple(ids), params)])
        first = first_stats = None
        count = 0
        async for event in stream:
            if isinstance(event, TextDelta) and event.token_ids:
                count += len(event.token_ids)
                if first is None:
                    first, first_stats, first_cpu = time.perf_counter(), pool.stats() if pool else None, _cpu()
                    first_disk = _disk_read()
            elif isinstance(event, Finished):
                end, end_stats, end_cpu = time.perf_counter(), pool.stats() if pool else None, _cpu()
                end_disk = _disk_read()
                timings = event.timings
        result = {"tokens": count, "decode_s": end - first, "cpu_s": end_cpu - first_cpu, "disk": end_disk - first_disk}
        if pool:
            result.update(
                hits=end_stats.hits - first_stats.hits,
                misses=end_stats.misses - first_stats.misses,
                decode_bytes=timings.get("expert_decode_bytes", 0.0),
                prefetch_reads=end_stats.prefetch_reads - first_stats.prefetch_reads,
                prefetch_hits=end_stats.prefetch_hits - first_stats.prefetch_hits,
                wait_s=end_stats.wait_seconds - first_stats.wait_seconds,
            )
        return result

    async def scenario() -> list[dict]:
        await generate(prompts[-1], spec.get("warmup", 4))
        with bench_lock():
            return [await generate(prompts[i], spec["tokens"]) for i in range(spec["reps"])]

    runs = asyncio.run(scenario())
    asyncio.run(front.aclose())
    steps = sum(r["tokens"] - 1 for r in runs)
    decode_s = sum(r["decode_s"] for r in runs)
    out = {
        "name": spec["name"],
        "load_s": load_s,
        "tokens_per_s": steps / decode_s,
        "status": _status(),
        # CPU time of the whole process (engine and reader threads) per token: less bent by a busy machine
        "cpu_s_per_token": sum(r["cpu_s"] for r in runs) / steps,
        # bytes this process had the block layer read (page-cache misses), per token: what came off the disk
        "disk_bytes_per_token": sum(r["disk"] for r in runs) / steps,
    }
    if pool:
        lookups = sum(r["hits"] + r["misses"] for r in runs)
        stats = pool.stats()
        out.update(
            hit_rate=sum(r["hits"] for r in runs) / lookups,
            bytes_per_token=sum(r["decode_bytes"] for r in runs) / steps,
            prefetch_reads=sum(r["prefetch_reads"] for r in runs),
            prefetch_hits=sum(r["prefetch_hits"] for r in runs),
            wait_s_per_token=sum(r["wait_s"] for r in runs) / steps,
            slots=stats.slots,
            pool_bytes=stats.slots * stats.slot_bytes,
            experts=len(pool.index.layers) * pool.index.experts,
            experts_bytes=pool.index.total_bytes,
        )
    return out


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _disk_read() -> int:
    """Bytes this process caused to be read from storage (/proc/self/io read_bytes: page-cache hits excluded)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def _status() -> dict[str, int]:
    """RssAnon and the peak resident set of this process, bytes."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


# --- the parent: variants, cgroups, llama.cpp ----------------------------------------------------------------


class MemoryCap:
    """A cgroup v1 memory group capping whatever process joins it (`join` runs in the child before exec)."""

    def __init__(self, limit: int) -> None:
        self.path = CGROUP_ROOT / f"deltafin-bench-{os.getpid()}"
        self.path.mkdir(exist_ok=True)
        (self.path / "memory.limit_in_bytes").write_text(str(limit))
        self.limit = limit

    def join(self) -> None:
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def report(self) -> dict:
        oom = dict(line.split() for line in (self.path / "memory.oom_control").read_text().splitlines())
        return {
            "cap_bytes": self.limit,
            "max_usage": int((self.path / "memory.max_usage_in_bytes").read_text()),
            "oom_kills": int(oom.get("oom_kill", 0)),
        }

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.path.rmdir()


def model_files() -> list[Path]:
    """Every file a variant may read the weights from: the checkpoint, accelerate's offload folder (without
    dropping these, a capped offload run reads its weights from pages an earlier run left in the cache: a
    cgroup v1 cap does not charge pages another group brought in) and the GGUF."""
    extra = [*sorted(OFFLOAD.glob("*")), *sorted((CACHE / "experts").glob("*.bin")), GGUF]
    for name in PUBLISHED:
        extra += sorted(published_model(name).glob("*.safetensors"))
    return checkpoint_files() + [path for path in extra if path.is_file()]


#: overrides every variant gets (--threads: placement.num_threads)
COMMON_OVERRIDES: list[str] = []


def run_child(spec: dict, cap: MemoryCap | None = None) -> dict:
    spec = {**spec, "overrides": [*spec["overrides"], *COMMON_OVERRIDES]}
    drop_page_cache(model_files())
    cmd = [sys.executable, __file__, "--child", json.dumps(spec)]
    print(f"-- {spec['name']}: {' '.join(spec['overrides'])}", flush=True)
    done = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        preexec_fn=cap.join if cap else None,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith('{"name"')]
    if done.returncode != 0 or not lines:
        result = {"name": spec["name"], "failed": done.returncode, "error": done.stderr.strip().splitlines()[-1:]}
    else:
        result = json.loads(lines[-1])
    if cap is not None:
        result["cap"] = cap.report()
    print(json.dumps(result), flush=True)
    return result


def pool_spec(fraction: float, *, prefetch: bool, tokens: int, reps: int, int8: bool = False, prefix: str = "") -> dict:
    """A pool of `fraction` of the float32 experts' bytes; `int8`: the same MiB of int8 slots (about four times
    the experts), misses read from the int8 copy of the experts with O_DIRECT."""
    import torch

    from deltafin.engine.experts.slots import FloatSlots

    s = shape()
    slot = FloatSlots.slot_bytes((2 * s.intermediate, s.hidden), (s.hidden, s.intermediate), torch.float32)
    pool_mb = int(fraction * s.layers * s.experts * slot / MIB)
    name = f"{prefix}pool 1/{round(1 / fraction)}{' int8' if int8 else ''} {'prefetch' if prefetch else 'no prefetch'}"
    return {
        "name": name,
        "tokens": tokens,
        "reps": reps,
        "overrides": [
            f"placement.experts.pool_mb={pool_mb}",
            f"placement.experts.prefetch={str(prefetch).lower()}",
            *(["placement.quantize=int8"] if int8 else []),
        ],
    }


def published_spec(name: str, pool: str, *, tokens: int, reps: int, prefix: str = "", prefetch: bool = True) -> dict:
    """The model as `name` (PUBLISHED), its experts pooled in `pool`: "576MiB" (the float32 1/8 pool's MiB),
    "1/8" (an eighth of the experts, in that format's records), or "resident" (every expert, no pool)."""
    from deltafin.engine.experts.records import PackedLayout
    from deltafin.engine.quant.formats import PackedModule

    s = shape()
    if pool == "576MiB":
        pool_mb = int(pool_spec(1 / 8, prefetch=True, tokens=0, reps=0)["overrides"][0].split("=")[1])
    elif pool == "1/8":
        fmt = PUBLISHED[name][0]
        spec = PackedModule("m", fmt, s.intermediate, s.hidden, {}, "BF16" if fmt == "int4" else "U8", 32)
        layout = PackedLayout(spec, (2 * s.intermediate, s.hidden), (s.hidden, s.intermediate))
        pool_mb = -(-s.layers * s.experts * layout.stride // 8 // MIB)
    else:
        pool_mb = 0
    return {
        "name": f"{prefix}{name} {'resident' if pool == 'resident' else 'pool ' + pool}"
        + ("" if prefetch or pool == "resident" else " no prefetch"),
        "model": str(published_model(name)),
        "tokens": tokens,
        "reps": reps,
        "overrides": [
            f"placement.experts.pool_mb={pool_mb}",
            f"placement.experts.prefetch={str(prefetch).lower()}",
            # the bfloat16 pool: bfloat16 slots (twice float32's experts in the same MiB), bfloat16 compute
            *(["placement.dtype=bfloat16"] if name == "bf16" else []),
        ],
    }


def published_runs(tokens: int, reps: int, cap: MemoryCap | None, variants: list[str] | None) -> list[dict]:
    """`variants`: only these (names without the "capped " prefix); None: all."""
    prefix = "capped " if cap else ""
    specs = [
        pool_spec(1 / 8, prefetch=True, tokens=tokens, reps=reps, prefix=prefix),
        pool_spec(1 / 8, prefetch=True, tokens=tokens, reps=reps, int8=True, prefix=prefix),
        *(published_spec(name, "576MiB", tokens=tokens, reps=reps, prefix=prefix) for name in PUBLISHED),
        published_spec("bf16", "576MiB", tokens=tokens, reps=reps, prefix=prefix, prefetch=False),
        published_spec("mxfp4", "1/8", tokens=tokens, reps=reps, prefix=prefix),
        published_spec("int4", "1/8", tokens=tokens, reps=reps, prefix=prefix),
        published_spec("mxfp4", "1/8", tokens=tokens, reps=reps, prefix=prefix, prefetch=False),
        published_spec("mxfp4", "resident", tokens=tokens, reps=reps, prefix=prefix),
        published_spec("int4", "resident", tokens=tokens, reps=reps, prefix=prefix),
    ]
    if variants is not None:
        specs = [spec for spec in specs if spec["name"].removeprefix(prefix) in variants]
    return [run_child(spec, cap) for spec in specs]


def offload_spec(tokens: int) -> dict:
    """accelerate's disk offload with the memory of the 1/8 pool (plus 128 MiB for the dense part)."""
    pool_mb = int(pool_spec(1 / 8, prefetch=True, tokens=0, reps=0)["overrides"][0].split("=")[1])
    return {
        "name": "accelerate offload",
        "tokens": tokens,
        "reps": 1,
        "warmup": 2,
        "overrides": [
            "placement.device_map=auto",
            f"placement.max_memory={{cpu:{pool_mb + 128}MiB}}",
            f"placement.offload_folder={OFFLOAD}",
        ],
    }


def ensure_model() -> None:
    if (MODEL / "config.json").exists():
        return
    from deltafin.tiny.moe import write_moe

    print(f"writing the model to {MODEL} ...", flush=True)
    started = time.perf_counter()
    write_moe("qwen3_moe", MODEL, shape(), stream=True, embedding_std=1.0)
    print(f"written in {time.perf_counter() - started:.0f} s", flush=True)


def ensure_gguf() -> None:
    if GGUF.exists():
        return
    from deltafin.tiny.gguf import converter_sources

    llama = converter_sources()
    print(f"converting to {GGUF} with llama.cpp's converter ...", flush=True)
    partial = GGUF.with_suffix(".part")
    subprocess.run(
        [sys.executable, "-m", "deltafin.tiny.gguf", "--convert-with", str(llama), str(MODEL), str(partial)],
        check=True,
        cwd=Path(__file__).resolve().parents[1],
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        stdout=subprocess.DEVNULL,
    )
    partial.rename(GGUF)


def llama(tokens: int, reps: int, cap: MemoryCap | None, name: str) -> dict:
    import httpx

    from deltafin.testing import free_port
    from deltafin.testing.llama_server import llama_server_binary

    binary = llama_server_binary()
    if not binary.exists():
        return {"name": name, "failed": "no llama-server binary (scripts/build-llama-server)"}
    drop_page_cache([GGUF])
    port = free_port()
    threads = os.cpu_count() or 2
    process = subprocess.Popen(
        [
            str(binary),
            "-m",
            str(GGUF),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-c",
            "1024",
            "-np",
            "1",
            "-t",
            str(threads),
            "--no-webui",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=cap.join if cap else None,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if process.poll() is not None:
                return {"name": name, "failed": process.returncode, **({"cap": cap.report()} if cap else {})}
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.5)

        def complete(prompt: str, n: int) -> dict:
            body = {
                "prompt": prompt,
                "n_predict": n,
                "temperature": 1.0,
                "seed": len(prompt),
                "ignore_eos": True,
                "cache_prompt": False,
            }
            return httpx.post(url + "/completion", json=body, timeout=3600).json()["timings"]

        complete(f"{reps}. {PROMPT}", 4)
        with bench_lock():
            timings = [complete(f"{i}. {PROMPT}", tokens) for i in range(reps)]
        result = {
            "name": name,
            "tokens_per_s": sum(t["predicted_n"] for t in timings) / sum(t["predicted_ms"] / 1000 for t in timings),
        }
        status = Path(f"/proc/{process.pid}/status").read_text()
        result["status"] = {
            k: int(v.split()[0]) * 1024
            for k, _, v in (line.partition(":") for line in status.splitlines())
            if k in ("RssAnon", "RssFile", "VmHWM")
        }
    finally:
        process.terminate()
        process.wait(timeout=30)
    if cap:
        result["cap"] = cap.report()
    print(json.dumps(result), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument(
        "--offload-tokens", type=int, default=4, help="accelerate's offload reads every weight per token"
    )
    parser.add_argument("--cap-gib", type=float, default=2.0, help="memory cap of the capped runs (model: 4.9 GB)")
    parser.add_argument(
        "--only",
        nargs="+",
        default=["bandwidth", "pool", "int8", "resident", "accelerate", "llama", "capped"],
        help="also: published published-capped (the model in the published quantized formats)",
    )
    parser.add_argument("--out", type=Path, default=WORK / "results.json")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="placement.num_threads of every variant (1 on a shared machine: a team of two waits for a busy core)",
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        default=None,
        help='published runs: only these, e.g. "bf16 pool 576MiB" "mxfp4 pool 576MiB" (default: all)',
    )
    parser.add_argument("--cleanup", action="store_true")
    parser.add_argument("--report", action="store_true", help="print the table of the results file and stop")
    args = parser.parse_args()
    if args.report:
        report(json.loads(args.out.read_text()))
        return
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    if args.cleanup:
        shutil.rmtree(WORK, ignore_errors=True)
        print(f"removed {WORK}")
        return
    WORK.mkdir(parents=True, exist_ok=True)
    if args.threads:
        COMMON_OVERRIDES.append(f"placement.num_threads={args.threads}")
    ensure_model()
    results = json.loads(args.out.read_text()) if args.out.exists() else {}

    def keep(result: dict) -> None:
        results[result["name"]] = result
        args.out.write_text(json.dumps(results, indent=1))

    t, r = args.tokens, args.reps
    if "bandwidth" in args.only:
        keep({"name": "bandwidth", **read_bandwidth()})
    if "pool" in args.only:
        for fraction in (1 / 8, 1 / 4, 1 / 2):
            for prefetch in (True, False):
                keep(run_child(pool_spec(fraction, prefetch=prefetch, tokens=t, reps=r)))
    if "int8" in args.only:
        for prefetch in (True, False):
            keep(run_child(pool_spec(1 / 8, prefetch=prefetch, tokens=t, reps=r, int8=True)))
        keep({"name": "bandwidth", **results.get("bandwidth", {}), **direct_read_bandwidth()})
    if "resident" in args.only:
        keep(run_child({"name": "resident", "overrides": [], "tokens": t, "reps": r}))
    if "accelerate" in args.only:
        keep(run_child(offload_spec(args.offload_tokens)))
    if "published" in args.only or "published-capped" in args.only:
        ensure_published()
    if "published" in args.only:
        for result in published_runs(t, r, None, args.variants):
            keep(result)
        keep({"name": "bandwidth", **results.get("bandwidth", {}), **direct_read_bandwidth()})
    if "published-capped" in args.only:
        cap = MemoryCap(int(args.cap_gib * (1 << 30)))
        try:
            for result in published_runs(t, r, cap, args.variants):
                keep(result)
        finally:
            cap.close()
        keep({"name": "bandwidth", **results.get("bandwidth", {}), **direct_read_bandwidth()})
    if "llama" in args.only or "capped" in args.only:
        ensure_gguf()
    if "llama" in args.only:
        keep(llama(t, r, None, "llama-server"))
    if "capped" in args.only:
        cap = MemoryCap(int(args.cap_gib * (1 << 30)))
        try:
            for fraction, prefetch, int8 in (
                (1 / 8, True, False),
                (1 / 8, False, False),
                (1 / 4, True, False),
                (1 / 8, True, True),
                (1 / 8, False, True),
            ):
                keep(
                    run_child(
                        pool_spec(fraction, prefetch=prefetch, tokens=t, reps=r, int8=int8, prefix="capped "), cap
                    )
                )
            keep(llama(t, r, cap, "capped llama-server"))
            keep(run_child({**offload_spec(args.offload_tokens), "name": "capped accelerate offload"}, cap))
            keep(run_child({"name": "capped resident", "overrides": [], "tokens": t, "reps": r}, cap))
        finally:
            cap.close()
    report(results)


def report(results: dict) -> None:
    """Tokens/s of every variant beside its I/O bound, and the ratios the targets name."""
    band = results.get("bandwidth", {})
    print(
        "\n| variant | tok/s | CPU s/token | hit rate | read/token | from disk/token | waited/token | I/O bound tok/s "
        "| of bound | RssAnon |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, result in results.items():
        if name == "bandwidth":
            continue
        if "tokens_per_s" not in result:
            print(
                f"| {name} | failed: {result.get('failed')} {' '.join(result.get('error', []))} "
                f"{json.dumps(result.get('cap', ''))} ||||||||"
            )
            continue
        cpu = result.get("cpu_s_per_token")
        cells = [name, f"{result['tokens_per_s']:.3f}", f"{cpu:.2f}" if cpu else ""]
        disk = result.get("disk_bytes_per_token")
        disk_cell = f"{disk / MIB:.0f} MiB" if disk is not None else ""
        if "bytes_per_token" in result:
            per_token = result["bytes_per_token"]
            # the int8 pool reads its copy with O_DIRECT: always the disk, whatever the page cache holds
            packed = next((f for f in ("mxfp4", "int4", "fp8") if f" {f} " in f" {name} "), None)
            key = (
                "direct_bytes_per_s"
                if " int8 " in name
                else f"direct_{packed}_bytes_per_s"
                if packed
                else "cold_bytes_per_s"
                if name.startswith("capped")
                else "warm_bytes_per_s"
            )
            bound = band.get(key, 0) / per_token if per_token else float("inf")
            cells += [
                f"{result['hit_rate']:.1%}",
                f"{per_token / MIB:.0f} MiB",
                disk_cell,
                f"{result['wait_s_per_token']:.3f} s",
                f"{bound:.2f} ({key.split('_')[0]})" if bound != float("inf") else "",
                f"{result['tokens_per_s'] / bound:.0%}" if bound and bound != float("inf") else "",
            ]
        else:
            cells += ["", "", disk_cell, "", "", ""]
        anon = result.get("status", {}).get("RssAnon")
        cells.append(f"{anon / MIB:.0f} MiB" if anon else "")
        print("| " + " | ".join(cells) + " |")
    if "cold_bytes_per_s" in band:  # a run without --only bandwidth has only the copies' O_DIRECT figures
        print(
            f"\nsequential read of the checkpoint: cold {band['cold_bytes_per_s'] / MIB:.0f} MiB/s, "
            f"warm {band['warm_bytes_per_s'] / MIB:.0f} MiB/s; of the int8 copy with O_DIRECT: "
            f"{band.get('direct_bytes_per_s', 0) / MIB:.0f} MiB/s"
        )
    for prefix in ("", "capped "):
        offload = results.get(f"{prefix}accelerate offload", {}).get("tokens_per_s")
        for variant in (
            "pool 1/8 prefetch",
            "pool 1/8 no prefetch",
            "pool 1/8 int8 prefetch",
            "pool 1/8 int8 no prefetch",
        ):
            pool = results.get(f"{prefix}{variant}", {}).get("tokens_per_s")
            if offload and pool:
                print(f"{prefix}{variant} / {prefix}accelerate offload: {pool / offload:.1f}x (target >= 10x)")
    for prefix in ("", "capped "):
        bf16 = results.get(f"{prefix}bf16 pool 576MiB", {}).get("tokens_per_s")
        for name in ("mxfp4", "int4", "fp8"):
            packed = results.get(f"{prefix}{name} pool 576MiB", {}).get("tokens_per_s")
            if bf16 and packed:
                print(f"{prefix}{name} pool 576MiB / {prefix}bf16 pool 576MiB: {packed / bf16:.1f}x (target >= 3x)")
    print(f"load average now: {os.getloadavg()[0]:.1f} (2 cores; figures taken on a busy machine are indicative)")


if __name__ == "__main__":
    main()
