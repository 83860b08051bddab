"""Batch-invariant torch kernels: a token's logits the same bits whatever shares its pass.

Speculative greedy equals plain greedy bit for bit only if the target gives a token the
same logits in a 1-token pass, inside a (k+1)-token verify pass, inside a tree pass and
next to other sequences. verispec's CPU kernels do that by construction (each row is
reduced in its own fixed order). torch's kernels do not: cuBLAS picks its GEMM kernel
(tile sizes, split-K) from the product's shape, SDPA splits a row's keys by the batch's
length, and a reduction over few outputs is split across blocks (CUDA) or threads (CPU)
differently from one over many. So a token's bits depend on how many tokens share the
pass. Everything here calls torch with shapes that depend on nothing but fixed
constants, so every call runs the same kernel in the same reduction order, and rows
never meet in a reduction:

- products (``linear``): the pass's rows in chunks of ``ROWS`` rows, the last one padded
  with zeros, one (ROWS, in) x (in, out) product each. A GEMM reduces over ``in`` only,
  each output row from its own input row, so a row's bits depend on neither the other
  rows nor their number.
- row-wise modules (``rows``: RMSNorm, LayerNorm, ...): the same chunks of ``ROWS`` rows.
- attention (``attention``): each (token, KV head) is one row, ``ATTN_ROWS`` rows a call;
  a row's visible keys, in cache order and packed from index 0 (so a token sees the same
  list in a chain pass and in a tree pass, where its ancestors sit elsewhere in the
  cache), in chunks of ``KEY_CHUNK`` keys anchored at key 0. Each chunk's scores, max,
  sum of exponentials and weighted values are computed with fixed shapes and merged
  into the row's running (max, sum, output) in chunk order by the online-softmax rule;
  a chunk in which the row sees no key leaves the state exactly as it was (a select,
  not arithmetic), so chunks that exist only because a longer row shares the pass
  change nothing. Attention sinks are one more merge at the end.

Element-wise ops (RoPE, SiLU, residual adds, masks) need nothing: each element is
computed on its own. (torch's CPU loops run a tail of fewer than two vectors with scalar
code, whose exp may round differently from the vectorized one; feature sizes that are a
multiple of 32 floats, as in real models, have no tail.)
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from verispec.models.layers.norm_rope import rms_norm as _rms_norm

#: Rows per product and per row-wise module call (the P of every GEMM's (P, in) shape).
ROWS = 32
#: (token, KV head) rows per attention call.
ATTN_ROWS = 64
#: Keys per attention chunk; the grid starts at each row's first visible key.
KEY_CHUNK = 256

# > 0 while a batch-invariant op runs: the check of an HFModel's forward
# (check_forward) records only the ops outside them.
_depth = 0


class _Inside:
    def __enter__(self) -> None:
        global _depth
        _depth += 1

    def __exit__(self, *exc: Any) -> None:
        global _depth
        _depth -= 1


# Why the mode and tensor parallelism exclude each other, said once for every refusal.
TP_REASON = ("the all-reduce of the ranks' partial products picks its algorithm, hence its "
             "summation order, by message size, i.e. by the number of tokens in the pass")


def refuse_tp(owner: str, batch_invariant: bool, tp: object) -> None:
    """The constructors' check: ``batch_invariant`` is a bool, and not with ``tp``."""
    if not isinstance(batch_invariant, bool):
        raise TypeError(f"{owner}: batch_invariant must be a bool, got {batch_invariant!r}")
    if batch_invariant and tp is not None:
        raise ValueError(f"{owner}: batch_invariant=True cannot run tensor-parallel (got tp): "
                         + TP_REASON)


def _padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [n, d] zero-padded to a multiple of ``rows`` rows, in a fresh buffer (x itself
    when it is one already, contiguous and 256-byte aligned: cuBLAS picks kernels by the
    operands' alignment too, so every chunk starts as aligned whatever the pass)."""
    n = x.shape[0]
    pad = -n % rows
    if pad == 0 and x.is_contiguous() and x.data_ptr() % 256 == 0:
        return x
    out = x.new_zeros((n + pad, *x.shape[1:]))
    out[:n] = x
    return out


def rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
         chunk: Optional[int] = None) -> torch.Tensor:
    """``fn`` (a row-wise function: output row i from input row i alone) applied to
    x [..., d] in calls of exactly ``chunk`` rows (default ROWS; zero-padded) ->
    [..., d_out]."""
    chunk = ROWS if chunk is None else chunk
    with _Inside():
        lead = x.shape[:-1]
        flat = x.reshape(-1, x.shape[-1])
        n = flat.shape[0]
        if n == 0:
            return fn(flat).reshape(*lead, -1)
        xp = _padded(flat, chunk)
        outs = [fn(xp[i:i + chunk]) for i in range(0, xp.shape[0], chunk)]
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out[:n].reshape(*lead, out.shape[-1])


