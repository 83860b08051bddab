"""The drafter protocol: what SpecDecoder asks a drafter, instead of testing its type.

A drafter answers one question, ``spec(target) -> DraftSpec``: how it proposes (the
native n-gram lookup of the core, or draft passes through a model), which cache its
passes use (its own, the target's first layers', none), which of the target's hidden
states it reads (``Feature``), whether it can propose trees and what q verification
gets (one-hot for deterministic proposals, the sampled distribution otherwise). The
decoder builds everything from that answer; a new drafter is one new file implementing
``spec`` (and, for draft passes, a model whose ``forward(PagedBatch)`` returns logits).

    class MyDrafter:
        def spec(self, target) -> DraftSpec:
            return DraftSpec(kind="model", model=MyHead(target), cache="own",
                             features=(Feature.layer_input(2), Feature.final()))

Features are decided once: the target writes each asked-for hidden state of every
token it processes (prefill, decode, verify, trees) into a paged feature pool beside
its KV pools, at the token's ``slot_mapping`` (``KVPools.features``). The pools roll
back, move and copy with the cache, so a drafter needs no bookkeeping of its own for
chains, trees, batches or preemption; a draft pass reads them through the target's
block tables (``PagedBatch.target_features``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, runtime_checkable

import torch

__all__ = ["DraftModel", "DraftSpec", "Drafter", "Feature", "FeatureView", "as_drafter"]

_KINDS = ("layer_input", "layer_output", "final", "final_normed")


@dataclass(frozen=True)
class Feature:
    """One hidden state of the target per token, [hidden_size] in the target's dtype.

    ``layer_input(i)``: the residual stream entering decoder layer i (i = 0: the token's
    embedding); ``layer_output(i)``: leaving layer i, which is the stream entering layer
    i + 1; ``final()``: the last layer's output before the final norm; ``final_normed()``:
    after it (what the LM head reads). Two names of one stream are one pool
    (``key(num_layers)``)."""

    kind: str
    layer: Optional[int] = None

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"Feature: kind must be one of {_KINDS}, got {self.kind!r}")
        takes_layer = self.kind in ("layer_input", "layer_output")
        if takes_layer and (isinstance(self.layer, bool) or not isinstance(self.layer, int)
                            or self.layer < 0):
            raise ValueError(f"Feature: {self.kind} needs a layer index >= 0, got {self.layer!r}")
        if not takes_layer and self.layer is not None:
            raise ValueError(f"Feature: {self.kind} takes no layer, got layer={self.layer!r}")

    @classmethod
    def layer_input(cls, layer: int) -> "Feature":
        return cls("layer_input", layer)

    @classmethod
    def layer_output(cls, layer: int) -> "Feature":
        return cls("layer_output", layer)

    @classmethod
    def final(cls) -> "Feature":
        return cls("final")

    @classmethod
    def final_normed(cls) -> "Feature":
        return cls("final_normed")

    def key(self, num_layers: int) -> int:
        """The stream's index in a target of ``num_layers`` layers: r in [0, num_layers]
        is the residual stream entering layer r (num_layers: the final pre-norm state),
        num_layers + 1 the normed final state. ValueError naming the layer past the
        target's last."""
        if self.kind == "final_normed":
            return num_layers + 1
        if self.kind == "final":
            return num_layers
        r = self.layer + (self.kind == "layer_output")
        if r > num_layers or (self.kind == "layer_input" and self.layer >= num_layers):
            raise ValueError(f"Feature: {self.kind}({self.layer}) is past the target's last "
                             f"layer ({num_layers - 1}; the target has {num_layers} layers)")
        return r

    @staticmethod
    def describe_key(key: int, num_layers: int) -> str:
        from verispec.models.base import feature_name

        return feature_name(key, num_layers)


