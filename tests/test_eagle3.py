"""verispec.drafters.Eagle3 through SpecDecoder: exact at every setting, the head's paged
passes equal its dense forward, the target's states read where the head was trained
to read them.

Heads here have random weights (a reduced draft vocabulary: q = 0 outside it), so
acceptance is low; what is checked is exactness and the wiring, not speed.
"""

import itertools
import math

import pytest
import torch
import transformers

from verispec import _C
from verispec.decoder import SpecDecoder, request_seed
from verispec.drafters import Eagle3
from verispec.drafters.eagle3_head import Eagle3Config, Eagle3Head, expected_shapes
from verispec.models import load_model
from verispec.models.testing import PagedRunner, randomize_weights

from test_decoder import chi_square_pvalue  # noqa: E402

VOCAB = 97


def random_head(folder, *, vocab, hidden, layers, draft_vocab, seed=0, taps=None,
                own_embedding=False, layout="speculators", intermediate_size=48, **flags):
    """A head of random weights for a target of ``hidden`` x ``layers`` and ``vocab``,
    drafting over ``draft_vocab`` ids (a random subset of the target's), saved
    in ``layout``; returns the folder."""
    g = torch.Generator().manual_seed(seed)
    cfg = Eagle3Config(hidden_size=hidden, intermediate_size=intermediate_size,
                       num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=vocab, draft_vocab_size=draft_vocab,
                       target_hidden_size=hidden,
                       tap_layers=taps or (1, 2, layers), num_taps=3,
                       rms_norm_eps=1e-5, own_embedding=own_embedding, **flags)
    tensors = {}
    for name, shape in expected_shapes(cfg).items():
        if name == "embed_tokens.weight" and not own_embedding:
            continue
        if len(shape) == 1:
            tensors[name] = 1 + 0.1 * torch.randn(shape, generator=g)
        else:
            tensors[name] = torch.randn(shape, generator=g) / math.sqrt(shape[1])
    ids = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    if draft_vocab < vocab:
        tensors["d2t"] = ids - torch.arange(draft_vocab)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        tensors["t2d"] = t2d
    Eagle3Head(cfg, tensors).save(folder, format=layout)
    return folder


