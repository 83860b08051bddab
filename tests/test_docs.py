"""The docs stay true to the code.

- docs/api.md has a ``### verispec.module.name`` heading for every name in the
  ``__all__`` of the public modules, and a ``####`` heading for every public method of
  SpecDecoder and BlockAllocator;
- every ``verispec...`` heading in api.md names something importable, so removing or
  renaming a name fails here until the reference follows;
- links between the pages point at headings that exist;
- the fenced ``python`` blocks of the guides marked ``# runnable`` run. A block whose
  first line is ``# runnable (continued)`` runs after the previous runnable blocks of
  the same page, in their namespace; each chain starts from a fresh namespace.

The checkers are plain functions, tested on small made-up pages below, so a broken
checker cannot pass silently.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
API_MODULES = (
    "verispec",
    "verispec.ops",
    "verispec.decoder",
    "verispec.distributed",
    "verispec.drafters",
    "verispec.models",
    "verispec.lab",
    "verispec.reference",
)
CLASSES_WITH_METHOD_ENTRIES = ("verispec.decoder.SpecDecoder", "verispec.BlockAllocator")
RUNNABLE_PAGES = ("how-it-works.md", "embedding.md", "api.md")

RUNNABLE = "# runnable"
CONTINUED = "# runnable (continued)"
_FENCE = re.compile(r"^\s*```\s*([\w+-]*)\s*$")
_HEADING = re.compile(r"^#{3,6}[ \t]+`?(verispec(?:\.[A-Za-z_][A-Za-z0-9_]*)*)`?[ \t]*$")


# --- checkers ------------------------------------------------------------------------


def code_blocks(text: str) -> list[tuple[int, str, str]]:
    """(line of the first code line, 1-based; language; code) of each fenced block."""
    blocks, lang, start, lines = [], None, 0, []
    for number, line in enumerate(text.splitlines(), start=1):
        fence = _FENCE.match(line)
        if lang is None:
            if fence:
                lang, start, lines = fence.group(1), number + 1, []
        elif fence and not fence.group(1):
            blocks.append((start, lang, "\n".join(lines) + "\n"))
            lang = None
        else:
            lines.append(line)
    if lang is not None:
        raise ValueError(f"code block opened at line {start - 1} is never closed")
    return blocks


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks (a '#' in code is a comment, not a heading)."""
    out, in_code = [], False
    for line in text.splitlines():
        fence = _FENCE.match(line)
        if fence and not in_code:
            in_code = True
        elif fence and not fence.group(1):
            in_code = False
        elif not in_code:
            out.append(line)
    return out


def api_headings(text: str) -> list[str]:
    """Dotted names of the ``###``-or-deeper headings that start with ``verispec``."""
    return [m.group(1) for m in map(_HEADING.match, _prose_lines(text)) if m]


def missing_entries(text: str, names) -> list[str]:
    """The names that have no heading in the page."""
    documented = set(api_headings(text))
    return sorted(set(names) - documented)


def resolve(dotted: str):
    """The object a dotted name refers to: the longest importable module prefix, then
    attributes. Raises ImportError or AttributeError when it does not exist."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        module_name = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            # Only "this prefix is not a module" moves on; a module that fails to import
            # because of something else is a real error.
            missing = e.name or ""
            if module_name == missing or module_name.startswith(missing + "."):
                continue
            raise
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"no module in {dotted!r}")


def unknown_entries(text: str) -> list[str]:
    """The headings that name nothing importable."""
    unknown = []
    for name in api_headings(text):
        try:
            resolve(name)
        except (ImportError, AttributeError):
            unknown.append(name)
    return unknown


def public_names() -> list[str]:
    """Every name the API reference must cover."""
    names = []
    for module_name in API_MODULES:
        module = importlib.import_module(module_name)
        names += [f"{module_name}.{name}" for name in getattr(module, "__all__", ())]
    for class_name in CLASSES_WITH_METHOD_ENTRIES:
        cls = resolve(class_name)
        names += [f"{class_name}.{name}" for name in dir(cls) if not name.startswith("_")]
    return names


def runnable_chains(text: str) -> list[list[tuple[int, str]]]:
    """Runnable examples of a page: chains of (first code line, code), each chain one
    ``# runnable`` block followed by its ``# runnable (continued)`` blocks."""
    chains: list[list[tuple[int, str]]] = []
    for line, lang, code in code_blocks(text):
        if lang != "python":
            continue
        first = code.split("\n", 1)[0].strip()
        if first == RUNNABLE:
            chains.append([(line, code)])
        elif first == CONTINUED:
            if not chains:
                raise ValueError(f"line {line}: {CONTINUED!r} with no {RUNNABLE!r} block before it")
            chains[-1].append((line, code))
        elif first.replace(" ", "").lower().startswith("#runnable"):
            raise ValueError(f"line {line}: unknown marker {first!r}; use {RUNNABLE!r} or "
                             f"{CONTINUED!r}")
    return chains


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def broken_anchors(pages: dict[str, str]) -> list[str]:
    """Links ``[text](page.md#anchor)`` or ``(#anchor)`` between the given pages whose
    anchor matches no heading of the target page."""
    anchors = {name: {slug(line.lstrip("#")) for line in _prose_lines(text) if line.startswith("#")}
               for name, text in pages.items()}
    broken = []
    for name, text in pages.items():
        for line in _prose_lines(text):
            for target, anchor in re.findall(r"\]\(([\w.-]*)#([\w-]+)\)", line):
                target = target or name
                if target in anchors and anchor not in anchors[target]:
                    broken.append(f"{name}: {target}#{anchor}")
    return broken


