"""SpecDecoder through verispec.models.HFModel: transformers models decoding on verispec's pools.

- Greedy: qwen2 (full and sliding layers, window 5 < the sequences), gemma2 (attention and
  final-logit softcaps, sliding window), mistral (sliding window), gpt_oss (sinks, MoE,
  sliding window) and mixtral (MoE), each with an n-gram draft, a smaller model draft and
  an early-exit draft, k = 3 and "auto", one sequence joining mid-flight: the output equals
  transformers' generate(do_sample=False) on an unwrapped copy, token for token.
- Sampled: the distribution of 3-token continuations equals the target's, enumerated
  exactly with transformers' own forward (a G-test, tests/exactness.py), for a model, an
  n-gram and an early-exit draft; the same test rejects a wrong draft q, a verify without
  the policy and an adapter that ignores the sliding window (its power).
- Vocabularies: drafts with a larger (padded) and a smaller vocabulary than the target's;
  a draft whose tokenizer differs is refused.
- SmolLM2: through the adapter (transformers' Llama on the GGUF's weights) and through
  verispec's native Llama, the same logits (1e-4) and the same speculative greedy tokens.
"""

from __future__ import annotations

import contextlib
import copy
import os

import numpy as np
import pytest
import torch
import transformers

import exactness
from verispec import reference
from verispec.decoder import SpecDecoder
from verispec.drafters import EarlyExit, NGram
from verispec.models import HFModel
from verispec.models.hf import model as vhf
from verispec.models.testing import PagedRunner, randomize_weights

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may come from a model hub

# SmolLM2: the file and verispec's native model, as test_models loads them (and its
# float_products: the comparisons with float references use the float arithmetic)
from test_models import (SMOLLM2_CONFIG, _unpermute_like_transformers,  # noqa: E402,F401
                         float_products, smollm2)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matmuls: intra-op threads only wait on each other, and on a loaded machine a
    thread descheduled at a barrier made every forward ~15x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_config(model_type, *, vocab, layers=3, hidden=64, **overrides):
    kw = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3 // 2,
              num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
              pad_token_id=None, tie_word_embeddings=False)
    kw.update(overrides)
    return transformers.AutoConfig.for_model(model_type, **kw)


def random_model(config, seed, norm_spread=0.2):
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    return randomize_weights(model, seed, norm_spread=norm_spread)


def truncated(model, layers):
    """The same architecture with its first `layers` decoder layers, its embeddings, final
    norm and head (copied weights): a smaller draft with its own cache."""
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    small = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    state = model.state_dict()
    small.load_state_dict({name: state[name] for name in small.state_dict()})
    return small


def transformers_greedy(model, prompt, n):
    """(tokens, smallest top-1 minus top-2 logit gap along the way) of generate()."""
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n,
                         pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    assert len(tokens) == n, "generate stopped early (an eos id in the config?)"
    gap = min(float(s[0].topk(2).values.diff().abs()) for s in out.scores)
    return tokens, gap


def speculate(target, draft, prompts, n, *, k, max_tokens_per_step=0):
    """Greedy: decodes all prompts but the last for two steps, then adds the last (its
    prefill rides next to the others' verify rows); the results in prompt order, every
    block freed."""
    dec = SpecDecoder(target, draft, k=k, num_blocks=64, block_size=4,
                      max_tokens_per_step=max_tokens_per_step)
    seqs = [dec.add(p, max_new_tokens=n, greedy=True) for p in prompts[:-1]]
    dec.step()
    dec.step()
    seqs.append(dec.add(prompts[-1], max_new_tokens=n, greedy=True))
    while dec.has_running():
        dec.step()
    results = [dec.result(s) for s in seqs]
    for s in seqs:
        dec.release(s)
    assert dec.num_free_blocks() == dec.num_blocks()
    return dec, results


# --------------------------------------------------------------------------- greedy

