"""HFModel's feature taps (verispec.models.hf.features): the target's hidden states a
drafter reads (verispec.drafters.Feature, KVPools.features), against transformers.

For every family of the adapter's table (tests/test_hf_adapter.py's tiny random models)
each stream's pool holds, after prefill, decode, a ragged verify, rollbacks (rejected
drafts) and their slots written again, what transformers reports for the same tokens:
``output_hidden_states`` (the input of layer r; its last entry the normed final state)
and a hook on the final norm's input (the last layer's output, which it does not list).
On the paths HFModel has (its CPU kernels, torch ops, captured programs on and off, the
batch-invariant mode, bfloat16), through SpecDecoder with a drafter that reads them, and
with the logits' bits unchanged by asking. Families without the streams are refused,
naming the family and the stream.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import transformers
from torch.overrides import TorchFunctionMode

from test_features import _script as feature_script, _worst
from test_hf_adapter import CONFIGS, VOCAB, _cfg, _reference
from verispec import _C
from verispec.decoder import SpecDecoder
from verispec.drafters import DraftSpec, Feature, FeatureView
from verispec.models import HFModel
from verispec.models.hf import features as hf_features
from verispec.models.testing import PagedRunner, randomize_weights

# families whose streams HFModel does not recognise (test_refusals_name_the_family_and_stream)
NO_LAYER_STREAM = ("gemma3n_text",)   # its layers pass 2 stacked streams (AltUp)
NO_FINAL_NORM = ("bert_decoder",)     # post-norm layers, no final norm
FAMILIES = [n for n in CONFIGS if n not in NO_LAYER_STREAM]
# a token's relative L2 distance from transformers' stream (per row: a residual stream's
# few large channels would hide the rest from a max norm), float32; measured: 0 for the
# embedding, <= 2.7e-6 elsewhere over every family and path (dots1)
TOLERANCE = 1e-5
TOLERANCE_BF16 = 5e-2  # measured 1.8e-2 (llama)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.lru_cache(maxsize=None)
def _hidden_reference(name: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A copy of the adapter test's reference model for output_hidden_states, which
    installs transformers' recording hooks on the model it runs (never wrapped)."""
    return copy.deepcopy(_reference(name)).to(dtype)


def _wrap(name: str, dtype: torch.dtype = torch.float32, **kw) -> HFModel:
    return HFModel(copy.deepcopy(_reference(name)).to(dtype), **kw)


def _keys(model: HFModel) -> list[int]:
    n = model.num_layers
    return list(range(n + 1 if model._streams.final_norm is None else n + 2))


def reference_states(model: HFModel, ref: torch.nn.Module, ids: list[int]) -> dict:
    """transformers' streams of ``ids`` as one sequence: {key: [n, hidden] float32}; r < N
    from output_hidden_states, N the final norm's input (a hook; the last layer's output
    where there is no final norm), N + 1 the normed state (its last entry)."""
    n = model.num_layers
    names = {id(m): name for name, m in model.model.named_modules()}
    modules = dict(ref.named_modules())
    norm = model._streams.final_norm
    seen = {}
    if norm is not None:
        handle = modules[names[id(norm)]].register_forward_hook(
            lambda m, i, o: seen.update(pre=i[0]))
    else:
        handle = modules[names[id(model._streams.layers[-1])]].register_forward_hook(
            lambda m, i, o: seen.update(pre=o[0] if isinstance(o, tuple) else o))
    try:
        with torch.no_grad():
            out = ref(torch.tensor([ids]), output_hidden_states=True)
    finally:
        handle.remove()
    hs = out.hidden_states
    assert len(hs) == n + 1
    refs = {r: hs[r][0].float() for r in range(n)}
    refs[n] = seen["pre"][0].float()
    if norm is not None:
        refs[n + 1] = hs[n][0].float()
    return refs


def _script(runner: PagedRunner):
    """test_features' script (prefill 3 rows, decode, a ragged verify, rollbacks and
    their slots written again, one row alone) with 6 decode steps, so a captured program
    records, checks and replays."""
    return feature_script(runner, VOCAB, decode_steps=6)


