"""Rules about the native sources that a compiler does not check.

- No torch in csrc/ (docs/design.md, Layers): the extension takes tensors through
  DLPack and must load next to any torch.
- No iostreams in the library (csrc/ outside csrc/tests): an ostream formats numbers
  through locale facets, and on a CUDA machine an error message built with
  std::ostringstream segfaulted inside the facet call (a process whose libstdc++ pieces
  did not match). Messages use std::string, std::to_string and snprintf.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(p for p in (ROOT / "csrc").rglob("*")
                 if p.suffix in {".h", ".cpp", ".cu", ".cuh"})
LIBRARY = [p for p in SOURCES if "tests" not in p.relative_to(ROOT / "csrc").parts]

TORCH = re.compile(r'#\s*include\s*[<"](torch|ATen|c10)/')
IOSTREAMS = re.compile(r"#\s*include\s*<(sstream|iostream|ostream|istream|fstream)>"
                       r"|std::(o|i)?stringstream|std::cout|std::cerr")


def offenders(paths, pattern):
    return [f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
            for p in paths for n, line in enumerate(p.read_text().splitlines(), 1)
            if pattern.search(line)]


def test_the_rules_see_the_sources():
    assert len(LIBRARY) > 20 and any(p.suffix == ".cu" for p in LIBRARY)


@pytest.mark.parametrize("name,pattern", [("torch", TORCH), ("iostreams", IOSTREAMS)])
def test_library_sources_follow_the_rule(name, pattern):
    assert offenders(LIBRARY, pattern) == [], f"{name} in csrc/"


@pytest.mark.parametrize("line", ['#include <torch/extension.h>', '#include "ATen/ATen.h"',
                                  "#include <sstream>", "  std::ostringstream s;"])
def test_the_patterns_catch_what_they_forbid(line):
    assert TORCH.search(line) or IOSTREAMS.search(line)


# --- the layer kernels' unchecked entry points have one caller ----------------------------
# `_C.*_unchecked` take raw pointers and sizes and trust them (csrc/python/bind_layers.cpp):
# models/layers/kernels.py wraps them and is the only Python module that may call them.

PACKAGE = ROOT / "python" / "verispec"
UNCHECKED_HOME = PACKAGE / "models" / "layers" / "kernels.py"


def unchecked_uses(source: str) -> list[int]:
    """Lines of ``source`` that reach an attribute named ``*_unchecked`` (docstrings and
    comments do not count), or name one in a getattr string."""
    import ast

    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr.endswith("_unchecked"):
            lines.append(node.lineno)
        elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr"
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
              and str(node.args[1].value).endswith("_unchecked")):
            lines.append(node.lineno)
    return lines


def test_only_the_layers_kernels_module_calls_the_unchecked_entry_points():
    modules = sorted(PACKAGE.rglob("*.py"))
    assert UNCHECKED_HOME in modules and unchecked_uses(UNCHECKED_HOME.read_text())
    found = [f"{p.relative_to(ROOT)}:{n}" for p in modules if p != UNCHECKED_HOME
             for n in unchecked_uses(p.read_text())]
    assert found == [], "_C.*_unchecked called outside models/layers/kernels.py"


@pytest.mark.parametrize("code", ["_C._linear_unchecked(x)", "y = verispec._C._rms_norm_unchecked",
                                  "f = getattr(_C, '_rope_unchecked')"])
def test_the_unchecked_rule_catches_a_call(code):
    assert unchecked_uses('"""_C._linear_unchecked in a docstring"""\n' + code) == [2]