def linear(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None,
           chunk: Optional[int] = None) -> torch.Tensor:
    """x [..., in] @ w[out, in]^T (+ bias) as (chunk, in) x (in, out) products."""
    return rows(lambda c: F.linear(c, w, bias), x, chunk)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             chunk: Optional[int] = None) -> torch.Tensor:
    """RMSNorm over the last dimension, ``chunk`` rows a call: float32 in torch's fused
    kernel (as transformers' float32 RMSNorm rounds), other dtypes with the statistics in
    float32 (``layers.norm_rope.rms_norm``). Each row is reduced alone; the call's
    shape, hence its kernel and reduction order, never changes."""
    if x.dtype == torch.float32:
        return rows(lambda c: F.rms_norm(c, weight.shape, weight, eps), x, chunk)
    return rows(lambda c: _rms_norm(c, weight, eps), x, chunk)


class KeyPlan:
    """Each new token's visible keys for one forward, as ``attention`` reads them.

    Built on the host from the batch's index tensors: token t of row b sees the row's
    context keys 0..positions[t] (a chain), or with a tree mask the keys before the row's
    new tokens and the new tokens the mask shows; ``keys(window)`` packs those (within
    a sliding window, when given) in cache order from index 0.
    """

    def __init__(self, batch: Any, device: torch.device) -> None:
        host = batch.host_tensor
        starts = host("query_start").tolist()
        ctx = host("context_lens").tolist()
        positions = host("positions").long()
        tables = host("block_tables").long()
        bs = batch.kv.block_size
        self.device = device
        t = starts[-1]
        b = len(ctx)
        l_max = max(ctx)
        j = torch.arange(l_max)
        valid = j[None, :] < torch.tensor(ctx)[:, None]                         # [B, L]
        blocks = torch.gather(tables, 1, (j // bs).clamp(max=tables.shape[1] - 1).expand(b, -1))
        slots = torch.where(valid, blocks * bs + j % bs, 0).clamp(min=0)       # [B, L]
        row_of = torch.repeat_interleave(torch.arange(b), torch.tensor(
            [starts[r + 1] - starts[r] for r in range(b)]), output_size=t)
        self.slots = slots[row_of]                                             # [T, L]
        self.q_pos = positions                                                 # [T]
        key_pos = j.expand(t, l_max).clone()
        tree = batch.tree_mask
        if tree is None:
            visible = (j[None, :] <= positions[:, None]) & valid[row_of]
        else:
            tree = tree.cpu()
            visible = torch.zeros(t, l_max, dtype=torch.bool)
            for r in range(b):
                s, e = starts[r], starts[r + 1]
                n = e - s
                prefix = ctx[r] - n
                if prefix < 0:
                    raise ValueError(f"PagedBatch: row {r} has {n} new tokens but context_lens "
                                     f"{ctx[r]}")
                visible[s:e, :prefix] = True
                visible[s:e, prefix:prefix + n] = tree[s:e, s:e]
                key_pos[s:e, prefix:prefix + n] = positions[s:e]
        self.visible = visible
        self.key_pos = key_pos
        self._keys: dict[Optional[int], tuple[torch.Tensor, torch.Tensor, list[int]]] = {}

    def keys(self, window: Optional[int] = None
             ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """(slots [T, L'] long, visible [T, L'] bool, count per token): each token's visible
        keys (within ``window``: key position > query position - window) packed in cache
        order from index 0, then padding (slot 0, not visible); L' a multiple of
        KEY_CHUNK. On the plan's device; the counts on the host."""
        if window is not None and window <= 0:
            window = None
        if window not in self._keys:
            vis = self.visible
            if window is not None:
                vis = vis & (self.key_pos > self.q_pos[:, None] - window)
            order = torch.sort((~vis).to(torch.int8), dim=1, stable=True).indices
            count = vis.sum(1)
            width = max(KEY_CHUNK, -(-int(count.max()) // KEY_CHUNK) * KEY_CHUNK)
            packed = torch.gather(self.slots, 1, order)
            if packed.shape[1] < width:
                packed = torch.cat([packed, packed.new_zeros(packed.shape[0],
                                                             width - packed.shape[1])], 1)
            packed_vis = torch.arange(width)[None, :] < count[:, None]
            packed = torch.where(packed_vis, packed[:, :width], 0)
            self._keys[window] = (packed.to(self.device), packed_vis.to(self.device),
                                  count.tolist())
        return self._keys[window]


def attention(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, plan: KeyPlan, *,
              scaling: float, window: Optional[int] = None, softcap: Optional[float] = None,
              sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q [T, H, Dk] (after RoPE) against each token's visible keys in the pools
    k_flat [slots, KvH, Dk], v_flat [slots, KvH, Dv] -> [T, H, Dv] in q's dtype.

    As transformers' eager attention: scores = q k^T * scaling, softcap
    (tanh(s / c) * c), masked, an attention sink per head (one more logit, no value),
    softmax; query head h reads KV head h // (H / KvH). Computed in float32, ATTN_ROWS
    (token, KV head) rows and KEY_CHUNK keys a step (see the module's docstring)."""
    with _Inside():
        return _attention(q, k_flat, v_flat, plan, scaling, window, softcap, sinks)


def _attention(q, k_flat, v_flat, plan, scaling, window, softcap, sinks):
    t, h, dk = q.shape
    kvh, dv = k_flat.shape[1], v_flat.shape[2]
    grp = h // kvh
    slots, visible, count = plan.keys(window)
    n_rows = t * kvh
    p = ATTN_ROWS
    chunk_keys = KEY_CHUNK
    padded = -(-n_rows // p) * p
    device = q.device
    qr = _padded(q.reshape(n_rows, grp, dk).float(), p)                    # [R', G, Dk]
    k2 = k_flat.reshape(-1, dk)                                            # slot * KvH + head
    v2 = v_flat.reshape(-1, dv)
    head = torch.arange(padded, device=device) % kvh
    token = torch.arange(padded, device=device) // kvh
    token_host = [min(r // kvh, t - 1) for r in range(0, padded, p)]
    sink = None
    if sinks is not None:
        sink = sinks.float().reshape(kvh, grp)
    out = torch.empty(padded, grp, dv, dtype=torch.float32, device=device)
    neg_inf = torch.tensor(-math.inf, device=device)
    for r0 in range(0, padded, p):
        tok = token[r0:r0 + p].clamp(max=t - 1)                           # padding: any token
        hd = head[r0:r0 + p]
        real = (torch.arange(r0, r0 + p, device=device) < n_rows)[:, None]  # [P, 1]
        # chunks past every row's last visible key leave every state as it is: skipped
        last = min((t - 1), (r0 + p - 1) // kvh)
        most = max(count[token_host[r0 // p]:last + 1])
        qc = qr[r0:r0 + p]                                                 # [P, G, Dk]
        m = torch.full((p, grp), -math.inf, device=device)
        s_exp = torch.zeros(p, grp, device=device)
        acc = torch.zeros(p, grp, dv, device=device)
        for c0 in range(0, max(most, 1), chunk_keys):
            sl = slots[tok, c0:c0 + chunk_keys]                              # [P, C]
            vis = visible[tok, c0:c0 + chunk_keys] & real                     # [P, C]
            idx = sl * kvh + hd[:, None]
            kc = k2[idx].float()                                             # [P, C, Dk]
            vc = v2[idx].float().masked_fill(~vis[:, :, None], 0.0)          # [P, C, Dv]
            scores = torch.bmm(qc, kc.transpose(1, 2)) * scaling            # [P, G, C]
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            scores = scores.masked_fill(~vis[:, None, :], -math.inf)
            mc = scores.amax(-1)                                             # [P, G]
            seen = mc > neg_inf
            e = torch.exp(scores - torch.where(seen, mc, 0.0)[:, :, None])
            sc = e.sum(-1)
            ac = torch.bmm(e, vc)                                            # [P, G, Dv]
            m, s_exp, acc = _merge(m, s_exp, acc, mc, sc, ac, seen)
        if sink is not None:
            ms = sink[hd]                                                    # [P, G]
            m, s_exp, acc = _merge(m, s_exp, acc, ms, torch.ones_like(ms),
                                   torch.zeros_like(acc), torch.ones_like(ms, dtype=torch.bool))
        out[r0:r0 + p] = acc / s_exp[:, :, None]
    return out[:n_rows].reshape(t, h, dv).to(q.dtype)


def _merge(m, s, acc, mc, sc, ac, seen):
    """The online-softmax merge of a chunk (max mc, sum of exponentials sc, weighted
    values ac) into the state (m, s, acc); where ``seen`` is False (the row sees no key
    of the chunk) the state stays exactly as it was."""
    new_m = torch.maximum(m, mc)
    a = torch.exp(m - new_m)       # 0 while the state is empty (m = -inf)
    b = torch.exp(mc - new_m)
    s_new = s * a + sc * b
    acc_new = acc * a[:, :, None] + ac * b[:, :, None]
    return (torch.where(seen, new_m, m), torch.where(seen, s_new, s),
            torch.where(seen[:, :, None], acc_new, acc))
