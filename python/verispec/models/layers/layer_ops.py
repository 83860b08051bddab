"""The four ways a LlamaModel forward runs the steps between its matrix products (RoPE
with the cache write, attention, residual adds with RMSNorm, SwiGLU): one object per
forward, chosen by ``LlamaModel.forward``.

- ``_TorchLayerOps``: torch ops (any device, dtype), attention through the backends of
  ``layers.attention``;
- ``_BatchInvariantOps``: the torch batch-invariant mode (``layers.batch_invariant``);
- ``_BucketLayerOps``: a CUDA graph's captured forward at a bucket's fixed shapes
  (``layers.graphs``);
- ``_NativeLayerOps``: verispec's CPU kernels (``layers.kernels``), three calls a layer.

Each takes the model as an argument and reads its attributes (``_nh``, ``_nkv``,
``config``, ``geometry``, the RoPE tables ``_cos``/``_sin``, ``_norm_fn()``,
``_torch_attention()``); this module does not import models/llama.py (it sits below it).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F

from verispec.models.base import KVWrite, PagedBatch
from verispec.models.layers import batch_invariant as _bi
from verispec.models.layers import kernels
from verispec.models.layers import quantized as _quantized
from verispec.models.layers.attention import attend_long_row
from verispec.models.layers.graphs import GraphInputs
from verispec.models.layers.kernels import native_rms_norm
from verispec.models.layers.norm_rope import apply_rope
from verispec.models.layers.paged import KERNEL_MAX_QUERIES, NativeIndex, PagedPlan


class _TorchLayerOps:
    """A forward's steps between the matrix products in torch ops (any device, dtype)."""

    def __init__(self, model: Any, batch: PagedBatch, num_tokens: int,
                 positions: torch.Tensor):
        g = model.geometry
        self.model, self.nh, self.nkv, self.hd = model, model._nh, model._nkv, model.config.head_dim
        # the forward's paged plan, its groups built (and checked) before any write
        self.plan = PagedPlan(batch, g.device, who="LlamaModel.forward")
        self.plan.groups  # noqa: B018
        self.write = self.plan.write
        self.attention = model._torch_attention()
        self.scaling = 1.0 / math.sqrt(self.hd)
        self.norm = model._norm_fn()
        self.cos = model._cos[positions][:, None, :]                          # [T, 1, hd]
        self.sin = model._sin[positions][:, None, :]
        self.num_tokens = num_tokens

    def rope_write(self, qkv: torch.Tensor, k_pool: torch.Tensor,
                   v_pool: torch.Tensor) -> torch.Tensor:
        """RoPE of q and k, k and v written to the pools; returns q [T, nh, hd]."""
        nh, nkv, hd = self.nh, self.nkv, self.hd
        qkv = qkv.view(self.num_tokens, nh + 2 * nkv, hd)
        qk = apply_rope(qkv[:, :nh + nkv], self.cos, self.sin)               # q and k together
        self.write(k_pool.view(-1, nkv, hd), qk[:, nh:])
        self.write(v_pool.view(-1, nkv, hd), qkv[:, nh + nkv:])
        return qk[:, :nh]

    def attend(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        """q [T, nh, hd] against each row's cached context -> [T, nh * hd]."""
        if self.attention.name == "flashinfer":
            out = self.attention.attend(self.plan, q, k_pool, v_pool, scaling=self.scaling)
        else:
            out = self.attention.attend(self.plan, q, k_pool.view(-1, self.nkv, self.hd),
                                        v_pool.view(-1, self.nkv, self.hd), scaling=self.scaling)
        return out.reshape(self.num_tokens, self.nh * self.hd)

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor,
                 weight: Optional[torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """x + delta, and its norm with ``weight`` (None: no norm)."""
        x = x + delta
        return x, None if weight is None else self.norm(x, weight)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
        return F.silu(gate_up[:, :inter]) * gate_up[:, inter:]


class _BatchInvariantOps(_TorchLayerOps):
    """A forward's steps between the products in the torch batch-invariant mode
    (``verispec.models.layers.batch_invariant``): RMSNorm in fixed chunks of ROWS rows, every
    token's attention over its own visible keys in fixed-shape steps; RoPE, the cache
    write, residual adds and SwiGLU are element-wise as in _TorchLayerOps."""

    def __init__(self, model: Any, batch: PagedBatch, num_tokens: int,
                 positions: torch.Tensor):
        g = model.geometry
        self.model, self.nh, self.nkv, self.hd = model, model._nh, model._nkv, model.config.head_dim
        self.keys = _bi.KeyPlan(batch, g.device)
        self.write = KVWrite(batch.host_tensor("slot_mapping"), g.device)
        eps = model.config.rms_norm_eps
        self.norm = lambda x, weight: _bi.rms_norm(x, weight, eps)
        self.cos = model._cos[positions][:, None, :]                          # [T, 1, hd]
        self.sin = model._sin[positions][:, None, :]
        self.num_tokens = num_tokens
        self.scaling = 1.0 / math.sqrt(self.hd)

    def attend(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        out = _bi.attention(q, k_pool.view(-1, self.nkv, self.hd), v_pool.view(-1, self.nkv, self.hd),
                            self.keys, scaling=self.scaling)
        return out.reshape(self.num_tokens, self.nh * self.hd)


class _BucketLayerOps(_TorchLayerOps):
    """A captured forward's steps between the products (``layers.graphs``): the torch
    ops of _TorchLayerOps at a bucket's fixed shapes, writing through the bucket's
    static slots and attending over each row's gathered keys with the mask the graph
    builds (nothing read from the host)."""

    def __init__(self, model: Any, inputs: GraphInputs):
        self.model, self.nh, self.nkv, self.hd = model, model._nh, model._nkv, model.config.head_dim
        self.inputs = inputs
        self.write = inputs.write
        self.scaling = 1.0 / math.sqrt(self.hd)
        self.norm = model._norm_fn()
        self.cos = model._cos[inputs.positions][:, None, :]                   # [N, 1, hd]
        self.sin = model._sin[inputs.positions][:, None, :]
        self.num_tokens = inputs.bucket.tokens

    def attend(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        out = self.inputs.attend(q, k_pool.view(-1, self.nkv, self.hd),
                                 v_pool.view(-1, self.nkv, self.hd), self.scaling)
        return out.reshape(self.num_tokens, self.nh * self.hd)


class _NativeLayerOps:
    """A forward's steps between the matrix products in verispec's CPU kernels
    (``layers.kernels``: verispec/layers/decode_ops.h; float32 CPU tensors, contiguous
    pools): three native calls a layer. Every row attends in the paged kernel (one
    rounding for decode, verify, tree, batched rows and prefill chunks) except rows of
    more than KERNEL_MAX_QUERIES new tokens without a tree (a long prompt at once), which
    attend row by row in SDPA."""

    def __init__(self, model: Any, batch: PagedBatch, num_tokens: int):
        self.nh, self.nkv, self.hd = model._nh, model._nkv, model.config.head_dim
        self.num_tokens = num_tokens
        self.eps = model.config.rms_norm_eps
        self.threads = torch.get_num_threads()
        self.cos, self.sin = model._cos, model._sin
        # Index tensors as the kernels read them (kept alive for the forward's calls).
        self.index = index = NativeIndex(batch)
        starts = index.query_start.tolist()  # rising from 0 to T: check_batch
        # Rows attended in SDPA instead (long prefills): (first token, last + 1, row).
        # None in the batch-invariant mode: SDPA rounds by the row's length.
        self.long_rows = [] if index.tree is not None or model.batch_invariant else [
            (starts[r], starts[r + 1], r) for r in range(len(starts) - 1)
            if starts[r + 1] - starts[r] > KERNEL_MAX_QUERIES]
        # Positions, context lengths and block tables checked once, before the first
        # layer writes the cache (a bad batch changes nothing).
        self._attention(batch.kv.k[0], batch.kv.v[0], None, None, check_only=True)

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return native_rms_norm(x if x.is_contiguous() else x.contiguous(), weight, self.eps)

    def rope_write(self, qkv: torch.Tensor, k_pool: torch.Tensor,
                   v_pool: torch.Tensor) -> torch.Tensor:
        return kernels.rope_kv_write(qkv, self.nh, self.nkv, self.hd, self.index, self.cos,
                                     self.sin, k_pool, v_pool)

    def _attention(self, k_pool: torch.Tensor, v_pool: torch.Tensor, q: Optional[torch.Tensor],
                   out: Optional[torch.Tensor], check_only: bool = False) -> None:
        kernels.paged_attention(self.index, k_pool, v_pool, q, out, self.nh, self.nkv, self.hd,
                                1.0 / math.sqrt(self.hd),
                                KERNEL_MAX_QUERIES if self.long_rows else 0, self.threads,
                                check_only=check_only)

    def attend(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        t, nh, nkv, hd = self.num_tokens, self.nh, self.nkv, self.hd
        out = torch.empty((t, nh * hd), dtype=torch.float32)
        self._attention(k_pool, v_pool, q, out)
        k_flat, v_flat = k_pool.view(-1, nkv, hd), v_pool.view(-1, nkv, hd)
        for lo, hi, r in self.long_rows:
            out[lo:hi] = attend_long_row(self.index, r, q[lo:hi], k_flat, v_flat).reshape(
                hi - lo, nh * hd)
        return out

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor,
                 weight: Optional[torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """x += delta in place, and the norm of the sum with ``weight`` (None: no norm)."""
        delta = delta if delta.is_contiguous() else delta.contiguous()
        if weight is None:
            x += delta
            return x, None
        return x, kernels.add_rms_norm(x, delta, weight, self.eps)

    def run_layers(self, layers: Any, x: torch.Tensor, kv: Any, inter: int) -> None:
        """Every decoder layer of a quantized model in one native call
        (_C._QuantDecodeLayers): x [T, hidden] becomes the last layer's output."""
        kernels.quant_decode_layers(layers, x, kv, inter, self.eps, self.nh, self.nkv, self.hd,
                                    self.index, self.cos, self.sin, self.threads,
                                    _quantized.ARITHMETIC == "int8")

    @staticmethod
    def silu_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
        return kernels.silu_mul(gate_up, inter)
