"""Matrices kept in a GGUF file's quantized block formats (CPU), read by verispec's
native kernels (verispec._C.quant_linear; the formats and the arithmetic are documented
in csrc/include/verispec/layers/quant.h and docs/design.md).

A QuantizedMatrix is [N, K] as one or more row ranges ("parts"), each a uint8 tensor
[rows, row_bytes] of one format: a fused projection (q|k|v, gate|up) whose pieces the
file stores in different formats stays quantized part by part. ``pack()`` stores each
part in the packed layout the int8 kernel reads fastest (the same bytes, 16 rows' fields
side by side: QuantLayout::kPacked16 in verispec/layers/quant.h); the models put their matrices
in the layout of ARITHMETIC once at load (``for_arithmetic``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from verispec import _C
from verispec.models.layers import kernels

#: name -> (ggml type id, weights per block, bytes per block) of the supported formats.
QUANT_FORMATS: dict[str, tuple[int, int, int]] = dict(_C.quant_formats())
_NAMES = {tid: name for name, (tid, _, _) in QUANT_FORMATS.items()}
#: The 16-bit float formats: no block scale, so their products are always the float
#: arithmetic's (an int8 call runs it), and they stay in the file's layout.
FLOAT16_FORMATS = ("F16", "BF16")
#: Rows per group of the packed layout.
PACK_ROWS = _C.QUANT_PACK_ROWS
# Rows dequantized at a time for a long product (prefill): 256 rows x 1536 floats = 1.5 MB.
PREFILL_TILE_ROWS = 256
# Products in the int8 arithmetic run on the native kernel at every M: its rows are
# bitwise the same at any M, so a request's greedy tokens do not depend on what shares its
# passes, however many prompts prefill together. In the float arithmetic, products of up
# to KERNEL_MAX_ROWS rows run on the kernel (every decode, verify and serving pass of
# up to 512 tokens); longer ones (a long prompt prefilled at once) run dequantized tiles
# into torch.mm, rounded differently. SmolLM2-135M Q4_1, all layers' matrices, 2 threads,
# int8 kernel / float kernel / float tiles: M = 1: 7.9 / 11 / - ms, 6: 11.9 / 18 / - ms,
# 24: 36 / 60 / 72 ms, 96: 113 / 169 / 134 ms, 256: 338 / 490 / 313 ms; the int8 kernel
# against int8 tiles (x quantized, then torch.mm) at 512 / 1024 rows: 0.94 / 1.82 s
# against 1.44 / 2.78 s (the int8 figures at the commit that made 16 weight rows per
# pass).
KERNEL_MAX_ROWS = 512
_ARITHMETICS = ("int8", "float")


def _arithmetic_from_env() -> str:
    value = os.environ.get("VERISPEC_QUANT_ARITHMETIC", "int8")
    if value not in _ARITHMETICS:
        raise ValueError(f"VERISPEC_QUANT_ARITHMETIC must be 'int8' or 'float', got {value!r}")
    return value


#: The arithmetic of the kernel's products (quant.h):
#: "int8" (x quantized per block of 32 to int8, integer dot products: the faster one at
#: every M since the kernel runs 16 weight rows per pass, relative error ~ 2^-8 per
#: product, see docs/design.md; every product of any M on the kernel) or "float"
#: (dequantized weights, float32 products: the quantized model then equals its float32
#: load up to float32 summation; products of M <= KERNEL_MAX_ROWS). From the
#: environment variable VERISPEC_QUANT_ARITHMETIC at import, default int8 (since attention
#: is batch invariant too, int8's coarser products no longer tip a served request's greedy
#: text against the same request alone); one arithmetic for every call keeps speculative
#: and plain greedy outputs equal. The float arithmetic's longer products (M >
#: KERNEL_MAX_ROWS, prefill) run float32 tiles.
ARITHMETIC = _arithmetic_from_env()


def on_kernel(m: int) -> bool:
    """Whether a product of m rows runs on the native kernel (bitwise batch invariant):
    every m in the int8 arithmetic, m <= KERNEL_MAX_ROWS in the float one."""
    return ARITHMETIC == "int8" or m <= KERNEL_MAX_ROWS


def quant_format_name(type_id: int) -> Optional[str]:
    """The name of a supported ggml type id ("Q4_1"), or None."""
    return _NAMES.get(type_id)


def row_bytes(fmt: str, k: int) -> int:
    """Bytes of one row of K weights in format ``fmt`` (K a multiple of its block)."""
    _, block, size = QUANT_FORMATS[fmt]
    return k // block * size


@dataclass(frozen=True)
class QuantPart:
    """Rows of a QuantizedMatrix in one format: ``data`` uint8 [rows, row_bytes] in the
    file's layout, or, with ``packed_rows`` set, that many rows packed (``data`` uint8
    [ceil(packed_rows / 16), 16 * row_bytes], _C.quant_pack16)."""

    fmt: str
    data: torch.Tensor
    packed_rows: Optional[int] = None

    @property
    def packed(self) -> bool:
        return self.packed_rows is not None

    @property
    def rows(self) -> int:
        return self.data.shape[0] if self.packed_rows is None else self.packed_rows

    def pack(self, k: int) -> "QuantPart":
        """This part in the packed layout (itself when packed)."""
        if self.packed:
            return self
        out = torch.empty(((self.rows + PACK_ROWS - 1) // PACK_ROWS, PACK_ROWS * self.data.shape[1]),
                          dtype=torch.uint8)
        _C.quant_pack16(self.data, QUANT_FORMATS[self.fmt][0], k, out)
        return QuantPart(self.fmt, out, self.rows)

    def unpack(self, k: int) -> "QuantPart":
        """This part in the file's layout (itself when not packed)."""
        if not self.packed:
            return self
        out = torch.empty((self.rows, row_bytes(self.fmt, k)), dtype=torch.uint8)
        _C.quant_unpack16(self.data, QUANT_FORMATS[self.fmt][0], k, self.rows, out)
        return QuantPart(self.fmt, out)