def _check_against_transformers(model: HFModel, ref: torch.nn.Module, tol: float) -> float:
    """Runs _script with every stream asked; each row's pool after each forward against
    transformers; power: a neighbouring stream misses by far more. The worst distance."""
    keys = _keys(model)
    runner = PagedRunner(model, num_blocks=64, block_size=4, features=keys)
    worst = 0.0
    for history, rows, _ in _script(runner):
        for s in rows:
            refs = reference_states(model, ref, history[s])
            for key in keys:
                got = runner.features_of(s, key)
                assert got.shape == refs[key].shape and got.dtype == model.geometry.dtype
                err = _worst(got, refs[key])
                worst = max(worst, err)
                assert err < tol, f"{model.model_type}: stream {key} of seq {s}: {err:.2e}"
    s = rows[-1]
    refs = reference_states(model, ref, history[s])
    for key in keys[:-1]:  # an off-by-one tap would miss by O(1)
        assert _worst(runner.features_of(s, key), refs[key + 1]) > 10 * tol, key
    return worst


@pytest.mark.parametrize("name", FAMILIES)
def test_streams_equal_transformers_hidden_states(name):
    """The default wrapper (CPU kernels, the paged kernel, captured programs)."""
    model = _wrap(name)
    assert model.geometry.hidden_size == 64 and HFModel.writes_features
    assert (model._streams.final_norm is None) == (name in NO_FINAL_NORM)
    _check_against_transformers(model, _hidden_reference(name), TOLERANCE)


VARIANTS = ["capture_off", "torch", "batch_invariant", "bfloat16"]
# (family, path); the batch-invariant mode refuses gpt_oss (its router's top-k, see
# test_hf_adapter), so it runs on the others
PATHS = [(name, variant) for name in ("llama", "gemma2", "gpt_oss")
         for variant in ("default", *VARIANTS)
         if not (name == "gpt_oss" and variant == "batch_invariant")]


def _variant(name: str, variant: str) -> HFModel:
    if variant == "capture_off":
        return _wrap(name, capture=False)
    if variant == "torch":  # the padded torch attention, nn.Linear / norms' own code
        model = _wrap(name, cpu_kernels=False)
        model.native_attention = False
        return model
    if variant == "batch_invariant":
        return _wrap(name, batch_invariant=True)
    return _wrap(name, torch.bfloat16)


@pytest.mark.parametrize("name, variant", PATHS)
def test_every_path_writes_the_streams(name, variant):
    model = _wrap(name) if variant == "default" else _variant(name, variant)
    dtype = torch.bfloat16 if variant == "bfloat16" else torch.float32
    _check_against_transformers(model, _hidden_reference(name, dtype),
                                TOLERANCE_BF16 if dtype == torch.bfloat16 else TOLERANCE)
    captures = model._captures
    if variant in ("default", "bfloat16"):
        assert captures.replays > 0  # forwards with features ran as captured programs
    elif variant == "capture_off":
        assert captures is None or captures.replays == 0


@pytest.mark.parametrize("name, variant", PATHS + [("bert_decoder", "default")])
def test_asking_for_features_leaves_the_logits_bits(name, variant):
    make = (lambda: _wrap(name)) if variant == "default" else (lambda: _variant(name, variant))
    plain = PagedRunner(make(), num_blocks=64, block_size=4)
    tapped_model = make()
    tapped = PagedRunner(tapped_model, num_blocks=64, block_size=4, features=_keys(tapped_model))
    assert plain.kv.features == {}
    for (_, _, a), (_, _, b) in zip(_script(plain), _script(tapped)):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def _programs_tapping(model: HFModel) -> dict:
    """{feature keys of the program's key: how many _tap calls its code makes}."""
    out = {}
    for key, program in model._captures.programs.items():
        space = program.run.__globals__
        # a program calls what the opaque wrapper wraps
        taps = [name for name, value in space.items()
                if value is hf_features._tap.__wrapped__]
        out[key[-1]] = sum(program.source.count(f"{name}(") for name in taps)
    return out


def test_one_model_serves_forwards_with_and_without_features():
    """Two runners over one wrapper, one asking for every stream: a captured program per
    feature set (the one without features holds no tap), the plain runner's logits those
    of a wrapper never asked, the tapped runner's streams transformers'."""
    name = "llama"
    model, alone = _wrap(name), _wrap(name)
    keys = _keys(model)
    tapped = PagedRunner(model, num_blocks=64, block_size=4, features=keys)
    plain = PagedRunner(model, num_blocks=64, block_size=4)
    control = PagedRunner(alone, num_blocks=64, block_size=4)
    ref = _hidden_reference(name)
    for (h, rows, _), (_, _, a), (_, _, b) in zip(_script(tapped), _script(plain),
                                                  _script(control)):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
        for s in rows:
            refs = reference_states(model, ref, h[s])
            for key in keys:
                assert _worst(tapped.features_of(s, key), refs[key]) < TOLERANCE
    taps = _programs_tapping(model)
    # the decode key of each runner: N + 2 taps (each layer's input, the last layer's
    # output, the normed state) and none
    assert taps.get(tuple(keys)) == len(keys) and taps.get(None) == 0, taps
    assert model._captures.replays > 0


