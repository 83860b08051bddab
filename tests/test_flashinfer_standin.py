"""The "flashinfer" backend's adapter (``layers.attention.FlashInferAttention``) on the CPU,
against a stand-in of FlashInfer's two paged wrappers.

FlashInfer itself needs a CUDA GPU, so here a fake ``flashinfer`` module is put in
``sys.modules``: ``BatchDecodeWithPagedKVCacheWrapper`` and
``BatchPrefillWithPagedKVCacheWrapper`` with FlashInfer's ``plan`` keywords (an argument
the real API does not take is a TypeError here too) and a ``run`` that computes the
attention in plain torch from nothing but the paged arguments it was planned with: each
request's pages ``kv_indices[kv_indptr[i]:kv_indptr[i + 1]]`` of the "NHD" pools, its
last page holding ``last_page_len[i]`` keys, queries ``qo_indptr``, a bottom-right causal
mask, ``window_left`` (keys at most that far left of the query), a flattened custom
mask, ``logits_soft_cap`` and ``sm_scale``. So the adapter's page table, masks and
argument plumbing are checked, not FlashInfer's kernels.

The adapter's output is compared with ``TorchAttention`` on the same ``PagedPlan`` and
with the float64 reference of tests/test_paged_plan.py (float32, 2e-5 absolute on
outputs of size ~1), over decode, verify, mixed, prefill and tree batches with windows
and softcaps; sinks and K/V of different head sizes go to the fallback. Power: a page
table one key short on a row (``last_page_len``) or with a row boundary moved
(``kv_indptr``) misses by far more than the tolerance. The models then run end to end
on the stand-in (what "auto" picks on CUDA where FlashInfer imports): LlamaModel and
HFModel (softcap, windows, sinks) logits against their "sdpa" runs.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
import types

import pytest
import torch

from test_paged_plan import BS, CHAINS, D, SCALING, TOL, TREES, make_batch, reference
from verispec.models.layers import attention
from verispec.models.layers.attention import (FlashInferAttention, TorchAttention,
                                              flashinfer_paged, resolve_backend,
                                              select_backend)
from verispec.models.layers.paged import PagedPlan
from verispec.models.testing import PagedRunner, random_llama


class _PagedWrapper:
    """What both fake wrappers share: the plan kept, ``run`` in plain torch."""

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD"):
        if kv_layout != "NHD":
            raise ValueError(f"kv_layout: the stand-in reads 'NHD', got {kv_layout!r}")
        self.workspace = float_workspace_buffer
        self.runs = 0

    def _keep(self, qo_indptr, kv_indptr, kv_indices, last_page_len, num_qo_heads,
              num_kv_heads, head_dim, page_size, custom_mask, causal, window_left,
              logits_soft_cap, sm_scale, q_data_type, kv_data_type):
        for name, t in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr),
                        ("kv_indices", kv_indices), ("last_page_len", last_page_len)):
            if t.dtype != torch.int32:
                raise TypeError(f"{name}: must be int32, got {t.dtype}")
        rows = kv_indptr.shape[0] - 1
        if qo_indptr.shape[0] != rows + 1 or last_page_len.shape[0] != rows:
            raise ValueError("qo_indptr, kv_indptr and last_page_len disagree on the rows")
        if int(kv_indptr[-1]) != kv_indices.shape[0]:
            raise ValueError(f"kv_indptr[-1] = {int(kv_indptr[-1])} != "
                             f"len(kv_indices) = {kv_indices.shape[0]}")
        if bool(((last_page_len < 1) | (last_page_len > page_size)).any()):
            raise ValueError(f"last_page_len must be in [1, {page_size}], got "
                             f"{last_page_len.tolist()}")
        self.plan_args = dict(
            qo=qo_indptr.tolist(), kv=kv_indptr.tolist(), pages=kv_indices.cpu(),
            last=last_page_len.tolist(), heads=num_qo_heads, kv_heads=num_kv_heads,
            head_dim=head_dim, page_size=page_size,
            mask=None if custom_mask is None else custom_mask.cpu(), causal=causal,
            window_left=window_left, softcap=logits_soft_cap,
            scale=1.0 / head_dim ** 0.5 if sm_scale is None else sm_scale,
            q_dtype=q_data_type, kv_dtype=kv_data_type)

    def run(self, q: torch.Tensor, paged_kv_cache) -> torch.Tensor:
        p = self.plan_args
        k_pool, v_pool = paged_kv_cache                      # [pages, page_size, KvH, D]
        if k_pool.dim() != 4 or tuple(k_pool.shape[1:]) != (p["page_size"], p["kv_heads"],
                                                           p["head_dim"]):
            raise ValueError(f"paged_kv_cache: expected NHD pages [*, {p['page_size']}, "
                             f"{p['kv_heads']}, {p['head_dim']}], got {list(k_pool.shape)}")
        if q.shape[0] != p["qo"][-1] or q.shape[1] != p["heads"] or q.dtype != p["q_dtype"]:
            raise ValueError(f"q: expected [{p['qo'][-1]}, {p['heads']}, *] "
                             f"{p['q_dtype']}, got {list(q.shape)} {q.dtype}")
        self.runs += 1
        grp = p["heads"] // p["kv_heads"]
        out = torch.empty(q.shape[0], q.shape[1], v_pool.shape[3], dtype=q.dtype)
        mask_at = 0
        for i in range(len(p["last"])):
            pages = p["pages"][p["kv"][i]:p["kv"][i + 1]].long()
            length = (pages.shape[0] - 1) * p["page_size"] + p["last"][i]
            k = k_pool[pages].reshape(-1, p["kv_heads"], p["head_dim"])[:length].float()
            v = v_pool[pages].reshape(-1, p["kv_heads"], v_pool.shape[3])[:length].float()
            lo, hi = p["qo"][i], p["qo"][i + 1]
            n = hi - lo
            scores = torch.einsum("nhd,lhd->hnl", q[lo:hi].float(),
                                  k.repeat_interleave(grp, dim=1)) * p["scale"]
            if p["softcap"] is not None and p["softcap"] > 0:
                scores = torch.tanh(scores / p["softcap"]) * p["softcap"]
            key = torch.arange(length)
            query = length - n + torch.arange(n)        # bottom-right aligned positions
            seen = torch.ones(n, length, dtype=torch.bool)
            if p["mask"] is not None:
                seen = p["mask"][mask_at:mask_at + n * length].view(n, length).clone()
                mask_at += n * length
            elif p["causal"]:
                seen &= key[None, :] <= query[:, None]
            if p["window_left"] >= 0:
                seen &= key[None, :] >= query[:, None] - p["window_left"]
            scores = scores.masked_fill(~seen[None], float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[lo:hi] = torch.einsum("hnl,lhd->nhd", probs,
                                      v.repeat_interleave(grp, dim=1)).to(q.dtype)
        if p["mask"] is not None and mask_at != p["mask"].shape[0]:
            raise ValueError(f"custom_mask: {p['mask'].shape[0]} entries, the rows read "
                             f"{mask_at}")
        return out


class BatchDecodeWithPagedKVCacheWrapper(_PagedWrapper):
    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
             page_size, pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None,
             q_data_type="float16", kv_data_type=None, data_type=None, sm_scale=None,
             rope_scale=None, rope_theta=None):
        rows = indptr.shape[0] - 1
        self._keep(torch.arange(rows + 1, dtype=torch.int32), indptr, indices, last_page_len,
                   num_qo_heads, num_kv_heads, head_dim, page_size, None, False, window_left,
                   logits_soft_cap, sm_scale, q_data_type, kv_data_type)


class BatchPrefillWithPagedKVCacheWrapper(_PagedWrapper):
    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
             num_qo_heads, num_kv_heads, head_dim_qk, page_size, head_dim_vo=None,
             custom_mask=None, packed_custom_mask=None, causal=False,
             pos_encoding_mode="NONE", use_fp16_qk_reduction=False, sm_scale=None,
             window_left=-1, logits_soft_cap=None, rope_scale=None, rope_theta=None,
             q_data_type="float16", kv_data_type=None):
        self._keep(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                   num_qo_heads, num_kv_heads, head_dim_qk, page_size, custom_mask, causal,
                   window_left, logits_soft_cap, sm_scale, q_data_type, kv_data_type)


@pytest.fixture
def standin(monkeypatch) -> list:
    """The fake ``flashinfer`` importable (and imported afresh by the backend); returns
    the wrappers made, in order."""
    made: list = []
    fake = types.ModuleType("flashinfer")
    for cls in (BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper):
        def make(*args, cls=cls, **kwargs):
            made.append(cls(*args, **kwargs))
            return made[-1]
        setattr(fake, cls.__name__, make)
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setattr(flashinfer_paged, "_FLASHINFER", [])
    monkeypatch.setattr(flashinfer_paged, "_WORKSPACES", {})
    return made


def _attend(backend, batch, q, **kw):
    plan = PagedPlan(batch, torch.device("cpu"), who="test")
    backend.plan(plan)
    return backend.attend(plan, q, batch.kv.k[0], batch.kv.v[0], scaling=SCALING, **kw)


CASES = [*CHAINS, *TREES]
FEATURES = {"plain": {}, "window": dict(window=3), "softcap": dict(softcap=1.5),
            "window_softcap": dict(window=4, softcap=2.0)}


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("case", CASES)
def test_adapter_equals_torch_attention_on_the_same_plan(standin, case, feature):
    rows = {**CHAINS, **TREES}[case]
    batch, q = make_batch(rows, seed=len(case) * 7 + len(feature))
    kw = FEATURES[feature]
    got = _attend(FlashInferAttention(), batch, q, **kw)
    want = _attend(TorchAttention(), batch, q, **kw)
    assert got.shape == want.shape == q.shape
    err = (got - want).abs().max().item()
    assert err <= TOL, f"{case}/{feature}: FlashInfer adapter vs TorchAttention {err:.3g}"
    truth = reference(batch, q, scaling=SCALING, **kw)
    assert (got.double() - truth).abs().max().item() <= TOL
    # which wrapper ran: decode for one query per chain row, else prefill (planned once
    # for the layer's arguments)
    decode = case == "decode"
    assert [type(w).__name__ for w in standin] == [
        "BatchDecodeWithPagedKVCacheWrapper" if decode else "BatchPrefillWithPagedKVCacheWrapper"]
    assert standin[0].runs == 1


def test_one_page_table_and_one_wrapper_per_layer_arguments(standin):
    """plan() once a forward; every layer with the same (scaling, window, softcap) runs
    the same planned wrapper; a new forward re-plans."""
    batch, q = make_batch(CHAINS["mixed"], seed=3)
    backend = FlashInferAttention()
    plan = PagedPlan(batch, torch.device("cpu"), who="test")
    backend.plan(plan)
    for _ in range(3):
        backend.attend(plan, q, batch.kv.k[0], batch.kv.v[0], scaling=SCALING)
    backend.attend(plan, q, batch.kv.k[0], batch.kv.v[0], scaling=SCALING, window=2)
    assert [w.runs for w in standin] == [3, 1]
    plan2 = PagedPlan(batch, torch.device("cpu"), who="test")
    backend.plan(plan2)
    backend.attend(plan2, q, batch.kv.k[0], batch.kv.v[0], scaling=SCALING)
    assert [w.runs for w in standin] == [3, 1, 1]


def test_sinks_and_mixed_head_sizes_take_the_fallback(standin):
    batch, q = make_batch(CHAINS["verify"], seed=5)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    got = _attend(FlashInferAttention(), batch, q, sinks=sinks)
    assert standin == []  # FlashInfer never planned: the layer went to TorchAttention
    assert torch.equal(got, _attend(TorchAttention(), batch, q, sinks=sinks))
    # values of another head size (MLA): the fallback too
    v_small = batch.kv.v[0][..., :D // 2].contiguous()
    plan = PagedPlan(batch, torch.device("cpu"), who="test")
    out = FlashInferAttention().attend(plan, q, batch.kv.k[0], v_small, scaling=SCALING)
    assert out.shape == (q.shape[0], q.shape[1], D // 2) and standin == []


@pytest.mark.parametrize("wrong", ["last_page_len", "kv_indptr"])
def test_power_a_wrong_page_table_fails(standin, monkeypatch, wrong):
    """The comparison above catches a page table one key short on a row, or a row
    boundary moved by one page."""
    real = FlashInferAttention._page_table

    def broken(self, plan):
        table = real(self, plan)
        if wrong == "last_page_len":
            last = table["last_page_len"].clone()
            row = int(torch.nonzero(last >= 2)[0])
            last[row] -= 1
            table["last_page_len"] = last
        else:
            indptr = table["kv_indptr"].clone()
            indptr[1] += 1
            table["kv_indptr"] = indptr
        return table

    monkeypatch.setattr(FlashInferAttention, "_page_table", broken)
    batch, q = make_batch(CHAINS["verify"], seed=11)
    got = _attend(FlashInferAttention(), batch, q)
    want = _attend(TorchAttention(), batch, q)
    # (a row left with fewer keys than queries has a query that sees none: NaN, a miss)
    miss = torch.nan_to_num((got - want).abs(), nan=float("inf")).max().item()
    assert miss > 10 * TOL


def test_auto_on_cuda_is_flashinfer_where_it_imports(standin, monkeypatch):
    cuda = torch.device("cuda", 0)
    assert select_backend("auto", cuda, torch.bfloat16) == "flashinfer"
    assert resolve_backend("auto", cuda, torch.bfloat16, native=False) == "flashinfer"
    assert select_backend("flashinfer", cuda, torch.float16) == "flashinfer"
    assert type(attention.make_backend("flashinfer", sdpa_groups=True).fallback) is TorchAttention
    # without the package: "auto" is SDPA, "flashinfer" refused naming the extra
    monkeypatch.setattr(flashinfer_paged, "_FLASHINFER", [None])
    assert select_backend("auto", cuda, torch.bfloat16) == "sdpa"
    with pytest.raises(ValueError, match=r"backend 'flashinfer' needs the flashinfer package"):
        FlashInferAttention()


@pytest.fixture
def on_cpu(standin, monkeypatch) -> list:
    """The stand-in, and the "flashinfer" backend allowed on the CPU (it refuses any
    device but CUDA), so the models run their forwards through the adapter."""
    monkeypatch.setattr(FlashInferAttention, "refuse",
                        classmethod(lambda cls, device, dtype: None))
    return standin


def _script(model, vocab: int, tree: bool = True) -> list[torch.Tensor]:
    """Ragged prefill, decodes, a verify pass with rollback, a tree next to a chain."""
    runner = PagedRunner(model, num_blocks=64, block_size=BS)
    a, b = runner.add_sequence(), runner.add_sequence()
    g = torch.Generator().manual_seed(4)

    def toks(n):
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    out = runner.step({a: toks(11), b: toks(6)})
    out += runner.step({a: toks(1), b: toks(1)})
    out += runner.step({a: toks(1), b: toks(1)})
    out += runner.step({a: toks(4), b: toks(1)})
    runner.rollback(a, 13)
    if tree:
        batch = runner.make_batch({a: toks(4), b: toks(2)})
        mask = torch.zeros(6, 6, dtype=torch.bool)
        for i, path in enumerate([[0], [0, 1], [0, 2], [0, 1, 3]]):
            mask[i, path] = True
        mask[4:, 4:] = torch.ones(2, 2).tril().bool()
        positions = batch.positions.clone()
        positions[:4] = 13 + torch.tensor([0, 1, 1, 2])
        out.append(model.forward(dataclasses.replace(batch, tree_mask=mask,
                                                     positions=positions)))
    return out


def _close(got: list, want: list, atol: float) -> None:
    assert len(got) == len(want)
    for x, y in zip(got, want):
        assert (x.float() - y.float()).abs().max().item() <= atol
        assert torch.equal(x.argmax(-1), y.argmax(-1))


def test_llama_model_runs_on_the_adapter_and_graphs_capture_only_what_can_be(on_cpu):
    """LlamaModel with "flashinfer" passes its pools as they are and no layer branches on
    the name; logits as with "sdpa" (another summation order). With graphs on
    (RecordedGraph, as on CUDA), forwards that fit a bucket are captured through SDPA's
    static path (FlashInfer is not capturable yet), the others run FlashInfer; "sdpa"
    forwards are captured through the backend's attend_static."""
    from verispec.models.layers.graphs import GraphCache, RecordedGraph

    model = random_llama(vocab=97, hidden=64, intermediate=128, layers=2, heads=4,
                         kv_heads=2, head_dim=16, max_context=128, seed=2)
    model.attention_backend = "sdpa"
    want = _script(model, 97)
    model.attention_backend = "flashinfer"
    got = _script(model, 97)
    assert sum(w.runs for w in on_cpu) == 2 * 5   # two layers, five forwards
    _close(got, want, 1e-4)
    # power: the same script with other tokens is far away
    other = _script(random_llama(vocab=97, hidden=64, intermediate=128, layers=2, heads=4,
                                 kv_heads=2, head_dim=16, max_context=128, seed=3), 97)
    assert max((x - y).abs().max().item() for x, y in zip(other, want)) > 1e-1

    model.graphs = GraphCache("cpu", graph=RecordedGraph)
    runs = sum(w.runs for w in on_cpu)
    _script(model, 97, tree=False)
    assert model.graphs.stats()["captures"] >= 1
    assert runs < sum(w.runs for w in on_cpu) < runs + 2 * 4  # replays skip FlashInfer
    model.attention_backend = "sdpa"
    _script(model, 97, tree=False)
    assert model.graphs.stats()["captures"] >= 1


@pytest.mark.parametrize("name", ["gemma2", "gpt_oss"])
def test_hf_model_runs_on_the_adapter(on_cpu, name):
    """HFModel with "flashinfer": gemma2's softcap and sliding window through the
    wrappers, gpt_oss's sinks through the fallback (its windowed layers too: sinks on
    every layer); logits as with "sdpa"."""
    import test_hf_adapter as hf_tests

    from verispec.models import HFModel

    ref = hf_tests._reference(name)
    model = HFModel(copy.deepcopy(ref), capture=False)
    model.attention_backend = "sdpa"
    want = _script(model, hf_tests.VOCAB)
    model.attention_backend = "flashinfer"
    got = _script(model, hf_tests.VOCAB)
    _close(got, want, 1e-4)
    runs = sum(w.runs for w in on_cpu)
    if name == "gpt_oss":
        assert runs == 0
    else:
        assert runs == model.num_layers * 5
        assert {w.plan_args["softcap"] for w in on_cpu} == {2.0}
        assert {w.plan_args["window_left"] for w in on_cpu} >= {hf_tests.WINDOW - 1}