GREEDY_VOCAB = 97
N_NEW = 24
# Repetition for the n-gram lookup; the last prompt (24 tokens) joins after two steps.
PROMPTS = [[5, 17, 42, 42, 9, 60, 3, 7, 7, 50, 1, 5, 17, 42], [88, 2, 13],
           [4, 4, 4, 4, 30, 31, 32, 30, 31, 32, 30, 31, 32, 11, 12, 13, 11, 12, 13, 11, 12, 13,
            4, 4]]
# Random tiny models can have near-ties: each model's seed is one whose transformers
# greedy path keeps its top-1 logit at least MIN_GAP above the second at every step,
# ~300x the adapter's measured error (<= 3e-6), so no float noise can flip a token.
MIN_GAP = 1e-3
ARCHS = {
    "qwen2": (dict(sliding_window=5, use_sliding_window=True, max_window_layers=1,
                   layer_types=["full_attention", "sliding_attention", "sliding_attention"]), 6),
    "gemma2": (dict(head_dim=16, sliding_window=5, attn_logit_softcapping=5.0,
                    final_logit_softcapping=3.0), 2),
    "mistral": (dict(sliding_window=5), 5),
    "gpt_oss": (dict(head_dim=16, sliding_window=5, num_local_experts=4, num_experts_per_tok=2,
                     layer_types=["sliding_attention", "full_attention", "sliding_attention"]), 3),
    "mixtral": (dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None), 6),
}


@pytest.fixture(scope="module", params=list(ARCHS))
def greedy_case(request):
    overrides, seed = ARCHS[request.param]
    reference_model = random_model(tiny_config(request.param, vocab=GREEDY_VOCAB, **overrides),
                                   seed)
    want, gaps = zip(*(transformers_greedy(reference_model, p, N_NEW) for p in PROMPTS))
    assert min(gaps) >= MIN_GAP, f"seed {seed}: a near-tie ({min(gaps):.1e}); pick another"
    target = HFModel(copy.deepcopy(reference_model))
    small = HFModel(truncated(reference_model, 1))
    return target, small, list(want)


@pytest.mark.parametrize("k", [3, "auto"])
@pytest.mark.parametrize("source", ["ngram", "model", "early_exit"])
def test_greedy_speculation_equals_transformers_generate(greedy_case, source, k):
    target, small, want = greedy_case
    draft = {"ngram": NGram(1, 3), "model": small,
             "early_exit": EarlyExit(target, num_layers=1)}[source]
    dec, results = speculate(target, draft, PROMPTS, N_NEW, k=k)
    assert dec.shares_target_cache == (source == "early_exit")
    assert [r.tokens for r in results] == want
    assert all(r.finish_reason == "length" for r in results)
    proposed = sum(r.stats["proposed"] for r in results)
    accepted = sum(r.stats["accepted"] for r in results)
    if k == "auto":
        assert proposed > 0
    else:  # both paths taken: accepted drafts, and rejected ones rolled back
        assert 0 < accepted < proposed, (proposed, accepted)


def test_chunked_prefill_equals_transformers_generate(greedy_case):
    """A budget of 6 tokens a step: the 24-token prompt that joins late is prefilled in
    chunks next to the others' verify rows (rows without logits); HFModel's output is
    still transformers' greedy output."""
    target, small, want = greedy_case
    dec, results = speculate(target, small, PROMPTS, N_NEW, k=3, max_tokens_per_step=6)
    assert [r.tokens for r in results] == want
    assert results[-1].stats["prefill_chunks"] >= 3


# --------------------------------------------------------------------------- sampled

# The distribution of DEPTH-token continuations of SAMPLE_PROMPT over a SV-token
# vocabulary, against the target's own, enumerated with transformers' forward. G-test of
# tests/exactness.py; false-alarm rate exactness.ALPHA per test (fixed seeds: each case is
# deterministic, a correct decoder would fail one with probability ALPHA over seeds).
SV, DEPTH = 5, 3
SAMPLE_PROMPT = [0, 1, 0]
SAMPLE_ROWS, ROWS_PER_CALL = 8000, 1000