def run_chain(chain: list[tuple[int, str]], filename: str) -> dict:
    """Executes the blocks of a chain in one fresh namespace; returns the namespace.
    Tracebacks point at the page's own line numbers."""
    namespace: dict = {"__name__": "docs_example"}
    for line, code in chain:
        exec(compile("\n" * (line - 1) + code, filename, "exec"), namespace)
    return namespace


# --- the docs --------------------------------------------------------------------------


def _page(name: str) -> str:
    return (DOCS / name).read_text(encoding="utf-8")


def _examples():
    for page in RUNNABLE_PAGES:
        for chain in runnable_chains(_page(page)):
            yield pytest.param(page, chain, id=f"{page}:{chain[0][0]}")


@pytest.mark.parametrize("module_name", API_MODULES)
def test_public_modules_declare_all(module_name):
    assert hasattr(importlib.import_module(module_name), "__all__"), \
        f"{module_name} has no __all__: its public names are undefined"


def test_every_public_name_has_an_api_entry():
    missing = missing_entries(_page("api.md"), public_names())
    assert not missing, "docs/api.md has no '### <name>' heading for: " + ", ".join(missing)


def test_every_api_entry_names_something_that_exists():
    unknown = unknown_entries(_page("api.md"))
    assert not unknown, "docs/api.md documents names that do not exist: " + ", ".join(unknown)


def test_links_between_pages_point_at_headings():
    pages = {name: _page(name) for name in ("README.md", "performance.md", *RUNNABLE_PAGES)}
    broken = broken_anchors(pages)
    assert not broken, "links to anchors that no heading has: " + ", ".join(broken)


def test_pages_have_runnable_examples():
    for page in ("how-it-works.md", "embedding.md"):
        assert runnable_chains(_page(page)), f"docs/{page} has no '# runnable' example"


@pytest.mark.parametrize("page, chain", list(_examples()))
def test_runnable_example(page, chain):
    run_chain(chain, str(DOCS / page))


# --- the checkers themselves -----------------------------------------------------------

PAGE = """\
# API
### verispec.ops.sample
text
#### verispec.decoder.SpecDecoder.step
```python
### verispec.ops.verify
```
### `verispec.__version__`
"""


def test_checker_reports_a_name_without_an_entry():
    names = ["verispec.ops.sample", "verispec.ops.verify", "verispec.decoder.SpecDecoder.step",
             "verispec.__version__"]
    # verify's "heading" is inside a code block: a comment, not an entry
    assert missing_entries(PAGE, names) == ["verispec.ops.verify"]
    assert missing_entries(PAGE + "### verispec.ops.verify\n", names) == []


def test_checker_reports_entries_that_name_nothing():
    page = PAGE + ("### verispec.ops.no_such_op\n"
                   "#### verispec.decoder.SpecDecoder.no_such_method\n"
                   "### verispec.no_such_module.thing\n")
    assert unknown_entries(PAGE) == []
    assert unknown_entries(page) == ["verispec.ops.no_such_op",
                                     "verispec.decoder.SpecDecoder.no_such_method",
                                     "verispec.no_such_module.thing"]


def test_checker_public_names_cover_all_and_methods():
    names = public_names()
    assert "verispec.ops.verify" in names and "verispec.BlockAllocator" in names
    assert "verispec.decoder.SpecDecoder.generate" in names
    assert "verispec.BlockAllocator.rollback" in names


def test_checker_runs_chains_and_fails_broken_examples():
    page = ("```python\n# runnable\nx = 1\n```\n"
            "```python\nnot_run = 1 / 0\n```\n"
            "```python\n# runnable (continued)\nassert x == 1\ny = x + 1\n```\n"
            "```python\n# runnable\nassert 'x' not in globals()\nz = 3\n```\n"
            "```\n# runnable\nraise SystemExit\n```\n"
            "```python\n# runnable (continued)\nassert z == 4, 'broken example'\n```\n")
    first, second = runnable_chains(page)
    assert [line for line, _ in first] == [2, 9]
    assert run_chain(first, "page.md")["y"] == 2
    with pytest.raises(AssertionError, match="broken example") as error:
        run_chain(second, "page.md")
    assert error.traceback[-1].lineno + 1 == 24  # the page's line of the failing assert


def test_checker_finds_broken_anchors():
    pages = {"a.md": "## The KV cache: paged\n"
                     "[ok](b.md#a-complete-example) [self](#the-kv-cache-paged)\n",
             "b.md": "### A complete example\n[bad](a.md#the-kv-cache)\n[elsewhere](c.md#x)\n"}
    assert broken_anchors(pages) == ["b.md: a.md#the-kv-cache"]


def test_checker_refuses_bad_markers():
    with pytest.raises(ValueError, match="no '# runnable' block before it"):
        runnable_chains("```python\n# runnable (continued)\nx = 1\n```\n")
    with pytest.raises(ValueError, match="unknown marker"):
        runnable_chains("```python\n#runnable\nx = 1\n```\n")
    with pytest.raises(ValueError, match="never closed"):
        code_blocks("```python\nx = 1\n")
