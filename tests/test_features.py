"""The target's hidden states for drafters (verispec.drafters.Feature, KVPools.features).

A drafter names the streams it reads; the target writes them for every token it
processes at the token's cache slot. Checked here against transformers'
``output_hidden_states`` (and the final norm's input, which transformers does not list)
on every LlamaModel path, after prefill, decode, a ragged verify, a rollback and the
slots rewritten; through SpecDecoder after rejections, trees and preemption; and that
asking for features leaves the logits' bits alone.
"""

import pytest
import torch
import transformers

from verispec import _C
from verispec.decoder import SpecDecoder
from verispec.drafters import DraftModel, DraftSpec, Feature, FeatureView, NGram
from verispec.models import LlamaModel, load_model
from verispec.models.base import KVPools
from verispec.models.layers.graphs import GraphCache, RecordedGraph
from verispec.models.testing import PagedRunner, randomize_weights

# the bundled SmolLM2 (quantized GGUF) and transformers on its dequantized weights
from test_models import smollm2, smollm2_reader, smollm2_transformers  # noqa: E402,F401

VOCAB = 97
LAYERS = 3
ALL = list(range(LAYERS + 2))  # entering layers 0..2, final (pre-norm), final normed


def _hf(layers=LAYERS, seed=0):
    cfg = transformers.LlamaConfig(
        hidden_size=48, intermediate_size=80, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
        tie_word_embeddings=False, rms_norm_eps=1e-5)
    return randomize_weights(transformers.LlamaForCausalLM(cfg), seed, norm_spread=0.2).eval()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("features_llama")
    hf = _hf()
    hf.save_pretrained(folder, safe_serialization=True)
    return folder, hf


def reference_states(hf, ids):
    """transformers' streams of ``ids`` as one sequence: {key: [n, hidden] float32}; key r
    < N from output_hidden_states (the input of layer r), N the final norm's input (a
    hook: transformers does not list it), N + 1 the normed state (its last entry)."""
    n_layers = hf.config.num_hidden_layers
    seen = {}
    handle = hf.model.norm.register_forward_hook(lambda m, i, o: seen.update(pre=i[0]))
    try:
        with torch.no_grad():
            out = hf(torch.tensor([ids]), output_hidden_states=True)
    finally:
        handle.remove()
    hs = out.hidden_states
    assert len(hs) == n_layers + 1
    refs = {r: hs[r][0].float() for r in range(n_layers)}
    refs[n_layers] = seen["pre"][0].float()
    refs[n_layers + 1] = hs[n_layers][0].float()
    return refs


VARIANTS = ["native", "torch", "batch_invariant", "batch_invariant_torch", "graphs", "bfloat16"]
# a token's relative L2 distance from transformers in the model's dtype (measured: float32
# paths <= 1.3e-6, bfloat16 2.5e-2)
TOLERANCE = {"bfloat16": 5e-2}


def _model(folder, variant):
    if variant == "bfloat16":
        return load_model(folder, dtype=torch.bfloat16)
    model = load_model(folder)
    if variant == "torch":
        model.native_linear = model.native_norm = model.native_layer_ops = False
    elif variant.startswith("batch_invariant"):
        model = LlamaModel(model.config, model.weights, batch_invariant=True)
        model.batch_invariant_torch = variant == "batch_invariant_torch"
    elif variant == "graphs":
        model.native_layer_ops = False  # the torch path, as on a GPU
        model.graphs = GraphCache(model.geometry.device, graph=RecordedGraph)
    return model


def _script(runner, vocab, seed=2, decode_steps=4):
    """Prefill 3 rows, ``decode_steps`` decode steps, a ragged verify, rollbacks (rejected
    drafts) and their slots written again, a single row: yields after each forward {seq:
    tokens so far}, the rows it ran and their logits."""
    g = torch.Generator().manual_seed(seed)

    def tok(n):
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    seqs = [runner.add_sequence() for _ in range(3)]
    history = {s: tok(n) for s, n in zip(seqs, (11, 6, 1))}

    def step(new):
        for s, toks in new.items():
            history[s] = history[s][:runner.length(s)] + list(toks)
        logits = runner.step(new)
        return history, list(new), logits

    yield step({s: history[s] for s in seqs})
    for _ in range(decode_steps):
        yield step({s: tok(1) for s in seqs})
    yield step({s: tok(n) for s, n in zip(seqs, (4, 1, 3))})
    first, last = seqs[0], seqs[-1]
    runner.rollback(first, runner.length(first) - 3)
    runner.rollback(last, runner.length(last) - 1)
    yield step({first: tok(2), last: tok(5)})
    yield step({seqs[1]: tok(1)})


