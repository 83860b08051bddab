"""The "sdpa" backend (:class:`TorchAttention`): attention in torch ops over the forward's
``PagedPlan``, on any device and dtype, and the fallback of every other backend.

Each group of rows (``PagedPlan.groups``) gathers its keys from the pools (or takes a
slice of them) and attends in SDPA for long rows, or in two batched matmuls for few
queries and wherever a softcap or sinks apply (``attend_matmul``, rounding as
transformers' eager attention). Its ``attend_static`` is the same math at a CUDA-graph
bucket's fixed shapes (``layers.graphs``), so graphs capture this backend.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F

from verispec.models.layers.attention.interface import AttentionBackend, flat
from verispec.models.layers.paged import SMALL_ROW_QUERIES, PagedPlan, RowGroup

__all__ = ["TorchAttention", "attend_long_row", "attend_matmul"]


class TorchAttention(AttentionBackend):
    """The "sdpa" backend: each group's keys gathered from the pools (or a slice of them),
    attended in torch.

    A lone row of few queries whose keys are a slice of the pool (plain decoding, a verify
    pass) takes the lean path: two batched matmuls over views of the pool, the mask and
    scaling fused into the first. Groups of more than SMALL_ROW_QUERIES queries without
    a softcap or sinks call SDPA; the others attend in two batched matmuls rounding as
    transformers' eager attention (``attend_matmul``).

    ``sdpa_groups`` keeps LlamaModel's rounding (as before the plans were merged): a
    single-row batch of few queries takes the lean path whether its keys are sliced or
    gathered, every group of several rows calls SDPA (fresh prefills of one length as
    plain causal attention), and the rows of a tree batch without a softcap or sinks
    attend one by one.

    The pools may also be passed flat, [slots, KvH, D] (the same memory viewed as slots).
    """

    name = "sdpa"
    capturable = True

    def plan(self, plan: PagedPlan) -> None:
        plan.groups  # noqa: B018 - built (and checked) before any write

    def attend(self, plan: PagedPlan, q: torch.Tensor, k_pool: torch.Tensor,
               v_pool: torch.Tensor, *, scaling: float, window: Optional[int] = None,
               softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None
               ) -> torch.Tensor:
        """q [T, H, Dk] of the batch's new tokens against each row's keys in the pools
        k_pool [blocks, block_size, KvH, Dk], v_pool [..., Dv] -> [T, H, Dv]."""
        k_flat, v_flat = flat(k_pool), flat(v_pool)
        plain = softcap is None and sinks is None
        groups = plan.groups
        t, h = q.shape[0], q.shape[1]
        if self.sdpa_groups and plan.num_rows == 1 and groups[0].n <= SMALL_ROW_QUERIES and plain:
            return self._attend_lean(groups[0], q, k_flat, v_flat, scaling, window)
        if (not self.sdpa_groups and len(groups) == 1 and groups[0].lean and plain):
            return self._attend_lean(groups[0], q, k_flat, v_flat, scaling, window)
        if self.sdpa_groups and plan.tree is not None and plan.num_rows > 1 and plain:
            return self._attend_tree_rows(plan, q, k_flat, v_flat, scaling, window)
        g0 = groups[0]
        if len(groups) == 1 and g0.tokens is None and g0.lo == 0 and g0.hi == t:
            return self._attend_group(g0, q, k_flat, v_flat, scaling, window, softcap, sinks,
                                      self.sdpa_groups)
        out = q.new_empty(t, h, v_flat.shape[2])
        for g in groups:
            if g.tokens is None:
                out[g.lo:g.hi] = self._attend_group(g, q[g.lo:g.hi], k_flat, v_flat, scaling,
                                                    window, softcap, sinks, self.sdpa_groups)
            else:
                out.index_copy_(0, g.tokens, self._attend_group(
                    g, q.index_select(0, g.tokens), k_flat, v_flat, scaling, window, softcap,
                    sinks, self.sdpa_groups))
        return out

    @staticmethod
    def _attend_lean(g: RowGroup, q, k_flat, v_flat, scaling, window):
        """One row's few queries, q [n, H, Dk], against its keys -> [n, H, Dv] in two
        batched matmuls (bias + q k^T * scaling, softmax in float32, probs v). Query
        head h reads KV head h // (H / KvH), as transformers' repeat_kv does."""
        n, h, dk = q.shape
        kvh, dv = k_flat.shape[1], v_flat.shape[2]
        grp = h // kvh
        k, v = g.keys(k_flat)[0], g.keys(v_flat)[0]                             # [L, KvH, D]
        qg = q.reshape(n, kvh, grp, dk).transpose(0, 1).reshape(kvh, n * grp, dk)  # i * grp + j
        bias, weight = g.bias(window, grp, q.dtype)
        scores = torch.baddbmm(bias, qg, k.permute(1, 2, 0), beta=weight, alpha=scaling)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
        out = torch.bmm(probs, v.transpose(0, 1))                               # [KvH, n*grp, Dv]
        return out.view(kvh, n, grp, dv).transpose(0, 1).reshape(n, h, dv)

    @staticmethod
    def _attend_group(g: RowGroup, q, k_flat, v_flat, scaling, window, softcap, sinks,
                      sdpa_groups=False):
        """q [T_g, H, Dk] of the group's tokens -> [T_g, H, Dv]."""
        h, dk = q.shape[1], q.shape[2]
        kvh, dv = k_flat.shape[1], v_flat.shape[2]
        k, v = g.keys(k_flat), g.keys(v_flat)                                   # [b, L, KvH, D]
        if g.q_index is None:
            qp = q.reshape(g.b, g.n, h, dk)
        else:
            qp = q.new_zeros(g.b * g.n, h, dk)
            qp[g.q_index] = q
            qp = qp.view(g.b, g.n, h, dk)
        if softcap is None and sinks is None and (sdpa_groups or g.n > SMALL_ROW_QUERIES):
            # a fresh prefill that no window cuts is plain causal attention
            causal = ((g.fresh if sdpa_groups else g.is_causal)
                      and (window is None or window <= 0 or window >= g.l))
            mask = None if causal else g.mask(window)
            out = F.scaled_dot_product_attention(
                qp.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                attn_mask=None if mask is None else mask[:, None], is_causal=causal,
                scale=scaling, enable_gqa=h != kvh).transpose(1, 2)           # [b, n, H, Dv]
        else:
            out = attend_matmul(qp, k, v, g.mask(window), scaling, softcap, sinks)
        out = out.reshape(g.b * g.n, h, dv)
        return out if g.q_index is None else out[g.q_index]

    @staticmethod
    def _attend_tree_rows(plan: PagedPlan, q, k_flat, v_flat, scaling, window):
        """A tree batch row by row in SDPA, each row over its own keys with its ancestor
        mask cut by the window (LlamaModel's rounding): q [T, H, Dk] -> [T, H, Dv]."""
        h, kvh = q.shape[1], k_flat.shape[1]
        out = q.new_empty(q.shape[0], h, v_flat.shape[2])
        for g in plan.groups:
            k, v = g.keys(k_flat), g.keys(v_flat)                               # [b, L, KvH, D]
            mask = g.mask(window)
            for i, r in enumerate(g.rows):
                lo, hi, ctx = plan.starts[r], plan.starts[r + 1], plan.ctx_lens[r]
                o = F.scaled_dot_product_attention(
                    q[lo:hi].transpose(0, 1), k[i, :ctx].transpose(0, 1),
                    v[i, :ctx].transpose(0, 1),
                    attn_mask=None if mask is None else mask[i, :hi - lo, :ctx],
                    scale=scaling, enable_gqa=h != kvh)                         # [H, n, Dv]
                out[lo:hi] = o.transpose(0, 1)
        return out

    def attend_static(self, inputs: Any, q: torch.Tensor, k_pool: torch.Tensor,
                      v_pool: torch.Tensor, *, scaling: float) -> torch.Tensor:
        """A bucket's padded tokens q [tokens, H, Dk] (``layers.graphs.GraphInputs``:
        row r's queries are tokens r * queries ..) against each row's
        ``key_blocks * block_size`` keys gathered through its static block table, with the
        mask built in the graph (``inputs.prepare``) -> [tokens, H, Dv]. Nothing here
        depends on the rows' context lengths, only on the bucket."""
        bk = inputs.bucket
        keys = bk.key_blocks * inputs.block_size
        k_flat, v_flat = flat(k_pool), flat(v_pool)
        k = k_flat.index_select(0, inputs.key_slots).view(bk.rows, keys, *k_flat.shape[1:])
        v = v_flat.index_select(0, inputs.key_slots).view(bk.rows, keys, *v_flat.shape[1:])
        out = attend_matmul(q.view(bk.rows, bk.queries, *q.shape[1:]), k, v, inputs.mask,
                            scaling, None, None)
        return out.reshape(bk.tokens, q.shape[1], v_flat.shape[2])


