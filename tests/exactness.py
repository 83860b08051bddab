"""A statistical harness: does a verify implementation emit exactly the target's tokens?

The promise of speculative sampling is that the emitted sequence is distributed as
sampling from the target (after its policy), whatever the draft. This harness runs
many independent sequences through a `verify_fn` (reference.verify, ops.verify, or a
deliberately wrong variant) and compares the joint distribution of their first
`depth` emitted tokens with the exact target joint, computed by enumeration.

Sequences live in a toy world where logits depend on the whole prefix:

    h(empty) = H0,  h(prefix + t) = (31 * h(prefix) + t + 1) mod M
    target logits at prefix = TARGET[h(prefix)],   draft logits = DRAFT[h(prefix)]

so every accepted, corrected or bonus token changes the distributions that follow, and
an implementation that mixes up positions is caught. Each verify call continues every
unfinished sequence from its emitted prefix with fresh drafts, until it has `depth`
tokens; a sequence may therefore be verified once or `depth` times.

The test is a G-test (log-likelihood ratio) over the V**depth outcomes, with cells of
expected count < 5 pooled; an outcome the target gives probability 0 fails outright.
With fixed seeds every case is deterministic; over random seeds a correct
implementation would fail a case with probability ALPHA (the false-alarm rate).
"""

from __future__ import annotations

from dataclasses import dataclass

import scipy.stats
import torch

from verispec import reference

__all__ = ["ALPHA", "JointCheck", "joint_distribution_check", "joint_distribution_result"]

ALPHA = 1e-3          # false-alarm rate per case: assert p_value > ALPHA
MIN_EXPECTED = 5.0    # cells expected fewer times than this are pooled
TABLE_SIZE = 257      # M: distinct logit rows in the toy world (prime)
H0 = 1                # hash of the empty prefix
DRAFT_QUALITIES = ("close", "poor", "same")
DRAFT_KINDS = ("sampled", "onehot")


@dataclass(frozen=True)
class JointCheck:
    """The outcome of one joint-distribution comparison."""

    p_value: float
    statistic: float      # G statistic (inf when an impossible outcome was emitted)
    dof: int              # pooled cells - 1
    num_rows: int
    num_calls: int        # verify calls made
    impossible: int       # rows whose outcome has target probability 0
    max_abs_error: float  # max over outcomes of |empirical - exact| probability
    mean_emitted: float   # tokens emitted per verify call per row (acceptance, roughly)

    def __str__(self):
        return (f"p_value={self.p_value:.3g} G={self.statistic:.1f} dof={self.dof} "
                f"rows={self.num_rows} calls={self.num_calls} impossible={self.impossible} "
                f"max|err|={self.max_abs_error:.2g} emitted/call={self.mean_emitted:.2f}")


def joint_distribution_check(verify_fn, **kwargs):
    """The p-value of joint_distribution_result(verify_fn, **kwargs); tests assert > ALPHA."""
    return joint_distribution_result(verify_fn, **kwargs).p_value


