"""The int8 arithmetic of the quantized products, bit for bit.

verispec/layers/quant.h specifies the int8 arithmetic exactly: x quantized per block of
32 (dx = fl(amax / 127), q = round-half-even(fl(x * fl(127 / amax)))), each weight
block's exact integer product P with q (its quants less their offset, times the
half-block sub-scales of Q6_K / Q2_K / Q3_K), and one float accumulator per output that
takes the blocks in order, y = fma(float(P), fl(ws * dx), y) and, for the formats with a
min, y = fma(float(S), fl(wc * dx), y). Here that is computed again in numpy from the
ggml block layouts (decoded as ggml's dequantizers walk them, into integer weights and
scales: no code shared with the kernels), the integers in int64 and each fused
multiply-add rounded once, exactly; the kernels' outputs must be the same bits, on
every int8 path this CPU runs. A test of a bound could not see a quant one step off in
one lane of a block (the bound holds 2^-8 of sum |x w|); an exact reference sees any.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verispec import _C, ops
from verispec.models.layers.quantized import QUANT_FORMATS
from verispec.models.testing import QUANT_HALF_FIELDS, random_quant_blocks

INT8_PATHS = ["scalar", "avx2-maddubs", "avx-vnni", "avx512-vnni"]
# the formats of the int8 arithmetic: every block format with a scale
INT8_FORMATS = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "Q2_K", "Q3_K", "Q4_K",
                "Q5_K", "Q6_K", "IQ4_XS"]
# ggml's non-linear 4-bit table (kvalues_iq4nl)
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                      dtype=np.int64)


def test_every_block_format_is_covered():
    scaled = {f for f in QUANT_FORMATS if f not in ("F16", "BF16")}
    assert scaled == set(INT8_FORMATS)


# ---- the ggml block layouts, decoded to integers ---------------------------------------------

def _half(raw: np.ndarray, at: int) -> np.ndarray:
    """The IEEE half at byte `at` of each block, as float32 (exact)."""
    return raw[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _u16(raw: np.ndarray, at: int) -> np.ndarray:
    return raw[..., at].astype(np.int64) | (raw[..., at + 1].astype(np.int64) << 8)


def _u32(raw: np.ndarray, at: int) -> np.ndarray:
    return _u16(raw, at) | (_u16(raw, at + 2) << 16)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 values: the low nibbles are elements 0..15, the high ones 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int64)


class Decoded:
    """A matrix's blocks of 32 (n rows, nb blocks): the integer weights v [n, nb, 32] (the
    quants less their offset), the float32 scale ws [n, nb], the multipliers of the two
    halves mul [n, nb, 2] (1 where a format has none), and for the formats with a min its
    float32 coefficient wc [n, nb] and the multipliers of the halves' sums mins [n, nb, 2]:
    the block's weights are ws * mul_h * v + wc * mins_h (quant.h)."""

    def __init__(self, v, ws, mul=None, wc=None, mins=None):
        self.v = v.astype(np.int64)
        self.ws = ws.astype(np.float32)
        self.mul = np.ones(v.shape[:2] + (2,), np.int64) if mul is None else mul.astype(np.int64)
        self.wc = wc
        self.mins = mins

    def weights(self) -> np.ndarray:
        """The dequantized weights in float64 (exact), [n, nb * 32]."""
        n, nb, _ = self.v.shape
        w = (self.ws.astype(np.float64)[:, :, None]
             * np.repeat(self.mul, 16, axis=2) * self.v)
        if self.wc is not None:
            w = w + self.wc.astype(np.float64)[:, :, None] * np.repeat(self.mins, 16, axis=2)
        return w.reshape(n, nb * 32)


def _super(raw: np.ndarray, values: np.ndarray, per16: np.ndarray) -> tuple:
    """A super-block's 256 values and 16 per-16 multipliers as 8 blocks of 32."""
    n, ns = raw.shape[:2]
    return values.reshape(n, ns * 8, 32), per16.reshape(n, ns * 8, 2)


