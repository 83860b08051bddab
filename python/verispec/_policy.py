"""The sampling policy's arguments as every Python layer takes them (verispec.ops,
verispec.reference, the CLI).

- Ranges: one rule, the native ``policy_error`` (csrc/include/verispec/policy_rules.h)
  through ``verispec._C.check_policy``; nothing here restates a range. Per-row tensors
  are checked by the kernels (ops) or row by row with the same rule (reference).
- Greedy: inside the library greedy decoding is temperature 0. Public ``greedy=``
  arguments become it in :func:`fold_greedy`.
"""

from __future__ import annotations

from typing import Any

from verispec import _C

# The value of each argument that leaves the policy unchanged (and always passes).
DEFAULTS = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}


def policy_error(temperature: Any = None, top_k: Any = None, top_p: Any = None,
                 min_p: Any = None) -> str:
    """'' when the given scalars are in range, else the rule's message for the first bad
    one: its name, range and value (unprefixed: the caller names itself). None: not
    given as a scalar (a per-row tensor, or absent)."""
    args = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    try:
        _C.check_policy(**{name: DEFAULTS[name] if value is None else value
                           for name, value in args.items()})
    except ValueError as e:
        return str(e)
    return ""


def fold_greedy(op: str, greedy: Any, temperature: Any, batch: int = 0, device: Any = None):
    """``temperature`` with ``greedy`` folded in: 0 where greedy is set.

    greedy: a bool, or (verify) a bool tensor [batch] of per-row flags.
    temperature: a number or a tensor of per-row values (already checked by the caller).
    Returns 0.0 for ``greedy=True``, ``temperature`` unchanged for False, and for a tensor
    of flags a float32 tensor [batch] on ``device``: 0 on the flagged rows.
    """
    if isinstance(greedy, bool):
        return 0.0 if greedy else temperature
    import torch

    if not isinstance(greedy, torch.Tensor):
        raise TypeError(f"{op}: greedy must be a bool or a bool tensor [B], got {greedy!r}")
    if tuple(greedy.shape) != (batch,) or greedy.dtype != torch.bool:
        got = f"{str(greedy.dtype).replace('torch.', '')} {list(greedy.shape)}"
        raise ValueError(f"{op}: greedy must be a bool or a bool tensor [B] = [{batch}], "
                         f"got {got}")
    rows = torch.as_tensor(temperature, dtype=torch.float32, device=device)
    return torch.where(greedy.to(device), 0.0, rows.expand(batch))
