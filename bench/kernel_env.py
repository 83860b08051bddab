"""Where a CPU kernel benchmark ran, as its JSON records it (bench_linear.py,
bench_attention.py, bench_quant_formats.py): library versions, threads, the kernels'
instruction set and thread backend, the machine; and how those benches write it."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import torch

import verispec
from verispec import _C


def cpu_kernel_environment(threads: int) -> dict:
    return {"torch": torch.__version__, "verispec": verispec.__version__, "threads": threads,
            "isa": _C.linear_best_isa(), "thread_backend": _C.linear_threads(),
            "machine": platform.machine(), "processor": platform.processor()}


def write_result(path: Path, result: dict, table: str) -> None:
    """Print a benchmark's markdown table and write its JSON (``result`` with the table
    under "markdown") to ``path``."""
    print(table)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**result, "markdown": table}, indent=2) + "\n")
    print(f"wrote {path}")
