"""Drive a Model through the real paged cache: a verispec.BlockAllocator + KVPools.

For tests, benchmarks and notebooks; the speculative decoder builds its batches natively.
Also random matrices in the quantized formats (``random_quant_blocks``).

    runner = PagedRunner(model, num_blocks=64, block_size=4)
    a, b = runner.add_sequence(), runner.add_sequence()
    logits = runner.step({a: prompt_a, b: prompt_b})    # one forward: [len_a, V], [len_b, V]
    logits = runner.step({a: [tok], b: [tok, d1, d2]})  # decode row + verify row
    runner.rollback(b, runner.length(b) - 2)            # drop two rejected tokens
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from verispec.models.base import KVPools, Model, PagedBatch

# Byte offsets of the 2-byte fields in each quantized format's block: its IEEE half scales
# (d, m, dmin; and IQ4_XS's 16-bit scales_h, which any value fills).
QUANT_HALF_FIELDS = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2],
                     "IQ4_NL": [0], "IQ4_XS": [0, 2], "Q2_K": [80, 82], "Q3_K": [108],
                     "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "F16": [], "BF16": []}


def random_quant_blocks(fmt: str, n: int, k: int, *, seed: int, scale: float = 0.01) -> torch.Tensor:
    """A random [n, k] matrix in quantized format ``fmt`` (uint8 [n, row_bytes], the file's
    layout): random quants and scale bytes, the half-float scales set to normal values of
    about ``scale`` (random bytes could be NaN or subnormal); F16 / BF16: normal values
    of about ``scale``, either sign."""
    import numpy as np

    from verispec.models.layers.quantized import QUANT_FORMATS

    _, block, size = QUANT_FORMATS[fmt]
    rng = np.random.default_rng(seed)
    if fmt in ("F16", "BF16"):
        w = torch.from_numpy(scale * rng.standard_normal((n, k)).astype(np.float32))
        return w.to(torch.float16 if fmt == "F16" else torch.bfloat16).view(torch.uint8)
    raw = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    for off in QUANT_HALF_FIELDS[fmt]:
        d = (scale * (0.5 + rng.random((n, k // block)))).astype(np.float16)
        raw[:, :, off:off + 2] = d.view(np.uint8).reshape(n, k // block, 2)
    return torch.from_numpy(raw.reshape(n, -1).copy())


class PagedRunner:
    def __init__(self, model: Model, *, num_blocks: int = 256, block_size: int = 16,
                 features: Sequence[int] = ()):
        """``features``: the feature-pool keys (verispec.drafters.Feature.key) the model
        is asked to write (KVPools.features); read them back with ``features_of``."""
        from verispec import BlockAllocator

        self.model = model
        self.allocator = BlockAllocator(num_blocks=num_blocks, block_size=block_size)
        self.kv = KVPools.allocate(model.geometry, num_blocks, block_size, features=features)

    def features_of(self, seq: int, key: int) -> torch.Tensor:
        """Feature pool ``key``'s rows [length, hidden] of ``seq``'s cached positions, in
        position order (through its block table)."""
        pool = self.kv.features[key]
        bs = pool.shape[1]
        n = self.allocator.length(seq)
        table = torch.tensor(self.allocator.block_table(seq), dtype=torch.long)
        pos = torch.arange(n)
        return pool.view(-1, pool.shape[-1])[(table[pos // bs] * bs + pos % bs).to(pool.device)]

    def add_sequence(self) -> int:
        return self.allocator.add_sequence()

    def length(self, seq: int) -> int:
        return self.allocator.length(seq)

    def rollback(self, seq: int, new_len: int) -> None:
        self.allocator.rollback(seq, new_len)

    def free(self, seq: int) -> None:
        self.allocator.free(seq)

    def make_batch(self, new_tokens: Mapping[int, Sequence[int]], *,
                   all_logits: bool = True) -> PagedBatch:
        """Appends the tokens to the allocator and describes them as one PagedBatch.

        Logits are requested for every new token (``all_logits``) or each row's last one.
        """
        seqs = list(new_tokens)
        counts = [len(new_tokens[s]) for s in seqs]
        starts = [self.allocator.length(s) for s in seqs]
        total = sum(counts)
        slot_mapping = torch.empty(total, dtype=torch.int32)
        self.allocator.append_batch(seqs, counts, slot_mapping)
        max_blocks = max(len(self.allocator.block_table(s)) for s in seqs)
        block_tables = torch.empty(len(seqs), max_blocks, dtype=torch.int32)
        self.allocator.fill_block_tables(seqs, block_tables)
        context_lens = torch.empty(len(seqs), dtype=torch.int32)
        self.allocator.fill_context_lens(seqs, context_lens)
        for src, dst, n in self.allocator.take_block_copies():
            self.kv.copy_blocks([(src, dst, n)])

        query_start = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int64)
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, counts)])
        if all_logits:
            logits_indices = torch.arange(total)
        else:
            logits_indices = query_start[1:] - 1
        device = self.model.geometry.device
        return PagedBatch(
            input_ids=torch.tensor([t for s in seqs for t in new_tokens[s]], dtype=torch.int64,
                                   device=device),
            positions=positions.to(device), slot_mapping=slot_mapping.to(device),
            block_tables=block_tables.to(device), context_lens=context_lens.to(device),
            query_start=query_start.to(device), logits_indices=logits_indices.to(device),
            kv=self.kv)

    def step(self, new_tokens: Mapping[int, Sequence[int]], *,
             all_logits: bool = True) -> list[torch.Tensor]:
        """One forward over the new tokens of several sequences; logits per row
        ([n_b, V] with ``all_logits``, else [1, V])."""
        batch = self.make_batch(new_tokens, all_logits=all_logits)
        logits = self.model.forward(batch)
        if not all_logits:
            return list(logits.split(1))
        return list(logits.split([len(t) for t in new_tokens.values()]))


def randomize_weights(module: torch.nn.Module, seed: int, *, norm_spread: float = 0.2) -> torch.nn.Module:
    """Deterministic random weights for a (transformers) module, in place.

    Norm weights become 1 + norm_spread * N(0, 1); matrices N(0, 1/fan_in), so logits
    are O(1..10) and a 1e-4 comparison is a real check. Returns the module.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() == 1:
                p.copy_(1.0 + norm_spread * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
    return module


def random_llama(*, vocab: int = 32000, hidden: int = 2048, intermediate: int = 5632,
                 layers: int = 22, heads: int = 32, kv_heads: int = 4, head_dim: int = 64,
                 max_context: int = 2048, seed: int = 0, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, batch_invariant: bool = False):
    """A LlamaModel with random weights made on ``device`` in ``dtype`` (default: the
    shape of TinyLlama-1.1B, ~1.1 B parameters): norm weights 1 + 0.1 N(0, 1), matrices
    N(0, 1 / fan_in), embeddings N(0, 1), so activations and logits stay O(1)."""
    from verispec.models.llama import LlamaConfig, LlamaModel, LlamaWeights

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-5,
                         rope_theta=10000.0, max_position_embeddings=max_context,
                         tie_word_embeddings=False)
    g = torch.Generator(device=device).manual_seed(seed)

    def matrix(n: int, k: int, scale: float) -> torch.Tensor:
        return (torch.randn(n, k, generator=g, device=device) * scale).to(dtype)

    def norm() -> torch.Tensor:
        return (1 + 0.1 * torch.randn(hidden, generator=g, device=device)).to(dtype)

    q, kv = heads * head_dim, kv_heads * head_dim
    state = {"model.embed_tokens.weight": matrix(vocab, hidden, 1.0),
             "lm_head.weight": matrix(vocab, hidden, hidden ** -0.5), "model.norm.weight": norm()}
    for i in range(layers):
        p = f"model.layers.{i}."
        state.update({
            p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm(),
            p + "self_attn.q_proj.weight": matrix(q, hidden, hidden ** -0.5),
            p + "self_attn.k_proj.weight": matrix(kv, hidden, hidden ** -0.5),
            p + "self_attn.v_proj.weight": matrix(kv, hidden, hidden ** -0.5),
            p + "self_attn.o_proj.weight": matrix(hidden, q, q ** -0.5),
            p + "mlp.gate_proj.weight": matrix(intermediate, hidden, hidden ** -0.5),
            p + "mlp.up_proj.weight": matrix(intermediate, hidden, hidden ** -0.5),
            p + "mlp.down_proj.weight": matrix(hidden, intermediate, intermediate ** -0.5)})
    with torch.no_grad():
        weights = LlamaWeights.from_state_dict(config, state, device=device, dtype=dtype)
    del state
    return LlamaModel(config, weights, max_context=max_context, batch_invariant=batch_invariant)
