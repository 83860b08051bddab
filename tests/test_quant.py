"""Quantized weights on the CPU: verispec's kernels over GGUF block formats.

Every format x instruction set: dequantization bit for bit as gguf.quants; products
against a float64 product of the dequantized weights within a rounding bound (and a
perturbed block scale falls outside it); bitwise batch invariance; a quantized GGUF model
against the same file dequantized to float32; greedy speculation on the quantized model
equals its plain greedy output; bad files and arguments fail naming what is wrong.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verispec import _C, ops
from verispec.models.layers.quantized import FLOAT16_FORMATS, QUANT_FORMATS, QuantizedMatrix, row_bytes
# byte offsets of the half-float scales in each format's block; random matrices in a format
from verispec.models.testing import QUANT_HALF_FIELDS as _HALF_FIELDS
from verispec.models.testing import random_quant_blocks as random_blocks

ISAS = _C.linear_isas()
FORMATS = list(QUANT_FORMATS)
# the block formats with a scale: the int8 arithmetic's (F16 / BF16 always run the float one)
SCALED_FORMATS = [f for f in FORMATS if f not in FLOAT16_FORMATS]


def gguf_dequantize(data: torch.Tensor, fmt: str) -> torch.Tensor:
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize
    return torch.from_numpy(np.array(dequantize(data.numpy(), GGMLQuantizationType[fmt]),
                                     dtype=np.float32))


def bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The documented bound (verispec/layers/quant.h): K * 2^-24 * sum_k |x_k w_k|."""
    return x.shape[1] * 2.0 ** -24 * (x.abs().double() @ w.abs().double().t()) + 1e-30


