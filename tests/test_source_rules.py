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
