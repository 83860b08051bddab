"""verispec.ops.linear: the CPU kernel for few-row products (verify passes).

Both layouts of a weight (row-major, and column-major as LlamaModel stores it): values
against a float64 product (a rounding bound); batch invariance (a row's output is bitwise
the same whatever shares the call) for every instruction set this CPU runs; the thread
split; the argument checks; and the Llama model with and without the kernel.
"""

import numpy as np
import pytest
import torch

from verispec import _C, ops

ISAS = _C.linear_isas()
LAYOUTS = ("rows", "columns")


def _layout(w, layout):
    """w [N, K] with contiguous rows, or the same values with contiguous columns."""
    return w.contiguous() if layout == "rows" else w.t().contiguous().t()


def _reference(x, w):
    return (x.double() @ w.double().t()).float()


def _bound(x, w):
    """|float32 dot - exact| <= ~K * eps * sum |x_k w_k| (a loose rounding bound)."""
    k = x.shape[1]
    return 2 * k * torch.finfo(torch.float32).eps * (x.abs().double() @ w.abs().double().t()).float() + 1e-30


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (1, 7, 16), (3, 5, 17), (6, 960, 576), (8, 3, 33),
                                   (9, 100, 15), (16, 37, 1536), (2, 4, 0), (5, 1000, 70)])
def test_matches_float64(isa, layout, m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    y = ops.linear(x, _layout(w, layout), isa=isa)
    err = (y - _reference(x, w)).abs()
    assert y.shape == (m, n)
    assert (err <= _bound(x, w)).all(), f"max error {err.max().item():.3g}"


def test_bound_catches_a_wrong_product():
    """The value check can fail: a product with one weight row off by one ulp-scale step
    per element is outside the bound."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 64, generator=g), torch.randn(5, 64, generator=g)
    y = ops.linear(x, w)
    y[2, 3] += 1e-3 * y[2, 3].abs() + 1e-3
    assert not ((y - _reference(x, w)).abs() <= _bound(x, w)).all()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("isa", ISAS)
def test_rows_do_not_depend_on_the_rest_of_the_call(isa, layout):
    """Bitwise: each row alone == that row in any call of 1..20 rows, at any position,
    with any thread count, on either thread backend, and with strided rows."""
    g = torch.Generator().manual_seed(1)
    k, n = 577, 1203  # K, N: tails past every vector width, tile and block
    w = _layout(torch.randn(n, k, generator=g), layout)
    rows = torch.randn(20, k, generator=g) * torch.logspace(-3, 3, 20)[:, None]
    alone = torch.cat([ops.linear(rows[i:i + 1], w, isa=isa, num_threads=1) for i in range(20)])
    for m in (2, 3, 7, 8, 9, 16, 20):
        for start in (0, 20 - m):
            for threads in (1, 2, 3):
                got = ops.linear(rows[start:start + m], w, isa=isa, num_threads=threads)
                assert torch.equal(got, alone[start:start + m]), (m, start, threads)
    out = torch.empty(6, n)
    _C.linear(rows[:6], w, out, 2, isa, True)  # own worker threads
    assert torch.equal(out, alone[:6])
    wide = torch.zeros(20, k + 5)
    wide[:, :k] = rows
    assert torch.equal(ops.linear(wide[:, :k], w, isa=isa), alone)  # row stride k + 5


def test_column_major_gives_the_same_bits_on_every_instruction_set():
    """With column-major weights each output is one FMA chain over K, so scalar, AVX2 and
    AVX-512 agree bitwise (row-major uses lane-wise partial sums, which differ)."""
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(6, 300, generator=g), _layout(torch.randn(77, 300, generator=g), "columns")
    outs = [ops.linear(x, w, isa=isa) for isa in ISAS]
    assert all(torch.equal(o, outs[0]) for o in outs)


def test_invariance_check_catches_a_row_dependent_product():
    """The bitwise check can fail: torch.mm itself gives a row different values when other
    rows share the call (MKL switches kernels with M)."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(49152, 576, generator=g)
    rows = torch.randn(6, 576, generator=g)
    alone = torch.cat([torch.mm(rows[i:i + 1], w.t()) for i in range(6)])
    assert not torch.equal(torch.mm(rows, w.t()), alone)


def test_out_and_threads():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(5, 64, generator=g), torch.randn(300, 64, generator=g)
    out = torch.full((5, 300), float("nan"))
    assert ops.linear(x, w, out=out) is out
    assert torch.equal(out, ops.linear(x, w, num_threads=1))
    assert _C.linear_threads() in ("openmp", "verispec")
    assert _C.linear_best_isa() in ISAS


def test_errors_name_the_argument():
    x, w = torch.randn(3, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"linear: x must be a float32 CPU tensor \[M, K\], got float64"):
        ops.linear(x.double(), w)
    with pytest.raises(ValueError, match=r"weight must be a float32 CPU tensor \[N, K\], got float32 \[8\]"):
        ops.linear(x, w[0])
    with pytest.raises(ValueError, match=r"weight must be \[N, K\] with K = x.shape\[1\] = 8, got \[4, 7\]"):
        ops.linear(x, w[:, :7])
    with pytest.raises(ValueError, match=r"out must be a float32 CPU tensor \[3, 4\], got float32 \[4, 3\]"):
        ops.linear(x, w, out=torch.empty(4, 3))
    with pytest.raises(ValueError, match=r"num_threads must be an int >= 1, got 0"):
        ops.linear(x, w, num_threads=0)
    with pytest.raises(ValueError, match=r"isa must be one of 'auto', 'scalar', 'avx2', 'avx512', got 'sse'"):
        ops.linear(x, w, isa="sse")
    with pytest.raises(TypeError, match=r"x must be a torch.Tensor, got list"):
        ops.linear([[1.0]], w)
    with pytest.raises(ValueError, match=r"out must have a contiguous last dimension"):
        ops.linear(x, w, out=torch.empty(4, 3).t())
    with pytest.raises(ValueError, match=r"weight must have contiguous rows or contiguous columns"):
        _C.linear(x, torch.randn(4, 24)[:, ::3], torch.empty(3, 4), 1)
    with pytest.raises(ValueError, match=r"the output must not overlap x or w"):
        buf = torch.randn(3, 8)
        _C.linear(buf, torch.randn(8, 8), buf, 1)
    with pytest.raises(ValueError, match=r"row strides must cover a row"):
        _C._linear_unchecked(x.data_ptr(), w.data_ptr(), torch.empty(3, 4).data_ptr(),
                             3, 4, 8, 4, 8, 4, 1)
    with pytest.raises(ValueError, match=r"null data pointer"):
        _C._linear_unchecked(0, w.data_ptr(), torch.empty(3, 4).data_ptr(), 3, 4, 8, 8, 8, 4, 1)
    with pytest.raises(ValueError, match=r"ldw = 3 \(>= n = 4\)"):
        _C._linear_unchecked(x.data_ptr(), w.data_ptr(), torch.empty(3, 4).data_ptr(),
                             3, 4, 8, 8, 3, 4, 1, True)
    missing = [i for i in ("avx2", "avx512") if i not in ISAS]
    if missing:
        with pytest.raises(ValueError, match=f"instruction set {missing[0]} is not supported"):
            ops.linear(x, w, isa=missing[0])


# --- the model -------------------------------------------------------------------------


def _tiny_llama(seed=0):
    from verispec.models import LlamaConfig, LlamaModel, LlamaWeights
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256,
                         tie_word_embeddings=False)
    g = torch.Generator().manual_seed(seed)
    names = {}
    h, q, kv, inter = 64, 64, 32, 160
    names["model.embed_tokens.weight"] = (97, h)
    names["lm_head.weight"] = (97, h)
    names["model.norm.weight"] = (h,)
    for i in range(2):
        p = f"model.layers.{i}."
        names.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                      p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                      p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                      p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                      p + "mlp.down_proj.weight": (h, inter)})
    state = {name: (1 + 0.1 * torch.randn(shape, generator=g)) if len(shape) == 1
             else 0.2 * torch.randn(shape, generator=g) for name, shape in names.items()}
    return LlamaModel(config, LlamaWeights.from_state_dict(config, state))