def min_terms(data: torch.Tensor, fmt: str, k: int) -> torch.Tensor:
    """C_b per block of 32 of each row (float64 [n, k / 32]): the size of the block's min
    term, Q4_1 / Q5_1 |m|, Q4_K / Q5_K 63 |dmin| (the largest 6-bit min), Q2_K 15 |dmin|
    (the largest 4-bit one), else 0 (Q3_K's and Q6_K's quants have offsets, not mins)."""
    _, block, size = QUANT_FORMATS[fmt]
    n = data.shape[0]
    # the min's byte offset and the largest integer it is multiplied by
    at, most = {"Q4_1": (2, 1), "Q5_1": (2, 1), "Q4_K": (2, 63), "Q5_K": (2, 63),
                "Q2_K": (82, 15)}.get(fmt, (None, 0))
    if at is None:
        return torch.zeros(n, k // 32, dtype=torch.float64)
    raw = data.reshape(n, k // block, size)
    c = raw[:, :, at:at + 2].contiguous().view(torch.float16).reshape(n, k // block).double().abs()
    c = most * c
    return c.repeat_interleave(block // 32, dim=1)


def int8_bound(x: torch.Tensor, w: torch.Tensor, data: torch.Tensor, fmt: str) -> torch.Tensor:
    """The documented bound of the int8 arithmetic (verispec/layers/quant.h), [M, N]:
    sum_b 0.50003 amax_b / 127 sum_{k in b} |w_k|
      + (K/32 + 8) 2^-23 sum_k (|x_k| + amax_b / 254) (|w_k| + C_b)
    (amax_b: max |x| over block b of the row; C_b: min_terms)."""
    m, k = x.shape
    xb = x.double().abs().reshape(m, k // 32, 32)
    amax = xb.amax(dim=2)                                                 # [m, nb]
    wa = w.double().abs().reshape(w.shape[0], k // 32, 32)                # [n, nb, 32]
    quant = 0.50003 / 127 * torch.einsum("mb,nb->mn", amax, wa.sum(dim=2))
    xs = xb + (amax / 254)[:, :, None]                                    # [m, nb, 32]
    c = min_terms(data, fmt, k)                                           # [n, nb]
    rounding = torch.einsum("mbi,nbi->mn", xs, wa) + torch.einsum("mb,nb->mn", xs.sum(dim=2), c)
    return quant + (k // 32 + 8) * 2.0 ** -23 * rounding + 1e-30


def _k_for(fmt: str, blocks: int) -> int:
    return QUANT_FORMATS[fmt][1] * blocks


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_matches_gguf(fmt, isa):
    k = _k_for(fmt, 3)
    data = random_blocks(fmt, 11, k, seed=1)
    want = gguf_dequantize(data, fmt)
    out = torch.empty(11, k)
    _C.quant_dequantize(data, QUANT_FORMATS[fmt][0], k, None, out, isa)
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))
    rows = torch.tensor([10, 0, 3, 3])
    assert torch.equal(QuantizedMatrix.from_bytes(data, fmt, k).dequantize(rows), want[rows])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,n,blocks", [(1, 1, 1), (3, 7, 2), (8, 40, 3), (16, 33, 1), (5, 300, 6)])
def test_matches_float64(fmt, isa, m, n, blocks):
    k = _k_for(fmt, blocks)
    data = random_blocks(fmt, n, k, seed=m * 100 + n)
    w = gguf_dequantize(data, fmt)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n))
    want = x.double() @ w.double().t()
    y = ops.quant_linear(x, data, fmt, isa=isa, num_threads=2, arithmetic="float")
    err = (y.double() - want).abs()
    assert (err <= bound(x, w)).all(), f"float: max error {err.max().item():.3g}"
    y8 = ops.quant_linear(x, data, fmt, isa=isa, num_threads=2)  # int8, the default
    if fmt in FLOAT16_FORMATS:
        # no block scale: an int8 call runs the float arithmetic, linear_f32's bits over the
        # converted weights (those of a float32 load of the file)
        assert torch.equal(y8, y) and torch.equal(y, ops.linear(x, w, isa=isa, num_threads=1))
        return
    err = (y8.double() - want).abs()
    assert (err <= int8_bound(x, w, data, fmt)).all(), f"int8: max error {err.max().item():.3g}"
    # int8: integer sums and one float order, so every instruction set gives the same bits
    assert torch.equal(y8, ops.quant_linear(x, data, fmt, isa="scalar", num_threads=1))


# the formats gguf.quants can quantize (its quantizer is llama.cpp's reference one)
GGUF_QUANTIZER_FORMATS = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]


@pytest.mark.parametrize("fmt", GGUF_QUANTIZER_FORMATS)
def test_blocks_from_ggufs_quantizer(fmt):
    """Blocks as a real quantizer writes them (gguf.quants.quantize of a float matrix, not
    random bytes): dequantized bit for bit as gguf.quants, products within the bounds."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import quantize

    k, n = 256, 48
    g = torch.Generator().manual_seed(11)
    wf = torch.randn(n, k, generator=g) * 0.05 + 0.01
    data = torch.from_numpy(np.ascontiguousarray(quantize(wf.numpy(), GGMLQuantizationType[fmt])))
    assert data.shape == (n, row_bytes(fmt, k))
    w = gguf_dequantize(data, fmt)
    # a quantization of wf: each weight within a 4-bit step (amax / 8; Q4_0 clamps the end
    # of its range opposite the block's largest weight by up to a step) of wf
    amax = wf.abs().reshape(n, k // 32, 32).amax(dim=2, keepdim=True)
    assert ((w - wf).abs().reshape(n, k // 32, 32) <= amax / 7).all()
    assert torch.equal(QuantizedMatrix.from_bytes(data, fmt, k).dequantize(), w)
    x = torch.randn(5, k, generator=g)
    want = x.double() @ w.double().t()
    for isa in ISAS:
        y = ops.quant_linear(x, data, fmt, isa=isa, arithmetic="float")
        assert ((y.double() - want).abs() <= bound(x, w)).all(), isa
        y8 = ops.quant_linear(x, data, fmt, isa=isa)
        assert ((y8.double() - want).abs() <= int8_bound(x, w, data, fmt)).all(), isa


@pytest.mark.parametrize("fmt", SCALED_FORMATS)
def test_bound_catches_a_perturbed_scale(fmt):
    """The value checks can fail: the kernel fed a matrix whose first block scale of row 2
    is off (float: 1%, int8: 5%) gives outputs outside the bound of the true weights, for
    that row only. x follows the signs of the perturbation (of row 2's weights where it
    changes none), so the perturbed block's share of the output (~3.7% of sum |w| over it
    for int8) is well over the bound (~0.4% of sum |w| over the row for int8), whatever
    the weights' min terms."""
    k = _k_for(fmt, 2)
    data = random_blocks(fmt, 6, k, seed=5)
    w = gguf_dequantize(data, fmt)
    off = _HALF_FIELDS[fmt][0]
    for arithmetic, factor in (("float", 1.01), ("int8", 1.05)):
        bad = data.clone()
        d = bad[2, off:off + 2].view(torch.float16)
        bad[2, off:off + 2] = (d * factor).view(torch.uint8)
        delta = gguf_dequantize(bad, fmt)[2] - w[2]
        sign = torch.where(delta != 0, torch.sign(delta), torch.sign(w[2]))
        g = torch.Generator().manual_seed(0)
        x = sign * (0.5 + 0.5 * torch.rand(4, k, generator=g))
        limit = bound(x, w) if arithmetic == "float" else int8_bound(x, w, data, fmt)
        want = x.double() @ w.double().t()
        ok = (ops.quant_linear(x, data, fmt, arithmetic=arithmetic).double() - want).abs() <= limit
        assert ok.all(), arithmetic
        ok_bad = (ops.quant_linear(x, bad, fmt, arithmetic=arithmetic).double() - want).abs() <= limit
        assert not ok_bad[:, 2].any() and ok_bad[:, [0, 1, 3, 4, 5]].all(), arithmetic


@pytest.mark.parametrize("arithmetic", ["int8", "float"])
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_rows_do_not_depend_on_the_rest_of_the_call(fmt, isa, arithmetic):
    """Bitwise: each row alone == that row in any call of 1..16 rows, at any position,
    with 1 or 2 threads, on either thread backend, and with strided rows."""
    k = _k_for(fmt, 2)
    n = 70
    data = random_blocks(fmt, n, k, seed=9)
    g = torch.Generator().manual_seed(3)
    xs = torch.randn(16, k, generator=g)
    alone = torch.stack([ops.quant_linear(xs[i:i + 1], data, fmt, isa=isa, num_threads=1,
                                          arithmetic=arithmetic)[0] for i in range(16)])
    wide = torch.zeros(16, k + 13)
    wide[:, 5:5 + k] = xs
    for m in range(1, 17):
        for start in {0, 16 - m}:
            for threads in (1, 2):
                y = ops.quant_linear(xs[start:start + m], data, fmt, isa=isa, num_threads=threads,
                                     arithmetic=arithmetic)
                assert torch.equal(y, alone[start:start + m]), (m, start, threads)
        strided = wide[:m, 5:5 + k]
        out = torch.empty(m, n)
        _C.quant_linear(strided, data, QUANT_FORMATS[fmt][0], out, 2, isa, True, arithmetic)
        assert torch.equal(out, alone[:m])
    if arithmetic == "float":
        # the float kernel over the dequantized rows gives the same bits (one rounding rule)
        w = gguf_dequantize(data, fmt)
        assert torch.equal(ops.linear(xs, w, isa=isa, num_threads=1), alone)


INT8_PATHS = ["scalar", "avx2-maddubs", "avx-vnni", "avx512-vnni"]


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("fmt", ["Q4_K", "Q6_K", "Q4_0"])
def test_int8_threads_take_every_chunk_once(fmt, packed):
    """The int8 product's columns are cut in chunks that threads take from their own part's
    front and, out of their own, from the others' back: with 1..12 threads and column
    counts that leave a short last group, a short last chunk, parts of one chunk and parts
    of many, every column is written exactly once (the output starts as NaN) and equals
    the one-thread bits. A chunk skipped leaves NaN; one taken by two threads or the wrong
    column range gives other bits."""
    k = _k_for(fmt, 1)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(3, k, generator=g)
    for n in (16, 37, 16 * 17 + 3, 16 * 257, 4099):
        data = random_blocks(fmt, n, k, seed=n)
        w = ops.quant_pack(data, fmt) if packed else data
        kwargs = {"packed_rows": n} if packed else {}
        want = ops.quant_linear(x, w, fmt, num_threads=1, **kwargs)
        assert not torch.isnan(want).any()
        for threads in (2, 3, 5, 8, 12):
            for m in (1, 3):
                out = torch.full((m, n), float("nan"))
                ops.quant_linear(x[:m], w, fmt, out=out, num_threads=threads, **kwargs)
                assert torch.equal(out, want[:m]), (n, threads, m)


@pytest.mark.parametrize("path", INT8_PATHS)
def test_int8_paths_compute_the_same_bits(path):
    """Each int8 code path this CPU runs (forced, whatever the isa) gives the scalar path's
    bits for every format, M = 1..16 and an odd block count; a path it lacks is refused."""
    try:
        _C._quant_int8_force_path(path)
    except ValueError as e:
        assert "does not run on this CPU" in str(e)
        assert _C.quant_int8_path("auto") != path
        return
    try:
        for fmt in SCALED_FORMATS:
            k = _k_for(fmt, 3)
            data = random_blocks(fmt, 37, k, seed=4)
            x = torch.randn(16, k, generator=torch.Generator().manual_seed(6))
            got = ops.quant_linear(x, data, fmt, num_threads=2)
            _C._quant_int8_force_path("scalar")
            want = ops.quant_linear(x, data, fmt, num_threads=1)
            _C._quant_int8_force_path(path)
            assert torch.equal(got, want), fmt
            for m in (1, 5):
                assert torch.equal(ops.quant_linear(x[:m], data, fmt, num_threads=1), want[:m])
    finally:
        _C._quant_int8_force_path("")
    with pytest.raises(ValueError, match="unknown int8 path"):
        _C._quant_int8_force_path("avx9")


def test_int8_rows_with_zeros_and_non_finite_values():
    """int8: an all-zero block of x contributes nothing (scale 0); a row holding an inf or
    a NaN gives NaN outputs for that row only."""
    k = 64
    data = random_blocks("Q4_1", 5, k, seed=2)
    w = gguf_dequantize(data, "Q4_1")
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(1))
    x[0, :32] = 0
    x[1, 7] = float("inf")
    x[2, 40] = float("nan")
    y = ops.quant_linear(x, data, "Q4_1")
    assert torch.isnan(y[1:]).all()
    want = x[0].double() @ w.double().t()
    assert ((y[0].double() - want).abs() <= int8_bound(x[:1], w, data, "Q4_1")[0]).all()
    assert torch.equal(ops.quant_linear(x[:1], data, "Q4_1")[0], y[0])



