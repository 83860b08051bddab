"""Tiny models that read their whole context back from the paged KV cache.

Each model writes (token, position) of every new token into layer 0's K pool at the
slot the decoder gave, then, for each requested logits row, gathers the row's cache
through its block table and returns logits that depend on the entire cached prefix
(via a hash of it). A stale or corrupted cache (a missing rollback, a wrong slot, a
lost copy) changes the logits or trips the integrity check, so decoder tests that
compare against plain autoregressive decoding catch it.
"""

from __future__ import annotations

import torch

from verispec.models.base import ModelGeometry, PagedBatch

MASK = (1 << 61) - 1


def prefix_hash(tokens) -> int:
    h = 1469598103934665603 & MASK
    for t in tokens:
        h = (h * 1099511628211 + int(t) + 7) & MASK
    return h


class CacheModel:
    """logits(prefix) = table[prefix_hash(prefix) % rows] (optionally + noise table)."""

    def __init__(self, vocab: int, *, table_rows: int = 97, seed: int = 0, scale: float = 2.0,
                 max_context: int = 256, base: "CacheModel | None" = None, noise: float = 0.0,
                 dtype=torch.float32, strict: bool = True) -> None:
        g = torch.Generator().manual_seed(seed)
        # strict: assert that every key read holds the position it should (a wrong mask or
        # an unmoved K/V fails at once); False: read whatever the cache and mask give (the
        # power tests see a wrong distribution instead)
        self.strict = strict
        if base is None:
            self.table = torch.randn(table_rows, vocab, generator=g) * scale
        else:  # a draft that resembles `base`
            self.table = base.table + noise * torch.randn(base.table.shape, generator=g)
        self.geometry = ModelGeometry(num_layers=1, num_kv_heads=1, head_dim=2, vocab_size=vocab,
                                      max_context=max_context, dtype=dtype,
                                      device=torch.device("cpu"))
        self.forward_calls = 0

    def logits_for(self, prefix) -> torch.Tensor:
        return self.table[prefix_hash(prefix) % self.table.shape[0]]

    def forward(self, batch: PagedBatch) -> torch.Tensor:
        self.forward_calls += 1
        k = batch.kv.k[0].view(-1, 2)
        bs = batch.kv.block_size
        write = batch.slot_mapping >= 0
        k[batch.slot_mapping[write].long()] = torch.stack(
            [batch.input_ids[write], batch.positions[write]], dim=1).to(k.dtype)
        qs = batch.query_start.tolist()
        out = []
        for t in batch.logits_indices.tolist():
            b = next(i for i in range(batch.num_rows) if qs[i] <= t < qs[i + 1])
            p = int(batch.positions[t])
            assert p < int(batch.context_lens[b]), "logits asked past the row's context"
            pos = torch.arange(p + 1)
            if batch.tree_mask is not None:  # the keys before the row's new tokens + the mask's
                ctx, n = int(batch.context_lens[b]), qs[b + 1] - qs[b]
                seen = [ctx - n + u - qs[b] for u in range(qs[b], qs[b + 1])
                        if bool(batch.tree_mask[t, u])]
                pos = torch.tensor(list(range(ctx - n)) + seen, dtype=torch.long)
                assert len(pos) == p + 1 or not self.strict, \
                    f"the tree mask shows {len(pos)} keys at position {p}"
            index = pos
            blocks = batch.block_tables[b, index // bs].long()
            assert (blocks >= 0).all(), "block table too short for the context"
            cached = k[blocks * bs + index % bs]
            want = torch.arange(len(index)).to(k.dtype)  # the positions the keys were written at
            assert torch.equal(cached[:, 1], want) or not self.strict, \
                f"cache corrupt at row {b}: {cached[:, 1]}"
            out.append(self.logits_for(cached[:, 0].long().tolist()))
        return torch.stack(out).to(self.geometry.dtype)


def train_byte_bpe(corpus, vocab_size: int = 300):
    """A byte-level BPE trained on ``corpus`` with three control tokens, like SmolLM2's
    (needs the ``tokenizers`` package)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    return tok


def write_tiny_llama(folder, chat_template: str, layers: int = 2):
    """A random Llama of ``layers`` layers (2 unless given) as a Hugging Face folder in
    ``folder`` (config.json, model.safetensors, tokenizer.json with a byte-level BPE,
    tokenizer_config.json with ``chat_template``); returns the folder."""
    import json
    import math

    import safetensors.torch as safetensors_torch

    tok = train_byte_bpe(["the quick brown fox jumps over the lazy dog"] * 4)
    tok.save(str(folder / "tokenizer.json"))
    vocab, hidden, inter, heads, kv_heads = tok.get_vocab_size(), 32, 64, 4, 2
    head_dim = hidden // heads
    g = torch.Generator().manual_seed(0)

    def mat(rows, cols):
        return torch.randn(rows, cols, generator=g) / math.sqrt(cols)

    state = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g),
             "model.norm.weight": torch.ones(hidden)}
    for i in range(layers):
        pre = f"model.layers.{i}."
        state.update({
            pre + "input_layernorm.weight": torch.ones(hidden),
            pre + "post_attention_layernorm.weight": torch.ones(hidden),
            pre + "self_attn.q_proj.weight": mat(heads * head_dim, hidden),
            pre + "self_attn.k_proj.weight": mat(kv_heads * head_dim, hidden),
            pre + "self_attn.v_proj.weight": mat(kv_heads * head_dim, hidden),
            pre + "self_attn.o_proj.weight": mat(hidden, heads * head_dim),
            pre + "mlp.gate_proj.weight": mat(inter, hidden),
            pre + "mlp.up_proj.weight": mat(inter, hidden),
            pre + "mlp.down_proj.weight": mat(hidden, inter)})
    safetensors_torch.save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(dict(
        model_type="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=512, tie_word_embeddings=True, rope_theta=10000.0,
        rms_norm_eps=1e-5)))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": chat_template, "eos_token": "<|im_end|>"}))
    return folder