def test_model_uses_the_kernel_for_verify_passes_and_matches_torch(monkeypatch):
    """Same logits as torch.mm's products up to rounding, for prefill-sized and
    verify-sized forwards; the kernel runs for passes of up to NATIVE_LINEAR_MAX_ROWS
    tokens, torch.mm for longer ones; and a verify
    pass gives its last tokens bitwise the logits a pass of just those tokens gives them
    (the projections are batch invariant; the attention's small matmuls are too here)."""
    from verispec.models.layers.linear import NATIVE_LINEAR_MAX_ROWS
    from verispec.models.testing import PagedRunner
    model = _tiny_llama()
    vector_isa = _C.linear_best_isa() != "scalar"
    assert model.native_linear == vector_isa  # the portable fallback is slower than MKL
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, 97, (20,), generator=g).tolist()
    draft = torch.randint(0, 97, (6,), generator=g).tolist()

    calls = []
    native_fn = _C._linear_unchecked
    monkeypatch.setattr(_C, "_linear_unchecked", lambda *a: calls.append(a[3]) or native_fn(*a))

    def run(native, chunks):
        model.native_linear = native
        runner = PagedRunner(model, num_blocks=24, block_size=8)
        seq = runner.add_sequence()
        return [runner.step({seq: c})[0] for c in chunks]

    # matmul_layout: row-major where the kernel runs them, column-major for MKL
    assert model.weights.lm_head.is_contiguous() == vector_isa
    assert (model.weights.lm_head.stride(0) == 1) != vector_isa
    chunks = [prompt, draft]
    got, want = run(True, chunks), run(False, chunks)
    for a, b in zip(got, want):
        assert (a - b).abs().max().item() < 1e-4
    if not vector_isa:  # a CPU without AVX2: every product stays with torch.mm
        assert calls == []
        return
    # both passes: 4 products a layer, 2 layers, the head
    assert calls.count(20) == calls.count(6) == 4 * 2 + 1 and set(calls) == {20, 6}
    calls.clear()
    long_prompt = torch.randint(0, 97, (NATIVE_LINEAR_MAX_ROWS + 1,), generator=g).tolist()
    run(True, [long_prompt])
    assert calls == []  # a longer prompt at once: torch.mm
    # token 5 of the draft: in the 6-token pass vs in a 2-token pass [draft[4], draft[5]],
    # and vs one-token passes (plain decoding runs on the kernel too)
    split = run(True, [prompt, draft[:4], draft[4:]])
    assert torch.equal(got[1][4:], split[2])
    calls.clear()
    single = run(True, [prompt] + [[t] for t in draft])
    assert calls.count(1) == 6 * (4 * 2 + 1) and set(calls) == {20, 1}
    assert torch.equal(got[1][5:], single[6])


