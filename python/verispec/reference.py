"""Speculative sampling in plain PyTorch: the test oracle and the benchmark baseline.

Notation, at one accepted prefix: ``p`` is the target's next-token distribution after
the sampling policy, ``q`` the distribution the drafter drew its proposal ``y`` from.

    accept y with probability min(1, p(y) / q(y))       (test: u * q(y) < p(y))
    on the first rejection, emit a correction ~ norm(max(p - q, 0)) and stop
    after all proposals are accepted, emit a bonus token ~ p at the next position

Every emitted token is then distributed exactly as a token sampled from ``p``, for any
``q`` (Leviathan et al. 2023; Chen et al. 2023). The native ops in ``verispec.ops``
have the same signatures and semantics. They draw from a Philox stream, so they
agree with this module in distribution, not token for token.

The math here does not use ``verispec._C``: it is the independent oracle the native
ops are tested against. The argument ranges are not math but a contract, and they come
from the one native rule (``policy_error`` in csrc/include/verispec/policy_rules.h,
through ``verispec._policy``), so the oracle accepts and rejects exactly what the ops
do, with the same messages; so do the checks of the arguments' types and shapes, which
it shares with the ops (``verispec._args``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from verispec import _args

__all__ = ["RESIDUAL_EPS", "apply_policy", "sample", "verify", "verify_keyed", "verify_tree"]

# A rejection whose residual mass sum(max(p - q, 0)) is below this is roundoff (p and q
# equal up to float error, or q not quite normalised): the correction is drawn from p.
RESIDUAL_EPS = 1e-6

_MASK64 = (1 << 64) - 1


# --- the sampling policy ------------------------------------------------------------


def apply_policy(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """Target distribution after the sampling policy, in float32.

    logits: [N, V] float32/bfloat16/float16. Each parameter is a Python scalar or a
    1-D tensor of N per-row values. Ties at a threshold are always kept.
      temperature  0 => greedy row: one-hot at argmax(logits), lowest index on ties;
                   else probs = softmax(logits / temperature)
      top_k > 0    keep prob >= the k-th largest prob (k >= V keeps everything)
      top_p < 1    on the survivors, keep prob >= t for the largest t whose kept mass
                   is >= top_p * surviving mass
      min_p > 0    keep prob >= min_p * max prob
    Returns probs [N, V] float32, renormalised over the kept tokens.
    """
    x = _check_logits("apply_policy", "logits", logits).float()
    n, v = x.shape
    temperature, top_k, top_p, min_p = _policy_params(
        "apply_policy", n, x.device, temperature, top_k, top_p, min_p
    )
    greedy = (temperature == 0)[:, None]
    probs = torch.softmax(x / torch.where(greedy, 1.0, temperature[:, None]), dim=-1)

    # top-k: the threshold is the k-th largest probability.
    desc = probs.sort(dim=-1, descending=True).values
    kth = desc.gather(-1, (top_k.clamp(1, v) - 1)[:, None])
    probs = torch.where((top_k[:, None] == 0) | (probs >= kth), probs, 0.0)

    # top-p: the smallest descending prefix holding top_p of the surviving mass ends at
    # the threshold t; every token tied with t is kept too.
    desc = probs.sort(dim=-1, descending=True).values
    mass = desc.cumsum(dim=-1)
    cut = (mass < top_p[:, None] * mass[:, -1:]).sum(dim=-1, keepdim=True).clamp(max=v - 1)
    keep = (top_p[:, None] >= 1) | (probs >= desc.gather(-1, cut))
    probs = torch.where(keep, probs, 0.0)

    # min-p: relative to the most likely token (which top-k and top-p always keep).
    probs = torch.where(probs >= min_p[:, None] * probs.amax(dim=-1, keepdim=True), probs, 0.0)

    probs = probs / probs.sum(dim=-1, keepdim=True)
    one_hot = F.one_hot(x.argmax(dim=-1), v).float()  # argmax returns the first maximum
    return torch.where(greedy, one_hot, probs)


def sample(probs, seed=0, offset=0, *, seeds=None, positions=None):
    """One token per row of probs [N, V] (need not be normalised): int32 [N].

    Inverse CDF with uniforms from a torch.Generator seeded by (seed, offset); the same
    (seed, offset) gives the same tokens on the same device.

    Keyed (``seeds`` and ``positions``, N ints each): row n's token is the exponential
    race argmax_i probs[n, i] / E_i over probs[n, i] > 0 (first index on ties), with
    E ~ Exp(1) drawn from a generator seeded by (seeds[n], positions[n]) alone.
    """
    probs = _check_probs("sample", "probs", probs)
    if seeds is not None or positions is not None:
        seeds, positions = _keys("sample", probs.shape[0], seeds, positions)
        return torch.stack([_race(probs[n], seeds[n], positions[n])
                            for n in range(probs.shape[0])]).int() if len(seeds) else \
            torch.empty(0, dtype=torch.int32, device=probs.device)
    u = torch.rand(probs.shape[0], generator=_generator("sample", seed, offset, probs.device),
                   device=probs.device, dtype=torch.float64)
    return _inverse_cdf(probs, u).int()


# --- the verify step ----------------------------------------------------------------


def verify(target_logits, draft_tokens, draft_probs=None, *, num_draft=None,
           temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, greedy=False, seed=0, offset=0,
           method="token", draft_index=None):
    """Accept or reject a batch of drafts against the target; emit 1..K+1 tokens per row.

    target_logits: [B, K+1, V]  target logits at prefix, prefix+d1, ..., prefix+d1..dK
    draft_tokens:  [B, K]       proposals d1..dK (positions >= num_draft are ignored)
    draft_probs:   [B, K, V]    q each proposal was drawn from; None = deterministic
                                proposals, q = one-hot(d)
    num_draft:     [B] ints     proposals per row (ragged), each <= K; None = K
    policy:        scalars or [B] tensors, as in apply_policy, per row
    greedy:        bool or [B] bools: the same as temperature 0 on those rows (a scalar
                   temperature is still range-checked). Greedy rows accept while
                   d == argmax p and emit argmax p: the greedy output token for token.
    method:        "token" (token-wise: accept each proposal with min(1, p/q), correct at
                   the first rejection) or "block" (block verification, Sun et al., arXiv
                   2403.10444: see _block_accepted; rows with draft_probs None or greedy
                   stay token-wise).

    Returns (tokens [B, K+1] int32, -1 after the emitted ones; num_emitted [B] int32 =
    num_accepted + 1; num_accepted [B] int32).
    """
    if method not in ("token", "block"):
        raise ValueError(f"verify: method must be 'token' or 'block', got {method!r}")
    draft_probs = expand_compact_q("verify", target_logits, draft_probs, draft_index)
    b, k, v, num_draft = _check_verify_args(target_logits, draft_tokens, draft_probs, num_draft)
    device = target_logits.device
    temperature, top_k, top_p, min_p = _policy_params(
        "verify", b, device, temperature, top_k, top_p, min_p, greedy)
    greedy = temperature == 0
    gen = _generator("verify", seed, offset, device)

    # p at every position [B, K+1, V]; greedy rows get the one-hot at the argmax.
    def per_position(row_values):
        return row_values.repeat_interleave(k + 1)

    p = apply_policy(target_logits.reshape(b * (k + 1), v),
                     per_position(temperature),
                     per_position(top_k), per_position(top_p), per_position(min_p),
                     ).view(b, k + 1, v)

    positions = torch.arange(k, device=device)
    proposed = positions < num_draft[:, None]                              # [B, K]
    y = torch.where(proposed, draft_tokens.long(), 0)  # padding -> any valid index
    # q, plus an unused zero row at position K so the emitted position always indexes it.
    q = F.one_hot(y, v).float() if draft_probs is None else draft_probs.float()
    q = torch.cat([q, q.new_zeros(b, 1, v)], dim=1)                       # [B, K+1, V]
    p_y = p[:, :k].gather(-1, y[..., None]).squeeze(-1)                  # [B, K]
    q_y = q[:, :k].gather(-1, y[..., None]).squeeze(-1)

    u = torch.rand((b, k), generator=gen, device=device)
    accept = torch.where(greedy[:, None], y == p[:, :k].argmax(dim=-1), _accept(u, p_y, q_y))
    num_accepted = (accept & proposed).long().cumprod(dim=-1).sum(dim=-1)  # accepted prefix
    rows = torch.arange(b, device=device)
    # Block verification: the accepted length tau from the same ACCEPT coins (eta), and the
    # weight w_tau that scales p in the final residual; token-wise rows keep weight 1.
    weight = torch.ones(b, device=device)
    if method == "block" and draft_probs is not None:
        tau, w_tau = _block_accepted(p, q, p_y, q_y, u, num_draft)
        num_accepted = torch.where(greedy, num_accepted, tau)
        weight = torch.where(greedy, weight, w_tau)

    # The emitted position j = num_accepted: a correction after a rejection (j < num_draft),
    # a bonus from p after all proposals passed. Greedy rows emit argmax p either way.
    p_j, q_j = p[rows, num_accepted], q[rows, num_accepted]
    rejected = (num_accepted < num_draft) & ~greedy
    correction = _correction_distribution(p_j, q_j) if method == "token" else \
        _block_correction_distribution(p_j, q_j, weight[:, None])
    dist = torch.where(rejected[:, None], correction, p_j)
    last = _inverse_cdf(dist, torch.rand(b, generator=gen, device=device, dtype=torch.float64))

    tokens = torch.full((b, k + 1), -1, dtype=torch.long, device=device)
    tokens[:, :k] = torch.where(positions < num_accepted[:, None], y, -1)
    tokens.scatter_(1, num_accepted[:, None], last[:, None])
    return tokens.int(), (num_accepted + 1).int(), num_accepted.int()


def _block_weights(p_y, q_y):
    """w [B, K+1]: w_0 = 1, w_i = min(1, w_{i-1} p(y_i) / q(y_i)) (1 where q(y) = 0 <
    w p(y), 0 where w p(y) = 0)."""
    w = [torch.ones(p_y.shape[0], device=p_y.device)]
    for j in range(p_y.shape[1]):
        num = w[-1] * p_y[:, j]
        ratio = num / torch.where(q_y[:, j] > 0, q_y[:, j], 1.0)
        w.append(torch.where(num > 0, torch.where(num >= q_y[:, j], 1.0, ratio), 0.0))
    return torch.stack(w, dim=1)


def _block_keep_probabilities(p, q, w, num_draft):
    """h [B, K]: h[:, i - 1] = h_i = R_i / (R_i + 1 - w_i), R_i = sum max(w_i p_i - q_i, 0),
    for 1 <= i < n; h_n = w_n; 0 past n (not a candidate). 1 where R = 0 and w = 1."""
    b, k1, _ = p.shape
    k = k1 - 1
    mass = (w[:, :, None] * p - q).clamp(min=0.0).double().sum(dim=-1).float()  # [B, K+1]
    denom = mass + (1.0 - w)
    h = torch.where(denom > 0, mass / torch.where(denom > 0, denom, 1.0), 1.0)[:, 1:]
    i = torch.arange(1, k + 1, device=p.device)
    n = num_draft[:, None]
    return torch.where(i == n, w[:, 1:], torch.where(i < n, h, 0.0))


def _block_accepted(p, q, p_y, q_y, eta, num_draft):
    """Block verification (Sun et al., arXiv 2403.10444): tau = the largest i in [1, n]
    with eta_i < h_i, else 0, and w_tau. eta_i is the ACCEPT coin of draft position i - 1."""
    w = _block_weights(p_y, q_y)
    h = _block_keep_probabilities(p, q, w, num_draft)
    keep = eta < h  # [B, K]
    i = torch.arange(1, p.shape[1], device=p.device)
    tau = torch.where(keep, i, 0).amax(dim=-1) if keep.shape[1] else \
        torch.zeros(p.shape[0], dtype=torch.long, device=p.device)
    return tau, w.gather(1, tau[:, None]).squeeze(1)


def _block_correction_distribution(p, q, w):
    """The final token's distribution after tau < n: norm(max(w p - q, 0)), p when that
    mass is roundoff; w = 1 is token-wise's residual."""
    return _correction_distribution_from(w * p, q, p)


