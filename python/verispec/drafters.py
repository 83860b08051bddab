"""Draft sources for SpecDecoder.

- ``NGram(min_n, max_n)``: prompt lookup in the sequence's own tokens (native,
  incremental index). Proposals are deterministic, so verification uses the one-hot
  rule and the output stays exact.
- ``EarlyExit(target, num_layers=N)``: self-speculation, the target's first N layers
  plus its final norm and head, sharing the target's weights (no copy).
- Any model implementing the protocol (verispec.models.base.Model): a separate draft.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verispec.models.base import Model, ModelGeometry, PagedBatch

__all__ = ["EarlyExit", "NGram"]


@dataclass(frozen=True)
class NGram:
    """Propose the continuation of the longest recent n-gram match (min_n <= n <= max_n).

    ``branches > 1``: propose a tree instead of a chain: the trie of the continuations
    of up to 32 earlier occurrences of the matched suffix, k nodes chosen best first by
    how often each continuation followed it, at most ``branches`` children per node
    (csrc/include/verispec/ngram.h). The decoder's ``k`` is then the node budget; the
    target verifies the whole tree in one pass (``verispec.ops.verify_tree``).
    ``branches = 1``: chains, as before.
    """

    min_n: int = 1
    max_n: int = 4
    branches: int = 1

    def __post_init__(self) -> None:
        if not (isinstance(self.min_n, int) and isinstance(self.max_n, int)
                and 1 <= self.min_n <= self.max_n <= 64):
            raise ValueError(f"NGram: need 1 <= min_n <= max_n <= 64, got min_n={self.min_n!r}, "
                             f"max_n={self.max_n!r}")
        if (isinstance(self.branches, bool) or not isinstance(self.branches, int)
                or not 1 <= self.branches <= 64):
            raise ValueError(f"NGram: branches must be an int in [1, 64], got {self.branches!r}")


class EarlyExit:
    """Self-speculative draft: the first ``num_layers`` layers of ``target``.

    The target must offer ``early_exit(num_layers)`` returning a model that shares its
    weights (verispec's LlamaModel does). SpecDecoder gives the draft the target's own
    KV pools for those layers: the K/V the target wrote for committed tokens are what
    the draft would compute, so the draft never catches up on its own.
    """

    def __init__(self, target: Model, num_layers: int) -> None:
        if not hasattr(target, "early_exit"):
            raise TypeError(f"EarlyExit: target must offer early_exit(num_layers), "
                            f"got {type(target).__name__}")
        layers = target.geometry.num_layers
        if not isinstance(num_layers, int) or not 1 <= num_layers < layers:
            raise ValueError(f"EarlyExit: num_layers must be in [1, {layers - 1}] "
                             f"(the target has {layers}), got {num_layers!r}")
        self.target = target
        self.num_layers = num_layers
        self.model = target.early_exit(num_layers)

    @property
    def geometry(self) -> ModelGeometry:
        return self.model.geometry

    def forward(self, batch: PagedBatch) -> torch.Tensor:
        return self.model.forward(batch)
