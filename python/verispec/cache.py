"""Python-side helpers around the native paged KV cache."""

from __future__ import annotations

from typing import Any

from verispec import _C

# Blocks a sized pool keeps beyond what its sequences' tokens fill (blocks_for).
SPARE_BLOCKS = 2


def blocks_for(tokens: int, block_size: int = 16, *, spare: int = SPARE_BLOCKS) -> int:
    """KV blocks for ``tokens`` tokens of one sequence: ceil(tokens / block_size), the
    blocks the allocator gives a new sequence of that length, plus ``spare`` (0: exactly
    what the tokens fill; the default ``SPARE_BLOCKS`` is how the CLI and the benchmarks
    size a pool per sequence)."""
    if tokens < 0 or block_size < 1 or spare < 0:
        raise ValueError(f"blocks_for: tokens must be >= 0, block_size >= 1 and spare >= 0, "
                         f"got tokens={tokens}, block_size={block_size}, spare={spare}")
    return -(-tokens // block_size) + spare


def slot_mapping(block_tables: Any, row_index: Any, positions: Any, block_size: int,
                 out: Any = None) -> Any:
    """Slot ids of tokens from block tables, on the tensors' device.

    ``out[t] = block_tables[row_index[t], positions[t] // block_size] * block_size
    + positions[t] % block_size``; tokens with a negative row or position are
    padding and get -1. All tensors are int32 and on one device (CPU or CUDA);
    ``out`` is allocated like ``positions`` when not given. On CPU a token outside
    the table raises ValueError; on CUDA it is written as -1 (checking would
    synchronise the stream).
    """
    import torch

    if out is None:
        out = torch.empty_like(positions)
    stream = 0
    if out.device.type == "cuda":
        stream = torch.cuda.current_stream(out.device).cuda_stream
    _C.slot_mapping(block_tables, row_index, positions, block_size, out, stream)
    return out