def _correction_distribution_from(scaled_p, q, fallback):
    r = (scaled_p - q).clamp(min=0.0)
    mass = r.sum(dim=-1, keepdim=True)
    return torch.where(mass < RESIDUAL_EPS, fallback, r / mass.clamp(min=RESIDUAL_EPS))


# --- tree verification ---------------------------------------------------------------


def expand_compact_q(op, target_logits, draft_probs, draft_index):
    """A compact q (draft_probs [.., W] read through draft_index [V], ops.verify's
    draft_index) as the full [.., V] rows it stands for: column draft_index[x] at x, 0
    where draft_index[x] = -1, NaN where it is past W (an invalid probability). Without
    draft_index: draft_probs as given."""
    if draft_index is None:
        return draft_probs
    _args.spec_logits(op, target_logits)
    v = target_logits.shape[-1]
    lead = tuple(target_logits.shape[:2])
    lead = (lead[0], lead[1] - 1) if op == "verify" else lead
    dims = "[B, K, V]" if op == "verify" else "[B, N+1, V]"
    _args.draft_probs(op, draft_probs, lead + (v,), dims, draft_index)
    q = draft_probs.float()
    index = draft_index.to(q.device).long()
    width = q.shape[-1]
    full = torch.zeros(q.shape[:-1] + (v,), dtype=torch.float32, device=q.device)
    inside = (index >= 0) & (index < width)
    full[..., inside] = q[..., index[inside]]
    full[..., index >= width] = float("nan")
    return full


