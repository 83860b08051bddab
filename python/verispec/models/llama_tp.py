"""Tensor parallelism for the native Llama: which slice of the model a rank holds
(``TPShard``) and that slice of the weights (``shard_weights``), quantized matrices
kept in their formats. The split rules shared with HFModel are ``layers.tp``'s."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from verispec.models.layers.linear import matmul_layout
from verispec.models.layers.quantized import QUANT_FORMATS, QuantizedMatrix
from verispec.models.layers.tp import split_evenly, split_heads, split_vocab
from verispec.models.llama import LayerWeights, LlamaConfig, LlamaWeights

__all__ = ["TPShard", "shard_weights"]


@dataclass(frozen=True)
class TPShard:
    """What a tensor-parallel rank holds: [start, stop) ranges of the whole model's query
    heads, KV heads, MLP intermediate units and LM-head rows (vocabulary). The LM head is
    padded with zero rows to ``vocab_padded`` on every rank, so the ranks' slices have
    one size (all_gather needs it); the padding's logits are dropped after the gather."""

    rank: int
    world_size: int
    heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]
    vocab_padded: int

    @classmethod
    def of(cls, config: LlamaConfig, rank: int, world_size: int, *,
           intermediate_block: int = 1) -> "TPShard":
        """Rank ``rank``'s shard: KV heads split as evenly as possible (3 heads on 2 ranks:
        1 and 2), each query head with its KV head (grouped-query attention stays
        rank-local), intermediate units as evenly as possible in whole groups of
        ``intermediate_block`` (a quantized down projection's block: its row-parallel
        cut must fall on whole blocks; 1 for float weights), the vocabulary in slices of
        ceil(V / world_size) rows."""
        for name, value in (("world_size", world_size), ("rank", rank)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"TPShard: {name} must be an int, got {value!r}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"TPShard: expected world_size >= 1 and 0 <= rank < world_size, "
                             f"got rank {rank}, world_size {world_size}")
        nkv = config.num_key_value_heads
        if nkv < world_size:
            raise ValueError(f"TPShard: world_size must be <= num_key_value_heads = {nkv} (each "
                             f"rank holds at least one KV head), got {world_size}")
        inter, blk = config.intermediate_size, intermediate_block
        if isinstance(blk, bool) or not isinstance(blk, int) or blk < 1 or inter % blk:
            raise ValueError(f"TPShard: intermediate_block must be an int >= 1 that divides "
                             f"intermediate_size = {inter}, got {blk!r}")
        if inter // blk < world_size:
            whole = (f"intermediate_size = {inter}" if blk == 1 else
                     f"intermediate_size / intermediate_block = {inter} / {blk} = {inter // blk}")
            raise ValueError(f"TPShard: world_size must be <= {whole}, got {world_size}")
        heads, kv = split_heads(config.num_attention_heads, nkv, world_size, rank)
        vocab, padded = split_vocab(config.vocab_size, world_size, rank)
        i0, i1 = split_evenly(inter // blk, world_size, rank)
        return cls(rank=rank, world_size=world_size, heads=heads, kv_heads=kv,
                   intermediate=(i0 * blk, i1 * blk), vocab=vocab, vocab_padded=padded)

    @classmethod
    def for_weights(cls, config: LlamaConfig, weights: "LlamaWeights", rank: int,
                    world_size: int) -> "TPShard":
        """``of`` for these weights: a quantized model's intermediate units split in whole
        blocks of its down projections, and every rank's row-parallel cuts (O: at the
        ranks' query heads, down: at their intermediate units) checked against the blocks
        of the formats the matrices keep, on every rank alike (each rank raises the same
        ValueError, before any collective). Float matrices cut anywhere."""
        blocks = [m.block_elems() for lw in weights.layers for m in (lw.w_down,)
                  if isinstance(m, QuantizedMatrix)]
        block = math.lcm(*blocks) if blocks else 1
        if config.intermediate_size // block < world_size:  # (K is a multiple of each block)
            i, m = max(((i, lw.w_down) for i, lw in enumerate(weights.layers)
                        if isinstance(lw.w_down, QuantizedMatrix)),
                       key=lambda t: t[1].block_elems())
            fmt = _widest_format(m)
            raise ValueError(
                f"tensor parallelism over world size {world_size}: blk.{i}.ffn_down.weight "
                f"({fmt}, {list(m.shape)}) is row parallel, and its {m.k} input features are "
                f"{m.k // block} blocks of {block} weights: too few to give each of the "
                f"{world_size} ranks whole blocks (a block's scales cover all its weights, so "
                f"the quantized blocks cannot be cut). {_QUANT_TP_REMEDY}")
        shards = [cls.of(config, r, world_size, intermediate_block=block)
                  for r in range(world_size)]
        hd = config.head_dim
        for i, lw in enumerate(weights.layers):
            for what, m, cuts in (
                    ("attn_output", lw.wo, [(s.heads[0] * hd, s.heads[1] * hd, "query heads",
                                             s.rank) for s in shards]),
                    ("ffn_down", lw.w_down, [(*s.intermediate, "intermediate units", s.rank)
                                             for s in shards])):
                if not isinstance(m, QuantizedMatrix):
                    continue
                for p in m.parts:
                    b = QUANT_FORMATS[p.fmt][1]
                    bad = next(((a, z, unit, r) for a, z, unit, r in cuts if a % b or z % b),
                               None)
                    if bad is not None:
                        a, z, unit, r = bad
                        raise ValueError(
                            f"tensor parallelism over world size {world_size}: "
                            f"blk.{i}.{what}.weight ({p.fmt}, {list(m.shape)}) is row parallel, "
                            f"and rank {r} would keep its input features [{a}, {z}) (its "
                            f"{unit}), which do not start and end on multiples of {p.fmt}'s "
                            f"block of {b} weights: a block's scales cover all its weights, so "
                            f"the quantized blocks cannot be cut there. {_QUANT_TP_REMEDY}")
        return shards[rank]


_QUANT_TP_REMEDY = ("Use a world size whose cuts fall on whole blocks, or load the model "
                    "with dtype=torch.float32 (verispec generate --dtype float32) to shard "
                    "dequantized weights.")


def _widest_format(m: QuantizedMatrix) -> str:
    """The format of ``m``'s parts with the largest block."""
    return max(m.formats, key=lambda f: QUANT_FORMATS[f][1])


def shard_weights(config: LlamaConfig, weights: LlamaWeights, shard: TPShard) -> LlamaWeights:
    """The slice of ``weights`` (the whole model's) that ``shard``'s rank holds, as fresh
    tensors in the product layout (the whole model's can then be freed).

    Column-parallel (output rows split): the fused QKV (this rank's query heads, then its
    K and V heads), the fused gate/up (this rank's units of each). Row-parallel (input
    columns split, partial products summed by an all-reduce): O and down. Vocabulary
    parallel: the LM head's rows, zero-padded. Replicated: the norms and the embedding
    table (a lookup of a few rows; sharding it would cost another all-reduce per forward).

    Quantized matrices (QuantizedMatrix) keep their formats and bytes: rows are whole
    blocks, so the column-parallel cuts take any rows; a row-parallel cut takes whole
    blocks of every row (``QuantizedMatrix.select_columns``: ValueError where it would
    split one; ``TPShard.for_weights`` picks cuts that do not and names the tensor
    otherwise). Each slice is put in the layout of the quantized arithmetic.
    """
    c, hd = config, config.head_dim
    nh, nkv, inter = c.num_attention_heads, c.num_key_value_heads, c.intermediate_size
    (h0, h1), (k0, k1), (i0, i1) = shard.heads, shard.kv_heads, shard.intermediate

    def rows(w, *ranges: tuple[int, int]):
        if isinstance(w, QuantizedMatrix):
            return w.select_rows(ranges).for_arithmetic()
        return matmul_layout(torch.cat([w[a:b] for a, b in ranges]).contiguous())

    def columns(w, a: int, b: int):
        if isinstance(w, QuantizedMatrix):
            return w.select_columns(a, b).for_arithmetic()
        return matmul_layout(w[:, a:b].contiguous())

    layers = []
    for lw in weights.layers:
        q_off, k_off, v_off = 0, nh * hd, (nh + nkv) * hd
        layers.append(LayerWeights(
            attn_norm=lw.attn_norm.clone(),
            wqkv=rows(lw.wqkv, (q_off + h0 * hd, q_off + h1 * hd),
                      (k_off + k0 * hd, k_off + k1 * hd), (v_off + k0 * hd, v_off + k1 * hd)),
            wo=columns(lw.wo, h0 * hd, h1 * hd),
            mlp_norm=lw.mlp_norm.clone(),
            w_gate_up=rows(lw.w_gate_up, (i0, i1), (inter + i0, inter + i1)),
            w_down=columns(lw.w_down, i0, i1),
        ))
    v0, v1 = shard.vocab
    pad = shard.vocab_padded - (v1 - v0)
    if isinstance(weights.lm_head, QuantizedMatrix):
        # zero bytes are zero weights in every format; the padding's logits are dropped
        head = weights.lm_head.select_rows([(v0, v1)]).pad_rows(pad).for_arithmetic()
    else:
        head = weights.lm_head[v0:v1]
        if pad:
            head = torch.cat([head, head.new_zeros(pad, head.shape[1])])
        head = matmul_layout(head.contiguous())
    return LlamaWeights(embed=weights.embed, layers=layers, final_norm=weights.final_norm.clone(),
                        lm_head=head, file_types=dict(weights.file_types),
                        converted=weights.converted)