def joint_distribution_result(
    verify_fn, *, vocab=6, k=3, num_rows=60_000, depth=2,
    temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, greedy=False,
    draft="sampled", draft_quality="close", ragged=False,
    logits_dtype=torch.float32, seed=0, device="cpu",
):
    """Run `num_rows` sequences through verify_fn and test their first `depth` tokens.

    verify_fn   has reference.verify's signature; it is called with seed=`seed` and
                offset = call index, so a counter-based RNG draws fresh numbers per call.
    draft       'sampled': proposals drawn from q = softmax(DRAFT[h]) (or the table of
                q below), passed as draft_probs; 'onehot': proposal = argmax DRAFT[h],
                a deterministic drafter, draft_probs=None.
    draft_quality  'close': DRAFT = TARGET + noise; 'poor': independent, sharper logits
                with q restricted to its top 2 tokens (q = 0 where p has mass);
                'same': q = p exactly (everything should be accepted).
    ragged      each row gets num_draft ~ U{0..k} per call; positions past it are filled
                with junk (token 0, uniform q, target logits peaked on token 0) that a
                correct implementation never reads.
    logits_dtype  float32 or bfloat16 target logits; the exact joint uses the same
                rounded values, with the policy applied in float32.
    Policy arguments are scalars, passed through to verify_fn.
    device      where verify_fn's inputs live (e.g. "cuda"); the toy world and the
                bookkeeping stay on the CPU.
    """
    if draft not in DRAFT_KINDS:
        raise ValueError(f"draft must be one of {DRAFT_KINDS}, got {draft!r}")
    if draft_quality not in DRAFT_QUALITIES:
        raise ValueError(f"draft_quality must be one of {DRAFT_QUALITIES}, got {draft_quality!r}")
    if depth < 1 or vocab < 2 or k < 0 or vocab ** depth > 1 << 14:
        raise ValueError(f"need depth >= 1, vocab >= 2, k >= 0 and vocab**depth <= 16384, "
                         f"got depth={depth} vocab={vocab} k={k}")
    policy = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    exact_policy = dict(policy, temperature=0.0 if greedy else temperature)
    gen = torch.Generator().manual_seed(seed)

    # The toy world: target logits (rounded to logits_dtype once), draft q and proposals.
    target_table = (1.5 * torch.randn(TABLE_SIZE, vocab, generator=gen)).to(logits_dtype)
    target_probs = reference.apply_policy(target_table, **exact_policy)
    if draft_quality == "close":
        draft_logits = target_table.float() + 0.7 * torch.randn(TABLE_SIZE, vocab, generator=gen)
        q_table = torch.softmax(draft_logits, dim=-1)
    elif draft_quality == "poor":
        draft_logits = 3.0 * torch.randn(TABLE_SIZE, vocab, generator=gen)
        q_table = reference.apply_policy(draft_logits, top_k=2)
    else:
        draft_logits, q_table = target_probs.log(), target_probs
    draft_argmax = draft_logits.argmax(dim=-1)
    junk_logits = torch.zeros(vocab).index_fill_(0, torch.tensor([0]), 8.0).to(logits_dtype)

    emitted = torch.full((num_rows, depth), -1, dtype=torch.long)
    length = torch.zeros(num_rows, dtype=torch.long)
    h = torch.full((num_rows,), H0, dtype=torch.long)
    calls = tokens_per_row_call = row_calls = 0

    while (rows := (length < depth).nonzero().squeeze(1)).numel():
        n = rows.numel()
        nd = torch.randint(0, k + 1, (n,), generator=gen) if ragged else torch.full((n,), k)
        draft_tokens = torch.zeros(n, k, dtype=torch.long)
        draft_probs = torch.zeros(n, k, vocab)
        target_idx = torch.zeros(n, k + 1, dtype=torch.long)
        cur = h[rows]
        for j in range(k):  # the drafter runs ahead from the prefix
            target_idx[:, j] = cur
            draft_probs[:, j] = q_table[cur]
            if draft == "sampled":
                draft_tokens[:, j] = torch.multinomial(q_table[cur], 1, generator=gen).squeeze(1)
            else:
                draft_tokens[:, j] = draft_argmax[cur]
            cur = _step(cur, draft_tokens[:, j])
        target_idx[:, k] = cur
        target_logits = target_table[target_idx]                        # [n, k+1, V]
        if ragged:
            past = torch.arange(k) >= nd[:, None]                       # [n, k]
            draft_tokens[past] = 0
            draft_probs[past] = 1.0 / vocab
            target_logits[torch.arange(k + 1) > nd[:, None]] = junk_logits

        tokens, num_emitted, num_accepted = (t.cpu() for t in verify_fn(
            target_logits.to(device), draft_tokens.int().to(device),
            draft_probs.to(device) if draft == "sampled" else None,
            num_draft=nd.int().to(device) if ragged else None, greedy=greedy,
            seed=seed, offset=calls, **policy))
        _check_contract(tokens, num_emitted, num_accepted, draft_tokens, nd, vocab)
        calls += 1
        row_calls += n
        tokens_per_row_call += int(num_emitted.sum())

        tokens, num_emitted = tokens.long(), num_emitted.long()
        for j in range(k + 1):  # append emitted tokens until each row has `depth`
            take = (j < num_emitted) & (length[rows] < depth)
            r = rows[take]
            emitted[r, length[r]] = tokens[take, j]
            h[r] = _step(h[r], tokens[take, j])
            length[r] += 1

    exact = _exact_joint(target_table, exact_policy, vocab, depth)
    codes = (emitted * vocab ** torch.arange(depth - 1, -1, -1)).sum(dim=1)
    observed = torch.bincount(codes, minlength=vocab ** depth).double()
    p_value, statistic, dof, impossible = _g_test(observed, exact)
    return JointCheck(
        p_value=p_value, statistic=statistic, dof=dof, num_rows=num_rows, num_calls=calls,
        impossible=impossible,
        max_abs_error=float((observed / num_rows - exact).abs().max()),
        mean_emitted=tokens_per_row_call / row_calls,
    )