def _worst(got, ref):
    """The largest relative distance of a token's state from the reference's (L2 per
    row: a residual stream's few huge channels would hide the rest from a max norm)."""
    got, ref = got.float().reshape(-1, ref.shape[-1]), ref.float().reshape(-1, ref.shape[-1])
    return ((got - ref).norm(dim=-1) / ref.norm(dim=-1).clamp(min=1e-30)).max().item()


@pytest.mark.parametrize("variant", VARIANTS)
def test_llama_features_equal_transformers_hidden_states(llama, variant):
    folder, hf = llama
    model = _model(folder, variant)
    if variant == "bfloat16":
        hf = _hf().to(torch.bfloat16)  # the same weights (same seed), rounded alike
    runner = PagedRunner(model, num_blocks=64, block_size=4, features=ALL)
    tol = TOLERANCE.get(variant, 5e-6)
    worst = 0.0
    for history, rows, _ in _script(runner, VOCAB):
        for s in rows:
            refs = reference_states(hf, history[s])
            for key in ALL:
                got = runner.features_of(s, key)
                assert got.shape == refs[key].shape
                err = _worst(got, refs[key])
                worst = max(worst, err)
                assert err < tol, f"{variant}: stream {key} of seq {s}: {err:.2e} >= {tol}"
    # power: a neighbouring stream (an off-by-one tap) is far outside the tolerance
    s = rows[-1]
    refs = reference_states(hf, history[s])
    for key in ALL[:-1]:
        assert _worst(runner.features_of(s, key), refs[key + 1]) > 10 * tol
    if variant == "graphs":
        assert model.graphs.stats()["replays"] > 0  # some forwards ran captured


@pytest.mark.parametrize("variant", VARIANTS)
def test_asking_for_features_leaves_the_logits_bits(llama, variant):
    folder, _ = llama
    plain = PagedRunner(_model(folder, variant), num_blocks=64, block_size=4)
    tapped = PagedRunner(_model(folder, variant), num_blocks=64, block_size=4, features=ALL)
    assert plain.kv.features == {}
    for (_, _, a), (_, _, b) in zip(_script(plain, VOCAB), _script(tapped, VOCAB)):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def test_quantized_fused_layers_write_features_with_the_same_logits(smollm2):
    """The fused quantized layers run in spans between the taps: the same kernels in the
    same order (logits bit for bit), and each tap holds what the layer loop computes."""
    _, model, tok = smollm2
    assert model.quantized and model.native_decode_layers  # the fused native layers
    n = model.geometry.num_layers
    keys = [0, 2, n // 2, n - 3, n, n + 1]
    ids = tok.apply_chat_template([{"role": "user", "content": "Name three colours."}],
                                  tokenize=True)
    runs = {}
    for name, feats, fused in (("plain", (), True), ("tapped", keys, True),
                               ("loop", keys, False)):
        model.native_decode_layers = fused
        try:
            runner = PagedRunner(model, num_blocks=32, block_size=16, features=feats)
            s = runner.add_sequence()
            logits = [runner.step({s: ids})[0]]
            for t in (17, 29, 31, 5):  # decode steps, then a 3-token verify-style step
                logits.append(runner.step({s: [t]})[0])
            logits.append(runner.step({s: [7, 8, 9]})[0])
            runs[name] = (runner, s, logits)
        finally:
            model.native_decode_layers = True
    for a, b in zip(runs["plain"][2], runs["tapped"][2]):
        assert torch.equal(a, b)
    tapped, s, _ = runs["tapped"]
    loop, s2, _ = runs["loop"]
    for key in keys:
        got, want = tapped.features_of(s, key), loop.features_of(s2, key)
        # the loop and the fused call run the same kernels: equal up to the fused
        # call's own rounding (the logits of the two paths are compared bit for bit by
        # test_quant's fused-layer tests)
        assert _worst(got, want) < 1e-5, key
    # power: the next tapped stream is far away
    assert _worst(tapped.features_of(s, keys[1]), loop.features_of(s2, keys[2])) > 0.1


def test_quantized_features_equal_transformers_on_the_dequantized_weights(
        smollm2, smollm2_transformers, monkeypatch):
    """The GGUF path (the fused native layers, in spans between the taps) against the
    same weights in transformers (dequantized by gguf's own code), for every stream
    asked. The quantized kernels' float arithmetic, whose products round like float32,
    as test_models holds the logits (the int8 arithmetic's own distance from float is
    test_quant's)."""
    from verispec.models.layers import quantized

    monkeypatch.setattr(quantized, "ARITHMETIC", "float")
    _, model, tok = smollm2
    hf = smollm2_transformers
    n = model.geometry.num_layers
    keys = [0, 2, n // 2, n - 3, n, n + 1]
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}],
                                  tokenize=True)
    runner = PagedRunner(model, num_blocks=32, block_size=16, features=keys)
    s = runner.add_sequence()
    runner.step({s: ids})
    runner.step({s: [28, 29]})
    refs = reference_states(hf, ids + [28, 29])
    # measured: 0 (the embedding), 1.2e-6..2.9e-6 (the rest)
    for key in keys:
        err = _worst(runner.features_of(s, key), refs[key])
        assert err < 2e-5, f"stream {key}: {err:.2e}"
    assert _worst(runner.features_of(s, keys[2]), refs[keys[3]]) > 0.2  # power


