"""The "flashinfer" backend (:class:`FlashInferAttention`, the optional ``verispec[gpu]``
extra): FlashInfer's paged prefill / decode kernels reading the pools in place.

A page is a block: a layer's pools [blocks, block_size, KvH, D] are FlashInfer's "NHD"
paged layout as they are. ``plan`` builds, once a forward, the page table of the rows
with new tokens in FlashInfer's CSR form (``kv_indptr``, ``kv_indices``: each row's first
ceil(context / block_size) blocks; ``kv_last_page_len``) and the rows' query offsets
(``qo_indptr``); a wrapper is planned once per (scaling, window, softcap, heads) a layer
passes and run by every layer with those. A batch of one query per row (plain decoding)
runs the decode wrapper, anything else the prefill wrapper: chain rows as bottom-right
causal masks (which is "keys 0..position" for rows whose new tokens end their context),
trees and windows of trees as custom masks, windows of chains as ``window_left``,
softcaps as ``logits_soft_cap``. Layers with attention sinks, and K and V of different
head sizes, go to the fallback (``TorchAttention``).

``import flashinfer`` is tried once a process, lazily (``flashinfer_available``); this
module imports without it. Not capturable yet: FlashInfer's wrappers can run inside CUDA
graphs (``use_cuda_graph=True`` with fixed-size index buffers, planned before each
replay), which ``layers.graphs`` does not do, so forwards on this backend run eagerly.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from verispec.models.layers.attention.interface import AttentionBackend
from verispec.models.layers.attention.sdpa import TorchAttention
from verispec.models.layers.paged import PagedPlan
from verispec.models.staging import upload

__all__ = ["FlashInferAttention", "flashinfer_available"]

_FLASHINFER: list = []  # [module or None], once imported

# FlashInfer's workspace: one per device, shared by every wrapper (its documented size
# for prefill and decode is 128 MiB).
_WORKSPACE_BYTES = 128 * 1024 * 1024
_WORKSPACES: dict[torch.device, torch.Tensor] = {}


def flashinfer_available() -> bool:
    """Whether ``import flashinfer`` works (tried once a process)."""
    if not _FLASHINFER:
        try:
            import flashinfer  # noqa: F401 - optional: the verispec[gpu] extra
        except Exception:  # noqa: BLE001 - any failure to load it: not available
            flashinfer = None
        _FLASHINFER.append(flashinfer)
    return _FLASHINFER[0] is not None


_NO_PACKAGE = ("needs the flashinfer package (pip install 'verispec[gpu]'), which does not "
               "import here")


class FlashInferAttention(AttentionBackend):
    """The "flashinfer" backend (module docstring). Runs on CUDA only; this project's
    CPU tests run it against a stand-in of FlashInfer's two paged wrappers
    (tests/test_flashinfer_standin.py)."""

    name = "flashinfer"

    def __init__(self, fallback: Optional[AttentionBackend] = None, *,
                 sdpa_groups: bool = False, batch_invariant: bool = False):
        super().__init__(sdpa_groups=sdpa_groups, batch_invariant=batch_invariant)
        flashinfer_available()
        self.fi = _FLASHINFER[0]
        if self.fi is None:
            raise ValueError(f"attention_backend: backend 'flashinfer' {_NO_PACKAGE}")
        self.fallback = fallback or TorchAttention(sdpa_groups=sdpa_groups)
        self._forward: Any = None   # the plan whose page table is built
        self._table: dict[str, Any] = {}
        self._wrappers: dict[tuple, Any] = {}

    @classmethod
    def refuse(cls, device: torch.device, dtype: torch.dtype) -> Optional[str]:
        if device.type != "cuda":
            return f"needs a CUDA device, got {device}"
        if not flashinfer_available():
            return _NO_PACKAGE
        return None

    def plan(self, plan: PagedPlan) -> None:
        """The forward's page table (its wrappers are planned at their first layer); the
        plan's row groups built, and so checked, before any write (the fallback and the
        trees' custom masks read them)."""
        plan.groups  # noqa: B018
        self._forward, self._wrappers = plan, {}
        self._table = self._page_table(plan)

    def _page_table(self, plan: PagedPlan) -> dict[str, Any]:
        rows = [r for r in range(plan.num_rows) if plan.q_lens[r] > 0]
        bs = plan.block_size
        pages = [-(-plan.ctx_lens[r] // bs) for r in rows]
        kv_indptr = [0]
        for p in pages:
            kv_indptr.append(kv_indptr[-1] + p)
        tables = plan.block_tables
        indices = torch.cat([tables[r, :p] for r, p in zip(rows, pages)]).to(torch.int32)
        qo_indptr = [0]
        for r in rows:
            qo_indptr.append(qo_indptr[-1] + plan.q_lens[r])
        # FlashInfer plans from host index arrays; the page indices are read on the device
        return dict(
            rows=rows, decode=plan.tree is None and all(plan.q_lens[r] == 1 for r in rows),
            qo_indptr=torch.tensor(qo_indptr, dtype=torch.int32),
            kv_indptr=torch.tensor(kv_indptr, dtype=torch.int32),
            kv_indices=upload(plan.staging, indices, torch.int32, plan.device),
            last_page_len=torch.tensor([plan.ctx_lens[r] - (p - 1) * bs
                                        for r, p in zip(rows, pages)], dtype=torch.int32),
            # the batch's tokens in row order (rows with no new tokens hold none)
            contiguous=rows == list(range(rows[0], rows[-1] + 1)))

    def _custom_mask(self, plan: PagedPlan, window: Optional[int]) -> torch.Tensor:
        """Each row's [n, ctx] visibility (ancestors, window) flattened row after row."""
        parts = []
        for g in plan.groups:
            mask = g.mask(window)
            for i, r in enumerate(g.rows):
                n, ctx = plan.q_lens[r], plan.ctx_lens[r]
                parts.append(torch.ones(n * ctx, dtype=torch.bool, device=plan.device)
                             if mask is None else mask[i, :n, :ctx].reshape(-1))
        return torch.cat(parts)

    def _wrapper(self, plan: PagedPlan, table: dict, q: torch.Tensor, k_pool: torch.Tensor,
                 scaling: float, window: Optional[int], softcap: Optional[float]):
        key = (scaling, window, softcap, q.shape[1], k_pool.shape[2], k_pool.shape[3])
        wrapper = self._wrappers.get(key)
        if wrapper is not None:
            return wrapper
        dev = plan.device
        workspace = _WORKSPACES.get(dev)
        if workspace is None:
            workspace = _WORKSPACES[dev] = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8,
                                                       device=dev)
        fi = self.fi
        common = dict(num_qo_heads=q.shape[1], num_kv_heads=k_pool.shape[2],
                      page_size=plan.block_size, sm_scale=scaling, logits_soft_cap=softcap,
                      q_data_type=q.dtype, kv_data_type=k_pool.dtype)
        tree = plan.tree is not None
        window_left = -1 if window is None or window <= 0 or tree else window - 1
        if table["decode"]:
            wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
            wrapper.plan(table["kv_indptr"], table["kv_indices"], table["last_page_len"],
                         head_dim=k_pool.shape[3], window_left=window_left, **common)
        else:
            wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
            wrapper.plan(table["qo_indptr"], table["kv_indptr"], table["kv_indices"],
                         table["last_page_len"], head_dim_qk=k_pool.shape[3],
                         custom_mask=self._custom_mask(plan, window) if tree else None,
                         causal=not tree, window_left=window_left, **common)
        self._wrappers[key] = wrapper
        return wrapper

    def attend(self, plan: PagedPlan, q: torch.Tensor, k_pool: torch.Tensor,
               v_pool: torch.Tensor, *, scaling: float, window: Optional[int] = None,
               softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None
               ) -> torch.Tensor:
        if sinks is not None or k_pool.shape[3] != v_pool.shape[3]:
            return self.fallback.attend(plan, q, k_pool, v_pool, scaling=scaling,
                                        window=window, softcap=softcap, sinks=sinks)
        if self._forward is not plan:  # planned here when the caller did not
            self.plan(plan)
        table = self._table
        rows = table["rows"]
        if table["contiguous"]:
            lo, hi = plan.starts[rows[0]], plan.starts[rows[-1] + 1]
            q_rows = q[lo:hi]
        else:
            index = torch.cat([torch.arange(plan.starts[r], plan.starts[r + 1]) for r in rows])
            q_rows = q.index_select(0, index.to(q.device))
        wrapper = self._wrapper(plan, table, q, k_pool, scaling, window, softcap)
        o = wrapper.run(q_rows.contiguous(), (k_pool, v_pool))
        if table["contiguous"] and lo == 0 and hi == q.shape[0]:
            return o
        out = q.new_zeros(q.shape[0], q.shape[1], v_pool.shape[3])
        if table["contiguous"]:
            out[lo:hi] = o
        else:
            out.index_copy_(0, index.to(q.device), o)
        return out
