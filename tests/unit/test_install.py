"""Installability where GPU users live: a non-editable install carries every module and data file, and installing
the package into an environment that already has torch (this venv's, or a GPU container's pre-release build) keeps
that torch.

Offline: pip runs with ``--no-index`` and no configuration file, so nothing is downloaded; the package's
dependencies are all satisfied by this venv, which is what the resolver is asked to notice.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.harness import REPO

NGC_TORCH = "2.14.0a0+ecf3bae40a.nv26.10"
"""A torch as GPU containers ship it: a pre-release of the next version with a local tag (NGC PyTorch 25.01 had
2.6.0a0+ecf3bae40a while 2.5.1 was the newest release)."""


def _pip(*args: str, pythonpath: Path | None = None, cwd: Path) -> subprocess.CompletedProcess:
    """This venv's pip, offline, blind to the machine's pip configuration (indexes, find-links, constraints)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    env.pop("PYTHONPATH", None)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([sys.executable, "-m", "pip", *args, "--no-index", "--disable-pip-version-check"],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the sources (a build writes build/ and *.egg-info next to them)."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "results")
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for name in ("ntp_megatron", "patches", "configs"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    proc = _pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(root / "out"), "./src", cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (built,) = (root / "out").glob("ntp_megatron-*.whl")
    return built


def test_wheel_carries_every_module_and_data_file(wheel, tmp_path):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {p.relative_to(REPO).as_posix() for p in (REPO / "ntp_megatron").rglob("*.py")}
    expected |= {f"ntp_megatron/patches/{p.name}" for p in (REPO / "patches").glob("*.py")}
    expected |= {"ntp_megatron/" + p.relative_to(REPO).as_posix() for p in (REPO / "configs").rglob("*.yaml")}
    expected |= {p.relative_to(REPO).as_posix() for p in (REPO / "ntp_megatron" / "data").glob("*.txt")}
    assert not expected - names, f"missing from the wheel: {sorted(expected - names)}"
    # Unpacked (what pip does with a pure wheel), it imports without the repository, default config included.
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = ("import ntp_megatron.elastic.keys, ntp_megatron.patches, ntp_megatron.sim.cli;"  # no torch: cheap
            "from ntp_megatron.config import schema as config;"
            "print(config.__file__, ntp_megatron.patches.__file__, config.DEFAULT_CONFIG.is_file())")
    env = {**os.environ, "PYTHONPATH": str(site)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    config_file, patches_file, default_config = proc.stdout.split()
    assert config_file.startswith(str(site)) and patches_file.startswith(str(site))
    assert default_config == "True"


def _fake_installed_torch(where: Path, version: str) -> Path:
    """A site directory whose only distribution is torch ``version`` (metadata is all pip's resolver reads); put
    first on the path, it stands for the container's torch."""
    info = where / f"torch-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
    return where


@pytest.mark.parametrize("installed", ["venv", NGC_TORCH])
def test_installing_keeps_the_installed_torch(wheel, tmp_path, installed):
    """``pip install`` of the package resolves against the torch already there and installs nothing but the
    package: this venv's torch 2.13.0, or a container's pre-release build (which an exact pin, or an upper bound
    at 2.14, would make pip replace)."""
    pythonpath = None if installed == "venv" else _fake_installed_torch(tmp_path / "container", installed)
    report = tmp_path / "report.json"
    proc = _pip("install", "--dry-run", "--no-build-isolation", "--report", str(report), str(wheel),
                pythonpath=pythonpath, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    torch_line = next(line for line in proc.stdout.splitlines() if "Requirement already satisfied: torch" in line)
    assert (installed if installed != "venv" else "2.13.0") in torch_line, torch_line
    installs = [(item["metadata"]["name"], item["metadata"]["version"])
                for item in json.loads(report.read_text())["install"]]
    assert installs == [("ntp-megatron", "0.1.0")]