class QuantizedMatrix:
    """An [N, K] weight matrix kept in ggml block formats (CPU), products in float32."""

    dtype = torch.float32  # the dtype of its products and dequantized rows
    device = torch.device("cpu")

    def __init__(self, parts: Sequence[QuantPart], k: int):
        if not parts:
            raise ValueError("QuantizedMatrix: parts must not be empty")
        for p in parts:
            if p.fmt not in QUANT_FORMATS:
                raise ValueError(f"QuantizedMatrix: format must be one of "
                                 f"{', '.join(QUANT_FORMATS)}, got {p.fmt!r}")
            block = QUANT_FORMATS[p.fmt][1]
            if k % block:
                raise ValueError(f"QuantizedMatrix: K = {k} is not a multiple of {p.fmt}'s "
                                 f"block of {block} weights")
            expected = row_bytes(p.fmt, k)
            if p.packed:
                if not isinstance(p.packed_rows, int) or p.packed_rows < 0:
                    raise ValueError(f"QuantizedMatrix: packed_rows must be an int >= 0, got "
                                     f"{p.packed_rows!r}")
                want = [(p.packed_rows + PACK_ROWS - 1) // PACK_ROWS, PACK_ROWS * expected]
            else:
                want = [p.data.shape[0] if p.data.dim() == 2 else -1, expected]
            if (p.data.dtype != torch.uint8 or list(p.data.shape) != want
                    or p.data.device.type != "cpu" or not p.data.is_contiguous()):
                shape = f"[{want[0]}, {want[1]}] (packed)" if p.packed else f"[rows, {expected}]"
                raise ValueError(f"QuantizedMatrix: a {p.fmt} part must be a contiguous uint8 CPU "
                                 f"tensor {shape}, got {p.data.dtype} "
                                 f"{list(p.data.shape)} on {p.data.device}")
        self.parts = tuple(parts)
        self.k = k
        self.shape = torch.Size((sum(p.rows for p in parts), k))

    @classmethod
    def quantize_q8_0(cls, weight: torch.Tensor) -> "QuantizedMatrix":
        """A float matrix [N, K] (K a multiple of 32) in Q8_0, in the layout of ARITHMETIC:
        per block of 32 weights d = max |w| / 127 (stored as float16) and q = round(w / d)
        (ties to even), clamped to [-127, 127], so that w = d * q within d / 2 plus d's
        float16 rounding."""
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] % 32:
            raise ValueError(f"QuantizedMatrix.quantize_q8_0: weight must be a 2-D tensor "
                             f"[N, K] with K a multiple of 32, got "
                             f"{getattr(weight, 'shape', type(weight).__name__)}")
        w = weight.detach().float().cpu()
        n, k = w.shape
        blocks = w.reshape(n, k // 32, 32)
        d = (blocks.abs().amax(dim=-1) / 127.0).half()
        scale = d.float()
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        q = torch.round(blocks * inv[..., None]).clamp(-127, 127).to(torch.int8)
        data = torch.cat([d.view(torch.uint8).reshape(n, k // 32, 2),
                          q.view(torch.uint8)], dim=-1).reshape(n, -1).contiguous()
        return cls([QuantPart("Q8_0", data)], k).for_arithmetic()

    @classmethod
    def from_bytes(cls, data: torch.Tensor, fmt: str, k: int) -> "QuantizedMatrix":
        return cls([QuantPart(fmt, data)], k)

    @property
    def nbytes(self) -> int:
        return sum(p.data.numel() for p in self.parts)

    @property
    def formats(self) -> tuple[str, ...]:
        return tuple(p.fmt for p in self.parts)

    @property
    def packed(self) -> bool:
        """Whether every part is in the packed layout."""
        return all(p.packed for p in self.parts)

    def pack(self) -> "QuantizedMatrix":
        """The same matrix in the packed layout the int8 kernel reads fastest (one stream
        per 16 rows, no transposes in registers): the same bytes plus at most 15 zero
        rows per part; products and dequantized rows are bitwise those of the file's
        layout."""
        return self if self.packed else QuantizedMatrix([p.pack(self.k) for p in self.parts], self.k)

    def for_arithmetic(self, arithmetic: Optional[str] = None) -> "QuantizedMatrix":
        """The same matrix in the layout ``arithmetic``'s kernel reads fastest (default:
        ARITHMETIC): packed for int8 (1.3x to 1.7x faster at one row, see ``pack``); the file's
        layout for float (its kernel dequantizes rows, and would first have to unpack each
        group of 16: ~1.7x slower at one row). Both kernels read both layouts, same bits.
        F16 / BF16 parts (FLOAT16_FORMATS) always run the float kernel: the file's layout."""
        arithmetic = ARITHMETIC if arithmetic is None else arithmetic
        if arithmetic not in _ARITHMETICS:
            raise ValueError(f"QuantizedMatrix.for_arithmetic: arithmetic must be 'int8' or "
                             f"'float', got {arithmetic!r}")
        if arithmetic == "float" or all(p.fmt in FLOAT16_FORMATS for p in self.parts):
            return self.unpack()
        # F16 / BF16 parts run the float arithmetic in any case: the file's layout
        return QuantizedMatrix([p.unpack(self.k) if p.fmt in FLOAT16_FORMATS else p.pack(self.k)
                                for p in self.parts], self.k)

    def unpack(self) -> "QuantizedMatrix":
        """The same matrix in the file's layout."""
        if not any(p.packed for p in self.parts):
            return self
        return QuantizedMatrix([p.unpack(self.k) for p in self.parts], self.k)

    def dim(self) -> int:
        return 2

    def __repr__(self) -> str:
        return f"QuantizedMatrix({list(self.shape)}, {'+'.join(self.formats)}, {self.nbytes} bytes)"

    @staticmethod
    def cat(matrices: Sequence["QuantizedMatrix"]) -> "QuantizedMatrix":
        """Rows of ``matrices`` one after another (a fused projection); neighbouring parts
        of one format are joined."""
        k = matrices[0].k
        if any(m.k != k for m in matrices):
            raise ValueError(f"QuantizedMatrix.cat: every matrix must have K = {k}, got "
                             f"{[m.k for m in matrices]}")
        parts: list[QuantPart] = []
        for p in (p.unpack(k) for m in matrices for p in m.parts):
            if parts and parts[-1].fmt == p.fmt:
                parts[-1] = QuantPart(p.fmt, torch.cat([parts[-1].data, p.data]))
            else:
                parts.append(p)
        return QuantizedMatrix(parts, k)

    # -- slices (tensor parallelism: verispec.models.llama_tp.shard_weights) ---------------
    # Each returns fresh tensors in the file's layout (the whole matrix can be freed);
    # callers put the result in their arithmetic's layout (for_arithmetic).

    def select_rows(self, ranges: Sequence[tuple[int, int]]) -> "QuantizedMatrix":
        """Rows [a, b) of each range, one after another (a column-parallel cut: output
        features). Whole rows are whole blocks, so any rows can be taken; each keeps its
        format and bytes."""
        n = self.shape[0]
        pieces: list[QuantizedMatrix] = []
        for a, b in ranges:
            if not 0 <= a <= b <= n:
                raise ValueError(f"QuantizedMatrix.select_rows: range [{a}, {b}) is outside "
                                 f"the matrix's {n} rows")
            n0 = 0
            for p in self.parts:
                lo, hi = max(a, n0), min(b, n0 + p.rows)
                if lo < hi:
                    data = p.unpack(self.k).data[lo - n0:hi - n0].clone()
                    pieces.append(QuantizedMatrix([QuantPart(p.fmt, data)], self.k))
                n0 += p.rows
        if not pieces:  # no rows (a rank's empty slice of a small vocabulary)
            p = self.parts[0]
            return QuantizedMatrix([QuantPart(p.fmt, torch.empty(
                (0, row_bytes(p.fmt, self.k)), dtype=torch.uint8))], self.k)
        return QuantizedMatrix.cat(pieces) if len(pieces) > 1 else pieces[0]

    def block_elems(self) -> int:
        """The largest block of its parts' formats (32, or 256 for K-quants and IQ4_XS):
        a cut of the K (input) dimension must fall on a multiple of it."""
        return max(QUANT_FORMATS[p.fmt][1] for p in self.parts)

    def select_columns(self, a: int, b: int) -> "QuantizedMatrix":
        """Input features [a, b) of every row (a row-parallel cut): the blocks that hold
        them, bytes unchanged, so a and b must be multiples of each part's block size
        (ValueError otherwise: a block's scale covers all its weights and cannot be
        split)."""
        if not 0 <= a < b <= self.k:
            raise ValueError(f"QuantizedMatrix.select_columns: [{a}, {b}) must be a non-empty "
                             f"range inside K = {self.k}")
        parts = []
        for p in self.parts:
            _, block, size = QUANT_FORMATS[p.fmt]
            if a % block or b % block:
                raise ValueError(f"QuantizedMatrix.select_columns: [{a}, {b}) does not cut "
                                 f"{p.fmt} at its blocks of {block} weights")
            data = p.unpack(self.k).data[:, a // block * size:b // block * size].contiguous()
            parts.append(QuantPart(p.fmt, data))
        return QuantizedMatrix(parts, b - a)

    def pad_rows(self, rows: int) -> "QuantizedMatrix":
        """This matrix with ``rows`` rows of zero bytes after its last: zero weights in
        every format (all scales 0), e.g. the padding of a vocabulary-parallel LM head."""
        if rows < 0:
            raise ValueError(f"QuantizedMatrix.pad_rows: rows must be >= 0, got {rows}")
        if rows == 0:
            return self
        last = self.parts[-1].unpack(self.k)
        pad = QuantPart(last.fmt, last.data.new_zeros(rows, last.data.shape[1]))
        return QuantizedMatrix.cat([QuantizedMatrix([p.unpack(self.k) for p in self.parts],
                                                    self.k),
                                    QuantizedMatrix([pad], self.k)])

    def dequantize(self, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """float32 [len(rows), K] (all rows when None): the exact dequantized weights."""
        if rows is None:
            out = torch.empty(self.shape, dtype=torch.float32)
            n0 = 0
            for p in self.parts:
                _C.quant_dequantize(p.data, QUANT_FORMATS[p.fmt][0], self.k, None,
                                    out[n0:n0 + p.rows], packed_rows=_packed(p))
                n0 += p.rows
            return out
        rows = rows.to(dtype=torch.long, device="cpu").reshape(-1)
        if len(self.parts) == 1:
            out = torch.empty((rows.numel(), self.k), dtype=torch.float32)
            p = self.parts[0]
            _C.quant_dequantize(p.data, QUANT_FORMATS[p.fmt][0], self.k, rows.contiguous(), out,
                                packed_rows=_packed(p))
            return out
        return self.dequantize()[rows]

    def linear(self, x: torch.Tensor, num_threads: int) -> torch.Tensor:
        """x [M, K] float32 (contiguous) @ self^T -> [M, N]: the native kernel in
        ARITHMETIC (batch invariant, verispec/layers/quant.h) for any M with int8 and for M <=
        KERNEL_MAX_ROWS with float; the float arithmetic's longer products (prefill) run
        dequantized tiles of PREFILL_TILE_ROWS rows into torch.mm."""
        m = x.shape[0]
        int8 = ARITHMETIC == "int8"
        kernel = on_kernel(m)
        out = torch.empty((m, self.shape[0]), dtype=torch.float32)
        n0 = 0
        for p in self.parts:
            n, tid = p.rows, QUANT_FORMATS[p.fmt][0]
            if kernel:
                kernels.quant_linear(x, p.data, out, n0, n, self.k, tid, num_threads, int8,
                                     p.packed)
            else:
                tile = torch.empty((min(n, PREFILL_TILE_ROWS), self.k), dtype=torch.float32)
                for r0 in range(0, n, PREFILL_TILE_ROWS):  # packed: whole groups of 16 rows
                    r1 = min(n, r0 + PREFILL_TILE_ROWS)
                    t = tile[:r1 - r0]
                    if p.packed:
                        g0, g1 = r0 // PACK_ROWS, (r1 + PACK_ROWS - 1) // PACK_ROWS
                        _C.quant_dequantize(p.data[g0:g1], tid, self.k, None, t,
                                            packed_rows=r1 - r0)
                    else:
                        _C.quant_dequantize(p.data[r0:r1], tid, self.k, None, t)
                    torch.mm(x, t.t(), out=out[:, n0 + r0:n0 + r1])
            n0 += n
        return out


def _packed(p: QuantPart) -> int:
    """quant_dequantize's packed_rows for part p (-1: the file's layout)."""
    return -1 if p.packed_rows is None else p.packed_rows
