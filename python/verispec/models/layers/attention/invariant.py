"""The batch-invariant mode's attention as a backend (:class:`BatchInvariantAttention`):
``layers.batch_invariant.attention``, each token over its own visible keys in
fixed-shape steps, so its bits do not depend on what shares the pass.

Not in the registry: no ``attention_backend`` name picks it; a model's batch-invariant
mode does (LlamaModel's _BatchInvariantOps, HFModel's forward plan), because the mode
needs its products and norms in fixed shapes too.
"""

from __future__ import annotations

from typing import Optional

import torch

from verispec.models.layers import batch_invariant as _bi
from verispec.models.layers.attention.interface import AttentionBackend, flat
from verispec.models.layers.paged import PagedPlan

__all__ = ["BatchInvariantAttention"]


class BatchInvariantAttention(AttentionBackend):
    """The batch-invariant mode's attention (module docstring): any device and dtype."""

    name = "batch_invariant"

    def plan(self, plan: PagedPlan) -> None:
        """Each new token's visible keys (``batch_invariant.KeyPlan``), built on the host
        before the first layer writes the cache."""
        self.keys = _bi.KeyPlan(plan.batch, plan.device)

    def attend(self, plan: PagedPlan, q: torch.Tensor, k_pool: torch.Tensor,
               v_pool: torch.Tensor, *, scaling: float, window: Optional[int] = None,
               softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None
               ) -> torch.Tensor:
        return _bi.attention(q, flat(k_pool), flat(v_pool), self.keys, scaling=scaling,
                             window=window, softcap=softcap, sinks=sinks)