def _hf(vocab, layers=3, seed=0, hidden=48):
    cfg = transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=80, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
        max_position_embeddings=512, tie_word_embeddings=False, rms_norm_eps=1e-5)
    return randomize_weights(transformers.LlamaForCausalLM(cfg), seed, norm_spread=0.2).eval()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(target LlamaModel, head folder speculators layout, head folder EAGLE layout)."""
    folder = tmp_path_factory.mktemp("eagle3_target")
    _hf(VOCAB).save_pretrained(folder, safe_serialization=True)
    target = load_model(folder)
    heads = {}
    for layout in ("speculators", "eagle"):
        heads[layout] = random_head(tmp_path_factory.mktemp(f"head_{layout}"), vocab=VOCAB,
                                    hidden=48, layers=3, draft_vocab=40, layout=layout)
    return target, heads


def _prompts(n, seed=3, lo=3, hi=20):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(torch.randint(lo, hi, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]


@pytest.mark.parametrize("layout", ["speculators", "eagle"])
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_greedy_equals_plain_greedy(tiny, layout, shape):
    """16 prompts x 128 tokens, batched, chains of k=4 or trees of 2 children."""
    target, heads = tiny
    prompts = _prompts(16)
    want = SpecDecoder(target, None, num_blocks=1024, block_size=8).generate(
        prompts, max_new_tokens=128, greedy=True)
    kw = dict(draft_branches=2) if shape == "tree" else {}
    dec = SpecDecoder(target, Eagle3(target, heads[layout]), k=4, num_blocks=1024,
                      block_size=8, **kw)
    got = dec.generate(prompts, max_new_tokens=128, greedy=True)
    assert [r.tokens for r in got] == [r.tokens for r in want]
    stats = [r.stats for r in got]
    assert sum(s["proposed"] for s in stats) > 1000  # it drafted


def test_the_head_passes_equal_its_dense_forward(tiny):
    """A chain step by step through SpecDecoder: the catch-up pass's logits at the last
    committed token equal the head's dense teacher-forced forward over the target's
    states (position p reads the target's state of p - 1; position 0 a zero state), and
    the next pass's equal the dense forward fed its own output state."""
    target, heads = tiny
    drafter = Eagle3(target, heads["speculators"])
    head, n_layers = drafter.head, target.geometry.num_layers
    keys = [f.key(n_layers) for f in drafter.model.features]
    seen = []
    real = drafter.model.forward

    def record(batch):
        out = real(batch)
        seen.append((batch.positions.tolist(), out.clone()))
        return out

    drafter.model.forward = record
    dec = SpecDecoder(target, drafter, k=2, num_blocks=256, block_size=4)
    tokens = _prompts(1, seed=11, lo=12, hi=13)[0]
    dec.add(tokens, max_new_tokens=24, greedy=True)
    checked = 0
    while dec.has_running():
        before = list(tokens)
        seen.clear()
        for o in dec.step():
            tokens.extend(o.tokens)
        if not seen:
            continue
        C = len(before)
        runner = PagedRunner(target, num_blocks=64, block_size=4, features=keys)
        s = runner.add_sequence()
        runner.step({s: before[:C - 1]})
        taps = torch.cat([runner.features_of(s, key) for key in keys], dim=-1)
        g = torch.cat([torch.zeros(1, head.config.hidden_size), head.fuse_taps(taps)])
        kv = head.new_kv()
        dense, hidden = head.forward(torch.tensor(before), torch.arange(C), hidden=g, kv=kv)
        positions, logits = seen[0]
        assert positions[-1] == C - 1
        want = head.scatter_to_target(dense[C - 1:C])
        assert torch.equal(torch.isinf(logits), torch.isinf(want))
        finite = torch.isfinite(want)
        assert (logits[finite] - want[finite]).abs().max() < 1e-5
        if len(seen) > 1:
            proposal = int(logits[0].argmax())
            d1, _ = head.forward(torch.tensor([proposal]), torch.tensor([C]),
                                 hidden=hidden[C - 1:C], kv=kv)
            positions1, logits1 = seen[1]
            assert positions1 == [C]
            want1 = head.scatter_to_target(d1)
            finite = torch.isfinite(want1)
            assert (logits1[finite] - want1[finite]).abs().max() < 1e-5
            checked += 1
            # power: the states read one position off give other logits
            off = head.forward(torch.tensor(before), torch.arange(C),
                               hidden=torch.cat([g[1:], g[-1:]]), kv=head.new_kv())[0]
            assert (off[C - 1] - dense[C - 1]).abs().max() > 1e-2
    assert checked >= 3


SV, DEPTH = 6, 3


@pytest.fixture(scope="module")
def tiny6(tmp_path_factory):
    folder = tmp_path_factory.mktemp("eagle3_tiny6")
    _hf(SV, layers=2, seed=7, hidden=32).save_pretrained(folder, safe_serialization=True)
    target = load_model(folder)
    head = random_head(tmp_path_factory.mktemp("head6"), vocab=SV, hidden=32, layers=2,
                       draft_vocab=4, seed=4, taps=(0, 1, 2))
    return target, head


def _exact(model, prompt, policy):
    from verispec import reference

    dists = {}

    def dist(prefix):
        if prefix not in dists:
            runner = PagedRunner(model, num_blocks=8, block_size=4)
            (logits,) = runner.step({runner.add_sequence(): list(prefix)}, all_logits=False)
            dists[prefix] = reference.apply_policy(logits.float(), **policy)[0]
        return dists[prefix]

    probs = {}
    for cont in itertools.product(range(SV), repeat=DEPTH):
        p, seq = 1.0, tuple(prompt)
        for t in cont:
            p *= float(dist(seq)[t])
            seq += (t,)
        probs[cont] = p
    return probs


# alpha 1e-4: a correct decoder fails a case once in 10,000 seeds; each case runs with a
# fixed seed, and its power is shown by the same case with q replaced by a distribution
# the proposals were not drawn from, which the test must reject.
ALPHA = 1e-4


@pytest.mark.parametrize("wrong", [False, True], ids=["exact", "power:wrong-q"])
@pytest.mark.parametrize("case", ["t1-chain", "topk-topp-chain", "t1-tree", "block"])
def test_sampled_output_is_the_target_distribution(tiny6, case, wrong, monkeypatch):
    target, head = tiny6
    policy = (dict(temperature=0.9, top_k=4, top_p=0.9) if case.startswith("topk")
              else dict(temperature=1.0))
    kw = dict(k=2, num_blocks=4000, block_size=4)
    if case.endswith("tree"):
        kw.update(draft_branches=2, k=3)
    if case == "block":
        kw.update(verify_method="block")
    dec = SpecDecoder(target, Eagle3(target, head), **kw)
    if wrong:
        real = SpecDecoder._sample_draft
        real_children = SpecDecoder._sample_children

        def wrong_q(self, logits, pol, seed, offset):
            tokens, _ = real(self, logits, pol, seed, offset)
            return tokens, torch.full((logits.shape[0], SV), 1.0 / SV)

        def wrong_children(self, logits, pol, seed, offset):
            tokens, _ = real_children(self, logits, pol, seed, offset)
            return tokens, torch.full((logits.shape[0], SV), 1.0 / SV)

        monkeypatch.setattr(SpecDecoder, "_sample_draft", wrong_q)
        monkeypatch.setattr(SpecDecoder, "_sample_children", wrong_children)
    prompt = [1, 2]
    probs = _exact(target, prompt, policy)
    counts = {}
    dec._core.reseed(500)
    for _ in range(8):
        for r in dec.generate([prompt] * 1000, max_new_tokens=DEPTH, **policy):
            counts[tuple(r.tokens)] = counts.get(tuple(r.tokens), 0) + 1
    p = chi_square_pvalue(counts, probs)
    assert (p > ALPHA) != wrong, p
    if not wrong:
        assert sum(r.stats["accepted"] for r in dec.generate(
            [prompt] * 50, max_new_tokens=DEPTH, **policy)) > 0  # proposals were accepted


def test_per_request_seeds_give_the_same_tokens_alone_and_batched(tiny):
    target, heads = tiny
    prompts = _prompts(4, seed=21)
    dec = SpecDecoder(target, Eagle3(target, heads["speculators"]), k=3, num_blocks=512,
                      block_size=4)
    batched = dec.generate(prompts, max_new_tokens=20, temperature=0.8, top_p=0.9, seed=77)
    for i, p in enumerate(prompts):
        alone = dec.generate([p], max_new_tokens=20, temperature=0.8, top_p=0.9,
                             seed=[request_seed(77, i)])
        assert alone[0].tokens == batched[i].tokens


def test_a_head_that_does_not_fit_is_refused_naming_the_field(tiny, tmp_path):
    target, _ = tiny
    wrong_hidden = random_head(tmp_path / "h", vocab=VOCAB, hidden=40, layers=3, draft_vocab=40)
    with pytest.raises(ValueError, match="hidden_size"):
        Eagle3(target, wrong_hidden)
    wrong_vocab = random_head(tmp_path / "v", vocab=VOCAB + 3, hidden=48, layers=3,
                              draft_vocab=40)
    with pytest.raises(ValueError, match="vocab_size"):
        Eagle3(target, wrong_vocab)
    past = random_head(tmp_path / "t", vocab=VOCAB, hidden=48, layers=3, draft_vocab=40,
                       taps=(1, 2, 5))
    with pytest.raises(ValueError, match="tap_layers"):
        Eagle3(target, past)


def test_the_draft_cache_holds_only_target_drafted_positions(tiny):
    """DecoderConfig::draft_reads_target: no drafting in the step that prefills the
    prompt, and after each commit the head's cache ends at the step's catch-up."""
    target, heads = tiny
    dec = SpecDecoder(target, Eagle3(target, heads["speculators"]), k=3, num_blocks=256,
                      block_size=4)
    prompt = _prompts(1, seed=5, lo=10, hi=11)[0]
    seq = dec.add(prompt, max_new_tokens=16, greedy=True)
    dec.step()  # the prefill: nothing drafted
    assert dec.result(seq).stats["proposed"] == 0
    assert dec._core.cache_len(seq, _C.ModelRole.draft) == 0
    while dec.has_running():
        before = len(prompt) + len(dec.result(seq).tokens)
        dec.step()
        if dec.has_running():
            # the catch-up wrote positions < committed-before-step
            assert dec._core.cache_len(seq, _C.ModelRole.draft) == before
    assert dec.result(seq).stats["proposed"] > 0


# --- the command line ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def cli_target(tmp_path_factory):
    """A tiny Llama folder with a tokenizer (the CLI's kind of model) and a head for it."""
    from test_cli import CHAT_TEMPLATE
    from toymodels import write_tiny_llama

    folder = write_tiny_llama(tmp_path_factory.mktemp("eagle3_cli"), CHAT_TEMPLATE, layers=3)
    target = load_model(folder)
    g = target.geometry
    head = random_head(tmp_path_factory.mktemp("eagle3_cli_head"), vocab=g.vocab_size,
                       hidden=g.hidden_size, layers=g.num_layers,
                       draft_vocab=g.vocab_size // 2, seed=2)
    return folder, head


def test_generate_with_an_eagle3_head(capsys, cli_target):
    from test_cli import run

    folder, head = cli_target
    code, out, err = run(capsys, "generate", "--model", folder, "--draft", "eagle3",
                         "--draft-head", head, "--prompt", "the quick brown fox", "--greedy",
                         "--max-new-tokens", 24, "--ignore-eos")
    assert code == 0, err
    assert "EAGLE-3 head" in err and "greedy outputs identical: yes" in err, err


@pytest.mark.parametrize("argv, needles", [
    (["--draft", "ngram", "--draft-head", "HEAD"], ["--draft-head", "applies to --draft eagle3"]),
    (["--draft", "eagle3", "--draft-head", "/no/such/folder"],
     ["--draft-head", "not a folder"]),
    (["--draft", "eagle3", "--draft-head", "WRONG"], ["--draft-head", "hidden_size"]),
])
def test_eagle3_command_line_errors_are_one_line(capsys, cli_target, tmp_path, argv, needles):
    from test_cli import assert_usage_error, run

    folder, head = cli_target
    wrong = random_head(tmp_path / "wrong", vocab=load_model(folder).geometry.vocab_size,
                        hidden=40, layers=3, draft_vocab=8, own_embedding=True)
    argv = [str(head) if a == "HEAD" else str(wrong) if a == "WRONG" else a for a in argv]
    code, _, err = run(capsys, "generate", "--model", folder, "--prompt", "the fox",
                       "--max-new-tokens", 4, *argv)
    assert_usage_error(code, err, *needles)


def test_info_names_a_head(capsys, cli_target):
    from test_cli import run

    _, head = cli_target
    code, out, err = run(capsys, "info", "--draft-head", head)
    assert code == 0, err
    line = [x for x in out.splitlines() if x.startswith("EAGLE-3 head")]
    assert line and "speculators layout" in line[0] and "taps entering target layers [1, 2, 3]" \
        in line[0] and "draft vocabulary" in line[0], out


# --- the head's matrices in the native kernels ------------------------------------------


def test_q8_0_quantization_is_within_half_a_step():
    from verispec.models.layers.quantized import QuantizedMatrix

    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 96, generator=g) * torch.logspace(-3, 1, 96)
    m = QuantizedMatrix.quantize_q8_0(w)
    # 34 bytes a block of 32; the packed layout (int8 arithmetic) pads to 16-row groups
    assert m.formats == ("Q8_0",) and tuple(m.shape) == (40, 96) and m.nbytes in (40 * 102, 48 * 102)
    d = (w.view(40, 3, 32).abs().amax(-1) / 127).half().float()
    err = (m.dequantize() - w).view(40, 3, 32).abs()
    assert bool((err <= d[..., None] * 0.5 + d[..., None] * 127 * 2 ** -11 + 1e-12).all())
    x = torch.randn(5, 96, generator=g)
    # quant_linear's int8 bound (x quantized per block of 32): sum_b amax_b / 254 sum |w|
    dq = m.dequantize()
    amax = x.view(5, 3, 32).abs().amax(-1)                            # [5, 3]
    wsum = dq.abs().view(40, 3, 32).sum(-1)                           # [40, 3]
    bound = 0.50003 / 127 * amax @ wsum.T + 1e-4 * (x.abs() @ dq.abs().T)
    assert bool(((m.linear(x, 1) - x @ dq.T).abs() <= bound).all())
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantizedMatrix.quantize_q8_0(torch.zeros(4, 40))


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory):
    """A target of hidden 64 (a head for it has rows of whole Q8_0 blocks)."""
    folder = tmp_path_factory.mktemp("eagle3_target64")
    _hf(VOCAB, hidden=64).save_pretrained(folder, safe_serialization=True)
    return load_model(folder)


