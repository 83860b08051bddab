"""Captured forwards at bucket shapes (``models.layers.graphs``), checked on the CPU.

On a CPU the graph is ``standins.ReplayGraph``: capture records the aten ops the body
runs and replay runs those ops again on the captured tensors, without the body's
Python, as a CUDA graph replays its kernels on fixed addresses. So a forward that puts
its inputs anywhere but the buffers the capture read, a graph replayed for other pools,
or a body whose result depends on the host's Python state computes from what the
capture saw, and the tests below see other logits or tokens. Everything around a CUDA
graph is exercised here: the bucket rule, the static inputs a forward fills, the
padding (rows, queries, writes), the bucketed attention, the bit check before a capture
is trusted and its fallback, the graph key (two decoders on one model), the LRU,
LlamaModel's switch, and that the decoder still makes one blocking transfer a step and
the same greedy tokens. The models run the torch ops a GPU runs (verispec's CPU kernels
write through raw pointers, which no graph captures). The CUDA tests at the end run the
real graphs on a GPU (skipped without one).

Tolerances: attention in float32 against the float64 reference of test_paged_plan
(2e-5 absolute, outputs of size ~1); a model's logits captured against eager 1e-4
(float32, different reduction lengths: the bucket's padded keys are masked, not
dropped). Each comparison has a power check next to it or a control test that breaks
what it checks on purpose.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_paged_plan import BS, CHAINS, D, H, KVH, SCALING, TOL, TREES, make_batch, reference  # noqa: E402
from verispec.decoder import SpecDecoder  # noqa: E402
from verispec.drafters import EarlyExit, NGram  # noqa: E402
from verispec.models.base import KVPools, PagedBatch  # noqa: E402
from verispec.models.layers import graphs  # noqa: E402
from verispec.models.layers.graphs import Bucket, GraphCache, GraphInputs, bucket_for  # noqa: E402
from verispec.models.loaders import load_model  # noqa: E402
from verispec.models.testing import randomize_weights  # noqa: E402
from test_staging import cuda_sync_sites, step_audit  # noqa: E402
from standins import CAPTURE_ERROR, ReplayGraph  # noqa: E402

VOCAB = 97


# --- the bucket rule --------------------------------------------------------------------


def test_bucket_rounds_rows_queries_and_blocks_up_to_powers_of_two():
    assert bucket_for([1], [1], 4, 64) == Bucket(1, 1, 1)
    assert bucket_for([1, 1, 1], [9, 17, 5], 4, 64) == Bucket(4, 1, 8)
    assert bucket_for([4, 2, 1, 3, 1], [40, 3, 8, 12, 5], 4, 64) == Bucket(8, 4, 16)
    assert bucket_for([16], [100], 16, 8) == Bucket(1, 16, 8)
    assert bucket_for([3], [90], 16, 6) == Bucket(1, 4, 6)  # capped at the table's width
    assert Bucket(8, 4, 16).tokens == 32


@pytest.mark.parametrize("q_lens,ctx,max_blocks", [
    ([graphs.MAX_QUERIES + 1], [40], 64),            # a long row (a prefill chunk)
    ([1] * (graphs.MAX_ROWS + 1), [4] * (graphs.MAX_ROWS + 1), 64),
    ([16] * 40, [20] * 40, 64),                      # 64 x 16 tokens > MAX_TOKENS
    ([1], [4 * 65], 64),                             # past the tables
    ([], [], 64), ([0, 0], [3, 4], 64)])
def test_batches_that_fit_no_bucket_run_eagerly(q_lens, ctx, max_blocks):
    assert bucket_for(q_lens, ctx, 4, max_blocks) is None


# --- the bucketed attention and the padded write, against the plain reference ------------


def _filled(batch, bucket=None):
    starts = batch.query_start.tolist()
    q_lens = [b - a for a, b in zip(starts, starts[1:])]
    bucket = bucket or bucket_for(q_lens, batch.context_lens.tolist(), BS, 64)
    num_slots = batch.kv.k[0].shape[0] * BS
    inputs = GraphInputs(bucket, BS, num_slots, torch.device("cpu"))
    picks = inputs.fill(batch)
    inputs.prepare()
    return inputs, picks


def _padded(inputs, values, picks_all):
    out = values.new_zeros(inputs.bucket.tokens, *values.shape[1:])
    out[picks_all] = values
    return out


# test_paged_plan's batches whose rows fit a bucket (a longer row runs eagerly)
FITTING = [name for name, rows in {**CHAINS, **TREES}.items()
           if max(r.get("n", len(r.get("parents", []))) for r in rows) <= graphs.MAX_QUERIES]


def test_the_cases_cover_decode_verify_mixed_and_trees():
    assert {"decode", "verify", "mixed", "one_tree", "trees_and_chain"} <= set(FITTING)


@pytest.mark.parametrize("case", FITTING)
@pytest.mark.parametrize("shuffle", [True, False], ids=["gathered", "sliced"])
def test_bucketed_attention_matches_plain_attention(case, shuffle):
    rows = {**CHAINS, **TREES}[case]
    batch, q = make_batch(rows, seed=len(case), shuffle=shuffle)
    inputs, picks = _filled(batch)
    k_flat, v_flat = batch.kv.k[0].view(-1, KVH, D), batch.kv.v[0].view(-1, KVH, D)
    out = inputs.attend(_padded(inputs, q, picks), k_flat, v_flat, SCALING)
    got = out[picks]
    assert torch.isfinite(out).all()  # padded queries and rows see a key too
    want = reference(batch, q, scaling=SCALING)
    wrong = (reference(batch, q, scaling=SCALING, tree_as_chain=True)
             if batch.tree_mask is not None else reference(batch, q, scaling=SCALING, see_self=False))
    assert (got.double() - want).abs().max().item() <= TOL
    assert (got.double() - wrong).abs().max().item() > 10 * TOL


def test_a_larger_bucket_gives_the_same_attention():
    """More padded rows, queries and key blocks change nothing for the real tokens."""
    batch, q = make_batch(TREES["trees_and_chain"], seed=9)
    small, picks = _filled(batch)
    big, big_picks = _filled(batch, Bucket(8, 16, 8))
    k_flat, v_flat = batch.kv.k[0].view(-1, KVH, D), batch.kv.v[0].view(-1, KVH, D)
    a = small.attend(_padded(small, q, picks), k_flat, v_flat, SCALING)[picks]
    b = big.attend(_padded(big, q, big_picks), k_flat, v_flat, SCALING)[big_picks]
    assert torch.allclose(a, b, atol=TOL, rtol=0)
    # power: the same queries without the trees' masks are far off
    chain = reference(batch, q, scaling=SCALING, tree_as_chain=True)
    assert (b.double() - chain).abs().max().item() > 10 * TOL


@pytest.mark.parametrize("case", ["decode", "mixed", "trees_and_chain"])
def test_the_padded_write_writes_the_real_slots_only(case):
    batch, _ = make_batch({**CHAINS, **TREES}[case], seed=4)
    batch.slot_mapping[0] = -1  # a padding token of the batch itself
    inputs, picks = _filled(batch)
    flat = batch.kv.k[0].view(-1, KVH, D)
    before = flat.clone()
    values = torch.randn(inputs.bucket.tokens, KVH, D, generator=torch.Generator().manual_seed(1))
    inputs.write(flat, values)
    slots = batch.slot_mapping.long()
    real = slots >= 0
    assert torch.equal(flat[slots[real]], values[picks[real]])
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[slots[real]] = False
    assert torch.equal(flat[untouched], before[untouched])  # bit for bit, the padding's slot too
    # power: a write that ignores the padding changes a slot no real token owns
    naive = before.clone()
    naive.index_copy_(0, inputs.slots, values)
    assert not torch.equal(naive[untouched], before[untouched])


def test_no_free_slot_for_the_padding_means_eager():
    """A batch that writes every slot of tiny pools leaves the padding nowhere to write."""
    kv = KVPools(k=[torch.zeros(1, 2, KVH, D)], v=[torch.zeros(1, 2, KVH, D)], block_size=2)
    batch = PagedBatch(
        input_ids=torch.zeros(2, dtype=torch.long), positions=torch.tensor([0, 1]),
        slot_mapping=torch.tensor([0, 1], dtype=torch.int32),
        block_tables=torch.tensor([[0]], dtype=torch.int32),
        context_lens=torch.tensor([2], dtype=torch.int32), query_start=torch.tensor([0, 2]),
        logits_indices=torch.arange(2), kv=kv)
    inputs = GraphInputs(Bucket(2, 2, 1), 2, 2, torch.device("cpu"))
    assert inputs.fill(batch) is None
    inputs = GraphInputs(Bucket(1, 2, 1), 2, 2, torch.device("cpu"))
    assert inputs.fill(batch) is not None  # no padding token: nothing to place


# --- LlamaModel with captured forwards ---------------------------------------------------


def _tiny_llama(folder, layers=2):
    cfg = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
        tie_word_embeddings=False)
    hf = randomize_weights(transformers.LlamaForCausalLM(cfg), 3, norm_spread=0.1)
    hf.save_pretrained(folder, safe_serialization=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("graphs_llama")
    _tiny_llama(path)
    return path


def _model(folder, graphs_on=True, graph=ReplayGraph):
    model = load_model(folder)
    # the torch ops, as on a GPU (verispec's CPU kernels write through raw pointers: a
    # graph does not capture them)
    model.native_layer_ops = model.native_linear = model.native_norm = False
    if graphs_on:
        model.graphs = GraphCache(model.geometry.device, graph=graph)
    return model


def _prompts(batch):
    g = torch.Generator().manual_seed(batch)
    base = torch.randint(1, VOCAB, (6,), generator=g).tolist()
    return [(base * 3)[b % 5:b % 5 + 10 + b % 3] for b in range(batch)]


def _decoder(model, source, **kw):
    if source == "plain":
        return SpecDecoder(model, None, num_blocks=300, block_size=4, **kw)
    if source == "ngram_tree":
        return SpecDecoder(model, NGram(1, 3, branches=2), k=3, num_blocks=300, block_size=4, **kw)
    draft = NGram(1, 3) if source == "ngram" else EarlyExit(model, num_layers=1)
    return SpecDecoder(model, draft, k=3, num_blocks=300, block_size=4,
                       draft_branches=2 if source == "draft_tree" else 1, **kw)


def _generate(model, source, batch, new=16):
    dec = _decoder(model, source)
    return [r.tokens for r in dec.generate(_prompts(batch), max_new_tokens=new, greedy=True)]


@pytest.mark.parametrize("source", ["plain", "ngram", "draft", "ngram_tree", "draft_tree"])
@pytest.mark.parametrize("batch", [1, 5])
def test_greedy_tokens_with_graphs_equal_eager(folder, source, batch):
    want = _generate(_model(folder, graphs_on=False), source, batch)
    model = _model(folder)
    got = _generate(model, source, batch)
    assert got == want
    stats = model.graphs.stats()
    assert stats["captures"] >= 1 and stats["replays"] >= stats["captures"], stats
    assert stats["refused"] == 0, stats


def _decode_batch(model, kv, prompts):
    """Prefills ``prompts`` (eagerly, blocks 0.. in order) and returns the next forward's
    batch: one new token a row, plus a 3-token verify chain in the last row."""
    ctx, tables, tok = [], [], []
    nb = 8
    for r, p in enumerate(prompts):
        tables.append(list(range(r * nb, (r + 1) * nb)))
        n = len(p)
        slots = [tables[r][i // 4] * 4 + i % 4 for i in range(n)]
        pre = PagedBatch(
            input_ids=torch.tensor(p), positions=torch.arange(n),
            slot_mapping=torch.tensor(slots, dtype=torch.int32),
            block_tables=torch.tensor([tables[r]], dtype=torch.int32),
            context_lens=torch.tensor([n], dtype=torch.int32), query_start=torch.tensor([0, n]),
            logits_indices=torch.tensor([n - 1]), kv=kv)
        tok.append(int(model(pre).argmax()))
        ctx.append(n)
    ids, pos, slots, starts = [], [], [], [0]
    for r, c in enumerate(ctx):
        n = 3 if r == len(ctx) - 1 else 1
        for i in range(n):
            ids.append((tok[r] + i) % VOCAB)
            pos.append(c + i)
            slots.append(tables[r][(c + i) // 4] * 4 + (c + i) % 4)
        starts.append(starts[-1] + n)
        ctx[r] = c + n
    return PagedBatch(
        input_ids=torch.tensor(ids), positions=torch.tensor(pos),
        slot_mapping=torch.tensor(slots, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        context_lens=torch.tensor(ctx, dtype=torch.int32), query_start=torch.tensor(starts),
        logits_indices=torch.arange(len(ids)), kv=kv)


def _clone_kv(kv):
    return KVPools(k=[p.clone() for p in kv.k], v=[p.clone() for p in kv.v],
                   block_size=kv.block_size)


def test_captured_logits_and_cache_match_eager(folder):
    """The same decode + verify forward three times from the same cache: seen (eager),
    captured (checked), replayed. Each time the logits agree with the eager path's, the
    written slots too, and every other slot keeps its bits."""
    model = _model(folder)
    kv = KVPools.allocate(model.geometry, 40, 4)
    model.graphs.enabled = False
    batch = _decode_batch(model, kv, _prompts(3))
    start = _clone_kv(kv)
    eager_kv = _clone_kv(start)
    want = model(dataclasses.replace(batch, kv=eager_kv))
    model.graphs.enabled = True
    written = batch.slot_mapping.long()
    other = torch.ones(40 * 4, dtype=torch.bool)
    other[written] = False
    for i in range(3):
        # the same pools every time (a graph is keyed by its pools), back at the start
        for p, s in zip((*kv.k, *kv.v), (*start.k, *start.v)):
            p.copy_(s)
        got = model(batch)
        assert got.shape == want.shape
        assert (got - want).abs().max().item() <= 1e-4, i
        for p, e, s in zip((*kv.k, *kv.v), (*eager_kv.k, *eager_kv.v), (*start.k, *start.v)):
            flat, eflat, sflat = (t.view(-1, *t.shape[2:]) for t in (p, e, s))
            assert (flat[written] - eflat[written]).abs().max().item() <= 1e-4
            assert torch.equal(flat[other], sflat[other])
    assert model.graphs.stats()["captures"] == 1 and model.graphs.stats()["replays"] == 1
    # power: the logits depend on the verify chain's own earlier tokens (the mask matters)
    batch.input_ids[-3] = (batch.input_ids[-3] + 1) % VOCAB
    for p, s in zip((*kv.k, *kv.v), (*start.k, *start.v)):
        p.copy_(s)
    assert (model(batch)[-1] - want[-1]).abs().max().item() > 1e-3


class _FaultyGraph(ReplayGraph):
    """A graph whose replays are off by one ulp somewhere: the check must catch it."""

    def replay(self) -> None:
        super().replay()
        self.out.view(-1)[7] = torch.nextafter(self.out.view(-1)[7], torch.tensor(1e9))


def test_a_capture_that_differs_from_eager_is_refused(folder):
    faulty = _model(folder, graph=_FaultyGraph)
    plain = _model(folder, graphs_on=False)
    assert _generate(faulty, "ngram", 1) == _generate(plain, "ngram", 1)
    stats = faulty.graphs.stats()
    assert stats["refused"] >= 1 and stats["captures"] == 0 and stats["replays"] == 0, stats
    assert stats["eager"] > stats["refused"]  # refused buckets stay eager afterwards


class _UncapturableGraph(ReplayGraph):
    """A body the graph cannot take (on CUDA: an op that synchronises, say)."""

    def capture(self, body):
        body()
        raise RuntimeError("operation not permitted when stream is capturing")


def test_a_capture_that_raises_leaves_the_bucket_eager(folder):
    broken = _model(folder, graph=_UncapturableGraph)
    plain = _model(folder, graphs_on=False)
    assert _generate(broken, "draft", 3) == _generate(plain, "draft", 3)
    stats = broken.graphs.stats()
    assert stats["refused"] >= 1 and stats["replays"] == 0, stats
    assert "not permitted" in broken.graphs.last_error


def test_a_body_that_waits_for_the_device_is_not_captured(folder, monkeypatch):
    """An op that makes the host wait (here .item()) cannot be captured: ReplayGraph
    raises as CUDA does, and the bucket stays eager."""
    from verispec.models.llama import LlamaModel

    body = LlamaModel._bucket_forward

    def waiting(self, inputs, kv):
        out = body(self, inputs, kv)
        return out * (1.0 + 0.0 * out.abs().max().item())
    monkeypatch.setattr(LlamaModel, "_bucket_forward", waiting)
    model = _model(folder)
    plain = _model(folder, graphs_on=False)
    assert _generate(model, "ngram", 2) == _generate(plain, "ngram", 2)
    stats = model.graphs.stats()
    assert stats["refused"] >= 1 and stats["captures"] == 0 and stats["replays"] == 0, stats
    assert CAPTURE_ERROR in model.graphs.last_error


def test_the_bit_check_refuses_a_body_that_reads_host_state(folder, monkeypatch):
    """A body whose result depends on a Python value of the forward (a host counter
    here; in a real bug, a length or an index the body reads from the host) replays
    what the capture saw: the replay and the eager run differ, the check refuses."""
    from verispec.models.llama import LlamaModel

    body = LlamaModel._bucket_forward
    calls = []

    def host_dependent(self, inputs, kv):
        out = body(self, inputs, kv)
        calls.append(1)
        out[:, len(calls) % VOCAB] += 100.0  # the token this forward favours
        return out
    monkeypatch.setattr(LlamaModel, "_bucket_forward", host_dependent)
    model = _model(folder)
    _generate(model, "ngram", 2)
    stats = model.graphs.stats()
    assert calls and stats["refused"] >= 1 and stats["captures"] == 0, stats
    assert stats["replays"] == 0, stats


def test_a_replay_reads_only_the_buffers_the_capture_read(folder, monkeypatch):
    """Control: a fill that puts the token ids into a new tensor each forward (the
    static buffer rebound, not written) leaves the graph reading the ids of the forward
    it captured; the stand-in replays exactly that, and the tokens go wrong."""
    want = _generate(_model(folder, graphs_on=False), "ngram", 5)
    assert _generate(_model(folder), "ngram", 5) == want
    fill = GraphInputs.fill

    def rebinding(self, batch):
        self.ids = torch.zeros_like(self.ids)  # a new buffer: the graph never reads it
        return fill(self, batch)
    monkeypatch.setattr(GraphInputs, "fill", rebinding)
    model = _model(folder)
    assert _generate(model, "ngram", 5) != want
    assert model.graphs.stats()["replays"] >= 1


def test_two_decoders_on_one_model_replay_their_own_graphs(folder):
    """A graph is keyed by its KV pools: two decoders of one model (two pools), stepped
    in turn, each replay the graphs captured on their own pools, same buckets."""
    model = _model(folder)
    plain = _model(folder, graphs_on=False)
    prompts = {"a": _prompts(4), "b": [p[::-1] for p in _prompts(4)]}
    want = {name: [r.tokens for r in _decoder(plain, "ngram").generate(
        ps, max_new_tokens=16, greedy=True)] for name, ps in prompts.items()}
    decs = {name: _decoder(model, "ngram") for name in prompts}
    seqs = {name: [decs[name].add(p, max_new_tokens=16, greedy=True) for p in ps]
            for name, ps in prompts.items()}
    while any(d.has_running() for d in decs.values()):
        for d in decs.values():
            if d.has_running():
                d.step()
    got = {name: [decs[name].result(s).tokens for s in seqs[name]] for name in prompts}
    assert got == want
    stats = model.graphs.stats()
    assert stats["replays"] >= 4 and stats["refused"] == 0, stats
    # the same buckets on both pools: each pool has its own graph of them
    keys = list(model.graphs._entries)
    buckets = {k[0] for k in keys}
    assert len(keys) > len(buckets), keys


def test_the_cache_keeps_the_most_recent_graphs(folder, monkeypatch):
    monkeypatch.setattr(graphs, "MAX_GRAPHS", 2)
    model = _model(folder)
    _generate(model, "ngram", 5, new=24)
    stats = model.graphs.stats()
    assert stats["graphs"] <= 2 and stats["evicted"] >= 1, stats


@pytest.mark.parametrize("source", ["ngram", "draft", "draft_tree"])
@pytest.mark.parametrize("batch", [1, 8])
def test_a_step_with_graphs_makes_one_blocking_transfer(folder, source, batch):
    model = _model(folder)
    dec = _decoder(model, source)
    for p in _prompts(batch):
        dec.add(p, max_new_tokens=40, greedy=True)
    dec.step()
    audit = step_audit(dec)
    caches = [model.graphs] + ([dec.draft.model.graphs] if source != "ngram" else [])

    def checked():  # a capture compares its replay with eager bit for bit: one more wait
        return sum(c.stats()["captures"] + c.stats()["refused"] for c in caches)

    steps = checks = 0
    while dec.has_running() and steps < 16:
        before = checked()
        with audit:
            dec.step()
        checks += checked() - before
        steps += 1
    assert checks >= 1 and steps > checks
    assert audit.reads == steps + checks, audit.sites
    assert sum(n for site, n in audit.sites.items() if "graphs.py" in site) == checks, audit.sites
    assert audit.unstaged_uploads == 0, audit.sites
    assert model.graphs.stats()["replays"] >= 1


def test_the_switch_and_where_graphs_do_not_run(folder):
    model = load_model(folder)
    assert model.graphs is None and model.cuda_graphs is False  # CPU: off
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device, got cpu"):
        model.cuda_graphs = True
    model.cuda_graphs = False  # always allowed
    # verispec's CPU kernels (native_layer_ops) never run captured
    model.graphs = GraphCache(model.geometry.device)
    _generate(model, "ngram", 2)
    assert model.graphs.stats()["captures"] == 0 and model.graphs.stats()["eager"] == 0
    # a draft cut from a model gets a cache of its own
    model = _model(folder)
    draft = model.early_exit(1)
    assert draft.graphs is not None and draft.graphs is not model.graphs
    # the batch-invariant mode runs eagerly
    bi = load_model(folder)
    bi.batch_invariant = True
    bi.native_layer_ops = False
    bi.graphs = GraphCache(bi.geometry.device)
    _generate(bi, "ngram", 2)
    assert bi.graphs.stats()["captures"] == 0


# --- on a GPU --------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("source", ["plain", "ngram", "draft", "draft_tree"])
def test_cuda_graphs_on_by_default_and_checked(folder, source):
    model = load_model(folder, device="cuda", dtype=torch.bfloat16)
    assert model.cuda_graphs
    dec = _decoder(model, source)
    first = [r.tokens for r in dec.generate(_prompts(8), max_new_tokens=16, greedy=True)]
    stats = model.graphs.stats()
    assert stats["captures"] >= 1 and stats["refused"] == 0, stats
    # the same work again on the same pools: every bucket is captured, each replayed
    # step syncs exactly once (its download)
    seqs = [dec.add(p, max_new_tokens=16, greedy=True) for p in _prompts(8)]
    syncs = []
    while dec.has_running():
        captures = model.graphs.stats()["captures"]
        sites = cuda_sync_sites(dec.step)
        if model.graphs.stats()["captures"] == captures:
            syncs.append(len(sites))
    replayed = [dec.result(s).tokens for s in seqs]
    assert syncs and all(n == 1 for n in syncs), syncs
    assert model.graphs.stats()["replays"] > stats["replays"]
    model.cuda_graphs = False  # the switch: nothing captured or replayed after it
    eager = [r.tokens for r in _decoder(model, source).generate(_prompts(8), max_new_tokens=16,
                                                                 greedy=True)]
    assert model.graphs.stats()["graphs"] == 0
    # what the graphs computed is what the eager path computes (bit-checked graphs)
    assert replayed == eager and first == eager


def test_the_cli_flag_turns_a_models_graphs_off(monkeypatch):
    from verispec import models
    from verispec.cli import common
    from verispec.cli.parser import build_parser

    class Model:  # what the loader hands back on a GPU: graphs on
        cuda_graphs = True

    monkeypatch.setattr(models, "load", lambda name, **kw: (Model(), "tok"))
    parser = build_parser()
    for command in ("generate --prompt hi", "serve"):
        args = parser.parse_args([*command.split(), "--no-cuda-graphs"])
        assert args.cuda_graphs is False
        assert parser.parse_args(command.split()).cuda_graphs is True
    model, _ = common._load("m", "--model", cuda_graphs=False)
    assert model.cuda_graphs is False
    model, _ = common._load("m", "--model")
    assert model.cuda_graphs is True