def test_int8_x_quantization_is_the_same_on_every_path():
    """x's int8 quantization (vectorized on the AVX-512 path, plain C++ on the scalar one)
    gives the same bits for the values where a rounding or a comparison could differ:
    rounding ties (to even: 0.5 -> 0, 1.5 -> 2, -2.5 -> -2), -0.0, subnormals, blocks
    whose largest value is FLT_MAX or a subnormal, an all-zero block, and a block holding
    an inf or a NaN (that row's outputs all NaN). Each path is compared with the scalar
    path's outputs over Q8_0 weights of all ones at one scale (so y is sum_b dx_b * sum q),
    and with a Q8_0 row holding a single 1 at each position (y is dx * q at that position:
    every quant seen on its own)."""
    k = 6 * 32
    x = torch.zeros(3, k)
    x[0, :32] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5] + [-0.0] * 24)
    x[0, 32:64] = torch.linspace(-1, 1, 32) * 1e-39  # subnormals, largest too
    x[0, 64:96] = torch.tensor([3.4028234663852886e38, -1.0e38] + [1e30] * 30)
    x[0, 96:128] = 0.0
    x[0, 128:160] = torch.randn(32, generator=torch.Generator().manual_seed(3)) * 1e-3
    x[0, 160:192] = torch.arange(32, dtype=torch.float32) - 15.5  # halves after the scale
    x[1] = x[0]
    x[1, 5] = float("inf")
    x[2] = x[0]
    x[2, 170] = float("nan")
    one = torch.tensor([0x00, 0x3C], dtype=torch.uint8)  # float16 1.0
    ones = torch.cat([one, torch.ones(32, dtype=torch.uint8)]).repeat(k // 32).view(1, -1)
    unit = []
    for e in range(k):  # row e: 1 at position e, 0 elsewhere
        row = torch.cat([one, torch.zeros(32, dtype=torch.uint8)]).repeat(k // 32)
        row[(e // 32) * 34 + 2 + e % 32] = 1
        unit.append(row)
    data = torch.cat([ones, torch.stack(unit)])
    try:
        _C._quant_int8_force_path("scalar")
        want = ops.quant_linear(x, data, "Q8_0", num_threads=1)
        assert torch.isnan(want[1:]).all() and not torch.isnan(want[0]).any()
        assert want[0, 1 + 1] == 0.0 and want[0, 1 + 2] == want[0, 1 + 3] != 0.0  # ties to even
        for path in INT8_PATHS[1:]:
            try:
                _C._quant_int8_force_path(path)
            except ValueError:
                continue  # a path this CPU lacks (refusal tested above)
            got = ops.quant_linear(x, data, "Q8_0", num_threads=1)
            assert torch.equal(got[0], want[0]), path
            assert torch.isnan(got[1:]).all(), path
    finally:
        _C._quant_int8_force_path("")

def test_quantized_matrix_parts_and_prefill_tiles(monkeypatch):
    """A matrix of parts in different formats: products of few rows (native kernel, in
    either arithmetic) and of many rows (dequantized tiles into torch.mm) both match its
    dequantized rows."""
    import verispec.models.layers.quantized as qm
    k = 256
    parts = [QuantizedMatrix.from_bytes(random_blocks(f, n, k, seed=n), f, k)
             for f, n in (("Q4_K", 5), ("Q6_K", 9), ("Q6_K", 3), ("Q8_0", 4))]
    q = QuantizedMatrix.cat(parts)
    assert q.formats == ("Q4_K", "Q6_K", "Q8_0") and tuple(q.shape) == (21, k)
    w = q.dequantize()
    assert torch.equal(w, torch.cat([p.dequantize() for p in parts]))
    monkeypatch.setattr(qm, "PREFILL_TILE_ROWS", 4)
    monkeypatch.setattr(qm, "KERNEL_MAX_ROWS", 24)
    for arithmetic in ("int8", "float"):
        monkeypatch.setattr(qm, "ARITHMETIC", arithmetic)
        for m in (3, 16, qm.KERNEL_MAX_ROWS, qm.KERNEL_MAX_ROWS + 1, 40):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            err = (q.linear(x, 2).double() - x.double() @ w.double().t()).abs()
            if arithmetic == "int8":  # the kernel at every m
                limit = torch.cat([int8_bound(x, p.dequantize(), p.parts[0].data, p.formats[0])
                                   for p in parts], dim=1)
            else:  # the kernel, then (m > KERNEL_MAX_ROWS) float32 tiles into torch.mm
                limit = bound(x, w)
            assert (err <= limit).all(), (arithmetic, m)


def test_int8_rows_keep_their_bits_at_any_m_float_up_to_kernel_max_rows(monkeypatch):
    """A pass's products run on the kernel, so each row's output is bitwise what it is
    alone: in the int8 arithmetic at every M (however many prompts prefill together), in
    the float arithmetic up to KERNEL_MAX_ROWS rows; past it the float arithmetic's tiles
    into torch.mm do not promise that (power: at M = KERNEL_MAX_ROWS + 1 they differ from
    the kernel's bits on some row)."""
    import verispec.models.layers.quantized as qm
    assert qm.KERNEL_MAX_ROWS >= 256  # every serving pass of a default server
    monkeypatch.setattr(qm, "KERNEL_MAX_ROWS", 24)  # the rule, at an affordable size
    k = 256
    for fmt in ("Q4_1", "Q8_0", "Q6_K"):
        q = QuantizedMatrix.from_bytes(random_blocks(fmt, 40, k, seed=5), fmt, k)
        x = torch.randn(3 * qm.KERNEL_MAX_ROWS, k, generator=torch.Generator().manual_seed(1))
        for arithmetic in ("int8", "float"):
            monkeypatch.setattr(qm, "ARITHMETIC", arithmetic)
            alone = torch.cat([q.linear(x[i:i + 1].contiguous(), 2) for i in range(x.shape[0])])
            m = qm.KERNEL_MAX_ROWS
            assert torch.equal(q.linear(x[:m].contiguous(), 2), alone[:m])
            if arithmetic == "int8":
                assert torch.equal(q.linear(x[:m + 1].contiguous(), 2), alone[:m + 1])
                assert torch.equal(q.linear(x, 2), alone)
            else:
                assert not torch.equal(q.linear(x[:m + 1].contiguous(), 2), alone[:m + 1])


def _pack_by_the_rule(data: torch.Tensor, fmt: str) -> torch.Tensor:
    """The packed layout as quant.h states it, in numpy: rows in groups of 16 (zero rows
    pad the last); each row cut into 2-byte chunks (its half fields) and 4-byte chunks
    (the rest); the chunk of c bytes at offset x of row r at 16 x + c r of its group."""
    n, rb = data.shape
    _, _, unit = QUANT_FORMATS[fmt]
    chunks, x = [], 0
    while x < rb:
        c = 2 if x % unit in _HALF_FIELDS[fmt] else 4
        chunks.append((x, c))
        x += c
    src = data.numpy()
    groups = (n + 15) // 16
    out = np.zeros((groups, 16 * rb), dtype=np.uint8)
    for row in range(n):
        g, r = divmod(row, 16)
        for x, c in chunks:
            out[g, 16 * x + c * r:16 * x + c * r + c] = src[row, x:x + c]
    return torch.from_numpy(out)


@pytest.mark.parametrize("fmt", FORMATS)
def test_packed_layout_is_the_documented_rule_and_computes_the_same_bits(fmt):
    """ops.quant_pack lays the bytes out as quant.h says (checked against a numpy
    rendering of the rule), unpacks back to the file's bytes, and products (both
    arithmetics, every int8 path this CPU runs, M = 1..16, row counts that do and do not
    fill the last group) and dequantized rows are bitwise those of the file's layout."""
    from verispec.models.layers.quantized import QuantPart
    k = _k_for(fmt, 3)
    for n in (1, 15, 16, 37):
        data = random_blocks(fmt, n, k, seed=n)
        packed = ops.quant_pack(data, fmt)
        assert torch.equal(packed, _pack_by_the_rule(data, fmt)), n
        back = torch.empty_like(data)
        _C.quant_unpack16(packed, QUANT_FORMATS[fmt][0], k, n, back)
        assert torch.equal(back, data)
        x = torch.randn(16, k, generator=torch.Generator().manual_seed(n))
        for arithmetic in ("int8", "float"):
            for path in INT8_PATHS if arithmetic == "int8" else [""]:
                try:
                    if path:  # a path this CPU lacks is refused (tested above): skip it
                        try:
                            _C._quant_int8_force_path(path)
                        except ValueError:
                            continue
                    want = ops.quant_linear(x, data, fmt, num_threads=2, arithmetic=arithmetic)
                    for m in (1, 2, 5, 16):
                        got = ops.quant_linear(x[:m], packed, fmt, num_threads=2,
                                               arithmetic=arithmetic, packed_rows=n)
                        assert torch.equal(got, want[:m]), (n, arithmetic, path, m)
                finally:
                    _C._quant_int8_force_path("")
        q = QuantizedMatrix([QuantPart(fmt, data)], k)
        p = q.pack()
        assert p.packed and not q.packed and p.shape == q.shape and p.pack() is p
        assert p.nbytes == packed.numel() and p.nbytes - q.nbytes < 16 * data.shape[1]
        rows = torch.tensor([n - 1, 0, n // 2])
        assert torch.equal(p.dequantize(), q.dequantize())
        assert torch.equal(p.dequantize(rows), q.dequantize(rows))
        assert torch.equal(p.unpack().parts[0].data, data)


def test_packed_matrices_in_parts_prefill_tiles_and_errors(monkeypatch):
    """A packed matrix of parts in several formats gives the unpacked one's bits in both
    arithmetics, on the kernel and through the float arithmetic's tiles; cat unpacks;
    a packed part of the wrong shape, and packed weights of the wrong shape, are refused
    with the expected shape named."""
    import verispec.models.layers.quantized as qm
    from verispec.models.layers.quantized import QuantPart
    k = 256
    q = QuantizedMatrix.cat([QuantizedMatrix.from_bytes(random_blocks(f, n, k, seed=n), f, k)
                             for f, n in (("Q4_K", 21), ("Q6_K", 9), ("Q8_0", 40))])
    p = q.pack()
    assert p.formats == q.formats and all(part.packed for part in p.parts)
    monkeypatch.setattr(qm, "PREFILL_TILE_ROWS", 32)
    monkeypatch.setattr(qm, "KERNEL_MAX_ROWS", 8)
    for arithmetic in ("int8", "float"):
        monkeypatch.setattr(qm, "ARITHMETIC", arithmetic)
        for m in (1, 8, 9):  # float: 9 rows run the tiles
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            assert torch.equal(p.linear(x, 2), q.linear(x, 2)), (arithmetic, m)
    both = QuantizedMatrix.cat([p, q])
    assert not any(part.packed for part in both.parts) and both.shape[0] == 2 * q.shape[0]
    assert torch.equal(both.dequantize(), torch.cat([q.dequantize(), q.dequantize()]))
    bad = torch.zeros(2, 16 * qm.row_bytes("Q8_0", k), dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"Q8_0 part must be a contiguous uint8 CPU tensor "
                                         r"\[3, 4352\] \(packed\), got torch.uint8 \[2, 4352\]"):
        QuantizedMatrix([QuantPart("Q8_0", bad, 40)], k)
    with pytest.raises(ValueError, match="packed_rows must be an int >= 0, got -1"):
        QuantizedMatrix([QuantPart("Q8_0", bad, -1)], k)
    x = torch.randn(1, k)
    with pytest.raises(ValueError, match=r"a packed weight of 40 rows must be contiguous "
                                         r"\[3, 4352\] \(Q8_0, K = 256\), got \[2, 4352\]"):
        ops.quant_linear(x, bad, "Q8_0", packed_rows=40)
    with pytest.raises(ValueError, match="quant_unpack16: out must have N = 20 rows, got 19"):
        _C.quant_unpack16(bad, 8, k, 20, torch.empty(19, 272, dtype=torch.uint8))
    with pytest.raises(ValueError, match="quant_pack: weight's rows must be whole Q8_0 blocks "
                                         "of 34 bytes, got 40 bytes"):
        ops.quant_pack(torch.zeros(3, 40, dtype=torch.uint8), "Q8_0")


def test_argument_errors():
    data = random_blocks("Q4_0", 4, 64, seed=0)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="fmt must be one of F16, Q4_0, .*got 'IQ2_XXS'"):
        ops.quant_linear(x, data, "IQ2_XXS")
    with pytest.raises(ValueError, match=r"weight must be \[N, 36\] \(Q4_0 rows of K = 64\), got \[4, 40\]"):
        ops.quant_linear(x, torch.zeros(4, 40, dtype=torch.uint8), "Q4_0")
    with pytest.raises(ValueError, match="multiple of Q4_K's block of 256, got 64"):
        ops.quant_linear(x, data, "Q4_K")
    with pytest.raises(ValueError, match="quant_type must be a supported ggml type id .* got 16"):
        _C.quant_linear(x, data, 16, torch.empty(2, 4), 1)
    with pytest.raises(ValueError, match="row index 4 at 1 is out of range"):
        _C.quant_dequantize(data, 2, 64, torch.tensor([0, 4]), torch.empty(2, 64))
    missing = [i for i in ("avx2", "avx512") if i not in ISAS]
    if missing:
        with pytest.raises(ValueError, match=f"instruction set {missing[0]} is not supported"):
            ops.quant_linear(x, data, "Q4_0", isa=missing[0])


# --- a quantized GGUF model -----------------------------------------------------------

HIDDEN, INTER, HEADS, KV_HEADS, VOCAB, LAYERS = 256, 512, 4, 2, 300, 2
# formats of each layer's tensors: K-quants and 32-blocks, mixed inside the fused q|k|v and
# gate|up; every format of QUANT_FORMATS somewhere (the embedding is Q8_0)
LAYER_FORMATS = [
    {"attn_q": "Q4_K", "attn_k": "Q5_K", "attn_v": "Q6_K", "attn_output": "Q5_0",
     "ffn_gate": "Q4_0", "ffn_up": "Q4_1", "ffn_down": "IQ4_XS"},
    {"attn_q": "Q8_0", "attn_k": "Q3_K", "attn_v": "BF16", "attn_output": "F16",
     "ffn_gate": "Q5_1", "ffn_up": "Q2_K", "ffn_down": "IQ4_NL"},
]
# quants of about 8x the 4-bit ones' size: random scales 8x smaller
_WIDE_QUANTS = ("Q8_0", "IQ4_NL", "IQ4_XS")


def write_quantized_gguf(path, *, seed=0, tied=False, formats=LAYER_FORMATS, tamper=None):
    """A tiny random Llama GGUF whose matrices are in ggml block formats (random blocks:
    verispec's own test quantizer) and whose norms are F32. `tamper(name, fmt, data)`
    may change a tensor's bytes / format before it is written."""
    import gguf
    from gguf.constants import GGMLQuantizationType

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(VOCAB)
    rng = np.random.default_rng(seed)
    hd = HIDDEN // HEADS
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * hd, HIDDEN),
              "attn_v": (KV_HEADS * hd, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
              "ffn_gate": (INTER, HIDDEN), "ffn_up": (INTER, HIDDEN), "ffn_down": (HIDDEN, INTER)}

    def add(name, fmt, shape, counter=[0]):
        counter[0] += 1
        data = random_blocks(fmt, shape[0], shape[1], seed=seed * 1000 + counter[0],
                             scale=0.4 / shape[1] ** 0.5 / (8 if fmt in _WIDE_QUANTS else 1)).numpy()
        if tamper is not None:
            fmt, data = tamper(name, fmt, data)
        w.add_tensor(name, data, raw_dtype=GGMLQuantizationType[fmt])

    add("token_embd.weight", "Q8_0", (VOCAB, HIDDEN))
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    if not tied:
        add("output.weight", "Q6_K", (VOCAB, HIDDEN))
    for i in range(LAYERS):
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight",
                         (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
        for name, shape in shapes.items():
            add(f"blk.{i}.{name}.weight", formats[i][name], shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def quantized_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("quant")
    return {tied: write_quantized_gguf(d / f"tiny_{tied}.gguf", tied=tied, seed=int(tied))
            for tied in (False, True)}


@pytest.mark.parametrize("tied", [False, True])
def test_quantized_model_matches_dequantized_float32(quantized_files, tied, monkeypatch):
    """load(path) keeps every matrix quantized (resident bytes ~ the file's); in the float
    arithmetic its logits equal load(path, dtype=float32)'s within the rounding of the
    products. (The int8 arithmetic's products are checked against their bound above; this
    random tiny model amplifies any product error through its layers, so end-to-end
    logits are no measure of it.)"""
    import os

    import verispec.models.layers.quantized as qm
    monkeypatch.setattr(qm, "ARITHMETIC", "float")

    from verispec.models import load_model
    from verispec.models.testing import PagedRunner

    path = quantized_files[tied]
    q = load_model(path)
    f = load_model(path, dtype=torch.float32)
    assert q.quantized and not f.quantized
    lw = q.weights.layers[0]
    assert isinstance(lw.wqkv, QuantizedMatrix) and lw.wqkv.formats == ("Q4_K", "Q5_K", "Q6_K")
    assert isinstance(q.weights.embed, QuantizedMatrix)
    assert (q.weights.lm_head is q.weights.embed) == tied
    matrices = [q.weights.embed] + ([] if tied else [q.weights.lm_head]) + [
        m for lw in q.weights.layers for m in (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down)]
    assert sum(m.nbytes for m in matrices) <= os.path.getsize(path)
    assert {f for m in matrices for f in m.formats} == set(FORMATS)  # every kernel, end to end
    assert not any(m.packed for m in matrices)  # the float arithmetic's layout: the file's
    assert torch.equal(q.weights.layers[1].w_down.dequantize(), f.weights.layers[1].w_down)
    g = torch.Generator().manual_seed(2)
    chunks = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (20, 1, 6, 17)]

    def run(model):
        runner = PagedRunner(model, num_blocks=16, block_size=8)
        seq = runner.add_sequence()
        return [runner.step({seq: c})[0] for c in chunks]

    for a, b in zip(run(q), run(f)):
        scale = b.abs().max().item()
        assert (a - b).abs().max().item() <= 1e-4 * scale, (a - b).abs().max().item() / scale


def test_quantized_verify_rows_equal_single_rows(quantized_files):
    """A verify pass's last tokens get bitwise the logits a pass of just those tokens
    gives them (the quantized projections are batch invariant)."""
    from verispec.models import load_model
    from verispec.models.testing import PagedRunner

    model = load_model(quantized_files[False])
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, VOCAB, (12,), generator=g).tolist()
    draft = torch.randint(0, VOCAB, (6,), generator=g).tolist()

    def run(chunks):
        runner = PagedRunner(model, num_blocks=16, block_size=8)
        seq = runner.add_sequence()
        return [runner.step({seq: c})[0] for c in chunks]

    whole, split = run([prompt, draft]), run([prompt, draft[:4], draft[4:]])
    assert torch.equal(whole[1][4:], split[2])


@pytest.mark.parametrize("source", ["ngram", "early_exit"])
def test_greedy_speculation_equals_plain_greedy_on_the_quantized_model(quantized_files, source):
    from verispec.decoder import SpecDecoder
    from verispec.drafters import EarlyExit, NGram
    from verispec.models import load_model

    model = load_model(quantized_files[True])
    assert model.quantized
    prompts = [[5, 17, 42, 42, 9, 100, 3, 7, 7, 50, 1], [88, 2, 13], [4, 4, 4, 4, 4, 4, 4]]
    plain = SpecDecoder(model, None, num_blocks=64, block_size=4)
    want = [r.tokens for r in plain.generate(prompts, max_new_tokens=20, greedy=True)]
    draft = NGram(1, 3) if source == "ngram" else EarlyExit(model, num_layers=1)
    dec = SpecDecoder(model, draft, k=3, num_blocks=64, block_size=4)
    got = [r.tokens for r in dec.generate(prompts, max_new_tokens=20, greedy=True)]
    assert got == want


@pytest.mark.parametrize("arithmetic", ["float", "int8"])
def test_decode_layers_in_one_call_equal_the_layer_loop(quantized_files, monkeypatch, arithmetic):
    """A quantized model's decoder layers in one native call (_C._QuantDecodeLayers, the
    default for passes of up to KERNEL_MAX_ROWS tokens) give bit for bit the logits of
    the layer-by-layer loop, for prefill, decode, verify and tree rows side by side, with
    fused projections of mixed formats; a bad index changes no cache."""
    import verispec.models.layers.quantized as qm
    from verispec.models import load_model
    from verispec.models.testing import PagedRunner

    monkeypatch.setattr(qm, "ARITHMETIC", arithmetic)
    model = load_model(quantized_files[False])
    assert model.native_decode_layers and model._decode_layers.num_layers == LAYERS
    # the matrices in the layout of the arithmetic's kernel (int8: packed)
    lw = model.weights.layers[0]
    assert all(m.packed == (arithmetic == "int8") for m in (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down))
    calls = []
    original = model._decode_layers

    class Spy:
        def run(self, *args):
            calls.append(args[1])
            return original.run(*args)

    model._decode_layers = Spy()
    g = torch.Generator().manual_seed(6)
    steps = [{0: 20, 1: 3}, {0: 1, 1: 6, 2: 9}, {0: 4, 1: 1, 2: 1}]
    plans = [{s: torch.randint(0, VOCAB, (n,), generator=g).tolist() for s, n in st.items()}
             for st in steps]

    def run(fused):
        model.native_decode_layers = fused
        runner = PagedRunner(model, num_blocks=24, block_size=4)
        seqs = {}
        out = []
        for plan in plans:
            for s in plan:
                seqs.setdefault(s, runner.add_sequence())
            out += runner.step({seqs[s]: toks for s, toks in plan.items()})
        return out, runner

    fused, runner = run(True)
    assert calls == [23, 16, 6]
    loop, _ = run(False)
    assert calls == [23, 16, 6]  # the loop did not call it
    assert all(torch.equal(a, b) for a, b in zip(fused, loop))
    # a block table entry past the pools: refused before any layer writes
    model.native_decode_layers = True
    batch = runner.make_batch({0: [1, 2]})
    before = [p.clone() for p in (*runner.kv.k, *runner.kv.v)]
    batch.block_tables[0, 0] = 10_000
    with pytest.raises(ValueError, match="block 0 must be in"):
        model.forward(batch)
    assert all(torch.equal(a, b) for a, b in zip(before, (*runner.kv.k, *runner.kv.v)))


def test_a_type_without_a_kernel_is_converted_and_named(tmp_path):
    """A matrix in a ggml type verispec has no kernel for (IQ2_XXS here) is dequantized
    to float32 at a quantized load, with the pieces fused with it; the model names them
    (tensor and type) and the CLI header lists the file's types and the conversions."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    from verispec.cli import _weights_desc
    from verispec.models import load_model

    def tamper(name, fmt, data):
        if name != "blk.0.attn_k.weight":
            return fmt, data
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType.IQ2_XXS]
        rng = np.random.default_rng(3)
        raw = rng.integers(0, 256, (data.shape[0], HIDDEN // block, size), dtype=np.uint8)
        raw[:, :, 0:2] = np.full((data.shape[0], HIDDEN // block, 1), 1e-3,
                                 np.float16).view(np.uint8)
        return "IQ2_XXS", raw.reshape(data.shape[0], -1)

    path = write_quantized_gguf(tmp_path / "iq2.gguf", tamper=tamper)
    q = load_model(path)
    f = load_model(path, dtype=torch.float32)
    assert q.quantized
    assert q.weights.converted == ("blk.0.attn_q.weight (Q4_K)", "blk.0.attn_k.weight (IQ2_XXS)",
                                   "blk.0.attn_v.weight (Q6_K)")
    assert q.weights.file_types["IQ2_XXS"] == 1 and q.weights.file_types["F32"] == 2 * LAYERS + 1
    assert not isinstance(q.weights.layers[0].wqkv, QuantizedMatrix)
    assert torch.equal(q.weights.layers[0].wqkv, f.weights.layers[0].wqkv)
    assert isinstance(q.weights.layers[1].wqkv, QuantizedMatrix)
    desc = _weights_desc(q)
    assert "(file: 5 F32, " in desc and " 1 IQ2_XXS, " in desc, desc
    assert ("converted to float32: blk.0.attn_q.weight (Q4_K), blk.0.attn_k.weight (IQ2_XXS), "
            "blk.0.attn_v.weight (Q6_K), float32 activations") in desc, desc
    good = load_model(write_quantized_gguf(tmp_path / "good.gguf"))
    assert good.weights.converted == () and "nothing converted" in _weights_desc(good)


def test_bad_files(tmp_path):
    from verispec.models import load_model

    path = write_quantized_gguf(tmp_path / "good.gguf")
    raw = bytearray(path.read_bytes())
    # the tensor table entry of token_embd.weight: name, n_dims, dims (row length first),
    # then its type id
    name = b"token_embd.weight"
    dims = raw.index(name) + len(name) + 4
    at = dims + 2 * 8
    assert int.from_bytes(raw[at:at + 4], "little") == 8  # Q8_0
    assert int.from_bytes(raw[dims:dims + 8], "little") == HIDDEN
    bad_size = bytearray(raw)
    bad_size[dims:dims + 8] = (250).to_bytes(8, "little")  # not a whole number of blocks
    (tmp_path / "bad_size.gguf").write_bytes(bytes(bad_size))
    with pytest.raises(ValueError, match=r"tensor token_embd\.weight is Q8_0 \(blocks of 32\) "
                                         r"but its rows have 250 elements"):
        load_model(tmp_path / "bad_size.gguf")
    raw[at:at + 4] = (77).to_bytes(4, "little")
    (tmp_path / "unknown_type.gguf").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"tensor token_embd\.weight has unknown ggml type 77"):
        load_model(tmp_path / "unknown_type.gguf")
    short = tmp_path / "short.gguf"
    short.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(ValueError, match=r"tensor \S+ \(\w+ \[\d+, \d+\]\) needs \d+ bytes at offset \d+, but the file has"):
        load_model(short)


@pytest.mark.parametrize("arithmetic", ["int8", "float"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_tensor_parallel_cuts_keep_blocks_and_products(fmt, arithmetic, monkeypatch):
    """The cuts of a tensor-parallel shard (verispec.models.llama_tp.shard_weights) keep the
    format and its bytes: select_rows / select_columns dequantize to the whole matrix's
    rows / columns bit for bit. A row cut's products (column parallel: q|k|v, gate|up, the
    LM head; rows that start inside a group of 16 of the packed layout) are the whole
    product's columns bit for bit; a cut at whole blocks of the input (row parallel: O,
    down) gives partial products whose sum is the whole product up to the rounding of
    the sum. A cut inside a block is refused; pad_rows adds zero weights."""
    import verispec.models.layers.quantized as qm
    monkeypatch.setattr(qm, "ARITHMETIC", arithmetic)

    block = QUANT_FORMATS[fmt][1]
    n, k = 40, 512
    data = random_blocks(fmt, n, k, seed=3, scale=0.05)
    whole = QuantizedMatrix.from_bytes(data, fmt, k)
    w = whole.dequantize()
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(1))

    ranges = [(3, 17), (20, 40)]
    rows = whole.for_arithmetic().select_rows(ranges)  # from the packed layout too
    assert rows.formats == (fmt,) and rows.shape == (14 + 20, k)
    assert torch.equal(rows.dequantize(), torch.cat([w[3:17], w[20:40]]))
    y = whole.for_arithmetic().linear(x, 1)
    assert torch.equal(rows.for_arithmetic().linear(x, 1), torch.cat([y[:, 3:17], y[:, 20:40]], 1))

    cut = k // 2  # a multiple of every block (32, 256)
    halves = [whole.select_columns(0, cut), whole.for_arithmetic().select_columns(cut, k)]
    assert [h.shape for h in halves] == [(n, cut), (n, k - cut)]
    assert torch.equal(halves[0].dequantize(), w[:, :cut])
    assert torch.equal(halves[1].dequantize(), w[:, cut:])
    y_sum = (halves[0].for_arithmetic().linear(x[:, :cut].contiguous(), 1)
             + halves[1].for_arithmetic().linear(x[:, cut:].contiguous(), 1))
    scale = (x.abs() @ w.abs().t()).max()
    assert (y_sum - y).abs().max() <= 1e-5 * scale
    with pytest.raises(ValueError, match=f"does not cut {fmt} at its blocks of {block} weights"):
        whole.select_columns(0, block // 2)

    padded = rows.pad_rows(5)
    assert padded.shape == (39, k) and padded.formats == (fmt,)
    assert torch.equal(padded.dequantize()[34:], torch.zeros(5, k))
    assert whole.select_rows([(7, 7)]).shape == (0, k)


def test_arithmetic_from_the_environment(monkeypatch):
    """VERISPEC_QUANT_ARITHMETIC picks the models' arithmetic (default int8); anything
    else than int8 / float is refused, naming the variable."""
    import verispec.models.layers.quantized as qm
    monkeypatch.delenv("VERISPEC_QUANT_ARITHMETIC", raising=False)
    assert qm._arithmetic_from_env() == "int8"
    monkeypatch.setenv("VERISPEC_QUANT_ARITHMETIC", "float")
    assert qm._arithmetic_from_env() == "float"
    monkeypatch.setenv("VERISPEC_QUANT_ARITHMETIC", "int4")
    with pytest.raises(ValueError, match="VERISPEC_QUANT_ARITHMETIC must be 'int8' or 'float', got 'int4'"):
        qm._arithmetic_from_env()
    with pytest.raises(ValueError, match="arithmetic must be 'int8' or 'float'"):
        ops.quant_linear(torch.zeros(1, 32), random_blocks("Q8_0", 2, 32, seed=0), "Q8_0",
                         arithmetic="double")
