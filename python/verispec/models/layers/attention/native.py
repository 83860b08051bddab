"""The "native" backend (:class:`NativeAttention`): verispec's paged CPU kernel
(``layers.kernels``; verispec/layers/decode_ops.h) on float32 CPU models.

Every row attends in cache order through its block table: one rounding for decode,
verify, tree, batched rows and prefill chunks, so a token's attention does not depend on
what shares its pass or how its prompt was chunked. The kernel reads the pools in place
(contiguous float32 [blocks, block_size, KvH, D], K and V of one head size).

- ``attend``: ``kernels.paged_attention`` (LlamaModel: the cache was written with RoPE
  by ``kernels.rope_kv_write``, so the model runs its other layer steps in the CPU
  kernels too: ``layer_kernels``). Rows of more than KERNEL_MAX_QUERIES new tokens
  without a tree (a long prompt at once) attend row by row in SDPA
  (``sdpa.attend_long_row``), which is faster there, except in the batch-invariant mode.
- ``write_attend``: HFModel's layers, one native call that writes the new K/V and
  attends (``kernels.write_attend``), sliding windows included, reading the strided
  tensors the module passes.

Softcaps, sinks, a window in ``attend`` and pools or tensors laid out otherwise go to
the fallback (``TorchAttention``).
"""

from __future__ import annotations

from typing import Optional

import torch

from verispec.models.layers import kernels
from verispec.models.layers.attention.interface import AttentionBackend, flat
from verispec.models.layers.attention.sdpa import TorchAttention, attend_long_row
from verispec.models.layers.paged import KERNEL_MAX_QUERIES, PagedPlan

__all__ = ["NativeAttention"]


class NativeAttention(AttentionBackend):
    """The "native" backend (module docstring)."""

    name = "native"
    layer_kernels = True

    def __init__(self, *, sdpa_groups: bool = False, batch_invariant: bool = False):
        super().__init__(sdpa_groups=sdpa_groups, batch_invariant=batch_invariant)
        self.fallback = TorchAttention(sdpa_groups=sdpa_groups)
        #: Rows attended in SDPA instead (long prefills): (first token, last + 1, row).
        self.long_rows: list[tuple[int, int, int]] = []
        self._pools: dict[tuple[int, int], bool] = {}

    @classmethod
    def refuse(cls, device: torch.device, dtype: torch.dtype) -> Optional[str]:
        if device.type == "cpu" and dtype == torch.float32:
            return None
        return (f"(verispec's paged CPU kernels) needs a float32 model on the CPU, "
                f"got {dtype} on {device}")

    def plan(self, plan: PagedPlan) -> None:
        """The batch's index as the kernel reads it, checked (positions, context lengths,
        block tables) before the first layer writes the cache."""
        index = plan.native_index
        starts = index.query_start.tolist()  # rising from 0 to T: check_batch
        # None in the batch-invariant mode: SDPA rounds by the row's length
        self.long_rows = [] if index.tree is not None or self.batch_invariant else [
            (starts[r], starts[r + 1], r) for r in range(len(starts) - 1)
            if starts[r + 1] - starts[r] > KERNEL_MAX_QUERIES]
        self.threads = torch.get_num_threads()
        kernels.paged_attention(index, plan.kv.k[0], plan.kv.v[0], None, None, 1, 1, 1, 1.0,
                                0, 1, check_only=True)

    def _pools_ok(self, k_pool: torch.Tensor, v_pool: torch.Tensor) -> bool:
        """Whether the kernel reads these pools in place (decided once a pool pair)."""
        key = (k_pool.data_ptr(), v_pool.data_ptr())
        ok = self._pools.get(key)
        if ok is None:
            ok = self._pools[key] = (
                k_pool.dtype == v_pool.dtype == torch.float32 and k_pool.is_cpu
                and k_pool.dim() == 4 and k_pool.shape == v_pool.shape
                and k_pool.is_contiguous() and v_pool.is_contiguous())
        return ok

    def attend(self, plan: PagedPlan, q: torch.Tensor, k_pool: torch.Tensor,
               v_pool: torch.Tensor, *, scaling: float, window: Optional[int] = None,
               softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None
               ) -> torch.Tensor:
        t, nh, hd = q.shape
        if (softcap is not None or sinks is not None or (window is not None and window > 0)
                or q.dtype != torch.float32 or not self._pools_ok(k_pool, v_pool)):
            return self.fallback.attend(plan, q, k_pool, v_pool, scaling=scaling,
                                        window=window, softcap=softcap, sinks=sinks)
        nkv = k_pool.shape[2]
        out = torch.empty((t, nh, hd), dtype=torch.float32)
        kernels.paged_attention(plan.native_index, k_pool, v_pool,
                                q if q.is_contiguous() else q.contiguous(), out, nh, nkv, hd,
                                scaling, KERNEL_MAX_QUERIES if self.long_rows else 0,
                                self.threads)
        if self.long_rows:
            k_flat, v_flat = flat(k_pool), flat(v_pool)
            for lo, hi, r in self.long_rows:
                out[lo:hi] = attend_long_row(plan.native_index, r, q[lo:hi], k_flat, v_flat)
        return out

    def write_attend(self, plan: PagedPlan, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, *,
                     scaling: float, window: Optional[int] = None,
                     softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None
                     ) -> Optional[torch.Tensor]:
        """One native call that writes the new tokens' K/V and attends (the same bits
        whatever shares the pass), reading the strided [1, heads, T, D] tensors the
        module passes (no views, transposes or copies made here); None (nothing written)
        with a softcap or sinks, or tensors or pools not laid out for it."""
        if softcap is not None or sinks is not None or not self._pools_ok(k_pool, v_pool):
            return None
        kvh, d = k_pool.shape[2], k_pool.shape[3]
        h = query.shape[1]
        if not (query.dtype is key.dtype is value.dtype is torch.float32 and query.is_cpu
                and query.shape[3] == key.shape[3] == value.shape[3] == d
                and key.shape[1] == kvh and h % kvh == 0):
            return None
        if query.stride(3) != 1 or key.stride(3) != 1 or value.stride(3) != 1:
            query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
        return kernels.write_attend(query, key, value, plan.native_index, k_pool, v_pool,
                                    scaling, window)
