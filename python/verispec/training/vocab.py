"""The draft vocabulary: the target ids a head can propose, and its d2t / t2d maps.

The head's lm_head has one row per draft id; verification reads q = 0 outside the set,
so a token the head cannot propose costs acceptance, never exactness. The set is the
most frequent tokens of the target's own answers (what the head will be asked to
propose), the stop ids always included, ties broken by the smaller id; when the
answers hold fewer distinct tokens than asked, the prompts' tokens and then the
smallest unused ids fill it up, so the size asked is the size written.

Maps, as the speculators and EAGLE layouts store them (draft id i, target id t):
    d2t[i] = t - i        (int64 [V_draft]: an offset, so d2t = 0 is the identity)
    t2d[t] = t in the set (bool [V])
Draft ids are the chosen target ids in increasing order.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["DraftVocab", "choose_draft_vocab", "token_counts"]


@dataclass(frozen=True)
class DraftVocab:
    """The chosen target ids (int64 [V_draft], increasing) of a vocabulary of ``vocab_size``."""

    target_ids: torch.Tensor
    vocab_size: int

    @property
    def size(self) -> int:
        return int(self.target_ids.numel())

    @property
    def d2t(self) -> torch.Tensor:
        return self.target_ids - torch.arange(self.size)

    @property
    def t2d(self) -> torch.Tensor:
        out = torch.zeros(self.vocab_size, dtype=torch.bool)
        out[self.target_ids] = True
        return out

    def draft_index(self) -> torch.Tensor:
        """int64 [V]: the draft id of each target id, -1 outside the set."""
        out = torch.full((self.vocab_size,), -1, dtype=torch.int64)
        out[self.target_ids] = torch.arange(self.size)
        return out


def token_counts(sequences: Iterable[Sequence[int]], vocab_size: int) -> torch.Tensor:
    """int64 [vocab_size]: how often each id occurs in ``sequences``."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for seq in sequences:
        if len(seq):
            ids = torch.as_tensor(list(seq), dtype=torch.int64)
            if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
                raise ValueError(f"token_counts: ids must be in [0, {vocab_size}), got "
                                 f"{int(ids.min())}..{int(ids.max())}")
            counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def _ranked(counts: torch.Tensor) -> torch.Tensor:
    """Ids with a count > 0, most frequent first, ties by the smaller id."""
    ids = torch.nonzero(counts > 0).flatten()
    # stable sort on -count keeps increasing ids among equal counts
    order = torch.sort(-counts[ids], stable=True).indices
    return ids[order]


def choose_draft_vocab(answers: Iterable[Sequence[int]], vocab_size: int, size: int, *,
                       prompts: Iterable[Sequence[int]] = (),
                       always: Sequence[int] = ()) -> DraftVocab:
    """The ``min(size, vocab_size)`` draft ids (module doc): ``always`` (the stop ids),
    then the answers' most frequent tokens, then the prompts', then the smallest ids."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"choose_draft_vocab: size must be an int >= 1, got {size!r}")
    size = min(size, vocab_size)
    chosen: list[int] = []
    seen = torch.zeros(vocab_size, dtype=torch.bool)

    def take(ids) -> None:
        for t in ids:
            t = int(t)
            if len(chosen) == size:
                return
            if not 0 <= t < vocab_size:
                raise ValueError(f"choose_draft_vocab: ids must be in [0, {vocab_size}), got {t}")
            if not seen[t]:
                seen[t] = True
                chosen.append(t)

    take(always)
    take(_ranked(token_counts(answers, vocab_size)).tolist())
    take(_ranked(token_counts(prompts, vocab_size)).tolist())
    if len(chosen) < size:
        take(torch.nonzero(~seen).flatten()[: size - len(chosen)].tolist())
    return DraftVocab(torch.tensor(sorted(chosen), dtype=torch.int64), vocab_size)