def verify_tree(target_logits, tree_tokens, parents, draft_probs=None, *, num_nodes=None,
                replacement=True, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                greedy=False, seed=0, offset=0, draft_index=None):
    """Verify a tree of drafts per row; emit the accepted path and one more token.

    target_logits [B, N+1, V]: row 0 the root's distribution, row i + 1 node i's.
    tree_tokens [B, N], parents [B, N] (-1 = the root, else a node < i).
    draft_probs [B, N+1, V] or None: q at the root (row 0) and at node i (row i + 1), the
      distribution node i's children were drawn from. None: deterministic candidates.
    num_nodes [B] or None (= N): row b uses nodes < num_nodes[b].
    replacement: siblings drawn i.i.d. from q (True) or without replacement (False).

    Deterministic: at a node, x ~ p (argmax for greedy rows); descend into the child whose
    token is x, else emit x. Sampled: siblings in node order; child c accepted iff
    u * q_i(c) < r(c), r = p at first, then norm(max(r - q_i, 0)) after each rejected
    sibling (p if that mass < RESIDUAL_EPS); q_i = q with replacement, else q without the
    earlier siblings, renormalised; all rejected: a sample of r; a leaf: a sample of p.
    Coins: u_accept [B, N] (node i's test), u_emit [B, N+1] (the draw at row j), from a
    generator seeded by (seed, offset).

    Returns (tokens [B, N+1] int32 -1 padded, num_emitted [B] int32, accepted_nodes [B, N]
    int32 -1 padded).
    """
    draft_probs = expand_compact_q("verify_tree", target_logits, draft_probs, draft_index)
    b, n_max, v, num_nodes = _check_tree_args(target_logits, tree_tokens, parents, draft_probs,
                                              num_nodes, replacement)
    device = target_logits.device
    temperature, top_k, top_p, min_p = _policy_params(
        "verify_tree", b, device, temperature, top_k, top_p, min_p, greedy)
    p = apply_policy(target_logits.reshape(b * (n_max + 1), v),
                     *(t.repeat_interleave(n_max + 1) for t in (temperature, top_k, top_p, min_p))
                     ).view(b, n_max + 1, v)
    q = None if draft_probs is None else draft_probs.float()
    gen = _generator("verify_tree", seed, offset, device)
    accept_u = torch.rand((b, n_max), generator=gen, device=device)
    emit_u = torch.rand((b, n_max + 1), generator=gen, device=device)
    tokens = torch.full((b, n_max + 1), -1, dtype=torch.int32, device=device)
    nodes = torch.full((b, n_max), -1, dtype=torch.int32, device=device)
    emitted = torch.zeros(b, dtype=torch.int32, device=device)
    for r in range(b):
        n = int(num_nodes[r])
        toks, pars = tree_tokens[r, :n].tolist(), parents[r, :n].tolist()
        path, last = _tree_walk(p[r], None if q is None else q[r], toks, pars,
                                bool(temperature[r] == 0), replacement, accept_u[r], emit_u[r])
        tokens[r, :len(path)] = torch.tensor([toks[c] for c in path], dtype=torch.int32)
        tokens[r, len(path)] = last
        nodes[r, :len(path)] = torch.tensor(path, dtype=torch.int32)
        emitted[r] = len(path) + 1
    return tokens, emitted, nodes