def attend_matmul(q, k, v, mask, scaling, softcap, sinks):
    """q [b, n, H, Dk], k [b, L, KvH, Dk], v [b, L, KvH, Dv], mask bool [b, n, L] or None
    -> [b, n, H, Dv], as transformers' eager attention: scores * scaling, softcap
    (tanh(s / c) * c), mask, sinks (one extra logit per head, dropped after the softmax),
    softmax in float32. Query head h reads KV head h // (H / KvH)."""
    b, n, h, dk = q.shape
    l, kvh, dv = k.shape[1], k.shape[2], v.shape[3]
    grp = h // kvh
    qg = q.reshape(b, n, kvh, grp, dk).permute(0, 2, 1, 3, 4).reshape(b * kvh, n * grp, dk)
    if b == 1:  # one row (plain decoding, a verify pass): views of the pool, no copies
        kt, vt = k[0].permute(1, 2, 0), v[0].transpose(0, 1)                  # [KvH, Dk, L], [KvH, L, Dv]
    else:
        kt = k.permute(0, 2, 3, 1).reshape(b * kvh, dk, l)
        vt = v.permute(0, 2, 1, 3).reshape(b * kvh, l, dv)
    scores = torch.bmm(qg, kt) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(b, kvh, n, grp, l)
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, :, None, :], -math.inf)
    if sinks is not None:
        sink = sinks.reshape(1, kvh, 1, grp, 1).to(scores.dtype).expand(b, kvh, n, grp, 1)
        combined = torch.cat([scores, sink], dim=-1)
        combined = combined - combined.amax(dim=-1, keepdim=True)
        probs = torch.softmax(combined, dim=-1, dtype=torch.float32)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    probs = probs.to(v.dtype).reshape(b * kvh, n * grp, l)
    out = torch.bmm(probs, vt)                                              # [b*KvH, n*grp, Dv]
    return out.view(b, kvh, n, grp, dv).permute(0, 2, 1, 3, 4).reshape(b, n, h, dv)


def attend_long_row(index: Any, row: int, q: torch.Tensor, k_flat: torch.Tensor,
                    v_flat: torch.Tensor) -> torch.Tensor:
    """The native backend's rows past the paged kernel's KERNEL_MAX_QUERIES (a long
    prompt at once) in SDPA: row ``row``'s n new tokens q [n, H, D] (``index`` a
    ``paged.NativeIndex``), token t seeing keys 0..positions[t] -> [n, H, D]."""
    n, h, _ = q.shape
    ctx, bs = int(index.context_lens[row]), index.block_size
    j = torch.arange(ctx)
    slots = index.tables[row].to(torch.long)[j // bs] * bs + j % bs
    k = k_flat.index_select(0, slots).transpose(0, 1)[None]               # [1, KvH, L, D]
    v = v_flat.index_select(0, slots).transpose(0, 1)[None]
    start = int(index.query_start[row])
    pos = index.positions[start:start + n]
    fresh = n == ctx and bool((pos == j).all())
    mask = None if fresh else j[None, :] <= pos[:, None]                   # [n, L]
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, attn_mask=mask,
                                       is_causal=fresh, enable_gqa=h != k_flat.shape[1])
    return o[0].transpose(0, 1)
