"""Native ops: the sampling policy, sampling, speculative verification, and a CPU linear
layer for the few-token forwards of speculative decoding.

Same signatures and semantics as :mod:`verispec.reference` (the PyTorch oracle); the
work runs in C++ on CPU tensors and in CUDA kernels on CUDA tensors, with no sort of the
vocabulary. What differs from the reference:

- Randomness is counter-based (Philox4x32-10): each coin is addressed by
  ``(seed, offset, row, position, purpose)``, so a call is a pure function of its
  inputs and ranks of a sharded run agree without communication. Every sum a decision
  depends on is an exact fixed-point sum and every float is computed alike on both
  devices, so for the same inputs the CPU and CUDA paths return the same probabilities
  and the same tokens, bit for bit. Rows have at most 2**20 entries (the vocabulary). Advance ``offset`` by one per call (per decoding step);
  ``offset`` must be in ``[0, 2**60)``, ``seed`` in ``[0, 2**64)``. Either may be a
  one-element int64 tensor, which a CUDA graph can replay with new values.
- Every op is a ``torch.library`` custom op (``torch.ops.verispec.*``) with a fake
  implementation, so it composes with ``torch.compile(fullgraph=True)``.
- Value errors found while running (NaN / +Inf logits, a row of only -Inf, out-of-range
  draft tokens or ``num_draft``, per-row policy values out of range) raise ValueError
  naming the argument, the row and the value. On CUDA that check synchronises the
  stream; while a CUDA graph is being captured it is skipped (bad rows then get the
  padding outputs: tokens -1, probabilities 0).
"""

import contextlib
import threading
from typing import Optional, Tuple

import torch

from verispec import _C
from verispec import _args
from verispec._policy import fold_greedy, policy_error
# The CPU linear layers live with the model layers (one home for the products' layout
# and kernels); they are public here under these names.
from verispec.models.layers.linear import linear, quant_linear, quant_pack
from verispec.models.layers.linear import _last_dim_contiguous

__all__ = ["DeferredErrors", "apply_policy", "deferred_errors", "linear", "quant_linear", "quant_pack", "sample", "verify",
           "verify_keyed", "verify_tree"]

_INT32_MIN, _INT32_MAX = -(1 << 31), (1 << 31) - 1
_SEED_LIMIT = 1 << 64
_OFFSET_LIMIT = 1 << 60


# --- public API ---------------------------------------------------------------------