def exact_joint(model, prompt, policy, vocab):
    """P(x_1..x_DEPTH | prompt) under the policy, transformers' full forward over every
    prefix: float64 [vocab ** DEPTH], row-major (the code of x is sum x_i vocab^(DEPTH-i))."""
    joint = torch.ones(1, dtype=torch.float64)
    prefixes = torch.tensor([prompt])
    for _ in range(DEPTH):
        with torch.no_grad():
            logits = model(prefixes).logits[:, -1].float()
        joint = (joint[:, None] * reference.apply_policy(logits, **policy).double()).reshape(-1)
        prefixes = torch.cat([prefixes.repeat_interleave(vocab, 0),
                              torch.arange(vocab).repeat(len(prefixes))[:, None]], dim=1)
    return joint / joint.sum()


def sampled_joint(dec, prompt, policy, vocab, *, seed):
    """Counts of the SAMPLE_ROWS continuations' codes, and the decoder's (proposed,
    accepted) over them."""
    observed = torch.zeros(vocab ** DEPTH, dtype=torch.float64)
    place = vocab ** torch.arange(DEPTH - 1, -1, -1)
    proposed = accepted = 0
    # the decoder's stream (verify's rule) from `seed`, continued from call to call; the
    # keyed rule's exactness is tested in test_decoder.py
    dec._core.reseed(seed)
    for _ in range(SAMPLE_ROWS // ROWS_PER_CALL):
        results = dec.generate([prompt] * ROWS_PER_CALL, max_new_tokens=DEPTH, **policy)
        codes = (torch.tensor([r.tokens for r in results]) * place).sum(dim=1)
        observed += torch.bincount(codes, minlength=vocab ** DEPTH)
        proposed += sum(r.stats["proposed"] for r in results)
        accepted += sum(r.stats["accepted"] for r in results)
    return observed, proposed, accepted


def distribution_p_value(dec, reference_model, policy, vocab=SV, *, seed):
    observed, proposed, accepted = sampled_joint(dec, SAMPLE_PROMPT, policy, vocab, seed=seed)
    p_value, *_ = exactness._g_test(observed, exact_joint(reference_model, SAMPLE_PROMPT,
                                                          policy, vocab))
    return p_value, proposed, accepted


def sampling_decoder(target, draft):
    return SpecDecoder(target, draft, k=2, num_blocks=5000, block_size=2)


@pytest.fixture(scope="module")
def sampling():
    """A 2-layer qwen2 target (a full layer, then a sliding one of window 2, which the
    6-token sequences exceed), its reference copy and an unrelated 1-layer gemma2 draft
    (softcaps: its proposals are often rejected)."""
    small = dict(vocab=SV, layers=2, hidden=32, num_attention_heads=2, num_key_value_heads=1,
                 max_position_embeddings=64)
    reference_model = random_model(tiny_config(
        "qwen2", **small, sliding_window=2, use_sliding_window=True, max_window_layers=1,
        layer_types=["full_attention", "sliding_attention"]), 7, norm_spread=0.1)
    draft = random_model(tiny_config("gemma2", **{**small, "layers": 1}, head_dim=16,
                                     attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
                         8, norm_spread=0.1)
    return reference_model, HFModel(copy.deepcopy(reference_model)), HFModel(draft)


SAMPLED = {
    "model": dict(temperature=0.8, top_k=4),
    "ngram": dict(temperature=0.8, top_k=4),
    "early_exit": dict(temperature=1.0, top_p=0.9, min_p=0.05),
}


@pytest.mark.parametrize("source", list(SAMPLED))
def test_sampled_speculation_has_the_target_distribution(sampling, source):
    reference_model, target, draft = sampling
    draft = {"model": draft, "ngram": NGram(1, 2),
             "early_exit": EarlyExit(target, num_layers=1)}[source]
    p_value, proposed, accepted = distribution_p_value(
        sampling_decoder(target, draft), reference_model, SAMPLED[source], seed=100)
    assert 0 < accepted < proposed, (proposed, accepted)
    assert p_value > exactness.ALPHA


def _verify_without_policy():
    """ops whose verify judges the drafts by the target's plain softmax (no top-k)."""
    from types import SimpleNamespace

    from verispec import ops

    def verify(*args, **kw):
        return ops.verify(*args, **{**kw, "top_k": 0, "top_p": 1.0, "min_p": 0.0})

    return SimpleNamespace(apply_policy=ops.apply_policy, sample=ops.sample, verify=verify)


@pytest.mark.parametrize("wrong", ["draft_q", "verify_policy", "adapter_window"])
def test_the_sampled_test_has_power(sampling, wrong, monkeypatch):
    """The same test rejects: q that is not the distribution the proposals were drawn
    from (the draft's sharpened softmax), a verify without the top-k of the policy (n-gram
    drafts), and an adapter that ignores the sliding window (an early-exit draft)."""
    reference_model, target, draft = sampling
    policy = SAMPLED["model"]
    if wrong == "draft_q":
        real = SpecDecoder._sample_draft

        def wrong_q(self, logits, pol, seed, offset):
            tokens, _ = real(self, logits, pol, seed, offset)
            return tokens, torch.softmax(logits.float() * 3, dim=-1)

        monkeypatch.setattr(SpecDecoder, "_sample_draft", wrong_q)
        dec = sampling_decoder(target, draft)
    elif wrong == "verify_policy":
        dec = SpecDecoder(target, NGram(1, 2), k=2, num_blocks=5000, block_size=2,
                          ops=_verify_without_policy())
    else:
        real_attend = vhf._Plan.attend

        def no_window(self, module, query, key, value, *, window, **kw):
            return real_attend(self, module, query, key, value, window=None, **kw)

        monkeypatch.setattr(vhf._Plan, "attend", no_window)
        dec = sampling_decoder(target, EarlyExit(target, num_layers=1))
    p_value, _, _ = distribution_p_value(dec, reference_model, policy, seed=100)
    assert p_value < exactness.ALPHA


# --------------------------------------------------------------------------- vocabularies

# One tokenizer of TOKENS ids, models of other vocabulary sizes (padded embedding tables).
# The target (phi: its head has a bias) has GREEDY_VOCAB rows; the bias of the rows past
# TOKENS is -1e4, so it never emits them, as a trained model never emits padding. A smaller
# draft has exactly the TOKENS rows; a larger one LARGER rows, whose padding rows get the
# largest logits: a decoder that kept them would propose ids the target does not have.
TOKENS, LARGER = 64, 128
VOCAB_PROMPTS = [[5, 17, 42, 42, 9, 60, 3, 7, 7, 50, 1, 5, 17, 42], [8, 2, 13],
                 [4, 4, 4, 4, 30, 31, 32, 30, 31, 32, 30, 31, 32, 11, 12, 13, 11, 12, 13, 11,
                  12, 13, 4, 4]]


def padded_head_model(vocab, tokens, seed, **config):
    model = random_model(tiny_config("phi", vocab=vocab, **config), seed)
    with torch.no_grad():
        model.lm_head.bias[tokens:] = -1e4
    return model


def resized(model, vocab, *, layers=1, padding_logit=1e4):
    """A `layers`-layer copy of `model` with `vocab` embedding and head rows: the rows of
    ids both have keep their weights; rows past the model's are random, with head bias
    `padding_logit`."""
    config = copy.deepcopy(model.config)
    config.num_hidden_layers, config.vocab_size = layers, vocab
    small = random_model(config, 99)
    have = model.state_dict()
    shared = min(vocab, model.config.vocab_size)
    with torch.no_grad():
        for name, weights in small.state_dict().items():  # dim 0 of a vocab-sized tensor
            weights[:shared] = have[name][:shared]      # is the token id
        small.lm_head.bias[model.config.vocab_size:] = padding_logit
    return small


@pytest.fixture(scope="module")
def padded():
    reference_model = padded_head_model(GREEDY_VOCAB, TOKENS, 2)
    want, gaps = zip(*(transformers_greedy(reference_model, p, N_NEW) for p in VOCAB_PROMPTS))
    assert min(gaps) >= MIN_GAP, f"a near-tie ({min(gaps):.1e}); pick another seed"
    assert max(max(w) for w in want) < TOKENS
    drafts = {"smaller": HFModel(resized(reference_model, TOKENS)),
              "larger": HFModel(resized(reference_model, LARGER))}
    return HFModel(copy.deepcopy(reference_model)), drafts, list(want)


@pytest.mark.parametrize("size", ["smaller", "larger"])
def test_greedy_with_a_draft_of_another_vocabulary_size(padded, size):
    target, drafts, want = padded
    assert drafts[size].geometry.vocab_size == {"smaller": TOKENS, "larger": LARGER}[size]
    _, results = speculate(target, drafts[size], VOCAB_PROMPTS, N_NEW, k=3)
    assert [r.tokens for r in results] == want
    proposed = sum(r.stats["proposed"] for r in results)
    assert 0 < sum(r.stats["accepted"] for r in results) < proposed


def test_a_context_id_past_a_smaller_draft_vocabulary(padded):
    """Ids below the target's vocabulary are valid input; a smaller draft cannot embed the
    ones past its own, but the output must still be the target's."""
    target, drafts, _ = padded
    prompt = [5, 17, 80, 17]
    want = [r.tokens for r in SpecDecoder(target, None, num_blocks=16, block_size=4).generate(
        [prompt], max_new_tokens=8, greedy=True)]
    dec = SpecDecoder(target, drafts["smaller"], k=3, num_blocks=16, block_size=4)
    got = [r.tokens for r in dec.generate([prompt], max_new_tokens=8, greedy=True)]
    assert got == want


@pytest.mark.parametrize("size", ["smaller", "larger"])
def test_sampled_with_a_draft_of_another_vocabulary_size(size):
    """The target has SV + 1 rows, SV of them tokens; the drafts SV and SV + 3 rows."""
    reference_model = padded_head_model(SV + 1, SV, 7, layers=2, hidden=32,
                                        num_attention_heads=2, num_key_value_heads=1,
                                        max_position_embeddings=64)
    draft = HFModel(resized(reference_model, {"smaller": SV, "larger": SV + 3}[size]))
    dec = sampling_decoder(HFModel(copy.deepcopy(reference_model)), draft)
    policy = dict(temperature=1.0)
    p_value, proposed, accepted = distribution_p_value(dec, reference_model, policy, SV + 1,
                                                       seed=200)
    assert 0 < accepted < proposed, (proposed, accepted)
    assert p_value > exactness.ALPHA


def word_tokenizer(words):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def test_a_draft_with_another_tokenizer_is_refused():
    words = ["<unk>"] + [f"w{i}" for i in range(1, TOKENS)]
    swapped = words[:1] + [words[2], words[1]] + words[3:]  # the same tokens, two ids swapped
    reference_model = padded_head_model(GREEDY_VOCAB, TOKENS, 2, layers=2)
    target = HFModel(copy.deepcopy(reference_model), tokenizer=word_tokenizer(words))
    other = HFModel(resized(reference_model, LARGER), tokenizer=word_tokenizer(swapped))
    assert target.tokenizer_fingerprint != other.tokenizer_fingerprint
    with pytest.raises(ValueError, match=(
            f"the draft's tokenizer must be the target's.*target "
            f"{target.tokenizer_fingerprint}, draft {other.tokenizer_fingerprint}")):
        SpecDecoder(target, other)
    # the same vocabulary (transformers' tokenizer of it) is accepted, also with another
    # vocabulary size; an early exit keeps the target's tokenizer
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=word_tokenizer(words))
    same = HFModel(resized(reference_model, LARGER), tokenizer=fast)
    assert same.tokenizer_fingerprint == target.tokenizer_fingerprint
    for draft in (same, EarlyExit(target, num_layers=1)):
        dec = SpecDecoder(target, draft, k=2, num_blocks=16, block_size=4)
        (r,) = dec.generate([[1, 2, 3]], max_new_tokens=4, greedy=True)
        assert len(r.tokens) == 4


# --------------------------------------------------------------------------- SmolLM2

SMOLLM2_ATOL = 1e-4  # float32 log-probabilities, adapter vs native
# float32 logits, adapter vs native, as a fraction of the largest logit (as test_models'
# transformers check): 30 layers summed in different orders (the native model's
# quantized-weight kernels and attention vs transformers' modules); measured 3.6e-6.
SMOLLM2_RTOL = 5e-6


@pytest.fixture(scope="module")
def smollm2_adapter(smollm2):
    """transformers' LlamaForCausalLM on the GGUF's weights, through the adapter: as
    test_models' smollm2_transformers, but read with verispec's GGUFFile (which test_models
    checks against gguf's reader, bit for bit) and without transformers' random
    initialisation, ~20 s faster."""
    from verispec.models.gguf_file import GGUFFile

    path, _, tok = smollm2
    names = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
             "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
             "token_embd": "model.embed_tokens", "output_norm": "model.norm"}
    heads = {"attn_q": SMOLLM2_CONFIG["num_attention_heads"],
             "attn_k": SMOLLM2_CONFIG["num_key_value_heads"]}
    gguf = GGUFFile(path)
    state = {}
    for name in gguf.tensors:
        parts = name.split(".")
        kind = parts[2] if parts[0] == "blk" else parts[0]
        values = gguf.tensor(name)
        if kind in heads:
            values = torch.from_numpy(np.ascontiguousarray(
                _unpermute_like_transformers(values.numpy(), heads[kind])))
        key = (f"model.layers.{parts[1]}.{names[kind]}.weight" if parts[0] == "blk"
               else f"{names[kind]}.weight")
        state[key] = values
    config = transformers.LlamaConfig(rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                                      **SMOLLM2_CONFIG)
    try:  # every weight is loaded below
        from transformers.initialization import no_init_weights
    except ImportError:
        no_init_weights = contextlib.nullcontext
    with no_init_weights():
        hf = transformers.LlamaForCausalLM(config).eval()
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    hf.tie_weights()
    return HFModel(hf, tokenizer=tok)


