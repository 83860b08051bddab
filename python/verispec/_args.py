"""The argument checks verispec.ops and verispec.reference share, so that the same
mistake gets the same error (type and words) from either: the op, the argument, what it
must be and what it got.

What only one side checks stays there: the values of the tensors (the kernels check
them for ops and name the element; the reference checks them in Python), the policy
ranges (one rule, :mod:`verispec._policy`), and how each side converts what passed
(ops: int32 for the kernels; reference: int64).
"""

from __future__ import annotations

import numbers
from typing import Any, Optional

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def describe(t: Any) -> str:
    """A tensor as messages show it, "float32 [2, 3]"; anything else by its type."""
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{str(t.dtype).replace('torch.', '')} {list(t.shape)}"


def float_tensor(op: str, name: str, t: Any, ndim: int, dims: str) -> None:
    """A float32/bfloat16/float16 tensor of ``ndim`` dimensions (written ``dims``, e.g.
    "[N, V]") with a vocabulary V >= 1 when it has rows."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim or t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{op}: {name} must be float32/bfloat16/float16 {dims}, "
                         f"got {describe(t)}")
    if t.shape[-1] == 0 and t.shape[0] > 0:
        raise ValueError(f"{op}: {name} must have a vocabulary V >= 1, got {describe(t)}")


def is_integer_tensor(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and not (t.is_floating_point() or t.is_complex()
                                                or t.dtype == torch.bool)


def integer_tensor(op: str, name: str, t: Any, shape: tuple, dims: str) -> None:
    """An integer tensor of ``shape`` (written ``dims``, e.g. "[B, K]")."""
    if not is_integer_tensor(t) or tuple(t.shape) != tuple(shape):
        raise ValueError(f"{op}: {name} must be an integer tensor {dims} = {list(shape)}, "
                         f"got {describe(t)}")


def spec_logits(op: str, target_logits: Any, dim: str = "K") -> tuple[int, int, int]:
    """(B, n, V) of a verify op's target_logits [B, n+1, V] (n written ``dim``)."""
    float_tensor(op, "target_logits", target_logits, 3, f"[B, {dim}+1, V]")
    b, n1, v = target_logits.shape
    if n1 < 1:
        raise ValueError(f"{op}: target_logits must be [B, {dim}+1, V] with {dim}+1 >= 1, "
                         f"got {describe(target_logits)}")
    return b, n1 - 1, v


def draft_probs(op: str, probs: Any, shape: tuple, dims: str, draft_index: Any = None) -> None:
    """draft_probs: None, or a float tensor of ``shape`` (written ``dims``); with
    ``draft_index`` (a compact q: int32-able [V] map from target id to column, -1 outside
    the draft vocabulary) its last dimension is the draft vocabulary's W >= 1 instead."""
    if draft_index is not None:
        if probs is None:
            raise ValueError(f"{op}: draft_index needs draft_probs, got draft_probs=None")
        integer_tensor(op, "draft_index", draft_index, (shape[-1],), "[V]")
        dims = dims[: dims.rindex(",")] + ", W]"
    if probs is None:
        return
    float_tensor(op, "draft_probs", probs, len(shape), dims)
    want = tuple(shape[:-1]) + ((probs.shape[-1],) if draft_index is not None else (shape[-1],))
    if tuple(probs.shape) != want or probs.shape[-1] < 1:
        raise ValueError(f"{op}: draft_probs must be float {dims} = {list(want)} or None, "
                         f"got {describe(probs)}")


def counts(op: str, name: str, value: Any, b: int, device: Any) -> Optional[torch.Tensor]:
    """Per-row counts (num_draft, num_nodes): None, or B ints (a sequence, made a tensor
    on ``device``, or an integer tensor, returned as given)."""
    if value is None:
        return None
    if not isinstance(value, torch.Tensor):
        value = torch.as_tensor(value, device=device)
    integer_tensor(op, name, value, (b,), "[B]")
    return value


def policy_value(op: str, name: str, value: Any, n: int, integer: bool) -> Any:
    """A policy argument: a Python number (returned as int or float), or per-row values,
    a 1-D tensor of length ``n`` (a 0-d tensor is each row's; integer for top_k),
    returned unconverted. The ranges are the policy rule's, not checked here."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            value = value.reshape(1).expand(n)
        if tuple(value.shape) != (n,):
            raise ValueError(f"{op}: {name} must be a number or a 1-D tensor of length {n}, "
                             f"got shape {list(value.shape)}")
        if integer and not is_integer_tensor(value):
            raise ValueError(f"{op}: {name} must be an integer tensor, got {value.dtype}")
        return value
    if type(value) is int or (type(value) is float and not integer):  # the common case,
        return int(value) if integer else float(value)                # without ABC checks
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind):
        expected = "an int" if integer else "a number"
        raise TypeError(f"{op}: {name} must be {expected} or a 1-D tensor, got {value!r}")
    return int(value) if integer else float(value)


def keyed(op: str, seeds: Any, positions: Any, *, required: bool = False) -> bool:
    """Whether a call is keyed: ``seeds`` and ``positions`` both given (``required``:
    they must be)."""
    if seeds is None and positions is None and not required:
        return False
    if seeds is None or positions is None:
        given = ("neither" if seeds is None and positions is None
                 else f"{'positions' if seeds is None else 'seeds'} only")
        raise ValueError(f"{op}: seeds and positions must be given together (keyed), "
                         f"got {given}")
    return True


def key_values(op: str, name: str, values: list, n: int, limit: int) -> list[int]:
    """A keyed call's ``n`` seeds or positions as Python ints, each in [0, limit)."""
    if len(values) != n:
        raise ValueError(f"{op}: {name} must hold N = {n} values, got {len(values)}")
    for i, x in enumerate(values):
        if isinstance(x, bool) or not isinstance(x, numbers.Integral) or not 0 <= x < limit:
            raise ValueError(f"{op}: {name}[{i}] must be an int in [0, 2**{limit.bit_length() - 1}), "
                             f"got {x!r}")
    return [int(x) for x in values]


def stream_arg(op: str, name: str, value: Any, limit: int) -> Any:
    """seed or offset: a Python int in [0, limit) (returned as an int), or a one-element
    int64 tensor holding the 64 bits (returned as given; the op reads it)."""
    kind = "an int or a one-element int64 tensor"
    if isinstance(value, torch.Tensor):
        if value.dtype != torch.int64 or value.numel() != 1:
            raise ValueError(f"{op}: {name} must be {kind}, got {describe(value)}")
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{op}: {name} must be {kind}, got {value!r}")
    if not 0 <= value < limit:
        raise ValueError(f"{op}: {name} must be an int in [0, 2**{limit.bit_length() - 1}), "
                         f"got {value}")
    return int(value)
