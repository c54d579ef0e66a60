"""The built wheel carries conf/, the tiny-model templates and the C kernels, and an installed copy serves its
config without the checkout (`python -m deltafin --cfg job` from another folder)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.wheel


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """`pip wheel` of a copy of the sources (a build writes build/ and *.egg-info beside them)."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, source / name)
    for name in ("deltafin", "conf"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(root),
            str(source),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return next(root.glob("deltafin-*.whl"))


def test_the_wheel_holds_conf_templates_and_kernels(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {p.relative_to(REPO / "conf").as_posix() for p in (REPO / "conf").rglob("*.yaml")}
    assert {f"deltafin/conf/{name}" for name in shipped} <= names
    assert {"deltafin/tiny/templates/glm.jinja", "deltafin/engine/kernels/int8_matvec.c"} <= names
    assert not any(name.startswith("conf/") for name in names)  # no top-level `conf` package in site-packages


def test_an_installed_copy_prints_its_config_outside_the_checkout(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # The installed copy first on the path: the dependencies come from this environment, deltafin from `target`.
    env = {**os.environ, "PYTHONPATH": str(target), "HF_HUB_OFFLINE": "1"}
    probe = "import deltafin.config as c; print(c.__file__); print(c.CONF_DIR)"
    where = subprocess.run(
        [sys.executable, "-c", probe], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=60, check=True
    ).stdout.split()
    assert where == [str(target / "deltafin" / "config" / "__init__.py"), str(target / "deltafin" / "conf")]
    result = subprocess.run(
        [sys.executable, "-m", "deltafin", "--cfg", "job", "model=glm", "model.path=/m"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "family: glm" in result.stdout and "content_format: openai" in result.stdout
