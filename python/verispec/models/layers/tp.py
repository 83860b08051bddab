"""Tensor-parallel splits: which heads, units and vocabulary rows a rank holds. The rule
of the native Llama (``TPShard``) and of HFModel (``models.hf.tp``)."""

from __future__ import annotations

__all__ = ["split_evenly", "split_heads", "split_vocab"]


def split_evenly(n: int, world_size: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s [start, stop) of n items split as evenly as possible."""
    return (rank * n) // world_size, ((rank + 1) * n) // world_size


def split_heads(num_heads: int, num_kv_heads: int, world_size: int,
                rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Rank ``rank``'s [start, stop) of the query heads and of the KV heads: KV heads as
    evenly as possible (3 over 2 ranks: 1 and 2), each query head with its KV head
    (grouped-query attention stays rank-local). The tensor-parallel rule of the native
    Llama and of HFModel; callers check world_size <= num_kv_heads first."""
    group = num_heads // num_kv_heads
    kv = split_evenly(num_kv_heads, world_size, rank)
    return (kv[0] * group, kv[1] * group), kv


def split_vocab(vocab_size: int, world_size: int, rank: int) -> tuple[tuple[int, int], int]:
    """Rank ``rank``'s [start, stop) of the LM head's rows and the padded slice size
    ceil(V / world_size) every rank's slice is zero-padded to (all_gather needs one size;
    the padding's logits are dropped after the gather)."""
    padded = -(-vocab_size // world_size)
    lo = min(rank * padded, vocab_size)
    return (lo, min(lo + padded, vocab_size)), padded