def _tree_walk(p, q, tokens, parents, greedy, replacement, accept_u, emit_u):
    """One row's walk: (accepted node path, the last token). p, q: [N+1, V]."""
    path, cur = [], -1
    while True:
        row = cur + 1
        children = [c for c in range(cur + 1, len(parents)) if parents[c] == cur]
        if greedy or q is None:
            x = int(p[row].argmax()) if greedy else _draw(p[row], emit_u[row])
            child = next((c for c in children if tokens[c] == x), None)
            if child is None:
                return path, x
            path.append(child)
            cur = child
            continue
        r, removed, accepted = p[row], [], None
        for c in children:
            q_i = _sibling_q(q[row], removed)
            if bool(_accept(accept_u[c], r[tokens[c]], q_i[tokens[c]])):
                accepted = c
                break
            r = _tree_residual(r, q_i, p[row])
            if not replacement:
                removed.append(tokens[c])
        if accepted is None:
            return path, _draw(r, emit_u[row])
        path.append(accepted)
        cur = accepted


def _sibling_q(q, removed):
    """q_i: q without the tokens of the earlier (rejected) siblings, renormalised by
    1 - their mass (summed in float32 in node order); all zero once no mass is left."""
    if not removed:
        return q
    left = torch.tensor(1.0)
    for t in removed:
        left = left - q[t]
    out = q.clone()
    out[removed] = 0.0
    return out / left if left > 0 else torch.zeros_like(q)


