"""Python-side helpers around the native paged KV cache."""

from __future__ import annotations

from typing import Any

from verispec import _C


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