def prefill_logits(model, ids):
    runner = PagedRunner(model, num_blocks=8, block_size=16)
    return runner.step({runner.add_sequence(): ids}, all_logits=False)[0]


def test_smollm2_adapter_logits_equal_the_native_llama(smollm2, smollm2_adapter):
    """Two sequences in one batch: prefills, three decode steps, then a verify-shaped
    step (4 tokens next to 1); and the early exits of both after 8 layers."""
    _, native, tok = smollm2
    adapter = smollm2_adapter
    assert adapter.geometry.vocab_size == native.geometry.vocab_size == 49152
    assert adapter.tokenizer_fingerprint == native.tokenizer_fingerprint is not None
    chat = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}],
                                   tokenize=True)
    other = tok.encode("Paged caches make speculative decoding cheap because")
    runners = [PagedRunner(m, num_blocks=32, block_size=16) for m in (adapter, native)]
    seqs = [(r.add_sequence(), r.add_sequence()) for r in runners]

    def step(new):  # one batch of both sequences in both engines: max |diff|, native logits
        got, want = (r.step(dict(zip(s, new))) for r, s in zip(runners, seqs))
        return max((x - y).abs().max().item() for x, y in zip(got, want)), want

    worst, logits = step((chat, other))
    g = torch.Generator().manual_seed(6)
    for n in (1, 1, 1, 4):  # decode steps, then a verify row of 4 tokens next to a decode row
        first = [row[-1].argmax().item() for row in logits]
        diff, logits = step(([first[0]] + torch.randint(0, 49152, (n - 1,), generator=g).tolist(),
                             [first[1]]))
        worst = max(worst, diff)
    scale = max(row.abs().max().item() for row in logits)
    assert worst < SMOLLM2_RTOL * scale, f"max |logit diff| adapter vs native {worst:.2e}"
    got, want = (prefill_logits(m.early_exit(8), other) for m in (adapter, native))
    assert (got - want).abs().max().item() < SMOLLM2_RTOL * want.abs().max().item()