def _tree_residual(r, q_i, p):
    """r after a rejected sibling: norm(max(r - q_i, 0)), p if that mass is roundoff."""
    return _correction_distribution_from(r, q_i, p)


def _draw(dist, u):
    """One inverse-CDF draw from dist [V] with coin u."""
    return int(_inverse_cdf(dist[None], u.double().reshape(1))[0])


def _check_tree_args(target_logits, tree_tokens, parents, draft_probs, num_nodes, replacement):
    op = "verify_tree"
    b, n, v = _args.spec_logits(op, target_logits, "N")
    _check_logit_values(op, "target_logits", target_logits)
    if not isinstance(replacement, bool):
        raise TypeError(f"{op}: replacement must be a bool, got {replacement!r}")
    for name, t in (("tree_tokens", tree_tokens), ("parents", parents)):
        _args.integer_tensor(op, name, t, (b, n), "[B, N]")
    _args.draft_probs(op, draft_probs, (b, n + 1, v), "[B, N+1, V]")
    device = target_logits.device
    num_nodes = _counts(op, "num_nodes", num_nodes, b, n, device)
    distinct = draft_probs is None or not replacement
    for r in range(b):
        m = int(num_nodes[r])
        if not 0 <= m <= n:
            raise ValueError(f"{op}: num_nodes must be in [0, N] = [0, {n}], got {m} at "
                             f"num_nodes[{r}]")
        toks, pars = tree_tokens[r, :m].tolist(), parents[r, :m].tolist()
        for i in range(m):
            if not -1 <= pars[i] < i:
                raise ValueError(f"{op}: parents must be -1 or an earlier node (in [-1, i)), "
                                 f"got {pars[i]} at parents[{r}, {i}]")
            if not 0 <= toks[i] < v:
                raise ValueError(f"{op}: tree_tokens must be in [0, V) = [0, {v}), got "
                                 f"{toks[i]} at tree_tokens[{r}, {i}]")
            if distinct and any(pars[s] == pars[i] and toks[s] == toks[i] for s in range(i)):
                raise ValueError(f"{op}: sibling nodes must hold distinct tokens (deterministic "
                                 f"or without replacement), got {toks[i]} again at "
                                 f"tree_tokens[{r}, {i}]")
    return b, n, v, num_nodes


def verify_keyed(target_logits, draft_tokens, *, num_draft=None, seeds, positions,
                 temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, greedy=False):
    """Drafter-invariant verification keyed by request seed and position: x_j = the
    keyed sample of p_j = policy(target_logits[b, j]) at (seeds[b], positions[b] + j);
    proposals are accepted while d_j == x_j (j < num_draft[b]), then x at the first
    difference (or after the last proposal) is emitted. Outputs as :func:`verify`."""
    b, k, v, num_draft = _check_verify_args(target_logits, draft_tokens, None, num_draft,
                                            "verify_keyed")
    seeds, positions = _keys("verify_keyed", b, seeds, positions)
    device = target_logits.device
    temperature, top_k, top_p, min_p = _policy_params(
        "verify_keyed", b, device, temperature, top_k, top_p, min_p, greedy)
    p = apply_policy(target_logits.reshape(b * (k + 1), v),
                     *(t.repeat_interleave(k + 1) for t in (temperature, top_k, top_p, min_p))
                     ).view(b, k + 1, v)
    x = torch.tensor([[int(_race(p[r, j], seeds[r], positions[r] + j)) for j in range(k + 1)]
                      for r in range(b)], dtype=torch.long, device=device).view(b, k + 1)
    tokens = torch.full((b, k + 1), -1, dtype=torch.long, device=device)
    accepted = torch.zeros(b, dtype=torch.long, device=device)
    for r in range(b):
        a = 0
        while a < int(num_draft[r]) and int(draft_tokens[r, a]) == int(x[r, a]):
            a += 1
        tokens[r, :a + 1] = x[r, :a + 1]
        accepted[r] = a
    return tokens.int(), (accepted + 1).int(), accepted.int()