def apply_policy(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """Target distribution after the sampling policy, float32 [N, V].

    logits: [N, V] float32/bfloat16/float16 (-inf masks a token). Each parameter is a
    Python number or a tensor of N per-row values. Ties at a threshold are kept.
      temperature  0 => one-hot at argmax(logits) (lowest index on ties);
                   else softmax(logits / temperature)
      top_k > 0    keep prob >= the k-th largest prob (k >= V keeps everything)
      top_p < 1    on the survivors, keep prob >= t for the largest t whose kept mass
                   is >= top_p * surviving mass
      min_p > 0    keep prob >= min_p * max prob
    Kept probabilities are renormalised.
    """
    op = "apply_policy"
    _args.float_tensor(op, "logits", logits, 2, "[N, V]")
    n = logits.shape[0]
    policy = _policy(op, n, logits.device, temperature, top_k, top_p, min_p)
    return _dispatch(_apply_policy_op, _apply_policy_eager)(logits, *policy)


def sample(probs, seed=0, offset=0, *, seeds=None, positions=None):
    """One token per row of probs [N, V] (need not be normalised): int32 [N].

    The exact inverse CDF over the weights in fixed point (floor(w * 2^40 / 2^e), 2^e the
    largest weight's power of two) with the 64-bit draw (seed, offset, row, position 0,
    SAMPLE): the same seed and offset give the same tokens, on either device.

    Keyed (``seeds`` and ``positions``: [N] integer tensors or sequences of ints, seeds
    in [0, 2**64) and positions >= 0): row n's token is the exponential race of probs[n]
    over the keyed stream of (seeds[n], positions[n]) (csrc/include/verispec/philox.h;
    ``seed`` and ``offset`` are not used). It depends on that row's weights, seed and
    position only, whatever the row index or the rest of the call; two distributions
    raced with the same seed and position give the same token with probability at least
    (1 - TV) / (1 + TV) (Gumbel-max coupling), which keyed verification uses.
    """
    op = "sample"
    _args.float_tensor(op, "probs", probs, 2, "[N, V]")
    seed_args = _random(op, probs.device, seed, offset)
    keys = _keys(op, probs.shape[0], probs.device, seeds, positions)
    return _dispatch(_sample_op, _sample_eager)(probs.float(), *seed_args, *keys)


def verify_keyed(target_logits, draft_tokens, *, num_draft=None, seeds, positions,
                 temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, greedy=False):
    """Drafter-invariant verification, keyed by each row's request seed and position.

    target_logits [B, K+1, V], draft_tokens [B, K], num_draft and the policy as in
    :func:`verify`; ``seeds`` [B] (each row's request seed) and ``positions`` [B] (the
    sequence position of each row's first token, i.e. its committed length), as in
    keyed :func:`sample`.

    Row b's token at draft position j is x_j = the keyed sample of
    p_j = policy(target_logits[b, j]) at (seeds[b], positions[b] + j). Proposals are
    accepted while d_j == x_j (j < num_draft[b]); the first x_j that differs, or x_n after
    all n were accepted, is emitted. So every emitted token is x at its position: a
    function of the target's distribution, the seed and the position only. A request's
    tokens are the same alone or in any batch, with any k and any draft, and each is an
    exact sample of p (every position races fresh exponentials). A draft model proposing
    d_j = keyed sample of its q_j at the same seed and position is accepted with
    probability at least (1 - TV(p, q)) / (1 + TV(p, q)); a deterministic proposal d with
    probability p(d), as with :func:`verify`. A proposal outside [0, V) is never accepted.

    Returns (tokens [B, K+1] int32, -1 after the emitted ones; num_emitted [B] int32 =
    num_accepted + 1; num_accepted [B] int32), like :func:`verify`.
    """
    op = "verify_keyed"
    b, k, v, device, draft_tokens = _spec_inputs(op, target_logits, "draft_tokens", draft_tokens)
    k1 = k + 1
    num_draft = _optional_counts(op, "num_draft", num_draft, b, device)
    if num_draft is None:
        num_draft = torch.full((b,), k, dtype=torch.int32, device=device)
    elif device.type == "cpu" and b and not bool(((num_draft >= 0) & (num_draft <= k)).all()):
        row = int(((num_draft < 0) | (num_draft > k)).nonzero()[0, 0])
        raise ValueError(f"{op}: num_draft must be in [0, K] = [0, {k}], got "
                         f"{int(num_draft[row])} at num_draft[{row}]")
    seeds, positions = _keys(op, b, device, seeds, positions, required=True)
    if b == 0:
        return (torch.empty((0, k1), dtype=torch.int32, device=device),
                torch.empty(0, dtype=torch.int32, device=device),
                torch.empty(0, dtype=torch.int32, device=device))
    t, top_k_, p, m, t_rows, k_rows, p_rows, m_rows = _policy(op, b, device, temperature, top_k,
                                                              top_p, min_p, greedy)

    def per_position(value, rows):
        return value if rows is None else rows.repeat_interleave(k1)

    probs = apply_policy(target_logits.reshape(b * k1, v), per_position(t, t_rows),
                         per_position(top_k_, k_rows), per_position(p, p_rows),
                         per_position(m, m_rows))
    steps = torch.arange(k1, device=device)
    x = sample(probs, seeds=seeds.repeat_interleave(k1),
               positions=(positions[:, None] + steps).reshape(-1)).view(b, k1).long()
    return _keyed_outcome(x, draft_tokens, num_draft)


def _spec_inputs(op, target_logits, name, tokens, dim="K"):
    """A verify op's (B, n, V, device, tokens as int32) from target_logits [B, n+1, V] and
    the proposals `name` [B, n] (n written `dim` in messages), checked."""
    b, n, v = _args.spec_logits(op, target_logits, dim)
    device = target_logits.device
    return b, n, v, device, _int32_tensor(op, name, tokens, (b, n), f"[B, {dim}]", device)


def _optional_probs(op, probs, shape, dims, draft_index=None):
    """(draft_probs as float32 with a contiguous last dimension, checked to be `shape`
    (last dimension W with draft_index); draft_index as contiguous int32 or None)."""
    _args.draft_probs(op, probs, shape, dims, draft_index)
    if draft_index is not None:
        draft_index = draft_index.to(device=probs.device, dtype=torch.int32).contiguous()
    return (None if probs is None else _last_dim_contiguous(probs.float())), draft_index


def _optional_counts(op, name, counts, b, device):
    """Per-row counts ([B] ints: num_draft, num_nodes) as contiguous int32, or None."""
    counts = _args.counts(op, name, counts, b, device)
    return None if counts is None else _int32_tensor(op, name, counts, (b,), "[B]",
                                                     device).contiguous()


def _keyed_outcome(x, draft_tokens, num_draft):
    """The keyed rule's outputs from each position's keyed sample x [B, K+1]: accept while
    the proposal equals x, then emit x at the first difference (or after all proposals)."""
    b, k1 = x.shape
    steps = torch.arange(k1, device=x.device)
    proposed = steps[:-1] < num_draft[:, None].long()
    match = (draft_tokens.long() == x[:, :-1]) & proposed
    accepted = match.long().cumprod(dim=-1).sum(dim=-1)
    tokens = torch.where(steps <= accepted[:, None], x, -1)
    return tokens.int(), (accepted + 1).int(), accepted.int()


def verify(target_logits, draft_tokens, draft_probs=None, *, num_draft=None,
           temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, greedy=False, seed=0, offset=0,
           method="token", draft_index=None):
    """Accept or reject a batch of drafts against the target; emit 1..K+1 tokens per row.

    target_logits: [B, K+1, V]  target logits at prefix, prefix+d1, ..., prefix+d1..dK
    draft_tokens:  [B, K]       proposals d1..dK, an integer tensor (positions >= num_draft
                                are ignored)
    draft_probs:   [B, K, V]    q each proposal was drawn from; None = deterministic
                                proposals, q = one-hot(d)
    num_draft:     [B] ints     proposals per row (ragged), each <= K; None = K
    draft_index:   [V] ints     a compact q: draft_probs is [B, K, W] over a draft
                                vocabulary of W tokens and q(x) = draft_probs[..,
                                draft_index[x]], 0 where draft_index[x] = -1 (x outside
                                it); the results are bit for bit those of the full q.
                                None: draft_probs has V columns
    policy:        numbers or [B] tensors, as in apply_policy, per row
    greedy:        bool or [B] bool tensor: the same as temperature 0 on those rows
                   (verispec's one spelling of greedy; a scalar temperature is still
                   range-checked). Greedy rows accept while d == argmax p and emit
                   argmax p: the greedy output, token for token.

    Proposal j of row b is accepted iff u * q(d) < p(d), u the coin (seed, offset, b, j,
    ACCEPT); at the first rejection a correction is drawn from norm(max(p - q, 0)) (from
    p if that mass is < 1e-6), after K accepted proposals a bonus from p, with the 64-bit
    draw (seed, offset, b, position, CORRECTION) (an exact inverse CDF over fixed-point
    weights).

    method="block": block verification (Sun et al., arXiv 2403.10444) for sampled drafts
    (draft_probs given; greedy rows and draft_probs None stay token-wise): exact, and its
    expected number of accepted proposals is never below token-wise's. With weights
    w_0 = 1, w_i = min(1, w_{i-1} p(d_i) / q(d_i)) and keep probabilities
    h_i = R_i / (R_i + 1 - w_i), R_i = sum max(w_i p_i - q_i, 0) (h_n = w_n), it accepts
    the longest prefix i whose ACCEPT coin (b, i - 1) is below h_i, then draws the next
    token from norm(max(w_i p_i - q_i, 0)) (p_n after all n). csrc/include/verispec/ops.h
    has the details.

    Returns (tokens [B, K+1] int32, -1 after the emitted ones; num_emitted [B] int32 =
    num_accepted + 1; num_accepted [B] int32).
    """
    op = "verify"
    if method not in ("token", "block"):
        raise ValueError(f"{op}: method must be 'token' or 'block', got {method!r}")
    b, k, v, device, draft_tokens = _spec_inputs(op, target_logits, "draft_tokens", draft_tokens)
    draft_probs, draft_index = _optional_probs(op, draft_probs, (b, k, v), "[B, K, V]",
                                               draft_index)
    num_draft = _optional_counts(op, "num_draft", num_draft, b, device)
    policy = _policy(op, b, device, temperature, top_k, top_p, min_p, greedy)
    seed_args = _random(op, device, seed, offset)
    return _dispatch(_verify_op, _verify_eager)(target_logits, draft_tokens, draft_probs, num_draft,
                                                *policy, *seed_args, method == "block",
                                                draft_index)


def verify_tree(target_logits, tree_tokens, parents, draft_probs=None, *, num_nodes=None,
                replacement=True, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                greedy=False, seed=0, offset=0, draft_index=None):
    """Verify a tree of draft tokens per row: accept a path from the root, emit one more.

    target_logits: [B, N+1, V]  row 0: the target after the committed tokens (the root);
                                row i + 1: after draft node i
    tree_tokens:   [B, N] ints  the token of node i
    parents:       [B, N] ints  the parent of node i: -1 = the root, else a node < i
    draft_probs:   [B, N+1, V]  q at the root (row 0) and at node i (row i + 1): the
                                distribution that node's children were drawn from; None:
                                deterministic candidates (siblings distinct tokens)
    num_nodes:     [B] ints     row b uses nodes 0 .. num_nodes[b] - 1 (ragged); None = N
    replacement:   with draft_probs: siblings drawn i.i.d. from q (True) or without
                   replacement (False; siblings then distinct)
    draft_index:   [V] ints     a compact q ([B, N+1, W]), as in :func:`verify`
    policy, greedy, seed, offset: as in :func:`verify`, per row.

    Deterministic candidates: at a node, x ~ p (x = argmax p on greedy rows); descend into
    the child holding x, else emit x and stop: exact for any choice of candidates.
    Sampled children: siblings are tried in node order; child c is accepted with
    probability min(1, r(c) / q_i(c)), r = p at first and norm(max(r - q_i, 0)) after each
    rejected sibling (p if that mass is < 1e-6); q_i = q with replacement, else q without
    the earlier siblings' tokens, renormalised. If every sibling is rejected, a sample of r
    is emitted; a leaf emits a bonus token from its p. Exact (SpecInfer, arXiv 2305.09781;
    without replacement: recursive rejection sampling, arXiv 2402.14160).

    Coins (csrc/include/verispec/philox.h): node i's test uses the coin (seed, offset, b,
    i, TREE_ACCEPT); the token drawn at the node with target row j uses the 64-bit draw
    (seed, offset, b, j, TREE_EMIT).

    Returns (tokens [B, N+1] int32: the accepted path's tokens then the emitted one, -1
    after; num_emitted [B] int32 = accepted depth + 1; accepted_nodes [B, N] int32: the
    accepted nodes' indices, -1 after).
    """
    op = "verify_tree"
    b, n, v, device, tree_tokens = _spec_inputs(op, target_logits, "tree_tokens", tree_tokens,
                                                "N")
    if not isinstance(replacement, bool):
        raise TypeError(f"{op}: replacement must be a bool, got {replacement!r}")
    parents = _int32_tensor(op, "parents", parents, (b, n), "[B, N]", device)
    draft_probs, draft_index = _optional_probs(op, draft_probs, (b, n + 1, v), "[B, N+1, V]",
                                               draft_index)
    num_nodes = _optional_counts(op, "num_nodes", num_nodes, b, device)
    policy = _policy(op, b, device, temperature, top_k, top_p, min_p, greedy)
    seed_args = _random(op, device, seed, offset)
    return _dispatch(_verify_tree_op, _verify_tree_eager)(
        target_logits, tree_tokens, parents, draft_probs, num_nodes, replacement, *policy,
        *seed_args, draft_index)


# --- the ops' entry points into verispec._C ----------------------------------------------
# Each takes every policy value twice, as a scalar and as an optional per-row tensor
# that wins when given, and seed/offset as int64 scalars (two's complement) plus
# optional one-element tensors.
#
# Eager calls go straight to the implementation: the custom-op dispatch adds per-call
# overhead and its first call imports torch._dynamo (seconds). Under torch.compile /
# export the registered op (with its fake kernel) is what gets traced.


def _dispatch(op, eager):
    return op if torch.compiler.is_compiling() else eager


def _apply_policy_eager(logits, temperature, top_k, top_p, min_p, temperature_rows, top_k_rows,
                        top_p_rows, min_p_rows):
    probs = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    _C.apply_policy(_last_dim_contiguous(logits), probs,
                    _pick(temperature, temperature_rows), _pick(top_k, top_k_rows),
                    _pick(top_p, top_p_rows), _pick(min_p, min_p_rows),
                    **_launch(logits, _C.apply_policy_workspace_bytes(), "apply_policy"))
    return probs


@torch.library.custom_op("verispec::apply_policy", mutates_args=())
def _apply_policy_op(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float,
    temperature_rows: Optional[torch.Tensor], top_k_rows: Optional[torch.Tensor],
    top_p_rows: Optional[torch.Tensor], min_p_rows: Optional[torch.Tensor],
) -> torch.Tensor:
    return _apply_policy_eager(logits, temperature, top_k, top_p, min_p, temperature_rows,
                               top_k_rows, top_p_rows, min_p_rows)


@_apply_policy_op.register_fake
def _(logits, temperature, top_k, top_p, min_p, *rows):
    return logits.new_empty(logits.shape, dtype=torch.float32)


def _sample_eager(probs, seed, offset, seed_t, offset_t, seeds=None, positions=None):
    tokens = torch.empty(probs.shape[0], dtype=torch.int32, device=probs.device)
    _C.sample(_last_dim_contiguous(probs), tokens, _unsigned(seed, seed_t), _unsigned(offset, offset_t),
              **_launch(probs, _C.sample_workspace_bytes(), "sample"),
              row_seeds=seeds, row_positions=positions)
    return tokens


@torch.library.custom_op("verispec::sample", mutates_args=())
def _sample_op(probs: torch.Tensor, seed: int, offset: int, seed_t: Optional[torch.Tensor],
               offset_t: Optional[torch.Tensor], seeds: Optional[torch.Tensor] = None,
               positions: Optional[torch.Tensor] = None) -> torch.Tensor:
    return _sample_eager(probs, seed, offset, seed_t, offset_t, seeds, positions)


@_sample_op.register_fake
def _(probs, seed, offset, seed_t, offset_t, seeds=None, positions=None):
    return probs.new_empty(probs.shape[0], dtype=torch.int32)


def _verify_eager(target_logits, draft_tokens, draft_probs, num_draft, temperature, top_k, top_p,
                  min_p, temperature_rows, top_k_rows, top_p_rows, min_p_rows, seed, offset,
                  seed_t, offset_t, block=False, draft_index=None):
    b, k1, _ = target_logits.shape
    device = target_logits.device
    tokens = torch.empty((b, k1), dtype=torch.int32, device=device)
    num_emitted = torch.empty(b, dtype=torch.int32, device=device)
    num_accepted = torch.empty(b, dtype=torch.int32, device=device)
    _C.verify(_last_dim_contiguous(target_logits), draft_tokens, draft_probs, num_draft,
              tokens, num_emitted, num_accepted,
              _pick(temperature, temperature_rows), _pick(top_k, top_k_rows),
              _pick(top_p, top_p_rows), _pick(min_p, min_p_rows),
              _unsigned(seed, seed_t), _unsigned(offset, offset_t),
              **_launch(target_logits, _C.verify_workspace_bytes(b, k1 - 1), "verify"),
              method="block" if block else "token", draft_index=draft_index)
    return tokens, num_emitted, num_accepted


@torch.library.custom_op("verispec::verify", mutates_args=())
def _verify_op(
    target_logits: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: Optional[torch.Tensor],
    num_draft: Optional[torch.Tensor], temperature: float, top_k: int, top_p: float, min_p: float,
    temperature_rows: Optional[torch.Tensor], top_k_rows: Optional[torch.Tensor],
    top_p_rows: Optional[torch.Tensor], min_p_rows: Optional[torch.Tensor], seed: int,
    offset: int, seed_t: Optional[torch.Tensor], offset_t: Optional[torch.Tensor],
    block: bool = False, draft_index: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _verify_eager(target_logits, draft_tokens, draft_probs, num_draft, temperature, top_k,
                         top_p, min_p, temperature_rows, top_k_rows, top_p_rows, min_p_rows,
                         seed, offset, seed_t, offset_t, block, draft_index)


@_verify_op.register_fake
def _(target_logits, draft_tokens, draft_probs, num_draft, *rest):
    b, k1, _ = target_logits.shape
    return (target_logits.new_empty((b, k1), dtype=torch.int32),
            target_logits.new_empty(b, dtype=torch.int32),
            target_logits.new_empty(b, dtype=torch.int32))


def _verify_tree_eager(target_logits, tree_tokens, parents, draft_probs, num_nodes, replacement,
                       temperature, top_k, top_p, min_p, temperature_rows, top_k_rows,
                       top_p_rows, min_p_rows, seed, offset, seed_t, offset_t,
                       draft_index=None):
    b, n1, v = target_logits.shape
    device = target_logits.device
    tokens = torch.empty((b, n1), dtype=torch.int32, device=device)
    num_emitted = torch.empty(b, dtype=torch.int32, device=device)
    accepted_nodes = torch.empty((b, n1 - 1), dtype=torch.int32, device=device)
    _C.verify_tree(_last_dim_contiguous(target_logits), tree_tokens, parents, draft_probs,
                   num_nodes, replacement, tokens, num_emitted, accepted_nodes,
                   _pick(temperature, temperature_rows), _pick(top_k, top_k_rows),
                   _pick(top_p, top_p_rows), _pick(min_p, min_p_rows),
                   _unsigned(seed, seed_t), _unsigned(offset, offset_t),
                   **_launch(target_logits, _C.verify_tree_workspace_bytes(b, n1 - 1, v),
                             "verify_tree"), draft_index=draft_index)
    return tokens, num_emitted, accepted_nodes


@torch.library.custom_op("verispec::verify_tree", mutates_args=())
def _verify_tree_op(
    target_logits: torch.Tensor, tree_tokens: torch.Tensor, parents: torch.Tensor,
    draft_probs: Optional[torch.Tensor], num_nodes: Optional[torch.Tensor], replacement: bool,
    temperature: float, top_k: int, top_p: float, min_p: float,
    temperature_rows: Optional[torch.Tensor], top_k_rows: Optional[torch.Tensor],
    top_p_rows: Optional[torch.Tensor], min_p_rows: Optional[torch.Tensor], seed: int,
    offset: int, seed_t: Optional[torch.Tensor], offset_t: Optional[torch.Tensor],
    draft_index: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _verify_tree_eager(target_logits, tree_tokens, parents, draft_probs, num_nodes,
                              replacement, temperature, top_k, top_p, min_p, temperature_rows,
                              top_k_rows, top_p_rows, min_p_rows, seed, offset, seed_t, offset_t,
                              draft_index)


@_verify_tree_op.register_fake
def _(target_logits, tree_tokens, parents, draft_probs, num_nodes, replacement, *rest):
    b, n1, _ = target_logits.shape
    return (target_logits.new_empty((b, n1), dtype=torch.int32),
            target_logits.new_empty(b, dtype=torch.int32),
            target_logits.new_empty((b, n1 - 1), dtype=torch.int32))


def _pick(scalar, rows):
    return scalar if rows is None else rows


def _unsigned(value, tensor):
    return (value % _SEED_LIMIT) if tensor is None else tensor


class DeferredErrors:
    """Error records of CUDA op calls made inside ``deferred_errors()``, checked together.

    A CUDA op normally reads its error record back right after the launch, which waits
    for the GPU. Inside the context the calls do not wait; ``check()`` reads every record
    in one copy (one wait) and raises the first error, as the call itself would have.
    """

    def __init__(self) -> None:
        self._records: list = []  # (op, workspace)

    def __len__(self) -> int:
        return len(self._records)

    def records(self):
        """The pending records as one int32 device tensor (2 values a record), or None:
        a caller may bring them to the host with its own results, in the same copy."""
        if not self._records:
            return None
        return torch.stack([w[:8] for _, w in self._records]).view(torch.int32).view(-1)

    def raise_first(self, host_records) -> None:
        """Raises the first error among the records (as ``records()`` gave them, on the
        host: a numpy array or a CPU tensor), in call order; clears them."""
        ops = [op for op, _ in self._records]
        self._records.clear()
        raw = bytes(memoryview(torch.as_tensor(host_records, dtype=torch.int32).numpy()))
        for i, op in enumerate(ops):
            _C.raise_device_error(op, int.from_bytes(raw[8 * i:8 * i + 8], "little"))

    def check(self) -> None:
        """Reads every pending record (one copy, one wait) and raises the first error."""
        records = self.records()
        if records is not None:
            self.raise_first(records.cpu())


_DEFERRED = threading.local()


@contextlib.contextmanager
def deferred_errors():
    """Defers the error checks of the CUDA op calls made in this thread (see
    :class:`DeferredErrors`); call ``check()`` on the yielded object once the results are
    needed. CPU calls raise at once, as always."""
    previous = getattr(_DEFERRED, "errors", None)
    errors = _DEFERRED.errors = DeferredErrors()
    try:
        yield errors
    finally:
        _DEFERRED.errors = previous


def _launch(like, workspace_bytes, op):
    """Stream, error checking and workspace of a CUDA launch (nothing for CPU tensors)."""
    if like.device.type != "cuda":
        return {}
    workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=like.device)
    deferred = getattr(_DEFERRED, "errors", None)
    if deferred is not None and not torch.cuda.is_current_stream_capturing():
        deferred._records.append((op, workspace))
        check = False
    else:
        # Reading the error record back synchronises: not allowed while capturing a graph.
        check = not torch.cuda.is_current_stream_capturing()
    return dict(stream=torch.cuda.current_stream(like.device).cuda_stream, check_errors=check,
                workspace=workspace)


# --- argument checks ------------------------------------------------------------------


# The checks ops and reference share are verispec._args's; these convert what passed.


def _int32_tensor(op, name, t, shape, dims, device):
    """An integer tensor of `shape` as int32 on `device`; values outside int32 are clamped
    to its ends, which the op then reports as out of range."""
    _args.integer_tensor(op, name, t, shape, dims)
    if t.device != device:
        raise ValueError(f"{op}: {name} must be on the same device as target_logits "
                         f"({device}), got {t.device}")
    if t.dtype != torch.int32:
        if t.dtype == torch.int64:
            t = t.clamp(_INT32_MIN, _INT32_MAX)
        t = t.to(torch.int32)
    return _last_dim_contiguous(t)


def _row_values(op, name, value, n, device, integer):
    """(scalar, None) for a Python number, or (default, [n] tensor) for per-row values."""
    value = _args.policy_value(op, name, value, n, integer)
    if not isinstance(value, torch.Tensor):
        return value, None
    dtype = torch.int32 if integer else torch.float32
    if integer and value.dtype == torch.int64:
        value = value.clamp(_INT32_MIN, _INT32_MAX)
    return (0 if integer else 0.0), value.to(device=device, dtype=dtype).contiguous()


def _policy(op, n, device, temperature, top_k, top_p, min_p, greedy=False):
    """The 8 policy arguments of a custom op. Scalars are range-checked here, by the one
    rule (_policy.policy_error); per-row tensors by the kernels, which name the row.
    ``greedy`` (verify's) is then folded into the temperature: 0 on greedy rows."""
    t, t_rows = _row_values(op, "temperature", temperature, n, device, integer=False)
    k, k_rows = _row_values(op, "top_k", top_k, n, device, integer=True)
    p, p_rows = _row_values(op, "top_p", top_p, n, device, integer=False)
    m, m_rows = _row_values(op, "min_p", min_p, n, device, integer=False)
    # Under torch.compile the check is not traced (an opaque native call): the binding
    # applies the same rule to the same scalars when the op runs, with the same message.
    if not torch.compiler.is_compiling():
        error = policy_error(*(None if rows is not None else value for value, rows in
                               ((t, t_rows), (k, k_rows), (p, p_rows), (m, m_rows))))
        if error:
            raise ValueError(f"{op}: {error}")
    k = min(k, _INT32_MAX)  # the kernels' int32; every top_k >= V means "off" alike
    if greedy is not False:
        folded = fold_greedy(op, greedy, t if t_rows is None else t_rows, n, device)
        t, t_rows = (0.0, folded) if isinstance(folded, torch.Tensor) else (folded, None)
    return t, k, p, m, t_rows, k_rows, p_rows, m_rows


def _keys(op, n, device, seeds, positions, required=False):
    """(seeds, positions) of a keyed call as contiguous int64 [n] tensors on `device` (a
    seed's 64 bits in two's complement), or (None, None) when neither is given."""
    if not _args.keyed(op, seeds, positions, required=required):
        return None, None
    out = []
    for name, value, hi in (("seeds", seeds, _SEED_LIMIT), ("positions", positions, 1 << 63)):
        if isinstance(value, torch.Tensor):
            _args.integer_tensor(op, name, value, (n,), "[N]")
            if value.device != device:
                raise ValueError(f"{op}: {name} must be on {device}, got {value.device}")
            if name == "positions" and device.type == "cpu" and n and bool((value < 0).any()):
                row = int((value < 0).nonzero()[0, 0])
                raise ValueError(f"{op}: positions must be >= 0, got {int(value[row])} at "
                                 f"positions[{row}]")
            out.append(value.to(torch.int64).contiguous())
            continue
        values = _args.key_values(op, name, list(value), n, hi)
        values = [x - _SEED_LIMIT if x >= 1 << 63 else x for x in values]
        out.append(torch.tensor(values, dtype=torch.int64, device=device))
    return tuple(out)


def _random(op, device, seed, offset):
    """(seed, offset, seed_tensor, offset_tensor) arguments of a custom op."""
    out = []
    for name, value, limit in (("seed", seed, _SEED_LIMIT), ("offset", offset, _OFFSET_LIMIT)):
        value = _args.stream_arg(op, name, value, limit)
        if isinstance(value, torch.Tensor):
            out.append((0, value.reshape(1).to(device)))
        else:  # the op schema's int is int64: pass the same 64 bits, two's complement
            out.append((value - _SEED_LIMIT if value >= 1 << 63 else value, None))
    (seed_v, seed_t), (offset_v, offset_t) = out
    return seed_v, offset_v, seed_t, offset_t