def test_smollm2_adapter_speculation_equals_the_native_llama(smollm2, smollm2_adapter):
    """32 greedy tokens with an n-gram draft, through the adapter and natively: the same
    tokens. (The native greedy path keeps top-1 at least MIN_GAP above top-2, 10x the
    logits' agreement, so no rounding can flip a token.)"""
    _, native, tok = smollm2
    adapter = smollm2_adapter
    prompts = [tok.encode("Repeat after me: the red fox, the red fox, the red fox,"),
               tok.encode("def add(a, b):\n    return")]
    out = {}
    for name, model in (("adapter", adapter), ("native", native)):
        dec = SpecDecoder(model, NGram(1, 3), k=3, num_blocks=64, block_size=16)
        out[name] = dec.generate(prompts, max_new_tokens=32, greedy=True)
    assert [r.tokens for r in out["adapter"]] == [r.tokens for r in out["native"]]
    assert sum(r.stats["accepted"] for r in out["adapter"]) > 0
    runner = PagedRunner(native, num_blocks=16, block_size=16)
    for prompt, r in zip(prompts, out["native"]):
        logits = runner.step({runner.add_sequence(): prompt + r.tokens})[0][len(prompt) - 1:-1]
        top = logits.topk(2, dim=-1).values
        assert torch.equal(logits.argmax(-1), torch.tensor(r.tokens))
        assert (top[:, 0] - top[:, 1]).min().item() >= MIN_GAP