def _race(w, seed, position):
    """The keyed sample of weights w [V]: argmax w_i / E_i over w_i > 0, E ~ Exp(1) from
    a generator seeded by (seed, position) only."""
    gen = torch.Generator(device=w.device)
    gen.manual_seed(_splitmix64(_splitmix64(seed) ^ position) & ((1 << 63) - 1))
    e = torch.empty(w.shape[-1], dtype=torch.float64, device=w.device).exponential_(generator=gen)
    score = torch.where(w > 0, w.double() / e, torch.tensor(-1.0, dtype=torch.float64,
                                                            device=w.device))
    return score.argmax()


def _keys(op, n, seeds, positions):
    """Keyed calls' seeds and positions as lists of n Python ints."""
    _args.keyed(op, seeds, positions, required=True)
    out = []
    for name, value, hi in (("seeds", seeds, 1 << 64), ("positions", positions, 1 << 63)):
        if isinstance(value, torch.Tensor):
            _args.integer_tensor(op, name, value, (n,), "[N]")
        values = value.tolist() if isinstance(value, torch.Tensor) else list(value)
        if isinstance(value, torch.Tensor) and name == "seeds":
            values = [x + (1 << 64) if x < 0 else x
                      for x in values]  # an int64 tensor holds a seed's 64 bits
        out.append(_args.key_values(op, name, values, n, hi))
    return out


def _accept(u, p_y, q_y):
    """The acceptance test: u < p(y)/q(y), without the division (q(y) = 0 accepts)."""
    return u * q_y < p_y


def _correction_distribution(p, q):
    """After a rejection: r = norm(max(p - q, 0)) over rows [R, V]; p when r's mass is roundoff."""
    return _correction_distribution_from(p, q, p)


def _inverse_cdf(probs, u):
    """Token i with cdf[i-1] <= u * total < cdf[i]; zero-probability tokens are never hit."""
    cdf = probs.double().cumsum(dim=-1)
    x = (u * cdf[:, -1])[:, None].contiguous()
    return torch.searchsorted(cdf, x, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)


def _generator(op, seed, offset, device):
    """A torch.Generator for the stream (seed, offset): non-negative 64-bit ints, or
    one-element int64 tensors holding the 64 bits (two's complement), as the ops take
    them."""
    values = []
    for name, value in (("seed", seed), ("offset", offset)):
        value = _args.stream_arg(op, name, value, 1 << 64)
        values.append(int(value.reshape(())) & _MASK64 if isinstance(value, torch.Tensor)
                      else value)
    seed, offset = values
    gen = torch.Generator(device=device)
    gen.manual_seed(_splitmix64(_splitmix64(seed) ^ offset))
    return gen


def _splitmix64(z):
    # Mixes nearby integers into unrelated 64-bit seeds.
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


# --- argument checks ----------------------------------------------------------------


# The checks ops and reference share are verispec._args's; these check what only the
# reference does in Python (the values: the kernels check them for ops).


def _check_logits(op, name, logits):
    _args.float_tensor(op, name, logits, 2, "[N, V]")
    return _check_logit_values(op, name, logits)


def _check_logit_values(op, name, logits):
    x = logits.float()
    if torch.isnan(x).any() or (x == float("inf")).any():
        raise ValueError(f"{op}: {name} must be finite or -inf, got NaN or +inf")
    if logits.numel() and not torch.isfinite(x).any(dim=-1).all():
        raise ValueError(f"{op}: {name} has a row where every logit is -inf")
    return logits


def _check_probs(op, name, probs):
    _args.float_tensor(op, name, probs, 2, "[N, V]")
    x = probs.float()
    if not torch.isfinite(x).all() or (x < 0).any():
        raise ValueError(f"{op}: {name} must be finite and non-negative")
    if probs.numel() and not (x.sum(dim=-1) > 0).all():
        raise ValueError(f"{op}: {name} has a row with zero total probability")
    return x