@dataclass
class FeatureView:
    """The target's feature pools as a draft pass reads them: ``pools[key]`` [num_blocks,
    block_size, hidden] (slot s: block s // block_size, offset s % block_size), and each row's
    target block table [B, M] (int32, -1 past its end) on the device. The feature of
    row b's token at position p lies at slot ``block_tables[b, p // block_size] *
    block_size + p % block_size``; a draft pass reads only positions the target has
    processed (committed tokens)."""

    pools: dict[int, torch.Tensor]
    block_tables: torch.Tensor
    block_size: int
    num_layers: int
    #: [B] int: each row's positions the target has processed before this step (its
    #: states there are written; at and past it they are not, or are the step's own).
    cached: Optional[torch.Tensor] = None

    def pool(self, feature: Feature) -> torch.Tensor:
        """The feature's pool as [slots, hidden]."""
        pool = self.pools[feature.key(self.num_layers)]
        return pool.view(-1, pool.shape[-1])

    def slots(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The target slots [T] of (row, position) pairs (device tensors, no wait)."""
        rows, positions = rows.long(), positions.long()
        blocks = self.block_tables[rows, positions // self.block_size].long()
        return blocks * self.block_size + positions % self.block_size

    def read(self, feature: Feature, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The feature [T, hidden] of each (row, position)."""
        return self.pool(feature).index_select(0, self.slots(rows, positions))


_CACHES = ("own", "target", "none")


@dataclass(frozen=True)
class DraftSpec:
    """What a drafter needs from SpecDecoder, and what it gives.

    kind         "lookup": the core proposes from its native n-gram index (``ngram``);
                 "model": draft passes through ``model.forward(PagedBatch)``
    model        the model of the draft passes (kind "model")
    cache        "own": KV pools of the model's geometry, caught up by the core;
                 "target": the target's first ``model.geometry.num_layers`` layers' pools,
                 which the target writes (no catch-up; early exit); "none" (lookup)
    features     the target's hidden states the draft passes read (``Feature``); the
                 target writes them for every token (``KVPools.features``)
    trees        whether it can propose trees: a lookup's tries (``ngram`` branches), a
                 model's children drawn from q (SpecDecoder's ``draft_branches``)
    one_hot      proposals are deterministic and verified by the one-hot rule (lookup);
                 otherwise q is the distribution each proposal was sampled from
    ngram        (min_n, max_n, branches) of a lookup
    own_features feature pools the draft's own cache holds (keys of its choosing,
                 allocated [num_blocks, block_size, model.geometry.hidden_size] in
                 KVPools.features of its pools): states it writes at a pass and reads at
                 the next, rolled back with its cache
    memory       a lookup's NGramMemory: earlier requests of a tenant its index reads
                 before the prompt (SpecDecoder.add's tenant); None: none
    draft_vocab  the target ids a model draft can propose (its logits are -inf elsewhere),
                 ascending, or None (any). SpecDecoder keeps q over them only (compact q:
                 verify reads it through ops.verify's draft_index)
    """

    kind: str
    model: Any = None
    cache: str = "own"
    features: tuple[Feature, ...] = ()
    trees: bool = True
    one_hot: bool = False
    ngram: Optional[tuple[int, int, int]] = None
    own_features: tuple[int, ...] = ()
    draft_vocab: Any = None
    memory: Any = None

    def __post_init__(self) -> None:
        if self.kind not in ("lookup", "model"):
            raise ValueError(f"DraftSpec: kind must be 'lookup' or 'model', got {self.kind!r}")
        if self.cache not in _CACHES:
            raise ValueError(f"DraftSpec: cache must be one of {_CACHES}, got {self.cache!r}")
        if self.kind == "lookup" and (self.ngram is None or self.model is not None
                                      or self.cache != "none"):
            raise ValueError("DraftSpec: a lookup drafter gives ngram=(min_n, max_n, branches), "
                             f"no model and cache='none'; got ngram={self.ngram!r}, "
                             f"model={self.model!r}, cache={self.cache!r}")
        if self.kind == "model" and (self.model is None or self.cache == "none"):
            raise ValueError(f"DraftSpec: a model drafter gives a model and a cache ('own' or "
                             f"'target'); got model={self.model!r}, cache={self.cache!r}")
        if not all(isinstance(f, Feature) for f in self.features):
            raise TypeError(f"DraftSpec: features must be Feature values, got {self.features!r}")
        if self.draft_vocab is not None:
            import torch

            ids = torch.as_tensor(self.draft_vocab)
            if (self.kind != "model" or ids.dim() != 1 or ids.numel() == 0
                    or ids.dtype.is_floating_point or ids.dtype == torch.bool
                    or bool((ids[1:] <= ids[:-1]).any()) or int(ids.min()) < 0):
                raise ValueError(f"DraftSpec: draft_vocab must be a model drafter's ascending "
                                 f"non-negative target ids (1-D, at least one), got "
                                 f"{self.draft_vocab!r} for kind {self.kind!r}")
            object.__setattr__(self, "draft_vocab", ids.long().cpu())  # frozen


@runtime_checkable
class Drafter(Protocol):
    def spec(self, target: Any) -> DraftSpec: ...


@dataclass
class DraftModel:
    """A separate draft model (any Model: its own weights, its own KV cache) as a
    drafter. ``SpecDecoder(target, model)`` wraps a model in it."""

    model: Any
    features: tuple[Feature, ...] = field(default=())

    def spec(self, target: Any) -> DraftSpec:
        return DraftSpec(kind="model", model=self.model, cache="own", features=self.features)


def as_drafter(draft: Any) -> Optional[Drafter]:
    """``draft`` as a drafter: None stays None, a drafter is itself, a model (the
    protocol of verispec.models.base.Model) becomes DraftModel(model). TypeError for
    anything else, naming what was given."""
    from verispec.models.base import Model

    if draft is None or isinstance(draft, Drafter):
        return draft
    if isinstance(draft, Model):
        return DraftModel(draft)
    raise TypeError(f"SpecDecoder: draft must be a drafter (verispec.drafters: NGram, "
                    f"EarlyExit, ...), a model implementing the model protocol (a .geometry "
                    f"and .forward(batch)) or None, got {type(draft).__name__}")
