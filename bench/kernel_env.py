"""Where a CPU kernel benchmark ran, as its JSON records it (bench_linear.py,
bench_attention.py): library versions, threads, the kernels' instruction set and thread
backend, the machine."""

from __future__ import annotations

import platform

import torch

import verispec
from verispec import _C


def cpu_kernel_environment(threads: int) -> dict:
    return {"torch": torch.__version__, "verispec": verispec.__version__, "threads": threads,
            "isa": _C.linear_best_isa(), "thread_backend": _C.linear_threads(),
            "machine": platform.machine(), "processor": platform.processor()}