# --- RMSNorm (the model's other CPU kernel) ---------------------------------------------

def _rms_norm(x, w, eps):
    out = torch.empty_like(x)
    _C._rms_norm_unchecked(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), w.data_ptr(), eps,
                           out.data_ptr(), out.shape[1])
    return out


@pytest.mark.parametrize("rows,dim", [(1, 1), (3, 7), (6, 576), (20, 1536)])
def test_rms_norm_matches_torch(rows, dim):
    """Within a few float32 ulps of torch's rms_norm (the statistic is summed in double
    here); a 1e-6 relative change of the weight is outside that bound (the check's power)."""
    g = torch.Generator().manual_seed(rows * dim)
    x = torch.randn(rows, dim, generator=g) * torch.logspace(-4, 4, rows)[:, None]
    w = 1 + 0.2 * torch.randn(dim, generator=g)
    want = torch.nn.functional.rms_norm(x, (dim,), w, 1e-5)
    tol = 4 * torch.finfo(torch.float32).eps * want.abs() + 1e-30
    assert ((_rms_norm(x, w, 1e-5) - want).abs() <= tol).all()
    assert not ((_rms_norm(x, w * (1 + 1e-6), 1e-5) - want).abs() <= tol / 4).all()


def test_rms_norm_errors():
    x, w = torch.randn(2, 4), torch.randn(4)
    out = torch.empty(2, 4)
    with pytest.raises(ValueError, match=r"rms_norm: row strides must cover a row: ldx = 3"):
        _C._rms_norm_unchecked(x.data_ptr(), 2, 4, 3, w.data_ptr(), 1e-5, out.data_ptr(), 4)
    with pytest.raises(ValueError, match=r"rms_norm: rows must be >= 0 and dim >= 1, got rows = 2, dim = 0"):
        _C._rms_norm_unchecked(x.data_ptr(), 2, 0, 4, w.data_ptr(), 1e-5, out.data_ptr(), 4)
    with pytest.raises(ValueError, match=r"rms_norm: eps must be >= 0"):
        _C._rms_norm_unchecked(x.data_ptr(), 2, 4, 4, w.data_ptr(), -1.0, out.data_ptr(), 4)
    with pytest.raises(ValueError, match=r"rms_norm: null data pointer"):
        _C._rms_norm_unchecked(0, 2, 4, 4, w.data_ptr(), 1e-5, out.data_ptr(), 4)


def test_model_native_norm_matches_torch():
    from verispec.models.testing import PagedRunner
    model = _tiny_llama(seed=3)
    assert model.native_norm
    g = torch.Generator().manual_seed(7)
    chunks = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (12, 1, 5)]

    def run(native):
        model.native_norm = native
        runner = PagedRunner(model, num_blocks=16, block_size=8)
        seq = runner.add_sequence()
        return [runner.step({seq: c})[0] for c in chunks]

    for a, b in zip(run(True), run(False)):
        assert (a - b).abs().max().item() < 1e-4


@pytest.mark.parametrize("nbytes", [0, 7, 8, 64, 1000, 4096 + 24, 1 << 20])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_read_stream_reads_every_whole_word(nbytes, threads):
    """_C.read_stream (the benchmarks' bandwidth probe) reads each whole 64-bit word once,
    on any split: its XOR equals numpy's over the same words, whatever the thread count,
    and a change to one word, including the last one, changes it."""
    g = torch.Generator().manual_seed(nbytes)
    buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    words = buf[: nbytes // 8 * 8].numpy().view(np.uint64)
    want = int(np.bitwise_xor.reduce(words)) if words.size else 0
    assert _C.read_stream(buf, threads) == want
    if words.size:
        last = nbytes // 8 * 8 - 1
        buf[last] ^= 0x80
        assert _C.read_stream(buf, threads) == want ^ (0x80 << 56)


def test_read_stream_errors():
    with pytest.raises(ValueError, match="num_threads must be >= 1, got 0"):
        _C.read_stream(torch.zeros(8, dtype=torch.uint8), 0)
    with pytest.raises((TypeError, ValueError), match="buffer"):
        _C.read_stream(torch.zeros(8, dtype=torch.float32), 1)
    with pytest.raises((TypeError, ValueError), match="buffer"):
        _C.read_stream(torch.zeros(16, dtype=torch.uint8)[::2], 1)
