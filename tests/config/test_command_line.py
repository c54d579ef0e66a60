"""`python -m deltafin` as a process: every config error, Hydra's own included, is one line on stderr naming the
key and exit 2, before anything loads; `--cfg job` checks what it prints."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from tests.conftest import REPO


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "deltafin", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def assert_config_error(result: subprocess.CompletedProcess, key: str) -> str:
    """Exit 2, nothing on stdout, exactly one stderr line that starts with the key; returns that line."""
    lines = result.stderr.splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith(f"deltafin: config error: {key}: "), result.stderr
    assert result.stdout == ""
    return lines[0]


@pytest.mark.parametrize(
    "args, key",
    [
        (["server.no_such_key=1"], "server.no_such_key"),  # Hydra's composition refuses it
        (["+server.prot=1"], "server.prot"),  # Hydra's `+` adds it; the schema check refuses it
        (["server.port=[1"], "server.port"),  # the override grammar
        (["foo"], "foo"),
        (["server.port=notaport"], "server.port"),
        (["placement.quantize=int9"], "placement.quantize"),
        (["placement.device=tpu"], "placement.device"),
        (["model.context_length=-1"], "model.context_length"),
        (["server.host=999.1.1.1"], "server.host"),
        (["server.api_keys=[k1,' ']"], "server.api_keys"),
        (["model=kimi_k3"], "model.path"),  # required by the option, not given
        (["model.family=nope"], "model.family"),
        (["engine=vllm"], "engine.url"),
        (["--cfg", "job", "model.context_length=-1"], "model.context_length"),
        (["--cfg", "job", "server.no_such_key=1"], "server.no_such_key"),
        (["--cfg", "all"], "--cfg"),
        (["--info"], "--info"),
        # an entry of `models` (one more model this process serves): its errors name the entry first
        (['+models.glm=["model=glm","server.port=9"]'], "models.glm"),  # a process-wide key
        (['+models.glm=["model=glm"]'], "models.glm"),  # its own config's error (model.path is required)
        (['+models.a=["model.aliases=[]","placement.quantize=int9"]'], "models.a"),
        (['+models.a=["model.aliases=[]","model.path=/nonexistent"]'], "models.a"),  # checked before anything loads
        (['+models.a=["model.path=/nonexistent"]'], "models.a"),  # the smollm2 file's alias, served by the main model
        (['+models.a=["model.aliases=[]","+models.b=[]"]'], "models.a"),  # no entries of entries
        (["+models.glm=5"], "models.glm"),
        (['+models.a.b=["x"]'], "models.a"),
        (['+models.x=["server={api_keys:[secret]}","model.aliases=[]"]'], "models.x"),  # the group at once
        (['+models.e=["model.aliases=[]","model.name="]'], "models.e"),
        (["model.name= "], "model.name"),
        (["model.aliases=[a,'']"], "model.aliases"),
        (["engine.speculative.method=fast"], "engine.speculative.method"),
        (["engine.speculative.tokens=0"], "engine.speculative.tokens"),
        (["engine.speculative.ngram_min=6", "engine.speculative.ngram_max=3"], "engine.speculative"),
        (["engine.speculative.method=draft"], "engine.speculative"),  # no draft_path
        (
            ["engine.speculative.method=draft", "engine.speculative.draft_path=/nonexistent.gguf"],
            "engine.speculative.draft_path",
        ),
        (["engine.speculative.method=mtp"], "engine.speculative.method"),  # the default GGUF has no MTP layers
    ],
)
def test_config_error_is_one_line_naming_the_key(args, key):
    assert_config_error(run(*args), key)


def test_unknown_option_of_a_group_lists_the_known_ones():
    line = assert_config_error(run("model=nonexistent"), "model")
    assert "'nonexistent'" in line and "glm, kimi_k2, kimi_k3, qwen3, smollm2" in line


def test_a_near_miss_names_the_key_meant():
    assert "did you mean server.port?" in assert_config_error(run("+server.prot=1"), "server.prot")


def test_missing_model_path_exits_before_serving():
    line = assert_config_error(run("model=kimi_k3", "model.path=/nonexistent/k3"), "model.path")
    assert "/nonexistent/k3 does not exist" in line


def test_an_address_this_machine_does_not_have():
    line = assert_config_error(run("server.host=192.0.2.1"), "server.host")  # TEST-NET-1: never local
    assert "cannot listen on 192.0.2.1:8000" in line


def test_a_port_in_use():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert "cannot listen" in assert_config_error(run(f"server.port={port}"), "server.port")


def test_bad_rule_names_the_rule():
    assert_config_error(run("compat=para", "compat.rules.max_tokens_cap.value=-1"), "compat.rules.max_tokens_cap.value")


def test_a_rule_value_of_the_wrong_type_names_the_value():
    line = assert_config_error(
        run("compat=para", "compat.rules.max_tokens_cap.value=nan"), "compat.rules.max_tokens_cap.value"
    )
    assert "nan" in line


def test_cfg_job_prints_the_checked_config():
    result = run("--cfg", "job", "server.port=9001", "model=glm", "model.path=/m", "model.tool_parser=glm47")
    assert result.returncode == 0 and result.stderr == ""
    assert "port: 9001" in result.stdout and "device: cpu" in result.stdout
    assert "variant: glm47" in result.stdout  # the parser name selected the variant, as serving would


def test_help_lists_the_groups_and_their_options():
    result = run("--help")
    assert result.returncode == 0
    assert "model: glm, kimi_k2, kimi_k3, qwen3, smollm2" in result.stdout and "--cfg job" in result.stdout


def test_a_missing_model_path_is_reported_before_torch_is_imported():
    """The commonest start-up mistake, a typo in model.path, is answered at once: the path is checked before
    the checks that import torch and transformers (seconds)."""
    probe = (
        "import sys\nfrom deltafin.cli import main\ntry:\n    main(['model.path=/nonexistent'])\n"
        "except SystemExit as exit:\n    print(exit.code, 'torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.stdout.split() == ["2", "False"], result.stdout + result.stderr
    assert "model.path: /nonexistent does not exist" in result.stderr