def test_a_q8_0_head_drafts_like_its_float_self_and_stays_exact(tiny64, tmp_path):
    target = tiny64
    folder = random_head(tmp_path / "h", vocab=VOCAB, hidden=64, layers=3, draft_vocab=40,
                         seed=2, intermediate_size=64)
    native = Eagle3(target, folder)                    # auto: Q8_0 on the CPU
    plain = Eagle3(target, folder, weights="float32")
    assert native.weights["format"] == "Q8_0" and native.describe()["weights"] == "Q8_0"
    assert native.weights["bytes"] * 3.5 < native.weights["float32_bytes"]
    assert plain.weights["format"] == "float32"
    g = torch.Generator().manual_seed(1)
    taps = torch.randn(12, 3 * 64, generator=g)
    ids = torch.randint(0, VOCAB, (12,), generator=g)
    pos = torch.arange(12)
    a, _ = native.head.forward(ids, pos, taps=taps)
    b, _ = plain.head.forward(ids, pos, taps=taps)
    torch.testing.assert_close(a, b, rtol=0, atol=0.05 * float(b.abs().max()))
    prompts = _prompts(6, seed=4)
    want = SpecDecoder(target, None, num_blocks=256).generate(prompts, max_new_tokens=32,
                                                              greedy=True)
    got = SpecDecoder(target, native, k=3, num_blocks=256).generate(prompts, max_new_tokens=32,
                                                                   greedy=True)
    assert [r.tokens for r in got] == [r.tokens for r in want]
    with pytest.raises(ValueError, match="weights must be 'auto', 'Q8_0' or 'float32'"):
        Eagle3(target, folder, weights="int4")
