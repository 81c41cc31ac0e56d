"""The wheel carries every file the native build reads, and an installed copy builds them.

`pip wheel .` once left out csrc/hfd_simd.h, so a non-editable install never built the native
kernels, on any CPU. This builds the wheel (no network: the installed setuptools), checks its
file list against what _native.py compiles, installs it into a fresh virtual environment (with
this environment's packages visible for torch and the rest) and builds the kernels there from
the installed copy.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from hf_dsinfer.kernels import _native

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps",
                    "--no-build-isolation", "-q", "-w", str(out)], check=True, cwd=out)
    (path,) = out.glob("hf_dsinfer-*.whl")
    return path


def test_wheel_holds_every_file_the_build_reads(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    package = REPO / "hf_dsinfer"
    needed = {f"hf_dsinfer/{p.relative_to(package).as_posix()}"
              for p in (*_native.SOURCES, *_native.HEADERS)}
    assert needed <= names, f"missing from the wheel: {sorted(needed - names)}"
    # and the build reads no file of csrc/ that the lists leave out
    on_disk = {p.name for p in _native.CSRC.iterdir() if p.suffix in (".c", ".h")}
    assert on_disk == {p.name for p in (*_native.SOURCES, *_native.HEADERS)}


@pytest.mark.slow
def test_installed_wheel_builds_the_native_kernels(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
                   check=True)
    python = venv / "bin" / "python"
    # no PYTHONPATH: a checkout on it (with its egg-info) would make pip skip the install
    env = {**os.environ, "HF_DSINFER_CACHE": str(tmp_path / "cache"), "PYTHONPATH": ""}
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", str(wheel)],
                   check=True, env=env, cwd=tmp_path)
    probe = ("import hf_dsinfer.kernels._native as n; "
             "assert 'site-packages' in str(n.CSRC), n.CSRC; "
             "assert n.builds(), n.why_unavailable(); print(n.describe_tier())")
    got = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, env=env,
                         cwd=tmp_path, check=False)
    assert got.returncode == 0, got.stderr[-3000:]
    assert list((tmp_path / "cache").rglob("libhfd_cpu.so")), "nothing was built"
