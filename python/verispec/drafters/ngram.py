"""Prompt lookup: proposals copied from the sequence's own earlier tokens (native index),
and optionally from earlier requests of the same tenant (NGramMemory)."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

from verispec.drafters.base import DraftSpec

__all__ = ["NGram", "NGramMemory"]

SEPARATOR = -1   # NGramIndex::kSeparator: the boundary between two texts of a memory


class NGramMemory:
    """Earlier requests and answers an n-gram lookup may copy from, per tenant.

    ``SpecDecoder`` with ``NGram(memory=m)``: a sequence added for a tenant
    (``add(tenant=...)``, the server's API-key tenant) has its n-gram index read that
    tenant's memory before its prompt (the core's ``ngram_context``; separators keep
    every proposal inside one earlier text), and a sequence that finishes (stop, eos or
    length; not aborted) is remembered: its prompt and its output. At most
    ``max_tokens`` tokens per tenant (the oldest texts are evicted first; a text longer
    than that keeps its last ``max_tokens``). ``shared=True``: one memory for every
    tenant (one client's text may then draft for another: the operator's choice).
    Exactness never depends on it: proposals are verified like any others. Thread-safe.
    """

    def __init__(self, max_tokens: int = 32768, *, shared: bool = False) -> None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"NGramMemory: max_tokens must be an int >= 1, got {max_tokens!r}")
        if not isinstance(shared, bool):
            raise TypeError(f"NGramMemory: shared must be a bool, got {shared!r}")
        self.max_tokens, self.shared = max_tokens, shared
        self._texts: dict[str, deque] = {}
        self._sizes: dict[str, int] = {}
        self._lock = threading.Lock()

    def _key(self, tenant: str) -> str:
        if not isinstance(tenant, str) or not tenant:
            raise ValueError(f"NGramMemory: tenant must be a non-empty str, got {tenant!r}")
        return "*" if self.shared else tenant

    def remember(self, tenant: str, tokens: Any) -> None:
        """Keep ``tokens`` (a text: ids >= 0) as the tenant's newest text."""
        text = [int(t) for t in tokens][-self.max_tokens:]
        if any(t < 0 for t in text):
            raise ValueError("NGramMemory.remember: tokens must be ids >= 0, got a negative one")
        if not text:
            return
        key = self._key(tenant)
        with self._lock:
            texts = self._texts.setdefault(key, deque())
            texts.append(text)
            self._sizes[key] = self._sizes.get(key, 0) + len(text) + 1
            while self._sizes[key] - 1 > self.max_tokens and len(texts) > 1:
                self._sizes[key] -= len(texts.popleft()) + 1

    def context(self, tenant: str) -> list[int]:
        """The tenant's texts, oldest first, separated by SEPARATOR (what the core's
        ``ngram_context`` takes; empty when it has none)."""
        key = self._key(tenant)
        with self._lock:
            out: list[int] = []
            for text in self._texts.get(key, ()):
                if out:
                    out.append(SEPARATOR)
                out.extend(text)
            return out

    def tokens(self, tenant: str) -> int:
        """Tokens the tenant's memory holds (separators not counted)."""
        key = self._key(tenant)
        with self._lock:
            return sum(len(t) for t in self._texts.get(key, ()))

    def clear(self, tenant: Optional[str] = None) -> None:
        """Forget one tenant's texts, or every tenant's."""
        with self._lock:
            if tenant is None:
                self._texts.clear()
                self._sizes.clear()
            else:
                key = self._key(tenant)
                self._texts.pop(key, None)
                self._sizes.pop(key, None)


@dataclass(frozen=True)
class NGram:
    """Propose the continuation of the longest recent n-gram match (min_n <= n <= max_n).

    ``branches > 1``: propose a tree instead of a chain: the trie of the continuations
    of up to 32 earlier occurrences of the matched suffix, k nodes chosen best first by
    how often each continuation followed it, at most ``branches`` children per node
    (csrc/include/verispec/ngram.h). The decoder's ``k`` is then the node budget; the
    target verifies the whole tree in one pass (``verispec.ops.verify_tree``).
    ``branches = 1``: chains, as before.

    ``memory`` (an ``NGramMemory``): the lookup also reads the tenant's earlier
    requests and answers (module doc of NGramMemory); None: the sequence's own tokens.
    """

    min_n: int = 1
    max_n: int = 4
    branches: int = 1
    memory: Optional[NGramMemory] = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not (isinstance(self.min_n, int) and isinstance(self.max_n, int)
                and 1 <= self.min_n <= self.max_n <= 64):
            raise ValueError(f"NGram: need 1 <= min_n <= max_n <= 64, got min_n={self.min_n!r}, "
                             f"max_n={self.max_n!r}")
        if (isinstance(self.branches, bool) or not isinstance(self.branches, int)
                or not 1 <= self.branches <= 64):
            raise ValueError(f"NGram: branches must be an int in [1, 64], got {self.branches!r}")
        if self.memory is not None and not isinstance(self.memory, NGramMemory):
            raise TypeError(f"NGram: memory must be an NGramMemory or None, got "
                            f"{type(self.memory).__name__}")

    def spec(self, target: Any) -> DraftSpec:
        """Proposals from the core's native index of each sequence's own tokens: no
        model, no cache, one-hot q (deterministic proposals)."""
        return DraftSpec(kind="lookup", cache="none", one_hot=True,
                         ngram=(self.min_n, self.max_n, self.branches), memory=self.memory)