def _step(h, token):
    """The prefix hash after appending `token` (elementwise)."""
    return (31 * h + token + 1) % TABLE_SIZE


def _exact_joint(target_table, policy, vocab, depth):
    """P(x_1..x_depth) = prod_i p_{x_<i}(x_i), by enumeration; float64 [V**depth], row-major."""
    joint = torch.ones(1, dtype=torch.float64)
    h = torch.full((1,), H0, dtype=torch.long)
    for _ in range(depth):
        p = reference.apply_policy(target_table[h], **policy).double()     # [prefixes, V]
        joint = (joint[:, None] * p).reshape(-1)
        h = _step(h[:, None], torch.arange(vocab)).reshape(-1)
    return joint / joint.sum()


def _g_test(observed, exact):
    """(p_value, G, dof, impossible) for observed counts against exact probabilities."""
    n = observed.sum()
    support = exact > 0
    impossible = int(observed[~support].sum())
    if impossible:
        return 0.0, float("inf"), 0, impossible
    obs, exp = observed[support], exact[support] * n
    big = exp >= MIN_EXPECTED
    obs_bins, exp_bins = list(obs[big].tolist()), list(exp[big].tolist())
    if (~big).any():  # pool the rare outcomes into one cell; if still rare, into the rarest
        small_obs, small_exp = float(obs[~big].sum()), float(exp[~big].sum())
        if small_exp >= MIN_EXPECTED or not exp_bins:
            obs_bins.append(small_obs)
            exp_bins.append(small_exp)
        else:
            i = min(range(len(exp_bins)), key=exp_bins.__getitem__)
            obs_bins[i] += small_obs
            exp_bins[i] += small_exp
    if len(exp_bins) < 2:  # one possible outcome, and every row produced it
        return 1.0, 0.0, 0, 0
    result = scipy.stats.power_divergence(obs_bins, exp_bins, lambda_="log-likelihood")
    return float(result.pvalue), float(result.statistic), len(exp_bins) - 1, 0


def _check_contract(tokens, num_emitted, num_accepted, draft_tokens, num_draft, vocab):
    """Shapes, dtypes and the padding / accepted-prefix invariants of verify's outputs."""
    n, k = draft_tokens.shape
    assert tokens.shape == (n, k + 1) and tokens.dtype == torch.int32, tokens.shape
    assert num_emitted.shape == (n,) and num_emitted.dtype == torch.int32
    assert num_accepted.shape == (n,) and num_accepted.dtype == torch.int32
    tokens, num_emitted, num_accepted = tokens.long(), num_emitted.long(), num_accepted.long()
    assert torch.equal(num_emitted, num_accepted + 1), "num_emitted must be num_accepted + 1"
    assert ((num_accepted >= 0) & (num_accepted <= num_draft)).all(), "num_accepted > num_draft"
    pos = torch.arange(k + 1)
    live = pos < num_emitted[:, None]
    assert ((tokens >= 0) & (tokens < vocab))[live].all(), "emitted token out of range"
    assert (tokens[~live] == -1).all(), "positions after the emitted tokens must be -1"
    accepted = pos[:k] < num_accepted[:, None]
    assert (tokens[:, :k] == draft_tokens)[accepted].all(), "accepted tokens must be the drafts"


# The cases every verify implementation must pass (reference, native CPU, native CUDA).
EXACTNESS_CASES = {
    "plain": dict(),
    "temperature_0.7": dict(temperature=0.7),
    "temperature_1.6": dict(temperature=1.6),
    "top_k": dict(top_k=3),
    "top_p": dict(top_p=0.8),
    "min_p": dict(min_p=0.2),
    "all_knobs_depth3": dict(temperature=0.8, top_k=4, top_p=0.9, min_p=0.1, vocab=5, depth=3),
    "onehot_drafts": dict(draft="onehot"),
    "onehot_poor_drafts_top_p": dict(draft="onehot", draft_quality="poor", top_p=0.85),
    "poor_drafts_depth3": dict(draft_quality="poor", vocab=5, depth=3),
    "q_equals_p": dict(draft_quality="same", temperature=0.9, top_k=4),
    "ragged": dict(ragged=True),
    "ragged_onehot_min_p": dict(ragged=True, draft="onehot", min_p=0.1),
    "bfloat16": dict(logits_dtype=torch.bfloat16, temperature=0.7, top_p=0.9),
    "bfloat16_poor_k2": dict(logits_dtype=torch.bfloat16, draft_quality="poor", k=2),
    "greedy": dict(greedy=True, draft_quality="poor"),
}