def test_programs_recorded_before_the_taps_stay_right():
    """A wrapper decodes (its program recorded, checked, replayed) before a forward asks
    for features and installs the taps: the program keeps serving the forwards that ask
    for none (no invalidation), with the logits of a wrapper never asked."""
    model, alone = _wrap("llama"), _wrap("llama")
    runners = [PagedRunner(m, num_blocks=64, block_size=4) for m in (model, alone)]
    seqs = [r.add_sequence() for r in runners]

    def decode(tok):
        a, b = (r.step({s: [tok]})[0] for r, s in zip(runners, seqs))
        assert torch.equal(a, b)

    for r, s in zip(runners, seqs):
        r.step({s: [5, 6, 7]})
    for tok in range(6):
        decode(tok)
    replays = model._captures.replays
    assert replays > 0
    tapped = PagedRunner(model, num_blocks=16, block_size=4, features=_keys(model))
    s = tapped.add_sequence()
    tapped.step({s: [8, 9]})  # installs the taps
    assert "_verispec_tap_inner" in vars(model._streams.layers[0])
    for tok in range(3):
        decode(tok)
    assert model._captures.replays == replays + 3 and model._captures.invalidations == 0


class _CountTorchCalls(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def test_no_feature_asked_no_extra_torch_work():
    """A wrapper never asked for a stream has no taps (its modules as HFModel left them
    before); once asked, an eager forward with no feature asked makes the same torch
    calls as without the taps (a tap reads a context variable and returns); asking for
    every stream adds the writes."""
    model = _wrap("llama", capture=False)
    tapped = model._streams.layers + [model._streams.final_norm]
    assert not any("_verispec_tap_inner" in vars(m) for m in tapped)

    def count(features=()) -> int:
        runner = PagedRunner(model, num_blocks=16, block_size=4, features=features)
        s = runner.add_sequence()
        runner.step({s: [3, 4, 5]})
        mode = _CountTorchCalls()
        with mode:
            runner.step({s: [6]})
        return mode.calls

    asked = count(_keys(model))
    assert all("_verispec_tap_inner" in vars(m) for m in tapped)
    with_taps = count()
    hf_features.uninstall(model.model)
    without = count()
    assert with_taps == without
    assert asked > with_taps


def test_refusals_name_the_family_and_stream():
    gemma3n = _wrap("gemma3n_text")
    n = gemma3n.num_layers
    assert gemma3n._streams.layers is None
    runner = PagedRunner(gemma3n, num_blocks=16, block_size=4, features=[1])
    s = runner.add_sequence()
    with pytest.raises(ValueError, match=r"gemma3n_text \(Gemma3nForCausalLM\) cannot write "
                                         r"the feature layer_input\(1\) .*receives "
                                         r"\[2, 1, 2, 64\], not one \[1, tokens, hidden\]"):
        runner.step({s: [3, 4]})
    bert = _wrap("bert_decoder")
    n = bert.num_layers
    runner = PagedRunner(bert, num_blocks=16, block_size=4, features=[0, n + 1])
    s = runner.add_sequence()
    with pytest.raises(ValueError, match=r"bert \(BertLMHeadModel\) cannot write the feature "
                                         r"final_normed .*no norm module receives"):
        runner.step({s: [3, 4]})
    # SpecDecoder asks before it builds anything: the same refusal, naming itself
    from verispec.decoder import SpecDecoder
    from verispec.drafters import DraftModel, Feature

    with pytest.raises(ValueError, match=r"^SpecDecoder: bert \(BertLMHeadModel\) cannot write "
                                         r"the feature final_normed"):
        SpecDecoder(bert, DraftModel(bert, features=(Feature.final_normed(),)))
    # its other streams are written (test_streams_equal_transformers_hidden_states)
    runner = PagedRunner(bert, num_blocks=16, block_size=4, features=[0, n])
    s = runner.add_sequence()
    runner.step({s: [3, 4]})
    assert runner.features_of(s, n).abs().sum() > 0


def test_final_norm_found_by_what_it_receives():
    """The module each family's taps read as its final norm, by name."""
    want = {"llama": "model.norm", "gpt2": "transformer.ln_f", "phi": "model.final_layernorm",
            "gpt_neox": "gpt_neox.final_layer_norm", "opt": "model.decoder.final_layer_norm",
            "gemma2": "model.norm"}
    for name, path in want.items():
        model = _wrap(name)
        names = {id(m): n for n, m in model.model.named_modules()}
        assert names[id(model._streams.final_norm)] == path, name


# --- through SpecDecoder -------------------------------------------------------------------


class _Reader:
    """A separate draft model (its own weights and cache) that reads the target's
    streams: every draft pass records what FeatureView gives for each token's previous
    position, with the row's target block table."""

    def __init__(self, model, features):
        self.model, self.geometry, self.features = model, model.geometry, features
        self.reads = []

    def forward(self, batch):
        view = batch.target_features
        assert isinstance(view, FeatureView) and view.block_tables.shape[0] == batch.num_rows
        qs = batch.query_start.tolist()
        rows = torch.repeat_interleave(torch.arange(batch.num_rows),
                                       torch.tensor([b - a for a, b in zip(qs, qs[1:])]))
        prev = batch.positions.long() - 1
        keep = prev >= 0
        for f in self.features:
            values = view.read(f, rows[keep], prev[keep])
            self.reads.append((f, view.block_tables[rows[keep]].clone(), prev[keep].clone(),
                               values.clone()))
        return self.model.forward(batch)


class _Drafter:
    def __init__(self, reader):
        self.reader = reader

    def spec(self, target):
        return DraftSpec(kind="model", model=self.reader, cache="own",
                         features=self.reader.features)


@pytest.mark.parametrize("case", ["chain", "tree"])
def test_decoder_drafter_reads_the_hf_targets_streams(case):
    """A drafter reading every stream of an HFModel target (gemma2: scaled embedding,
    softcaps, a window) through SpecDecoder: what its draft passes read at committed
    positions and the target's pool after every step equal transformers', across
    rejections; the greedy tokens are the target's alone."""
    name = "gemma2"
    target = _wrap(name)
    n = target.num_layers
    ref = _hidden_reference(name)
    features = tuple(Feature.layer_input(r) for r in range(n)) + (Feature.final(),
                                                                  Feature.final_normed())
    draft_hf = randomize_weights(transformers.AutoModelForCausalLM.from_config(
        _cfg("llama", num_hidden_layers=1)).float().eval(), seed=5)
    reader = _Reader(HFModel(draft_hf), features)
    kw = dict(k=3, num_blocks=64, block_size=4)
    if case == "tree":
        kw.update(draft_branches=2)
    dec = SpecDecoder(target, _Drafter(reader), **kw)
    assert sorted(dec._pools[_C.ModelRole.target].features) == list(range(n + 2))
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, VOCAB, (k,), generator=g).tolist() for k in (9, 5, 14)]
    seqs = [dec.add(p, max_new_tokens=10, greedy=True) for p in prompts]
    out = {s: [] for s in seqs}
    checked = 0
    while dec.has_running():
        before = {s: dec._core.cache_len(s, _C.ModelRole.target) for s in seqs}
        tables = {s: dec._core.block_table(s, _C.ModelRole.target) for s in seqs}
        reader.reads.clear()
        for o in dec.step():
            out[o.seq].extend(o.tokens)
        for f, btab, prev, values in reader.reads:
            for i in range(prev.shape[0]):
                match = [s for s in seqs if tables[s]
                         and btab[i, :len(tables[s])].tolist() == tables[s]]
                if len(match) != 1 or prev[i] >= before[match[0]]:
                    continue  # a position the target had not processed before the step
                s, p = match[0], int(prev[i])
                refs = reference_states(target, ref, (prompts[seqs.index(s)] + out[s])[:p + 1])
                assert _worst(values[i][None], refs[f.key(n)][p][None]) < TOLERANCE
                checked += 1
        for s in seqs:  # the target's pool over the sequence's cached positions
            length = dec._core.cache_len(s, _C.ModelRole.target)
            if not length:
                continue
            table = dec._core.block_table(s, _C.ModelRole.target)
            refs = reference_states(target, ref, (prompts[seqs.index(s)] + out[s])[:length])
            slots = torch.tensor([table[p // 4] * 4 + p % 4 for p in range(length)])
            for key, pool in dec._pools[_C.ModelRole.target].features.items():
                assert _worst(pool.view(-1, pool.shape[-1])[slots], refs[key]) < TOLERANCE
    assert checked > 20  # the check ran
    stats = [dec.result(s).stats for s in seqs]
    assert sum(st["accepted"] for st in stats) < sum(st["proposed"] for st in stats)
    plain = SpecDecoder(_wrap(name), None, num_blocks=64, block_size=4)
    want = plain.generate(prompts, max_new_tokens=10, greedy=True)
    assert [out[s] for s in seqs] == [r.tokens for r in want]