def _row_values(op, name, value, n, device, integer):
    """A per-row 1-D tensor of length n as a 1-D tensor of length n (int64 for top_k); a
    scalar is type-checked and returned as a Python number."""
    value = _args.policy_value(op, name, value, n, integer)
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=torch.long if integer else torch.float32)
    return value


_POLICY_NAMES = ("temperature", "top_k", "top_p", "min_p")


def _policy_params(op, n, device, temperature, top_k, top_p, min_p, greedy=False):
    """The policy as four [n] tensors, range-checked by the rule the ops use, in the ops'
    order: scalars as given; then ``greedy`` (verify's) folded into the temperature, 0 on
    greedy rows; then per-row tensors row by row, naming the first bad row as the
    kernels do."""
    from verispec._policy import fold_greedy, policy_error

    given = {name: _row_values(op, name, value, n, device, integer=name == "top_k")
             for name, value in zip(_POLICY_NAMES, (temperature, top_k, top_p, min_p))}
    error = policy_error(**{name: None if isinstance(v, torch.Tensor) else v
                            for name, v in given.items()})
    if error:
        raise ValueError(f"{op}: {error}")
    rows = {}
    for name, v in given.items():
        if isinstance(v, torch.Tensor):
            rows[name] = v
        else:  # a valid scalar; top_k >= 2**63 is "off" too
            dtype = torch.long if name == "top_k" else torch.float32
            rows[name] = torch.full((n,), min(v, 2**63 - 1) if name == "top_k" else v,
                                    dtype=dtype, device=device)
    if greedy is not False:
        t = fold_greedy(op, greedy, rows["temperature"], n, device)
        rows["temperature"] = t if isinstance(t, torch.Tensor) else torch.full_like(
            rows["temperature"], t)
    _check_rows(op, {name: rows[name] for name, v in given.items()
                     if isinstance(v, torch.Tensor)}, policy_error)
    return tuple(rows[name] for name in _POLICY_NAMES)


def _check_rows(op, rows, policy_error):
    """Per-row values {name: [n] tensor} through the scalar rule; each distinct value is
    asked once. Raises for the first row with a bad value, for its first bad argument."""
    if not rows:
        return
    bad = None
    for name, values in rows.items():
        distinct, inverse = torch.unique(values.cpu(), return_inverse=True)
        for i, value in enumerate(distinct.tolist()):
            if policy_error(**{name: value}):
                bad = (inverse == i) if bad is None else bad | (inverse == i)
    if bad is None:
        return
    row = int(bad.nonzero()[0])
    for name, values in rows.items():
        error = policy_error(**{name: values[row].item()})
        if error:
            raise ValueError(f"{op}: {error} at {name}[{row}]")


def _counts(op, name, value, b, n, device):
    """Per-row counts (num_draft, num_nodes) as int64 [B] on `device`; None: n a row."""
    value = _args.counts(op, name, value, b, device)
    if value is None:
        return torch.full((b,), n, dtype=torch.long, device=device)
    return value.to(device=device, dtype=torch.long)


def _check_verify_args(target_logits, draft_tokens, draft_probs, num_draft, op="verify"):
    b, k, v = _args.spec_logits(op, target_logits)
    _check_logit_values(op, "target_logits", target_logits)
    _args.integer_tensor(op, "draft_tokens", draft_tokens, (b, k), "[B, K]")
    _args.draft_probs(op, draft_probs, (b, k, v), "[B, K, V]")
    device = target_logits.device
    num_draft = _counts(op, "num_draft", num_draft, b, k, device)
    if ((num_draft < 0) | (num_draft > k)).any():
        bad = num_draft[(num_draft < 0) | (num_draft > k)][0].item()
        raise ValueError(f"{op}: num_draft must be in [0, K] = [0, {k}], got {bad}")
    proposed = torch.arange(k, device=device) < num_draft[:, None]
    tokens = draft_tokens.long()
    if (proposed & ((tokens < 0) | (tokens >= v))).any():
        bad = tokens[proposed & ((tokens < 0) | (tokens >= v))][0].item()
        raise ValueError(f"{op}: draft_tokens must be in [0, V) = [0, {v}), got {bad}")
    return b, k, v, num_draft
