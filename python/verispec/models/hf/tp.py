"""Tensor parallelism for HFModel: a transformers model's own split plan, applied in place.

transformers' configs say, per architecture, how the base model's linear layers split
over ranks (``config.base_model_tp_plan``: ``"layers.*.self_attn.q_proj": "colwise"``,
``"layers.*.self_attn.o_proj": "rowwise"``, ...). ``plan_shard`` reads that plan against
the model and the attention geometry HFModel probed; ``apply_shard`` cuts the modules on
one rank. No per-architecture code: the plan names the layers, the probe the heads.

- ``colwise``: the rank keeps its slice of the output features (weight rows, bias).
  Inside an attention module the slice is whole heads, split as the native Llama splits
  them (``split_heads``: KV heads as evenly as possible, each query head with its KV
  head), so the attention is rank-local and the rank's pools hold its KV heads only;
  elsewhere (the MLP's gate / up) the features split evenly.
- ``rowwise``: the rank keeps the matching slice of the input features; the partial
  outputs are summed by an all-reduce (every rank receives the same bits) and the bias
  is added once, after the sum.
- ``replicated_with_grad_allreduce`` (per-head q / k norms) and ``embedding_rowwise``:
  left whole on every rank. Replication is exact; a vocabulary-parallel embedding would
  add an all-reduce per forward for a lookup of a few rows.
- The LM head (``get_output_embeddings()``, not in the base plan): vocabulary parallel
  as the native Llama's, ``ceil(V / world_size)`` rows zero-padded, and the slices
  all-gathered, so every rank holds the same V logits and the unchanged verify accepts
  the same tokens everywhere.

Refused (``ValueError`` naming the model type and the reason): configs without a plan,
mixtures of experts whose experts are stacked in one weight (a module with a parameter
of 3 or more dimensions, named whatever the plan says of it), plans that gather a split
output or split a replicated input (``colwise_gather_output``, ``rowwise_split_input``:
every rank would attend over every head), other mixture-of-experts styles, planned
modules that are not ``nn.Linear``, a world larger than a layer's KV heads, and plans
that leave an attention layer whole. Modules the plan does not name stay whole on
every rank (exact: HFModel's check of the cut compares the logits).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from verispec.models.hf.attention import refuse as hf_refuse
from verispec.models.layers.tp import split_evenly, split_heads, split_vocab

#: Plan styles verispec applies.
SPLIT_STYLES = ("colwise", "rowwise")
#: Plan styles whose modules stay whole on every rank (exact at inference).
REPLICATED_STYLES = ("replicated_with_grad_allreduce", "embedding_rowwise")


@dataclass(frozen=True)
class LinearCut:
    """One ``nn.Linear`` of the plan: ``style`` "colwise" keeps the output features of
    ``ranges`` (concatenated), "rowwise" the input features; ``name`` is its path in the
    wrapped model."""

    name: str
    module: torch.nn.Linear
    style: str
    ranges: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class ShardPlan:
    """What one rank cuts: the plan's linear layers and the LM head's rows."""

    rank: int
    world_size: int
    cuts: tuple[LinearCut, ...]
    lm_head: torch.nn.Linear
    vocab: tuple[int, int]
    vocab_padded: int


def _refuse(model: Any, why: str) -> ValueError:
    return hf_refuse(model, f"tensor parallelism: {why}")


def _pattern(key: str) -> re.Pattern:
    """A plan key ("layers.*.mlp.up_proj") as a regex over module names: * is an index."""
    return re.compile(r"\.".join(r"\d+" if part == "*" else re.escape(part)
                                 for part in key.split(".")))


def plan_shard(hf_model: Any, layers: Sequence[Any], world_size: int, rank: int) -> ShardPlan:
    """The cuts of rank ``rank`` of ``world_size``, from the config's
    ``base_model_tp_plan`` and ``layers`` (HFModel's probe records of the whole model:
    each attention module with its query / KV heads and head sizes)."""
    config = hf_model.config
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    model_type = getattr(text, "model_type", type(hf_model).__name__)
    plan = getattr(text, "base_model_tp_plan", None)
    if not plan:
        raise _refuse(hf_model, f"its config (model_type {model_type!r}) has no "
                                f"base_model_tp_plan: transformers names no split for it")
    base = hf_model.get_decoder() if hasattr(hf_model, "get_decoder") else hf_model.base_model
    full_name = {id(m): n for n, m in hf_model.named_modules()}
    # Decided from the modules, not from how a plan spells their style (transformers 5.24
    # planned Mixtral's experts as 'packed_colwise', 5.25 leaves them to its
    # expert-parallel plan): verispec cuts nn.Linear layers only, and would otherwise hold
    # every expert whole on every rank.
    for module in base.modules():
        if isinstance(module, torch.nn.modules.conv._ConvNd):
            continue  # a convolution's weight is 3-D or more without being experts
        stacked = [f"{n} {list(p.shape)}" for n, p in module.named_parameters(recurse=False)
                   if p.dim() >= 3]
        if stacked:
            raise _refuse(hf_model, f"model_type {model_type!r}: "
                                    f"{full_name[id(module)]} ({type(module).__name__}) "
                                    f"stacks its weights by expert ({', '.join(stacked)}), a "
                                    f"mixture of experts; verispec cuts nn.Linear layers only "
                                    f"and would hold every expert whole on every rank")
    modules = dict(base.named_modules())
    params = dict(base.named_parameters())

    # which attention layer (probe record) each module belongs to
    record_of: dict[int, Any] = {}
    for record in layers:
        for m in record.module.modules():
            record_of[id(m)] = record

    cuts: list[LinearCut] = []
    for key, style in plan.items():
        rx = _pattern(key)
        matched = [n for n in modules if rx.fullmatch(n)] + [
            n for n in params if rx.fullmatch(n)]
        if not matched or style in REPLICATED_STYLES:
            continue
        if style not in SPLIT_STYLES:
            kind = ("a mixture-of-experts style" if any(w in style for w in ("moe", "gemm",
                    "expert", "packed")) else "a style that gathers a split output or splits a "
                    "replicated input (every rank would attend over every head)")
            raise _refuse(hf_model, f"model_type {model_type!r}: its base_model_tp_plan splits "
                                    f"{key!r} as {style!r}, {kind}; verispec applies "
                                    f"{list(SPLIT_STYLES)} (and keeps "
                                    f"{list(REPLICATED_STYLES)} whole)")
        for name in matched:
            module = modules.get(name)
            if type(module) is not torch.nn.Linear:
                what = type(module).__name__ if module is not None else "a parameter"
                raise _refuse(hf_model, f"model_type {model_type!r}: {name!r} ({style}) must be "
                                        f"an nn.Linear, got {what}")
            cuts.append(LinearCut(name=full_name[id(module)], module=module, style=style,
                                  ranges=_ranges(hf_model, model_type, full_name[id(module)],
                                                 module, style, record_of.get(id(module)),
                                                 world_size, rank)))
    if not cuts:
        raise _refuse(hf_model, f"model_type {model_type!r}: its base_model_tp_plan "
                                f"{sorted(plan)} splits none of its linear layers")
    split = {id(record_of.get(id(c.module))) for c in cuts if c.style == "colwise"}
    for i, record in enumerate(layers):
        if id(record) not in split:
            raise _refuse(hf_model, f"model_type {model_type!r}: its base_model_tp_plan leaves "
                                    f"attention layer {i} ({type(record.module).__name__}) whole; "
                                    f"every rank's pools would hold all its heads")

    lm_head = hf_model.get_output_embeddings() if hasattr(
        hf_model, "get_output_embeddings") else None
    if type(lm_head) is not torch.nn.Linear:
        raise _refuse(hf_model, f"model_type {model_type!r}: its LM head "
                                f"(get_output_embeddings) must be an nn.Linear, got "
                                f"{type(lm_head).__name__}")
    vocab, padded = split_vocab(lm_head.out_features, world_size, rank)
    return ShardPlan(rank=rank, world_size=world_size, cuts=tuple(cuts), lm_head=lm_head,
                     vocab=vocab, vocab_padded=padded)


def _ranges(hf_model, model_type: str, name: str, module: torch.nn.Linear, style: str,
            record: Any, world_size: int, rank: int) -> tuple[tuple[int, int], ...]:
    """The features ``module`` keeps on this rank: whole heads inside an attention layer,
    an even split elsewhere."""
    n = module.out_features if style == "colwise" else module.in_features
    side = "output" if style == "colwise" else "input"
    if record is None:  # an MLP projection: intermediate units split evenly
        if n < world_size:
            raise _refuse(hf_model, f"model_type {model_type!r}: {name} has {n} {side} features, "
                                    f"fewer than world_size = {world_size}")
        return (split_evenly(n, world_size, rank),)
    h, kvh = record.num_heads, record.num_kv_heads
    if h % kvh:
        raise _refuse(hf_model, f"model_type {model_type!r}: {h} query heads are not a multiple "
                                f"of {kvh} KV heads")
    if world_size > kvh:
        raise _refuse(hf_model, f"model_type {model_type!r}: world_size must be <= "
                                f"num_key_value_heads = {kvh} (each rank holds at least one KV "
                                f"head), got {world_size}")
    (h0, h1), (k0, k1) = split_heads(h, kvh, world_size, rank)
    dq, dk, dv = record.q_head_dim, record.k_head_dim, record.v_head_dim
    if style == "colwise":  # Q, K or V: their heads' output features
        candidates = {(h * dq, (h0 * dq, h1 * dq)), (kvh * dk, (k0 * dk, k1 * dk)),
                      (kvh * dv, (k0 * dv, k1 * dv))}
        sizes = f"{h} x {dq} (Q), {kvh} x {dk} (K), {kvh} x {dv} (V)"
    else:  # O: the attention output's heads
        candidates = {(h * dv, (h0 * dv, h1 * dv))}
        sizes = f"{h} x {dv} (the attention output)"
    found = {r for size, r in candidates if size == n}
    if len(found) != 1:
        why = "ambiguous: it matches" if found else "not"
        raise _refuse(hf_model, f"model_type {model_type!r}: {name} ({style}) has {n} {side} "
                                f"features, {why} whole heads of {sizes}")
    return (found.pop(),)


def apply_shard(plan: ShardPlan, tp: Any) -> None:
    """Cuts the plan's modules in place (new, smaller parameters; the whole ones are freed
    when nothing else holds them) and hooks the collectives of ``tp`` onto them."""
    with torch.no_grad():
        for cut in plan.cuts:
            m = cut.module
            if cut.style == "colwise":
                m.weight = _param(torch.cat([m.weight[a:b] for a, b in cut.ranges]))
                if m.bias is not None:
                    m.bias = _param(torch.cat([m.bias[a:b] for a, b in cut.ranges]))
                m.out_features = m.weight.shape[0]
            else:
                m.weight = _param(torch.cat([m.weight[:, a:b] for a, b in cut.ranges], dim=1))
                m.in_features = m.weight.shape[1]
                # the bias is added once, after the ranks' partial products are summed
                m._verispec_reduce_bias = m.bias
                m.bias = None
                m._verispec_tp = tp
                m.register_forward_hook(_sum_over_ranks)
        head = plan.lm_head
        (lo, hi), padded = plan.vocab, plan.vocab_padded
        vocab_size = head.out_features
        rows = head.weight[lo:hi]
        head.weight = _param(torch.cat([rows, rows.new_zeros(padded - (hi - lo), rows.shape[1])]))
        if head.bias is not None:
            b = head.bias[lo:hi]
            head.bias = _param(torch.cat([b, b.new_zeros(padded - (hi - lo))]))
        head.out_features = padded
        head._verispec_tp = tp
        head._verispec_vocab_size = vocab_size
        head.register_forward_hook(_gather_vocab)


def _param(t: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(t.contiguous(), requires_grad=False)


def _sum_over_ranks(module, inputs, output: torch.Tensor) -> torch.Tensor:
    """Forward hook of a row-parallel linear: the sum of the ranks' partial products,
    plus the bias."""
    out = output if output.is_contiguous() else output.contiguous()
    module._verispec_tp.all_reduce(out)
    if module._verispec_reduce_bias is not None:
        out += module._verispec_reduce_bias
    return out


def _gather_vocab(module, inputs, output: torch.Tensor) -> torch.Tensor:
    """Forward hook of the vocabulary-parallel LM head: [..., padded slice] on each rank
    -> [..., V] on every rank."""
    lead, padded = output.shape[:-1], output.shape[-1]
    full = module._verispec_tp.gather_vocab(output.reshape(-1, padded),
                                            module._verispec_vocab_size)
    return full.reshape(*lead, module._verispec_vocab_size)
