"""SpecDecoder: speculative decoding over paged KV caches, exact for the target.

The loop lives in the native core (``verispec._C.SpecDecoderCore``): it picks k,
prepares each model's batch, commits tokens, applies the stop rules and rolls the
caches back. This module supplies what the core cannot do without tensors: the
models' forwards, the KV pools, and the sampling ops (``verispec.ops``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from verispec import _C
from verispec.drafters import EarlyExit, NGram
from verispec.models.base import KVPools, Model, PagedBatch

__all__ = ["GenerateResult", "SpecDecoder", "StepOutput"]


@dataclass
class StepOutput:
    """Tokens one step committed for one sequence (streaming)."""

    seq: int
    tokens: list[int]
    finish_reason: str | None  # None while the sequence is running


@dataclass
class GenerateResult:
    tokens: list[int]          # new tokens only (the prompt is not repeated)
    finish_reason: str         # "eos", "stop", "length", "context" or "aborted"
    stats: dict = field(default_factory=dict)


class _NoRange:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NO_RANGE = _NoRange()


def _nvtx_ranges(device: torch.device):
    """Python-side NVTX ranges (torch.cuda.nvtx) for a CUDA model; no-ops otherwise.

    The native loop marks the phases (verispec.step, .draft_forward, .target_forward,
    .verify, .commit); these mark what Python does inside them.
    """
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.nvtx.range
    return lambda name: _NO_RANGE


def _as_tensor(view: memoryview, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if len(view) == 0:
        return torch.empty(0, dtype=dtype, device=device)
    # frombuffer shares the native buffer, which lives only during the call: copy.
    return torch.frombuffer(view, dtype=dtype).to(device=device, copy=True)


def _policy_arg(values: Sequence[Any], dtype: torch.dtype, device: torch.device):
    """A scalar when every row agrees (cheaper kernels), else a per-row tensor."""
    first = values[0]
    if all(v == first for v in values):
        return first
    return torch.tensor(list(values), dtype=dtype, device=device)


class _Runner(_C.StepRunner):
    """Runs the models and the sampling ops for the native loop."""

    def __init__(self, decoder: "SpecDecoder") -> None:
        super().__init__()
        self.d = decoder
        self.logits: dict[Any, torch.Tensor] = {}
        self.draft_probs: torch.Tensor | None = None
        self.nvtx = _nvtx_ranges(decoder.target.geometry.device)

    def copy_blocks(self, role, copies) -> None:
        if copies:  # a draft sharing the target's cache copies in the target's pools
            shared = self.d.shares_target_cache
            self.d._pools[_C.ModelRole.target if shared else role].copy_blocks(copies)

    def forward(self, batch) -> None:
        model = self.d._models[batch.role]
        dev = model.geometry.device
        with self.nvtx("verispec.py.batch_to_device"):
            paged = self._paged_batch(batch, dev)
        with self.nvtx(f"verispec.py.{batch.role.name}_model"), torch.inference_mode():
            logits = model.forward(paged)
        expect = (len(batch.logits_indices), self.d.vocab_size)
        if tuple(logits.shape) != expect:
            raise ValueError(f"{batch.role.name} model: forward must return logits [R, V] = "
                             f"{list(expect)}, got {list(logits.shape)}")
        self.logits[batch.role] = logits

    def _paged_batch(self, batch, dev) -> PagedBatch:
        return PagedBatch(
            input_ids=_as_tensor(batch.input_ids, torch.int64, dev),
            positions=_as_tensor(batch.positions, torch.int64, dev),
            slot_mapping=_as_tensor(batch.slot_mapping, torch.int32, dev),
            block_tables=_as_tensor(batch.block_tables, torch.int32, dev).view(batch.num_rows, batch.max_blocks),
            context_lens=_as_tensor(batch.context_lens, torch.int32, dev),
            query_start=_as_tensor(batch.query_start, torch.int64, dev),
            logits_indices=_as_tensor(batch.logits_indices, torch.int64, dev),
            kv=self.d._pools[batch.role],
        )

    def _policy(self, policy, device) -> dict:
        return dict(
            temperature=_policy_arg(policy.temperature, torch.float32, device),
            top_k=_policy_arg(policy.top_k, torch.int32, device),
            top_p=_policy_arg(policy.top_p, torch.float32, device),
            min_p=_policy_arg(policy.min_p, torch.float32, device),
        )

    def sample_draft(self, batch, num_spec, position, rows, policy, seed, offset):
        ops = self.d._ops
        logits = self.logits[_C.ModelRole.draft]
        probs = ops.apply_policy(logits, **self._policy(policy, logits.device))
        tokens = ops.sample(probs, seed=seed, offset=offset)
        if position == 0:
            self.draft_probs = torch.zeros(batch, num_spec, probs.shape[-1], dtype=torch.float32,
                                           device=probs.device)
        index = torch.tensor(rows, dtype=torch.int64, device=probs.device)
        self.draft_probs[index, position] = probs
        return tokens.tolist()

    def verify(self, req):
        ops = self.d._ops
        logits = self.logits[_C.ModelRole.target]
        B, K = req.batch, req.num_spec
        dev = logits.device
        out = ops.verify(
            logits.view(B, K + 1, -1),
            torch.tensor(req.draft_tokens, dtype=torch.int32, device=dev).view(B, K),
            self.draft_probs if req.use_draft_probs else None,
            num_draft=torch.tensor(req.num_draft, dtype=torch.int32, device=dev),
            seed=req.seed,
            offset=req.offset,
            **self._policy(req.policy, dev),
        )
        tokens, num_emitted, num_accepted = out
        self.draft_probs = None
        return _C.VerifyResult(tokens.flatten().tolist(), num_emitted.tolist(), num_accepted.tolist())


class SpecDecoder:
    """Speculative decoding of a target model with a draft, exact for the target.

    ``target`` implements the model protocol (verispec.models.base.Model); ``draft`` is
    a model too (a separate draft, or ``verispec.drafters.EarlyExit``), or
    ``verispec.drafters.NGram`` (prompt lookup), or None. ``k`` draft tokens are
    proposed per step (0, or ``draft=None``: plain decoding through the same loop), or
    ``k="auto"``: chosen per sequence and step, up to ``max_k``, from the measured
    acceptance rate and the measured draft and target pass costs (k = 0 when
    speculation does not pay; see csrc/include/verispec/adaptive_k.h). The target gets
    paged KV pools of ``num_blocks`` blocks of ``block_size`` tokens; a draft model its
    own (``draft_num_blocks``, default ``num_blocks``), except an ``EarlyExit`` draft of
    this target, which reads and writes the target's pools for its layers.

    Sampled output is distributed exactly as sampling the target under the same policy
    (temperature, top-k, top-p, min-p, applied identically to target and draft).
    Greedy output is the target's greedy output token for token.
    """

    def __init__(self, target: Model, draft: Model | NGram | None = None, *, k: int | str = 4,
                 max_k: int = 8, num_blocks: int = 512, draft_num_blocks: int | None = None,
                 block_size: int = 16, seed: int = 0, ops: Any = None) -> None:
        ngram = draft if isinstance(draft, NGram) else None
        if ngram is not None:
            draft = None
        for name, m in (("target", target), ("draft", draft)):
            if m is not None and not isinstance(m, Model):
                raise TypeError(f"SpecDecoder: {name} must implement the model protocol "
                                f"(a .geometry and .forward(batch)), got {type(m).__name__}")
        adaptive = k == "auto"
        if adaptive:
            if not isinstance(max_k, int) or max_k < 1:
                raise ValueError(f"SpecDecoder: max_k must be an int >= 1, got {max_k!r}")
            k = max_k
        if draft is None and ngram is None and k != 0:
            k, adaptive = 0, False  # no draft: plain decoding through the same loop
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise ValueError(f"SpecDecoder: k must be an int >= 0 or 'auto', got {k!r}")
        g = target.geometry
        if draft is not None and draft.geometry.vocab_size != g.vocab_size:
            raise ValueError(f"SpecDecoder: draft vocab_size must equal the target's {g.vocab_size}, "
                             f"got {draft.geometry.vocab_size}")
        if ops is None:
            from verispec import ops
        self._ops = ops
        self.target, self.draft, self.ngram, self.k = target, draft, ngram, k
        self.vocab_size = g.vocab_size
        draft_num_blocks = num_blocks if draft_num_blocks is None else draft_num_blocks
        # An early-exit draft is the target's first layers: it reads the K/V the target
        # wrote for them, so it shares the target's cache (no draft cache, no catch-up).
        shared = isinstance(draft, EarlyExit) and draft.target is target
        self._core = _C.SpecDecoderCore(
            num_spec=k, has_draft_model=draft is not None, target_num_blocks=num_blocks,
            draft_num_blocks=draft_num_blocks if draft is not None and not shared else 0,
            block_size=block_size, max_context=g.max_context, seed=seed,
            ngram_min_n=ngram.min_n if ngram else 0, ngram_max_n=ngram.max_n if ngram else 0,
            adaptive_k=adaptive, draft_shares_target_cache=shared)
        self.adaptive = adaptive
        self.shares_target_cache = shared
        self._models = {_C.ModelRole.target: target}
        target_pools = KVPools.allocate(g, num_blocks, block_size)
        self._pools = {_C.ModelRole.target: target_pools}
        if draft is not None:
            self._models[_C.ModelRole.draft] = draft
            if shared:
                n = draft.num_layers
                self._pools[_C.ModelRole.draft] = KVPools(
                    k=target_pools.k[:n], v=target_pools.v[:n], block_size=block_size)
            else:
                self._pools[_C.ModelRole.draft] = KVPools.allocate(draft.geometry, draft_num_blocks,
                                                                   block_size)
        self._runner = _Runner(self)

    # -- continuous batching -------------------------------------------------------
    def add(self, prompt: Sequence[int], *, max_new_tokens: int, greedy: bool = False,
            temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
            eos_token_id: int | Sequence[int] | None = None,
            stop: Sequence[Sequence[int]] | None = None) -> int:
        """Adds a sequence (between steps at any time); returns its id."""
        if eos_token_id is None:
            eos = []
        elif isinstance(eos_token_id, int):
            eos = [eos_token_id]
        else:
            eos = list(eos_token_id)
        if temperature == 0:
            greedy = True
        return self._core.add(list(prompt), self.vocab_size, max_new_tokens, greedy,
                              float(temperature), top_k, float(top_p), float(min_p), eos,
                              [list(s) for s in (stop or [])])

    def step(self) -> list[StepOutput]:
        """One speculative step of every running sequence: the tokens each committed."""
        out = []
        for seq, tokens, reason in self._core.step(self._runner):
            out.append(StepOutput(seq, tokens, None if reason == "running" else reason))
        return out

    def abort(self, seq: int) -> None:
        """Stops a sequence now (finish reason "aborted") and frees its cache blocks."""
        self._core.abort(seq)

    def release(self, seq: int) -> None:
        """Forgets a sequence (aborting it if it runs); KeyError for an unknown id."""
        self._core.release(seq)

    def result(self, seq: int) -> GenerateResult:
        """The sequence's tokens so far (new tokens only), finish reason and statistics."""
        return GenerateResult(self._core.generated(seq), self._core.finish_reason(seq),
                              self._core.stats(seq))

    def has_running(self) -> bool:
        """Whether any added sequence is still running (step() has work)."""
        return self._core.has_running()

    def timings(self) -> dict:
        """Wall time by phase summed over all steps: draft_forward_s, draft_sample_s,
        target_forward_s, verify_s, bookkeeping_s (batches, commit, rollback), steps."""
        return self._core.times()

    def cost_model(self) -> dict:
        """What adaptive k measured: draft_pass_s and target_pass_s[n - 1] for n tokens per row."""
        return self._core.cost_model()

    def num_free_blocks(self, role: str = "target") -> int:
        """Free KV blocks of the "target" or "draft" cache (a shared draft: the target's)."""
        return self._core.num_free_blocks(self._role(role))

    def num_blocks(self, role: str = "target") -> int:
        """KV blocks of the "target" or "draft" cache (a shared draft: the target's)."""
        return self._core.num_blocks(self._role(role))

    def _role(self, role: str):
        if role not in ("target", "draft"):
            raise ValueError(f"role must be 'target' or 'draft', got {role!r}")
        return getattr(_C.ModelRole, role)

    # -- one call ------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                 greedy: bool = False, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, min_p: float = 0.0, seed: int = 0,
                 eos_token_id: int | Sequence[int] | None = None,
                 stop: Sequence[Sequence[int]] | None = None) -> list[GenerateResult]:
        """Decodes every prompt to completion; one result per prompt, in order.

        Reproducible: the same prompts, parameters and seed give the same tokens.
        """
        if self._core.has_running():
            raise RuntimeError("generate: sequences added with add() are still running; "
                               "finish them with step() (or abort them) first")
        if isinstance(prompts, (str, bytes)) or not all(isinstance(p, (list, tuple)) for p in prompts):
            raise TypeError("generate: prompts must be a list of token-id lists")
        self._core.reseed(seed)
        ids = []
        try:
            for p in prompts:
                ids.append(self.add(p, max_new_tokens=max_new_tokens, greedy=greedy,
                                    temperature=temperature, top_k=top_k, top_p=top_p,
                                    min_p=min_p, eos_token_id=eos_token_id, stop=stop))
            before = self._core.times()
            while self._core.has_running():
                self.step()
            after = self._core.times()
            split = {key: after[key] - before[key] for key in after}
            results = [self.result(i) for i in ids]
            for r in results:  # of the whole run (the batch shares passes)
                r.stats["time_split"] = dict(split)
            return results
        finally:
            for i in ids:
                self._core.release(i)