def test_feature_keys_and_refusals():
    assert Feature.layer_output(1).key(4) == Feature.layer_input(2).key(4) == 2
    assert Feature.layer_output(3).key(4) == Feature.final().key(4) == 4
    assert Feature.final_normed().key(4) == 5
    with pytest.raises(ValueError, match=r"layer_input\(4\) is past the target's last layer"):
        Feature.layer_input(4).key(4)
    with pytest.raises(ValueError, match=r"layer_output\(4\) is past the target's last layer"):
        Feature.layer_output(4).key(4)
    with pytest.raises(ValueError, match="kind must be one of"):
        Feature("middle")
    with pytest.raises(ValueError, match="needs a layer index >= 0, got -1"):
        Feature.layer_input(-1)
    with pytest.raises(ValueError, match="takes no layer, got layer=2"):
        Feature("final", 2)


# --- through SpecDecoder ----------------------------------------------------------------


class _Reader:
    """A separate draft model (its own weights and cache) that reads the target's
    streams: every draft pass records what FeatureView gives for each token's previous
    position, with the row's target block table."""

    def __init__(self, model):
        self.model, self.geometry = model, model.geometry
        self.reads = []

    def forward(self, batch):
        view = batch.target_features
        assert isinstance(view, FeatureView) and view.block_tables.shape[0] == batch.num_rows
        qs = batch.query_start.tolist()
        rows = torch.repeat_interleave(torch.arange(batch.num_rows),
                                       torch.tensor([b - a for a, b in zip(qs, qs[1:])]))
        prev = batch.positions.long() - 1
        keep = prev >= 0
        for key in ALL:
            f = Feature.layer_input(key) if key < LAYERS else (
                Feature.final() if key == LAYERS else Feature.final_normed())
            values = view.read(f, rows[keep], prev[keep])
            self.reads.append((key, view.block_tables[rows[keep]].clone(), prev[keep].clone(),
                               values.clone()))
        return self.model.forward(batch)


class _Drafter:
    def __init__(self, reader):
        self.reader = reader

    def spec(self, target):
        features = tuple(Feature.layer_input(r) for r in range(LAYERS)) + (
            Feature.final(), Feature.final_normed())
        return DraftSpec(kind="model", model=self.reader, cache="own", features=features)


def _check_pool(dec, hf, seq, prompt, tokens):
    """The target's pool for ``seq``'s cached positions against transformers."""
    table = dec._core.block_table(seq, _C.ModelRole.target)
    n = dec._core.cache_len(seq, _C.ModelRole.target)
    ids = (list(prompt) + list(tokens))[:n]
    refs = reference_states(hf, ids)
    bs = dec.block_size
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(n)])
    pools = dec._pools[_C.ModelRole.target].features
    for key in ALL:
        got = pools[key].view(-1, pools[key].shape[-1])[slots]
        assert _worst(got, refs[key][:n]) < 5e-6, (key, seq)
    return n


