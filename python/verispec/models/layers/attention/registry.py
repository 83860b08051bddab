"""Which attention backend runs: the registry of names and the one place "auto" resolves.

A backend is a file in this package holding an ``AttentionBackend`` subclass, and one
line in ``REGISTRY`` (name -> "module:Class", imported at first use, so a backend's
optional package is never imported by this table).
"""

from __future__ import annotations

import importlib
from typing import Any, Optional

import torch

from verispec.models.layers.attention.interface import AttentionBackend

__all__ = ["AUTO_ORDER", "BACKENDS", "REGISTRY", "backend_class", "make_backend",
           "resolve_backend", "select_backend"]

#: name -> "module:Class" of this package: one line per backend.
REGISTRY: dict[str, str] = {
    "native": "native:NativeAttention",
    "sdpa": "sdpa:TorchAttention",
    "flashinfer": "flashinfer_paged:FlashInferAttention",
}

#: The names ``select_backend`` takes ("auto" picks one of the others).
BACKENDS = ("auto", *REGISTRY)

#: What "auto" takes: the first of these that can run (``refuse`` returns None); "native"
#: only where the model runs verispec's CPU kernels (its ``native`` switches).
AUTO_ORDER = ("native", "flashinfer", "sdpa")

_CLASSES: dict[str, type] = {}


def backend_class(name: str) -> type:
    """The AttentionBackend subclass registered as ``name`` (imported at first use)."""
    cls = _CLASSES.get(name)
    if cls is None:
        module, _, attr = REGISTRY[name].partition(":")
        cls = getattr(importlib.import_module(f"{__package__}.{module}"), attr)
        if not (isinstance(cls, type) and issubclass(cls, AttentionBackend)
                and cls.name == name):
            raise TypeError(f"REGISTRY[{name!r}]: must name an AttentionBackend subclass "
                            f"whose name is {name!r}, got {cls!r}")
        _CLASSES[name] = cls
    return cls


def _auto(device: torch.device, dtype: torch.dtype, native: bool) -> str:
    for name in AUTO_ORDER:
        if (name != "native" or native) and backend_class(name).refuse(device, dtype) is None:
            return name
    raise AssertionError("the last of AUTO_ORDER runs anywhere")


def select_backend(name: str, device: Any, dtype: torch.dtype, *,
                   who: str = "attention_backend") -> str:
    """The backend ``name`` resolves to for a model on ``device`` in ``dtype``: "auto" ->
    "flashinfer" on CUDA where FlashInfer imports, else "sdpa"; another name as it is,
    once checked that it can run there (ValueError naming it otherwise)."""
    names = ("auto", *REGISTRY)  # BACKENDS, and any line added to REGISTRY since
    if name not in names:
        raise ValueError(f"{who}: must be one of {', '.join(map(repr, names))}, "
                         f"got {name!r}")
    device = torch.device(device)
    if name == "auto":
        return _auto(device, dtype, native=False)
    why: Optional[str] = backend_class(name).refuse(device, dtype)
    if why is not None:
        raise ValueError(f"{who}: backend {name!r} {why}")
    return name


def resolve_backend(name: str, device: Any, dtype: torch.dtype, *, native: bool,
                    who: str = "attention_backend") -> str:
    """The backend a forward runs for a model whose ``attention_backend`` is ``name``:
    ``native`` says whether the model runs verispec's CPU kernels this forward (its
    switches on, its pools laid out for them). "auto" is "native" where it does, else
    ``select_backend``'s pick; "native" is "auto" on a float32 CPU model (the torch path
    where the kernels do not run); another name as it is. ValueError as select_backend."""
    chosen = select_backend(name, device, dtype, who=who)
    if name in ("auto", "native"):
        return _auto(torch.device(device), dtype, native)
    return chosen


def make_backend(name: str, *, sdpa_groups: bool = False,
                 batch_invariant: bool = False) -> AttentionBackend:
    """A new instance of the backend registered as ``name``."""
    return backend_class(name)(sdpa_groups=sdpa_groups, batch_invariant=batch_invariant)