def decode(fmt: str, data: torch.Tensor, k: int) -> Decoded:
    _, block, size = QUANT_FORMATS[fmt]
    n = data.shape[0]
    raw = data.numpy().reshape(n, k // block, size)
    if fmt == "Q8_0":
        return Decoded(raw[..., 2:34].copy().view(np.int8), _half(raw, 0))
    if fmt in ("Q4_0", "IQ4_NL"):
        q = _nibbles(raw[..., 2:18])
        return Decoded(IQ4_VALUES[q] if fmt == "IQ4_NL" else q - 8, _half(raw, 0))
    if fmt == "Q4_1":
        one = np.ones((n, k // 32, 2), np.int64)
        return Decoded(_nibbles(raw[..., 4:20]), _half(raw, 0), wc=_half(raw, 2), mins=one)
    if fmt in ("Q5_0", "Q5_1"):
        at = 2 if fmt == "Q5_0" else 4
        qh = _u32(raw, at)[..., None] >> np.arange(32)                # bit i: element i
        q = _nibbles(raw[..., at + 4:at + 20]) | ((qh & 1) << 4)
        if fmt == "Q5_0":
            return Decoded(q - 16, _half(raw, 0))
        return Decoded(q, _half(raw, 0), wc=_half(raw, 2), mins=np.ones((n, k // 32, 2), np.int64))
    ns = k // 256
    if fmt in ("Q4_K", "Q5_K"):
        d, dmin, sc = _half(raw, 0), _half(raw, 2), raw[..., 4:16].astype(np.int64)
        # get_scale_min_k4: sub-blocks 0..3 in the low 6 bits of bytes 0..3 / 4..7, 4..7
        # in the nibbles of bytes 8..11 and the top 2 bits of bytes 0..3 / 4..7
        scale = np.concatenate([sc[..., 0:4] & 63, (sc[..., 8:12] & 15) | ((sc[..., 0:4] >> 6) << 4)], -1)
        mn = np.concatenate([sc[..., 4:8] & 63, (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)], -1)
        qs = raw[..., 48:176] if fmt == "Q5_K" else raw[..., 16:144]
        # 64 values per 32 bytes: low nibbles, then high nibbles
        q = np.stack([qs.reshape(n, ns, 4, 32) & 15, qs.reshape(n, ns, 4, 32) >> 4], axis=3)
        q = q.reshape(n, ns, 8, 32).astype(np.int64)
        if fmt == "Q5_K":  # bit j of byte l: element 32 j + l
            q |= ((raw[..., 16:48].astype(np.int64)[:, :, None, :] >> np.arange(8)[:, None]) & 1) << 4
        ws = (d[..., None] * scale.astype(np.float32)).reshape(n, ns * 8)      # exact
        wc = (-(dmin[..., None] * mn.astype(np.float32))).reshape(n, ns * 8)  # exact
        return Decoded(q.reshape(n, ns * 8, 32), ws, wc=wc, mins=np.ones((n, ns * 8, 2), np.int64))
    if fmt == "Q6_K":
        ql, qh = raw[..., 0:128].astype(np.int64), raw[..., 128:192].astype(np.int64)
        sc = raw[..., 192:208].copy().view(np.int8).astype(np.int64)
        out = np.zeros((n, ns, 256), np.int64)
        for h in range(2):  # two halves of 128, as ggml's dequantize_row_q6_K
            lo, hi = ql[..., 64 * h:64 * h + 64], qh[..., 32 * h:32 * h + 32]
            for i, (src, nib_shift) in enumerate([(lo[..., :32], 0), (lo[..., 32:], 0),
                                                  (lo[..., :32], 4), (lo[..., 32:], 4)]):
                q = ((src >> nib_shift) & 15) | (((hi >> (2 * i)) & 3) << 4)
                out[..., 128 * h + 32 * i:128 * h + 32 * i + 32] = q - 32
        v, mul = _super(raw, out, sc)
        return Decoded(v, np.repeat(_half(raw, 208), 8, axis=1), mul=mul)
    if fmt == "Q2_K":
        sc = raw[..., 0:16].astype(np.int64)
        qs = raw[..., 16:80].astype(np.int64).reshape(n, ns, 2, 1, 32)
        q = (qs >> (2 * np.arange(4))[:, None]) & 3                        # [n, ns, 2, 4, 32]
        v, mul = _super(raw, q, sc & 15)
        _, mins = _super(raw, q, sc >> 4)
        wc = np.repeat(-_half(raw, 82), 8, axis=1)
        return Decoded(v, np.repeat(_half(raw, 80), 8, axis=1), mul=mul, wc=wc, mins=mins)
    if fmt == "Q3_K":
        hm = raw[..., 0:32].astype(np.int64)
        qs = raw[..., 32:96].astype(np.int64).reshape(n, ns, 2, 1, 32)
        q2 = (qs >> (2 * np.arange(4))[:, None]) & 3                       # [n, ns, 2, 4, 32]
        high = (hm[:, :, None, :] >> np.arange(8)[:, None]) & 1            # sub-block j: bit j
        q = q2.reshape(n, ns, 8, 32) - 4 * (1 - high)                      # (hm bit ? 0 : -4)
        # ggml's 12-byte unpack (kmask1 = 0x03030303, kmask2 = 0x0f0f0f0f) into 16 6-bit scales
        a0, a1, tmp = _u32(raw, 96), _u32(raw, 100), _u32(raw, 104)
        m1, m2 = 0x03030303, 0x0F0F0F0F
        aux = [(a0 & m2) | (((tmp >> 0) & m1) << 4), (a1 & m2) | (((tmp >> 2) & m1) << 4),
               ((a0 >> 4) & m2) | (((tmp >> 4) & m1) << 4), ((a1 >> 4) & m2) | (((tmp >> 6) & m1) << 4)]
        scales = np.stack([(a >> (8 * b)) & 0xFF for a in aux for b in range(4)], -1) - 32
        v, mul = _super(raw, q, scales)
        return Decoded(v, np.repeat(_half(raw, 108), 8, axis=1), mul=mul)
    if fmt == "IQ4_XS":
        d, sh = _half(raw, 0), _u16(raw, 2)
        sl = raw[..., 4:8].astype(np.int64)
        j = np.arange(8)
        ls = ((sl[..., j // 2] >> (4 * (j % 2))) & 15) | (((sh[..., None] >> (2 * j)) & 3) << 4)
        ws = (d[..., None] * (ls - 32).astype(np.float32)).reshape(n, ns * 8)  # exact
        q = _nibbles(raw[..., 8:136].reshape(n, ns, 8, 16))
        return Decoded(IQ4_VALUES[q].reshape(n, ns * 8, 32), ws)
    raise AssertionError(f"no decoder for {fmt}")


# ---- the int8 arithmetic ------------------------------------------------------------------

def quantize_x(x: np.ndarray):
    """x [m, k] float32 -> q [m, nb, 32] int64 and dx [m, nb] float32 (quant.h)."""
    m, k = x.shape
    xb = x.reshape(m, k // 32, 32)
    amax = np.abs(xb).max(axis=2)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.float32(127) / amax                                     # float32 division
        q = np.rint(xb * inv[:, :, None]).astype(np.int64)               # half to even
    q[amax == 0] = 0
    return q, (amax / np.float32(127)).astype(np.float32)


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """fma(a, b, c) of float32 arrays, rounded once: a * b is exact in float64, and the sum
    with c is rounded to odd there (53 >= 24 + 2 bits), which the final rounding to float32
    then makes the correctly rounded result (Boldo and Melquiond)."""
    p = a.astype(np.float64) * b.astype(np.float64)
    cc = c.astype(np.float64)
    s = p + cc
    t = s - p
    err = (p - (s - t)) + (cc - t)                                     # s + err == p + cc
    even = (s.view(np.int64) & 1) == 0
    odd = np.where((err != 0) & even, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return odd.astype(np.float32)


def int8_product(x: torch.Tensor, dec: Decoded, *, lane_error: int = 0) -> np.ndarray:
    """y [m, n] float32 of the int8 arithmetic. lane_error: added to one integer weight of
    every block (lane 5), the decoding error a kernel would make (power test)."""
    q, dx = quantize_x(x.numpy())
    v = dec.v.copy()
    v[:, :, 5] += lane_error
    # each half's integer dot product, times its multiplier: [m, n, nb]
    halves = np.einsum("mbhi,nbhi->mnbh", q.reshape(q.shape[0], -1, 2, 16), v.reshape(v.shape[0], -1, 2, 16))
    p = (halves * dec.mul[None]).sum(axis=3)
    qh = q.reshape(q.shape[0], -1, 2, 16).sum(axis=3)                   # [m, nb, 2]
    y = np.zeros((x.shape[0], v.shape[0]), np.float32)
    for b in range(v.shape[1]):
        y = fma32(p[:, :, b].astype(np.float32), dec.ws[None, :, b] * dx[:, None, b], y)
        if dec.wc is not None:
            s = (qh[:, None, b, :] * dec.mins[None, :, b, :]).sum(axis=2)
            y = fma32(s.astype(np.float32), dec.wc[None, :, b] * dx[:, None, b], y)
    return y


def _bits(y) -> np.ndarray:
    return np.asarray(y, dtype=np.float32).view(np.int32)


def _data(fmt: str, n: int, k: int, seed: int) -> torch.Tensor:
    """Random blocks with half scales of either sign (random_quant_blocks' are positive)."""
    data = random_quant_blocks(fmt, n, k, seed=seed).clone()
    raw = data.view(n, k // QUANT_FORMATS[fmt][1], QUANT_FORMATS[fmt][2])
    flip = torch.from_numpy(np.random.default_rng(seed).integers(0, 2, raw.shape[:2], dtype=np.uint8))
    for at in QUANT_HALF_FIELDS[fmt]:
        raw[:, :, at + 1] ^= flip << 7
    return data


def _x(m: int, k: int, seed: int) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[:, 32:64] *= 1e-3  # blocks of other sizes, and a zero block
    if k >= 128:
        x[0, 96:128] = 0.0
    return x


@pytest.mark.parametrize("fmt", INT8_FORMATS)
def test_int8_product_is_the_specified_sequence(fmt):
    """Every output of every int8 path this CPU runs is the reference's bits; the decoded
    weights are gguf's dequantization (so the reference reads the layouts as ggml does)."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    block = QUANT_FORMATS[fmt][1]
    k = 512 if block == 256 else 32 * 9  # 2 super-blocks, or 9 blocks
    data = _data(fmt, 37, k, seed=7)
    dec = decode(fmt, data, k)
    gguf = np.asarray(dequantize(data.numpy(), GGMLQuantizationType[fmt]), dtype=np.float32)
    assert np.array_equal(dec.weights().astype(np.float32), gguf), "decoding differs from gguf's"
    x = _x(5, k, seed=3)
    want = int8_product(x, dec)
    ran = 0
    try:
        for path in INT8_PATHS:
            try:
                _C._quant_int8_force_path(path)
            except ValueError as e:
                assert "does not run on this CPU" in str(e)
                continue
            ran += 1
            got = ops.quant_linear(x, data, fmt, num_threads=2)
            wrong = np.argwhere(_bits(got) != _bits(want))
            assert wrong.size == 0, (
                f"{fmt} {path}: {len(wrong)} of {want.size} outputs differ from the int8 "
                f"sequence, first at {tuple(wrong[0])}: {got[tuple(wrong[0])].item()!r} "
                f"!= {want[tuple(wrong[0])]!r}")
    finally:
        _C._quant_int8_force_path("")
    assert ran >= 1  # the scalar path runs everywhere


@pytest.mark.parametrize("fmt", INT8_FORMATS)
def test_a_one_step_decoding_error_is_seen(fmt):
    """Power: the reference with one integer weight of every block one step off differs
    from the kernel in most outputs, although it stays inside the documented error bound
    that the bound tests check (so only an exact test sees such a bug)."""
    from test_quant import int8_bound

    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    block = QUANT_FORMATS[fmt][1]
    k = 512 if block == 256 else 32 * 9
    data = _data(fmt, 40, k, seed=11)
    dec = decode(fmt, data, k)
    x = _x(4, k, seed=5)
    got = ops.quant_linear(x, data, fmt, num_threads=2)
    off = int8_product(x, dec, lane_error=1)
    assert np.array_equal(_bits(got), _bits(int8_product(x, dec)))
    differ = (_bits(got) != _bits(off)).mean()
    assert differ > 0.9, f"{fmt}: a one-step error changed only {differ:.0%} of the outputs"
    w = torch.from_numpy(np.asarray(dequantize(data.numpy(), GGMLQuantizationType[fmt]), dtype=np.float32))
    within = ((torch.from_numpy(off).double() - x.double() @ w.double().t()).abs()
              <= int8_bound(x, w, data, fmt)).double().mean().item()
    assert within > 0.5, f"{fmt}: the bound alone would catch it ({within:.0%} inside)"