@pytest.mark.parametrize("case", ["chain", "tree", "preempted"])
def test_decoder_target_features_after_rejections_trees_and_preemption(llama, tmp_path, case):
    folder, hf = llama
    target = load_model(folder)
    draft_hf = _hf(layers=1, seed=5)  # a poor draft: many rejections
    draft_hf.save_pretrained(tmp_path, safe_serialization=True)
    reader = _Reader(load_model(tmp_path))
    kw = dict(k=3, num_blocks=64, block_size=4)
    if case == "tree":
        kw.update(draft_branches=2)
    if case == "preempted":
        kw.update(num_blocks=12)
    dec = SpecDecoder(target, _Drafter(reader), **kw)
    assert sorted(dec._pools[_C.ModelRole.target].features) == ALL
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (9, 5, 14)]
    seqs = [dec.add(p, max_new_tokens=12, greedy=True) for p in prompts]
    out = {s: [] for s in seqs}
    checked = 0
    while dec.has_running():
        before = {s: dec._core.cache_len(s, _C.ModelRole.target) for s in seqs}
        tables = {s: dec._core.block_table(s, _C.ModelRole.target) for s in seqs}
        reader.reads.clear()
        for o in dec.step():
            out[o.seq].extend(o.tokens)
        # what the draft passes read at committed positions equals transformers'
        for key, btab, prev, values in reader.reads:
            for i in range(prev.shape[0]):
                match = [s for s in seqs if tables[s] and
                         btab[i, :len(tables[s])].tolist() == tables[s]]
                if len(match) != 1 or prev[i] >= before[match[0]]:
                    continue  # a position the target had not processed before the step
                s, p = match[0], int(prev[i])
                ref = reference_states(hf, (prompts[seqs.index(s)] + out[s])[:p + 1])[key][p]
                assert _worst(values[i][None], ref[None]) < 5e-6
                checked += 1
        for s in seqs:
            if dec._core.cache_len(s, _C.ModelRole.target):
                _check_pool(dec, hf, s, prompts[seqs.index(s)], out[s])
    assert checked > 20  # the check ran
    stats = [dec.result(s).stats for s in seqs]
    assert sum(st["accepted"] for st in stats) < sum(st["proposed"] for st in stats)  # rejections
    if case == "preempted":
        assert dec.num_preemptions() > 0
    # greedy output is the target's alone
    plain = SpecDecoder(target, None, num_blocks=64, block_size=4)
    want = plain.generate(prompts, max_new_tokens=12, greedy=True)
    assert [out[s] for s in seqs] == [r.tokens for r in want]


def test_a_target_that_writes_no_features_is_refused_naming_them():
    from toymodels import CacheModel

    target = CacheModel(13, seed=0)
    draft = CacheModel(13, seed=1)
    drafter = DraftModel(draft, features=(Feature.final(),))
    with pytest.raises(ValueError, match="reads the target's hidden states"):
        SpecDecoder(target, drafter)
    # and no features asked: nothing allocated, the target asked for nothing
    dec = SpecDecoder(target, NGram(1, 2))
    assert dec._pools[_C.ModelRole.target].features == {}


def test_feature_pools_move_and_copy_with_the_cache():
    from verispec.models.base import ModelGeometry

    g = ModelGeometry(num_layers=1, num_kv_heads=1, head_dim=2, vocab_size=5, max_context=16,
                      dtype=torch.float32, device=torch.device("cpu"), hidden_size=3)
    pools = KVPools.allocate(g, num_blocks=3, block_size=2, features=[0, 2])
    for p in pools.features.values():
        p.copy_(torch.randn(p.shape))
    before = {k: p.clone() for k, p in pools.features.items()}
    pools.copy_blocks([(0, 2, 1)])
    for k, p in pools.features.items():
        assert torch.equal(p[2, 0], before[k][0, 0]) and torch.equal(p[2, 1], before[k][2, 1])
    pools.move_slots(torch.tensor([3]), torch.tensor([1]))
    for k, p in pools.features.items():
        assert torch.equal(p.view(-1, 3)[1], before[k].view(-1, 3)[3])
    with pytest.raises(ValueError, match="need geometry.hidden_size"):
        KVPools.allocate(ModelGeometry(num_layers=1, num_kv_heads=1, head_dim=2, vocab_size=5,
                                       max_context=16, dtype=torch.float32,
                                       device=torch.device("cpu")), 3, 2, features=[0])