def test_smollm2_logprobs_equal_transformers_log_softmax(smollm2, smollm2_adapter):
    """Logprobs of speculative decoding (n-gram drafts, sampled with top-p) on the native
    SmolLM2: the raw ones equal transformers' log-softmax of its own forward over the
    sequence, the policy-applied ones the reference policy on those logits, within the
    logits' agreement (1e-4); greedy, they equal plain decoding's report."""
    _, native, tok = smollm2
    hf = smollm2_adapter.model
    prompt = tok.encode("Repeat after me: the red fox, the red fox, the red fox,")
    policy = dict(temperature=0.8, top_p=0.9)
    dec = SpecDecoder(native, NGram(1, 3), k=3, num_blocks=64, block_size=16)
    (r,) = dec.generate([prompt], max_new_tokens=16, seed=2, logprobs=3, **policy)
    assert r.stats["accepted"] > 0
    smollm2_adapter.native_linear = smollm2_adapter.native_norm = False
    hf.set_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + r.tokens])).logits[0, len(prompt) - 1:-1]
    finally:
        hf.set_attn_implementation(vhf.ATTN_IMPLEMENTATION)
        smollm2_adapter.native_linear = smollm2_adapter.native_norm = True
    raw = torch.log_softmax(logits.double(), -1)
    applied = torch.log(reference.apply_policy(logits, **policy).double())
    for j, (token, lp) in enumerate(zip(r.tokens, r.logprobs)):
        assert abs(lp.raw_logprob - raw[j, token].item()) < SMOLLM2_ATOL
        assert abs(lp.logprob - applied[j, token].item()) < SMOLLM2_ATOL
        assert [t for t, _, _ in lp.top] == raw[j].topk(3).indices.tolist()
    # greedy: the same tokens and logprobs as plain decoding reports them
    plain = SpecDecoder(native, None, num_blocks=64, block_size=16).generate(
        [prompt], max_new_tokens=16, greedy=True, logprobs=1)[0]
    spec = SpecDecoder(native, NGram(1, 3), k=3, num_blocks=64, block_size=16).generate(
        [prompt], max_new_tokens=16, greedy=True, logprobs=1)[0]
    assert spec.tokens == plain.tokens
    for a, b in zip(spec.logprobs, plain.logprobs):
        assert abs(a.raw_logprob - b.raw_logprob) < SMOLLM2_ATOL and a.logprob == b.logprob == 0.0
