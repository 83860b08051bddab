"""Dense and quantized linear layers on the CPU: the products' layout and row limits, and
the checked entry points to verispec's linear kernels (``verispec.ops.linear``,
``ops.quant_linear`` and ``ops.quant_pack`` are these functions).

- ``matmul_layout``: the layout a float32 matrix's products run fastest in;
- ``NATIVE_LINEAR_MIN_ROWS`` .. ``NATIVE_LINEAR_MAX_ROWS``: the products (tokens a
  forward) LlamaModel and HFModel hand to verispec's kernel;
- ``linear``, ``quant_linear``, ``quant_pack``: argument-checked calls into ``_C`` (the
  models' hot paths call the unchecked ones through ``layers.kernels``).
"""

from __future__ import annotations

import torch

from verispec import _C
from verispec import _args
from verispec.models.layers.quantized import QUANT_FORMATS, row_bytes

__all__ = ["NATIVE_LINEAR_MAX_ROWS", "NATIVE_LINEAR_MIN_ROWS", "linear", "matmul_layout",
           "quant_linear", "quant_pack"]

# Products of NATIVE_LINEAR_MIN_ROWS..NATIVE_LINEAR_MAX_ROWS rows (tokens in a forward:
# plain decoding, verify passes, serving batches, prefill chunks) use verispec's CPU
# linear kernel when the model is float32 on CPU (LlamaModel.native_linear). On
# SmolLM2's shapes, row-major, it is at least as fast as MKL's best layout from 1 row
# (1.4x) to 128 (1.05x) (bench/bench_linear.py, commit 00b2907), and it rounds a row
# the same whatever shares the pass, so a sequence's logits do not depend on the batch
# up to 128 tokens a pass. Longer products (a long prompt at once) use torch.mm.
NATIVE_LINEAR_MAX_ROWS = 128
NATIVE_LINEAR_MIN_ROWS = 1


def matmul_layout(w: torch.Tensor) -> torch.Tensor:
    """``w`` [out, in] as the layout its products run fastest in on its device.

    For float32 on a CPU where verispec's linear kernel has vector instructions that is
    row-major: the kernel streams each weight row once for up to 8 rows of x (~2.8x
    MKL's one-row product on SmolLM2's matrices). Without them (MKL does the products)
    column-major (``w.t()`` contiguous; shape and values unchanged): MKL's one-row
    products read it ~7% faster than row-major. (bfloat16 goes through oneDNN, which
    prefers row-major.) Otherwise ``w`` as it is.
    """
    if w.device.type != "cpu" or w.dtype != torch.float32 or w.dim() != 2:
        return w
    if _C.linear_best_isa() != "scalar":
        return w if w.is_contiguous() else w.contiguous()
    return w if w.t().is_contiguous() else w.t().contiguous().t()


