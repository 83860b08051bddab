"""Self-speculation: the target's first layers, its final norm and head, as the draft."""

from __future__ import annotations

import torch

from verispec.drafters.base import DraftSpec
from verispec.models.base import Model, ModelGeometry, PagedBatch

__all__ = ["EarlyExit"]


class EarlyExit:
    """Self-speculative draft: the first ``num_layers`` layers of ``target``.

    The target must offer ``early_exit(num_layers)`` returning a model that shares its
    weights (verispec's LlamaModel does). SpecDecoder gives the draft the target's own
    KV pools for those layers: the K/V the target wrote for committed tokens are what
    the draft would compute, so the draft never catches up on its own.
    """

    def __init__(self, target: Model, num_layers: int) -> None:
        if not hasattr(target, "early_exit"):
            raise TypeError(f"EarlyExit: target must offer early_exit(num_layers), "
                            f"got {type(target).__name__}")
        layers = target.geometry.num_layers
        if not isinstance(num_layers, int) or not 1 <= num_layers < layers:
            raise ValueError(f"EarlyExit: num_layers must be in [1, {layers - 1}] "
                             f"(the target has {layers}), got {num_layers!r}")
        self.target = target
        self.num_layers = num_layers
        self.model = target.early_exit(num_layers)

    @property
    def geometry(self) -> ModelGeometry:
        return self.model.geometry

    def forward(self, batch: PagedBatch) -> torch.Tensor:
        return self.model.forward(batch)

    def spec(self, target: Model) -> DraftSpec:
        """Draft passes through the first layers; the target's own cache for them when
        ``target`` is the model they were taken from (the K/V it wrote are what the draft
        would compute), else a cache of their own."""
        return DraftSpec(kind="model", model=self.model,
                         cache="target" if target is self.target else "own")
