"""The attention both models call, over a forward's ``PagedPlan``: one interface, several
backends, picked by name from a registry.

- ``interface``: ``AttentionBackend``, what every backend is: ``plan(plan)`` once a
  forward, ``attend(plan, q, k_pool, v_pool, ...)`` per layer over the layer's pools in
  their one form [blocks, block_size, KvH, D], optionally ``write_attend`` (the cache
  write fused in) and ``attend_static`` (a CUDA-graph bucket's fixed shapes:
  ``capturable``).
- ``registry``: ``REGISTRY`` (name -> backend class, one line each), ``select_backend``
  (a name checked for a device and dtype; "auto" resolved) and ``resolve_backend`` (the
  backend a model's forward runs, the native kernels first where the model runs them).
- the backends, one file each: ``native`` (:class:`NativeAttention`, verispec's paged CPU
  kernel), ``sdpa`` (:class:`TorchAttention`, torch on any device: the fallback
  everywhere, and the one graphs capture), ``flashinfer_paged``
  (:class:`FlashInferAttention`, FlashInfer's paged kernels on CUDA), and ``invariant``
  (:class:`BatchInvariantAttention`, the batch-invariant mode's, chosen by that mode,
  not by name).

Every backend reads the new tokens' K/V from the pools: the caller writes them first
(``plan.write``), except where ``write_attend`` writes and attends in one call.
"""

from verispec.models.layers.attention.flashinfer_paged import (FlashInferAttention,
                                                               flashinfer_available)
from verispec.models.layers.attention.interface import AttentionBackend
from verispec.models.layers.attention.invariant import BatchInvariantAttention
from verispec.models.layers.attention.native import NativeAttention
from verispec.models.layers.attention.registry import (AUTO_ORDER, BACKENDS, REGISTRY,
                                                       backend_class, make_backend,
                                                       resolve_backend, select_backend)
from verispec.models.layers.attention.sdpa import (TorchAttention, attend_long_row,
                                                   attend_matmul)

__all__ = ["AUTO_ORDER", "AttentionBackend", "BACKENDS", "BatchInvariantAttention",
           "FlashInferAttention", "NativeAttention", "REGISTRY", "TorchAttention",
           "attend_long_row", "attend_matmul", "backend_class", "flashinfer_available",
           "make_backend", "resolve_backend", "select_backend"]