def linear(x, weight, *, out=None, num_threads=None, isa="auto"):
    """``x @ weight.T`` for float32 CPU tensors with few rows: ``x`` [M, K], ``weight``
    [N, K] (a Linear's layout) -> [M, N] (written into ``out`` when given).

    verispec's kernel for verify passes (LlamaModel uses it for 2-16 tokens): the weights
    are read once per 8 rows of ``x``, so on SmolLM2's shapes M = 6 costs ~1.4x M = 1
    where MKL's sgemm costs ~2.2x (bench/bench_linear.py). Batch invariant: a row's output is bitwise the same whatever the
    other rows, its position, M, N's split and the thread count; it depends only on K and
    the instruction set (``isa``: "auto" = the best of "avx512", "avx2", "scalar" this CPU
    runs; ``verispec._C.linear_isas()`` lists them). The dot products are float32 with
    FMA, lane-wise partial sums, so values differ from torch.mm by rounding only.

    ``num_threads`` (default ``torch.get_num_threads()``) split the N dimension, on the
    process's OpenMP team (torch's) when one is loaded. Rows need contiguous last
    dimensions (any row stride). ``weight`` may be row-major or column-major
    (``weight.t()`` contiguous, as LlamaModel keeps its matrices); the two round
    differently (lane-wise partial sums vs one FMA chain over K per output; the chain
    gives the same bits on every instruction set). Not a torch custom op: eager only.
    """
    op = "linear"
    for name, t, dims in (("x", x, "[M, K]"), ("weight", weight, "[N, K]")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2 or t.dtype != torch.float32 or t.device.type != "cpu":
            raise ValueError(f"{op}: {name} must be a float32 CPU tensor {dims}, got "
                             f"{_args.describe(t)} on {t.device}")
    if weight.shape[1] != x.shape[1]:
        raise ValueError(f"{op}: weight must be [N, K] with K = x.shape[1] = {x.shape[1]}, "
                         f"got {list(weight.shape)}")
    num_threads, out = _threads_and_out(op, num_threads, out, (x.shape[0], weight.shape[0]))
    if weight.shape[1] > 1 and weight.stride(1) != 1 and weight.shape[0] > 1 and weight.stride(0) != 1:
        weight = weight.contiguous()
    _C.linear(_last_dim_contiguous(x), weight, out, num_threads, isa)
    return out


def quant_linear(x, weight, fmt, *, out=None, num_threads=None, isa="auto", arithmetic="int8",
                 packed_rows=None):
    """``x @ dequantize(weight).T`` with ``weight`` kept in a GGUF block format: ``x``
    float32 CPU [M, K]; ``weight`` uint8 CPU [N, row_bytes], each row K / block blocks of
    format ``fmt`` (a name of ``verispec._C.quant_formats()``: "Q8_0", "Q4_0", "Q4_1",
    "Q5_0", "Q5_1", "IQ4_NL", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"; "F16" or
    "BF16": 16-bit floats, always the float arithmetic) -> float32 [M, N].
    With ``packed_rows=N``, ``weight`` is those N rows in the packed layout of
    ``quant_pack`` (the int8 arithmetic reads it fastest; the same bits either way).

    ``arithmetic="int8"`` (default, the faster): each row of ``x`` is quantized per block
    of 32 to int8 with a float scale (amax / 127), the weights' quants are unpacked to
    8-bit integers and the block dot products summed exactly in int32, then scaled and
    summed in float32 in one fixed order: every instruction set gives the same bits.
    Against a float64 product of the dequantized weights the error is within
    sum_b 0.50003 * amax_b / 127 * sum_{k in b} |w_k| + (K/32 + 8) * 2^-23 *
    sum_k (|x_k| + amax_b / 254) * (|w_k| + C_b) (amax_b: max |x| of block b; C_b the
    block's min term, Q4_1/Q5_1 |m|, Q4_K/Q5_K 63 |dmin|, Q2_K 15 |dmin|, else 0); see
    csrc/include/verispec/layers/quant.h.

    ``arithmetic="float"``: the kernel dequantizes a few weight rows at a time into cache
    and runs ``linear``'s float32 arithmetic on them: each output is the float32 dot
    product of ``linear`` over the exactly dequantized row. Against a float64 product of
    the dequantized weights the error is within K * 2^-24 * sum |x_k w_k|.

    Either way batch invariant: a row's output is bitwise the same whatever M, the row's
    position, strides and the thread count.
    """
    op = "quant_linear"
    if arithmetic not in ("int8", "float"):
        raise ValueError(f"{op}: arithmetic must be 'int8' or 'float', got {arithmetic!r}")
    if fmt not in QUANT_FORMATS:
        raise ValueError(f"{op}: fmt must be one of {', '.join(QUANT_FORMATS)}, got {fmt!r}")
    for name, t, dt in (("x", x, torch.float32), ("weight", weight, torch.uint8)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2 or t.dtype != dt or t.device.type != "cpu":
            raise ValueError(f"{op}: {name} must be a 2-D {dt} CPU tensor, got {_args.describe(t)} "
                             f"on {t.device}")
    k, block = x.shape[1], QUANT_FORMATS[fmt][1]
    if k % block:
        raise ValueError(f"{op}: x.shape[1] (K) must be a multiple of {fmt}'s block of {block}, "
                         f"got {k}")
    if packed_rows is None:
        if weight.shape[1] != row_bytes(fmt, k):
            raise ValueError(f"{op}: weight must be [N, {row_bytes(fmt, k)}] ({fmt} rows of "
                             f"K = {k}), got {list(weight.shape)}")
        n = weight.shape[0]
    else:
        if isinstance(packed_rows, bool) or not isinstance(packed_rows, int) or packed_rows < 0:
            raise ValueError(f"{op}: packed_rows must be an int >= 0, got {packed_rows!r}")
        g = _C.QUANT_PACK_ROWS
        want = [(packed_rows + g - 1) // g, g * row_bytes(fmt, k)]
        if list(weight.shape) != want or not weight.is_contiguous():
            raise ValueError(f"{op}: a packed weight of {packed_rows} rows must be contiguous "
                             f"{want} ({fmt}, K = {k}), got {list(weight.shape)}")
        n = packed_rows
    num_threads, out = _threads_and_out(op, num_threads, out, (x.shape[0], n))
    _C.quant_linear(_last_dim_contiguous(x), _last_dim_contiguous(weight),
                    QUANT_FORMATS[fmt][0], out, num_threads, isa, False, arithmetic,
                    -1 if packed_rows is None else packed_rows)
    return out


def quant_pack(weight, fmt):
    """``weight`` (uint8 CPU [N, row_bytes] in format ``fmt``, as ``quant_linear``) in the
    packed layout: uint8 [ceil(N / 16), 16 * row_bytes], the rows in groups of 16 (the
    last padded with zero rows), each field of the 16 rows side by side: the 2-byte halves
    (d, dmin, m) as 16 halves, the rest as 4-byte pieces, the piece of c bytes at offset x
    of row r stored at 16 x + c r of its group (csrc/include/verispec/layers/quant.h). The int8
    kernel then loads each field as it is and reads a group as one stream. Pass the result
    to ``quant_linear`` with ``packed_rows=N``."""
    op = "quant_pack"
    if fmt not in QUANT_FORMATS:
        raise ValueError(f"{op}: fmt must be one of {', '.join(QUANT_FORMATS)}, got {fmt!r}")
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{op}: weight must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dim() != 2 or weight.dtype != torch.uint8 or weight.device.type != "cpu":
        raise ValueError(f"{op}: weight must be a 2-D torch.uint8 CPU tensor, got "
                         f"{_args.describe(weight)} on {weight.device}")
    size = QUANT_FORMATS[fmt][2]
    if weight.shape[1] == 0 or weight.shape[1] % size:
        raise ValueError(f"{op}: weight's rows must be whole {fmt} blocks of {size} bytes, got "
                         f"{weight.shape[1]} bytes")
    k = weight.shape[1] // size * QUANT_FORMATS[fmt][1]
    g = _C.QUANT_PACK_ROWS
    out = torch.empty(((weight.shape[0] + g - 1) // g, g * row_bytes(fmt, k)), dtype=torch.uint8)
    _C.quant_pack16(_last_dim_contiguous(weight), QUANT_FORMATS[fmt][0], k, out)
    return out


def _threads_and_out(op, num_threads, out, shape):
    """A CPU linear's thread count (default: torch's) and float32 output of `shape` (given
    or allocated), checked."""
    if num_threads is None:
        num_threads = torch.get_num_threads()
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"{op}: num_threads must be an int >= 1, got {num_threads!r}")
    if out is None:
        out = torch.empty(shape, dtype=torch.float32)
    elif not isinstance(out, torch.Tensor) or out.dtype != torch.float32 \
            or out.device.type != "cpu" or tuple(out.shape) != shape:
        raise ValueError(f"{op}: out must be a float32 CPU tensor {list(shape)}, "
                         f"got {_args.describe(out)}")
    return num_threads, out


def _last_dim_contiguous(t):
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()
