"""Prompt lookup: proposals copied from the sequence's own earlier tokens (native index)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from verispec.drafters.base import DraftSpec

__all__ = ["NGram"]


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

    def spec(self, target: Any) -> DraftSpec:
        """Proposals from the core's native index of each sequence's own tokens: no
        model, no cache, one-hot q (deterministic proposals)."""
        return DraftSpec(kind="lookup", cache="none", one_hot=True,
                         ngram=(self.min_n, self.max_n, self.branches))
