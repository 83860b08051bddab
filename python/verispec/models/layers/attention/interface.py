"""What every attention backend is: ``plan`` once a forward, ``attend`` once a layer.

The call shape mirrors FlashInfer's wrappers (``plan()`` once a batch, ``run()`` per layer):

- ``plan(plan)``, before the first layer writes the cache: whatever does not depend on the
  layer (gather indices, page tables, the kernels' checks of the batch: a bad batch
  raises here and changes nothing). ``plan`` is the forward's ``layers.PagedPlan``
  (HFModel's is a subclass).
- ``attend(plan, q, k_pool, v_pool, *, scaling, window, softcap, sinks)``, per layer, the
  new tokens' K/V already written: q [T, H, Dk] against each row's keys -> [T, H, Dv].
  The pools come in ONE form, a layer's pools as ``KVPools`` holds them:
  k_pool [blocks, block_size, KvH, Dk], v_pool [blocks, block_size, KvH, Dv]; a backend
  views them as it needs (flat slots for torch gathers, pages for FlashInfer, raw
  pointers for the CPU kernel). What a backend cannot do itself (a softcap, sinks, a
  layout its kernel does not read) it hands to its ``fallback``.
- ``write_attend(...)`` (optional): the cache write and the attention in one call, on the
  tensors a transformers layer passes; None when the backend has no such call or it
  does not apply (the caller then writes and calls ``attend``).
- ``attend_static(inputs, q, k_pool, v_pool, *, scaling)`` (``capturable`` backends): the
  same attention at a CUDA-graph bucket's fixed shapes, reading only the bucket's static
  device buffers (``layers.graphs.GraphInputs``), so a captured graph replays it.

A backend's class says where it runs (``refuse``: why not on a device and dtype, None
where it can), whether graphs may capture it (``capturable``) and whether it comes with
the model's CPU layer kernels (``layer_kernels``: the native backend, whose cache write
is fused with RoPE in ``LlamaModel``'s ``_NativeLayerOps``). The registry
(``attention.registry``) maps names to classes; models never test a backend's name.
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional

import torch

__all__ = ["AttentionBackend", "flat"]


def flat(pool: torch.Tensor) -> torch.Tensor:
    """A layer's pool [blocks, block_size, KvH, D] viewed as slots [blocks * block_size,
    KvH, D] (the same memory); a pool already flat as it is."""
    return pool if pool.dim() == 3 else pool.view(-1, *pool.shape[2:])


class AttentionBackend:
    """The interface (module docstring). Subclasses set ``name`` and implement ``attend``.

    Every backend is built the same way, ``Backend(sdpa_groups=..., batch_invariant=...)``:
    ``sdpa_groups`` asks for LlamaModel's rounding of the torch path (``TorchAttention``)
    wherever the backend attends in torch (itself or its fallback); ``batch_invariant``
    says the forward runs the batch-invariant mode (a backend whose rounding would follow
    what shares the pass must not then split rows by length)."""

    #: The name the registry and ``attention_backend`` know it by.
    name: ClassVar[str] = ""
    #: Whether ``attend_static`` exists: a graph of a bucket's forward may capture it.
    capturable: ClassVar[bool] = False
    #: Whether the model runs the rest of its layers' steps in verispec's CPU kernels
    #: with it (RoPE with the cache write, norms, SwiGLU: LlamaModel's _NativeLayerOps).
    layer_kernels: ClassVar[bool] = False

    def __init__(self, *, sdpa_groups: bool = False, batch_invariant: bool = False):
        self.sdpa_groups = sdpa_groups
        self.batch_invariant = batch_invariant

    @classmethod
    def refuse(cls, device: torch.device, dtype: torch.dtype) -> Optional[str]:
        """Why this backend cannot run for a model on ``device`` in ``dtype``, as the end
        of "backend 'name' ..." (None: it can)."""
        return None

    def plan(self, plan: Any) -> None:
        """Once a forward, before the first layer writes the cache (module docstring)."""

    def attend(self, plan: Any, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
               *, scaling: float, window: Optional[int] = None,
               softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None
               ) -> torch.Tensor:
        """q [T, H, Dk] against each row's keys in k_pool [blocks, block_size, KvH, Dk],
        v_pool [blocks, block_size, KvH, Dv] (the new tokens' K/V written) -> [T, H, Dv]."""
        raise NotImplementedError(f"{type(self).__name__}.attend")

    def write_attend(self, plan: Any, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, *,
                     scaling: float, window: Optional[int] = None,
                     softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None
                     ) -> Optional[torch.Tensor]:
        """The new tokens' K/V written and attended in one call, from a transformers
        layer's query [1, H, T, Dk], key [1, KvH, T, Dk], value [1, KvH, T, Dv] ->
        [1, T, H, Dv]; None (nothing written) where the backend has no such call."""
        return None

    def attend_static(self, inputs: Any, q: torch.Tensor, k_pool: torch.Tensor,
                      v_pool: torch.Tensor, *, scaling: float) -> torch.Tensor:
        """``capturable`` backends: q [tokens, H, Dk] of a bucket's padded tokens against
        each row's keys, from the bucket's static buffers only -> [tokens, H, Dv]."""
        raise NotImplementedError(f"attention backend {self.name!r} cannot be captured "
                                  f"in a graph (capturable is False)")
