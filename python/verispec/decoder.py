"""SpecDecoder: speculative decoding over paged KV caches, exact for the target.

The decisions live in the native core (``verispec._C.SpecDecoder``): which sequences
run, k, every forward pass of a step with its cache slots, what is committed, the stop
rules, rollback. This module drives a step through the core's three calls, every call
going down (docs/design.md):

    plan = core.begin_step()            # rows, k, all passes, inputs in one buffer
    for each draft pass:  forward -> apply_policy -> sample   (proposals stay on the device)
    verify pass:          forward -> ops.verify
    core.commit(results)                # checked, then committed; any failure: cancel_step

Thread rule: ``add``, ``abort`` and ``release`` may be called from any thread at any
time, also while ``step`` runs (abort and release of a sequence in the running step take
effect when that step ends); a second ``step`` while one runs raises
``verispec.StepInProgressError``.
"""

from __future__ import annotations

import contextlib
import numbers
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from verispec import _C
from verispec._policy import fold_greedy, policy_error
from verispec.drafters.base import DraftSpec, Feature, FeatureView, as_drafter
from verispec.models.base import KVPools, Model, PagedBatch
from verispec.models.staging import PlanStaging

_INT32_MAX = 2**31 - 1

__all__ = ["GenerateResult", "SpecDecoder", "StepOutput", "TokenLogprob", "request_seed"]

_TARGET, _DRAFT = _C.ModelRole.target, _C.ModelRole.draft


# The most alternatives a token's logprobs may list (OpenAI's chat API allows 20 too).
MAX_TOP_LOGPROBS = 20


@dataclass
class TokenLogprob:
    """An emitted token's log-probability under the target: ``logprob`` under the
    policy-applied distribution it was sampled from (temperature, top-k, top-p, min-p;
    -inf for a token the policy excluded; greedy: 0 for the argmax), ``raw_logprob``
    under the model's own distribution (log-softmax of the logits), and ``top``: the
    ``n`` most likely tokens as (token, logprob, raw_logprob), most likely first. The
    same whether the token was an accepted draft, a correction or a bonus token."""

    token: int
    logprob: float
    raw_logprob: float
    top: list[tuple[int, float, float]] = field(default_factory=list)


@dataclass
class StepOutput:
    """Tokens one step committed for one sequence (streaming)."""

    seq: int
    tokens: list[int]
    finish_reason: str | None  # None while the sequence is running
    logprobs: list[TokenLogprob] | None = None  # one per token, when the sequence asked


@dataclass
class GenerateResult:
    tokens: list[int]          # new tokens only (the prompt is not repeated)
    finish_reason: str         # "eos", "stop", "length", "context" or "aborted"
    stats: dict = field(default_factory=dict)
    logprobs: list[TokenLogprob] | None = None  # one per token, when asked for


_MASK64 = (1 << 64) - 1


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def request_seed(seed: int, i: int) -> int:
    """The request seed of prompt ``i`` in ``generate(prompts, seed=seed)``:
    splitmix64(splitmix64(seed) + i) mod 2**64. Nearby seeds and indices give unrelated
    streams (``seed + call`` over many calls never repeats a request's stream), and
    ``add(prompts[i], seed=request_seed(seed, i))`` reproduces request i alone."""
    for name, value in (("seed", seed), ("i", i)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise ValueError(f"request_seed: {name} must be an int >= 0, got {value!r}")
    if seed >= 1 << 64:
        raise ValueError(f"request_seed: seed must be in [0, 2**64), got {seed}")
    return _splitmix64((_splitmix64(int(seed)) + int(i)) & _MASK64)


def _request_seeds(seed, n: int) -> list:
    """generate's per-prompt request seeds (None: the decoder's stream)."""
    if seed is None:
        return [None] * n
    if isinstance(seed, numbers.Integral) and not isinstance(seed, bool):
        if not 0 <= seed < 1 << 64:
            raise ValueError(f"generate: seed must be in [0, 2**64), got {seed}")
        return [request_seed(int(seed), i) for i in range(n)]
    if isinstance(seed, (str, bytes)) or not isinstance(seed, Sequence):
        raise TypeError(f"generate: seed must be an int, a list of ints or None, got {seed!r}")
    seeds = list(seed)
    if len(seeds) != n:
        raise ValueError(f"generate: seed must hold one seed per prompt ({n}), got {len(seeds)}")
    return seeds


def _nvtx_range(device: torch.device):
    """NVTX ranges (torch.cuda.nvtx) for a CUDA model; no-ops otherwise."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.nvtx.range
    return lambda name: contextlib.nullcontext()


class _Timer:
    """Wall time of the step's phases: host clocks on CPU, CUDA events on a GPU (read
    after the step's one wait for its results, so timing adds no wait of its own)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.spans: dict[str, list] = {"draft_forward": [], "draft_sample": [],
                                       "target_forward": [], "verify": []}

    @contextlib.contextmanager
    def __call__(self, name: str):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
        else:
            start = time.perf_counter()
            yield
            end = time.perf_counter()
        self.spans[name].append((start, end))

    def seconds(self, name: str) -> list[float]:
        if self.cuda:
            return [s.elapsed_time(e) / 1e3 for s, e in self.spans[name]]
        return [e - s for s, e in self.spans[name]]


@dataclass
class _StepState:
    """What a step's phases share, built once by ``_run``: the core's plan, its packed
    inputs on the host (``host``, the plan's bytes) and on the model's device (``inputs``,
    one staged copy), the batch (``batch`` rows, ``k`` draft positions), the draft tokens'
    device view [B, K], the policy (scalars, or per-row device tensors), the keyed rows
    (None without any) and the phases' timer."""

    plan: dict
    host: torch.Tensor
    inputs: torch.Tensor
    batch: int
    k: int
    draft_tokens: torch.Tensor
    policy: dict
    keys: dict | None
    timer: _Timer

    def view(self, offset: int, n: int, dtype: torch.dtype, *, on_host: bool = False):
        """``n`` values of ``dtype`` at ``offset`` of the packed inputs (device copy, or
        the host's with ``on_host``)."""
        return _view(self.host if on_host else self.inputs, offset, n, dtype)


_SIZES = {torch.int64: 8, torch.int32: 4, torch.float32: 4, torch.uint8: 1}


def _checked(op: str, name: str, t: Any, shape: tuple, integer: bool) -> torch.Tensor:
    """An op's output as the step needs it: a tensor of `shape`, integer or floating."""
    kind = "an integer" if integer else "a floating-point"
    ok = isinstance(t, torch.Tensor) and tuple(t.shape) == shape and (
        (not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool) if integer
        else t.is_floating_point())
    if not ok:
        got = (f"{str(t.dtype).replace('torch.', '')} {list(t.shape)}" if isinstance(t, torch.Tensor)
               else type(t).__name__)
        raise ValueError(f"ops.{op} must return {kind} tensor {list(shape)} as {name}, got {got}")
    return t


def _view(buf: torch.Tensor, offset: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """n values of `dtype` at byte `offset` of the step's inputs buffer."""
    return buf[offset:offset + n * _SIZES[dtype]].view(dtype)


_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def _config_int(name: str, value: Any, kind: str = "an int") -> None:
    """A SpecDecoder integer setting's type (ValueError naming it). Its range is the
    core's rule (spec_decoder.cpp), applied by :func:`_core`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"SpecDecoder: {name} must be {kind}, got {value!r}")


def _core(config: dict) -> Any:
    """The native decoder of ``config``, which checks it: the one home of the settings'
    ranges (k, max_num_seqs, max_tokens_per_step, draft_branches, ...); its ValueError
    names the setting, its range and the value. A Python int past int64 reaches the core
    saturated (out of range, or "no limit", alike) and its message shows it as given."""
    passed = {name: min(max(v, _INT64_MIN), _INT64_MAX) if type(v) is int else v
              for name, v in config.items()}
    try:
        return _C.SpecDecoder(**passed)
    except ValueError as e:
        message = str(e)
        for name, v in config.items():
            if passed[name] != v and message.startswith(f"SpecDecoder: {name} must "):
                message = message.replace(f"got {passed[name]}", f"got {v}")
        raise ValueError(message) from None


def _check_tree_ops(ops) -> None:
    """Trees (NGram(branches > 1), draft_branches > 1) are verified by ops.verify_tree."""
    if not hasattr(ops, "verify_tree"):
        raise ValueError(f"SpecDecoder: trees (NGram(branches > 1), draft_branches > 1) "
                         f"need ops with verify_tree; {ops!r} has none")


def _check_settings(target: Any, draft: Any, spec: DraftSpec | None, *, k: int | str, max_k: int,
                    max_num_seqs: int, max_tokens_per_step: int, verify_method: str,
                    draft_branches: int, draft_replacement: bool) -> tuple[int, bool]:
    """SpecDecoder's settings checked before anything is built: the types of the integer
    settings (the core takes int64 and cannot tell a bool from an int; their ranges are
    the core's, checked once when it is built), the combinations the core does not know
    of, the models' protocol and the draft's tokenizer and device. ``spec``: what the
    drafter said it needs (None: no drafter). Returns (k, adaptive): k="auto" is max_k,
    adaptively."""
    if verify_method not in ("token", "block"):
        raise ValueError(f"SpecDecoder: verify_method must be 'token' or 'block', "
                         f"got {verify_method!r}")
    _config_int("draft_branches", draft_branches)
    if not isinstance(draft_replacement, bool):
        raise TypeError(f"SpecDecoder: draft_replacement must be a bool, "
                        f"got {draft_replacement!r}")
    if draft_branches > 1 and (spec is None or spec.kind != "model"):
        raise ValueError(f"SpecDecoder: draft_branches = {draft_branches} (draft trees) needs "
                         f"a draft model, got {draft!r} "
                         f"(n-gram tries: NGram(branches=b))")
    if draft_branches > 1 and not spec.trees:
        raise ValueError(f"SpecDecoder: draft_branches = {draft_branches}: this drafter "
                         f"proposes chains only; use draft_branches=1")
    if draft_branches > 1 and verify_method == "block":
        raise ValueError(f"SpecDecoder: verify_method='block' verifies chains; draft trees "
                         f"(draft_branches = {draft_branches}) are verified by "
                         f"ops.verify_tree: use verify_method='token' or draft_branches=1")
    draft = spec.model if spec is not None else None  # the model of the draft passes
    for name, m in (("target", target), ("draft", draft)):
        if m is not None and not isinstance(m, Model):
            raise TypeError(f"SpecDecoder: {name} must implement the model protocol "
                            f"(a .geometry and .forward(batch)), got {type(m).__name__}")
    adaptive = k == "auto"
    if adaptive:
        if isinstance(max_k, bool) or not isinstance(max_k, int) or not 1 <= max_k <= _C.MAX_K:
            raise ValueError(f"SpecDecoder: max_k must be an int in [1, {_C.MAX_K}], got {max_k!r}")
        k = max_k
    _config_int("k", k, "an int or 'auto'")
    _config_int("max_num_seqs", max_num_seqs)
    _config_int("max_tokens_per_step", max_tokens_per_step)
    if spec is not None:
        g = target.geometry
        keys = [f.key(g.num_layers) for f in spec.features]  # ValueError past the last layer
        if keys and g.hidden_size is None:
            raise ValueError(f"SpecDecoder: the drafter reads the target's hidden states "
                             f"({', '.join(Feature.describe_key(x, g.num_layers) for x in keys)}), "
                             f"but the target's geometry has no hidden_size: it does not "
                             f"write features ({type(target).__name__})")
        if keys and not getattr(target, "writes_features", False):
            raise ValueError(f"SpecDecoder: the drafter reads the target's hidden states, "
                             f"which {type(target).__name__} does not write (a model that "
                             f"does sets writes_features = True)")
        check = getattr(target, "check_features", None)
        if keys and check is not None:  # streams a model family cannot write, named
            check(sorted(set(keys)), who="SpecDecoder")
    if draft is not None:
        g, dg = target.geometry, draft.geometry
        # Same tokenizer, vocabularies of any size (padded embedding tables): ids below
        # both sizes mean the same token. Told apart only when both models say which
        # tokenizer they have (verispec.models.load sets tokenizer_fingerprint).
        fingerprints = (getattr(target, "tokenizer_fingerprint", None),
                        getattr(draft, "tokenizer_fingerprint", None))
        if None not in fingerprints and fingerprints[0] != fingerprints[1]:
            raise ValueError(f"SpecDecoder: the draft's tokenizer must be the target's; "
                             f"their vocabularies differ (tokenizer fingerprints: target "
                             f"{fingerprints[0]}, draft {fingerprints[1]})")
        if torch.device(dg.device) != torch.device(g.device):
            raise ValueError(f"SpecDecoder: draft device must be the target's {g.device}, "
                             f"got {dg.device}")
    return k, adaptive


def _shared_tp(target: Any, draft: Any) -> Any:
    """The target's tensor-parallel collectives (None: one process), which a draft
    model must share (a model carries its ``tp``)."""
    tp = getattr(target, "tp", None)
    draft_tp = getattr(draft, "tp", None)
    if draft_tp is not None and draft_tp is not tp:
        raise ValueError(f"SpecDecoder: a tensor-parallel draft must share the target's "
                         f"collectives (target.tp {tp!r}), got {draft_tp!r}")
    return tp


def _draft_pools(draft: Any, target_pools: KVPools, shared: bool, num_blocks: int,
                 block_size: int, features: Sequence[int] = ()) -> KVPools:
    """The draft model's K/V pools: views of the target's first layers' when the drafter
    asked for the target's cache (``shared``: early exit), else its own (with the
    feature pools of its own states it asked for, DraftSpec.own_features)."""
    if shared:
        n = draft.geometry.num_layers
        return KVPools(k=target_pools.k[:n], v=target_pools.v[:n], block_size=block_size)
    return KVPools.allocate(draft.geometry, num_blocks, block_size, features=features)


class SpecDecoder:
    """Speculative decoding of a target model with a draft, exact for the target.

    ``target`` implements the model protocol (verispec.models.base.Model); ``draft`` is
    a drafter (``verispec.drafters``: ``NGram`` for prompt lookup, ``NGram(branches >
    1)``: tries of ``k`` nodes verified in one target pass, see docs/design.md "Tree
    steps"; ``EarlyExit``; anything implementing ``verispec.drafters.Drafter``), a model
    (a separate draft: its own weights and cache), or None. The decoder asks the drafter
    what it needs (``Drafter.spec``: its cache, the target's hidden states, one-hot or
    sampled q) and tests no types. ``k`` draft tokens are proposed per step (0, or
    ``draft=None``: plain decoding through the same loop), or ``k="auto"`` (the
    default): chosen per sequence and step, up to ``max_k``, from the measured
    acceptance rate and the measured draft and target pass costs (k = 0 when
    speculation does not pay; see csrc/include/verispec/adaptive_k.h). The target gets
    paged KV pools of ``num_blocks`` blocks of ``block_size`` tokens; a draft model its
    own (``draft_num_blocks``, default ``num_blocks``), except an ``EarlyExit`` draft of
    this target, which reads and writes the target's pools for its layers.

    Scheduling: added sequences wait in arrival order and run when admitted (at most
    ``max_num_seqs`` at once; 0: no limit). When a step does not fit the free cache
    blocks, the newest running sequence is preempted: its blocks are freed, its tokens
    kept, and it recomputes its cache when it runs again. ``CacheFullError`` reaches the
    caller only when one sequence alone does not fit. ``max_tokens_per_step`` (0: no
    limit) caps the tokens of a step's target pass: decoding sequences come first (their
    k shrinks when the budget is tight, to 0 at worst), then long prompts and recomputes
    are prefilled in chunks of what is left, so the other streams keep decoding; at most
    ``max_tokens_per_step`` sequences run at once. With ``k="auto"`` the cost model sees
    the whole batch: k falls as the target pass grows compute-bound.

    Sampled output is distributed exactly as sampling the target under the same policy
    (temperature, top-k, top-p, min-p, applied identically to target and draft).
    Greedy output is the target's greedy output token for token.

    ``verify_method="block"``: a draft model's sampled chains are verified by block
    verification (``verispec.ops.verify(method="block")``, Sun et al., arXiv 2403.10444):
    exact as well, and on average it accepts at least as many proposals as the
    token-wise rule (``"token"``, the default). Greedy rows, n-gram proposals (one-hot)
    and sequences added with a seed (the keyed rule) are verified as before.

    ``compact_q`` (default True): a drafter whose proposals come from a subset of the
    vocabulary (``DraftSpec.draft_vocab``: an EAGLE-3 head's draft vocabulary) has its q
    kept over that subset only, [B, K, W] instead of [B, K, V], and verify reads it
    through ``draft_index`` (q = 0 outside): the same tokens bit for bit as the full q
    (False), in W / V of the memory (``q_memory``).

    ``ops`` (default :mod:`verispec.ops`) is any object with ``apply_policy``, ``sample``
    and ``verify`` of those signatures (e.g. :mod:`verispec.reference`); whatever it
    returns is checked by the core before anything is committed.
    """

    def __init__(self, target: Model, draft: Any = None, *, k: int | str = "auto",
                 max_k: int = 8, num_blocks: int = 512, draft_num_blocks: int | None = None,
                 block_size: int = 16, seed: int = 0, ops: Any = None,
                 max_num_seqs: int = 0, max_tokens_per_step: int = 0,
                 verify_method: str = "token", draft_branches: int = 1,
                 draft_replacement: bool = True, compact_q: bool = True) -> None:
        drafter = as_drafter(draft)
        spec = drafter.spec(target) if drafter is not None else None
        if spec is not None and not isinstance(spec, DraftSpec):
            raise TypeError(f"SpecDecoder: {type(drafter).__name__}.spec(target) must return "
                            f"a verispec.drafters.DraftSpec, got {type(spec).__name__}")
        k, adaptive = _check_settings(
            target, draft, spec, k=k, max_k=max_k, max_num_seqs=max_num_seqs,
            max_tokens_per_step=max_tokens_per_step, verify_method=verify_method,
            draft_branches=draft_branches, draft_replacement=draft_replacement)
        g = target.geometry
        model = spec.model if spec is not None and spec.kind == "model" else None
        ngram = spec.ngram if spec is not None and spec.kind == "lookup" else None
        if ops is None:
            from verispec import ops
        if draft_branches > 1 or (ngram is not None and ngram[2] > 1):
            _check_tree_ops(ops)
        self._ops = ops
        #: The drafter (verispec.drafters.Drafter; a model given as draft is wrapped in
        #: DraftModel) and what it asked for (DraftSpec); None without a draft.
        self.drafter, self.draft_spec = drafter, spec
        #: The draft as given when it runs draft passes (a model, EarlyExit, ...), and as
        #: given when it is an n-gram lookup; None otherwise.
        self.draft = draft if model is not None else None
        self.ngram = draft if ngram is not None else None
        self.target = target
        self.verify_method = verify_method
        self.draft_branches, self.draft_replacement = draft_branches, draft_replacement
        self.vocab_size = g.vocab_size
        self._vocab = {_TARGET: g.vocab_size}
        if model is not None:
            self._vocab[_DRAFT] = model.geometry.vocab_size
        self.device = torch.device(g.device)
        draft_num_blocks = num_blocks if draft_num_blocks is None else draft_num_blocks
        # A drafter of the target's own first layers (early exit) reads the K/V the
        # target wrote for them: it shares the target's cache (no draft cache, no
        # catch-up).
        shared = spec is not None and spec.cache == "target"
        config = dict(
            k=k, has_draft_model=model is not None, target_num_blocks=num_blocks,
            draft_num_blocks=draft_num_blocks if model is not None and not shared else 0,
            block_size=block_size, vocab_size=g.vocab_size, max_context=g.max_context,
            seed=seed, ngram_min_n=ngram[0] if ngram else 0,
            ngram_max_n=ngram[1] if ngram else 0, adaptive_k=adaptive,
            draft_shares_target_cache=shared,
            draft_max_context=model.geometry.max_context if model is not None else 0,
            max_num_seqs=max_num_seqs, max_tokens_per_step=max_tokens_per_step,
            ngram_branches=ngram[2] if ngram else 1, draft_branches=draft_branches,
            # a draft reading the target's states drafts from what the target wrote:
            # not before the target cached the prompt; its cache keeps its catch-up only
            draft_reads_target=bool(spec is not None and spec.features and not shared))
        if model is None and ngram is None:
            # No draft: plain decoding through the same loop, k = 0 (the core refuses
            # drafts without a source). The k given still meets the core's rule: it
            # checks the settings as n-gram drafting would take them.
            if k:
                _core(dict(config, ngram_min_n=1, ngram_max_n=1))
            k, adaptive = 0, False
            config.update(k=0, adaptive_k=False)
        self._core = _core(config)
        self.k, self.adaptive = k, adaptive
        # A tensor-parallel target (verispec.distributed.shard) carries its collectives:
        # every rank runs this loop in lock-step; the step's times are agreed on (k="auto")
        # and the committed tokens checked (docs/distributed.md).
        self._tp = _shared_tp(target, model)
        self._agreement = self._tp.agreement() if self._tp is not None else None
        self.block_size = block_size
        self.shares_target_cache = shared
        self._models = {_TARGET: target}
        # The target writes the hidden states the drafter reads beside its K/V
        # (KVPools.features; none asked: no pool, no extra work)
        self._feature_keys = sorted({f.key(g.num_layers) for f in spec.features}) if spec else []
        self._pools = {_TARGET: KVPools.allocate(g, num_blocks, block_size,
                                                 features=self._feature_keys)}
        if model is not None:
            self._models[_DRAFT] = model
            self._pools[_DRAFT] = _draft_pools(model, self._pools[_TARGET], shared,
                                               draft_num_blocks, block_size, spec.own_features)
        self._nvtx = _nvtx_range(self.device)
        self._q: torch.Tensor | None = None        # draft probabilities, reused across steps
        # n-gram memory across requests (NGram(memory=...)): each sequence's tenant and
        # prompt, remembered with its output when it finishes
        self.ngram_memory = spec.memory if spec is not None and spec.kind == "lookup" else None
        self._tenant: dict[int, tuple[str, list[int]]] = {}
        # Compact q: a draft over a subset of the vocabulary (DraftSpec.draft_vocab) keeps
        # its probabilities over that subset only; verify reads them through draft_index
        self._q_cols = self._draft_index = None
        self.q_width = g.vocab_size
        if not isinstance(compact_q, bool):
            raise TypeError(f"SpecDecoder: compact_q must be a bool, got {compact_q!r}")
        if model is not None and spec.draft_vocab is not None and compact_q:
            cols = spec.draft_vocab
            if int(cols[-1]) >= g.vocab_size:
                raise ValueError(f"SpecDecoder: the drafter's draft_vocab must hold target ids "
                                 f"below the vocabulary size {g.vocab_size}, got "
                                 f"{int(cols[-1])}")
            index = torch.full((g.vocab_size,), -1, dtype=torch.int32)
            index[cols] = torch.arange(len(cols), dtype=torch.int32)
            self._q_cols, self._draft_index = cols.to(self.device), index.to(self.device)
            self.q_width = len(cols)
        # every host -> device upload of a step and its one download (models/staging.py)
        self.staging = PlanStaging(self.device)
        # logprobs: what each sequence asked for (top-n) and what it got so far; under
        # _lp_lock, which add() holds until its id is recorded (a step that plans the
        # sequence reads the request after that)
        self._lp_lock = threading.Lock()
        self._lp: dict[int, tuple[int, list[TokenLogprob]]] = {}  # seq -> (top n, so far)

    # -- continuous batching -------------------------------------------------------
    def add(self, prompt: Sequence[int], *, max_new_tokens: int, greedy: bool = False,
            temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
            eos_token_id: int | Sequence[int] | None = None,
            stop: Sequence[Sequence[int]] | None = None, logprobs: int | None = None,
            seed: int | None = None, priority: int = 0, tenant: str = "default") -> int:
        """Adds a sequence (any time, from any thread); returns its id. ``greedy=True``
        is temperature 0. Ids of released sequences are reused. ``logprobs=n`` (an int
        in [0, MAX_TOP_LOGPROBS]) reports each emitted token's TokenLogprob with the n
        most likely alternatives (StepOutput.logprobs, result(seq).logprobs).

        ``seed`` (an int in [0, 2**64)): the sequence samples from its own random stream,
        keyed by this seed and each token's position, and is verified by the keyed rule
        (``verispec.ops.verify_keyed``): its tokens are the same alone or in any batch, in
        any row order, with any k or draft, and across preemption. Without a seed it
        draws from the decoder's stream (``generate``'s ``seed=None``), where a draft
        model's proposals are accepted a little more often.

        ``priority`` (an int in [-2**63, 2**63), default 0): waiting sequences are admitted
        higher priority first, then in arrival order; when blocks or ``max_num_seqs``
        run out, the running sequence of the lowest priority (then the newest) is
        preempted, also to make room for a waiting one of higher priority. A preempted
        sequence keeps its tokens and recomputes its cache when it runs again.

        ``tenant`` (a non-empty str, default "default"): whose earlier requests an n-gram
        drafter with a memory (``NGram(memory=NGramMemory())``) copies from, and whose
        memory this one joins when it finishes; without a memory it changes nothing."""
        if not isinstance(tenant, str) or not tenant:
            raise ValueError(f"add: tenant must be a non-empty str, got {tenant!r}")
        if isinstance(priority, bool) or not isinstance(priority, numbers.Integral):
            raise TypeError(f"add: priority must be an int, got {priority!r}")
        if not -(1 << 63) <= priority < 1 << 63:
            raise ValueError(f"add: priority must be in [-2**63, 2**63), got {priority}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)):
            raise TypeError(f"add: seed must be an int or None, got {seed!r}")
        if seed is not None and not 0 <= seed < 1 << 64:
            raise ValueError(f"add: seed must be in [0, 2**64), got {seed}")
        if logprobs is not None and (isinstance(logprobs, bool)
                                     or not isinstance(logprobs, numbers.Integral)):
            raise TypeError(f"add: logprobs must be an int or None, got {logprobs!r}")
        if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"add: logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {logprobs}")
        if eos_token_id is None:
            eos = []
        elif isinstance(eos_token_id, numbers.Integral) and not isinstance(eos_token_id, bool):
            eos = [int(eos_token_id)]
        else:
            eos = [int(e) for e in eos_token_id]
        for name, value in (("temperature", temperature), ("top_p", top_p), ("min_p", min_p)):
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"add: {name} must be a number, got {value!r}")
        for name, value in (("top_k", top_k), ("max_new_tokens", max_new_tokens)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"add: {name} must be an int, got {value!r}")
        if not isinstance(greedy, bool):
            raise TypeError(f"add: greedy must be a bool, got {greedy!r}")
        # The core takes top_k as int32. Past its range a k is either off (the policy rule:
        # any k of the vocabulary's size or more; vocabularies stay below 2^20) or out of
        # range, which the rule words with the value as given.
        k = int(top_k)
        if k > _INT32_MAX:
            k = _INT32_MAX
        elif k < -_INT32_MAX - 1:
            raise ValueError(f"add: {policy_error(top_k=k)}")
        memory = self.ngram_memory
        context = memory.context(tenant) if memory is not None else []
        with self._lp_lock:
            seq = self._core.add(list(prompt), int(max_new_tokens),
                                 fold_greedy("add", greedy, float(temperature)), k,
                                 float(top_p), float(min_p), eos, [list(s) for s in (stop or [])],
                                 None if seed is None else int(seed), int(priority),
                                 ngram_context=context)
            self._lp.pop(seq, None)
            if logprobs is not None:
                self._lp[seq] = (int(logprobs), [])
            if memory is not None:
                self._tenant[seq] = (tenant, [int(t) for t in prompt])
            else:
                self._tenant.pop(seq, None)
        return seq

    def step(self) -> list[StepOutput]:
        """One speculative step of the running sequences: the tokens each committed (none
        for a sequence whose prompt is still being prefilled in chunks).

        On any exception (cache full, a model or ops error, an out-of-contract result)
        every sequence, both caches and the n-gram indexes are exactly as before.
        """
        start = time.perf_counter()
        plan = self._core.begin_step()
        if plan is None:
            return []
        try:
            with self._nvtx("verispec.step"):
                committed = self._run(plan, start)
        except BaseException:
            self._core.cancel_step(plan["step_id"])
            raise
        committed, logprobs = committed
        if self._agreement is not None:  # the ranks' committed tokens, compared every N steps
            self._agreement.after_step(committed, last=not self._core.has_running())
        if self.ngram_memory is not None:
            self._remember(committed)
        return [StepOutput(seq, tokens, None if reason == "running" else reason,
                           logprobs.get(seq))
                for seq, tokens, reason in committed]

    def _remember(self, committed) -> None:
        """Finished sequences (not aborted) join their tenant's n-gram memory: prompt and
        output."""
        for seq, _, reason in committed:
            if reason in ("running", None, "aborted"):
                continue
            with self._lp_lock:
                entry = self._tenant.pop(seq, None)
            if entry is not None:
                tenant, prompt = entry
                self.ngram_memory.remember(tenant, prompt + list(self._core.generated(seq)))

    # -- the step's phases ---------------------------------------------------------
    def _run(self, plan: dict, start: float) -> list:
        data = plan["inputs"]
        host = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
        self.staging.begin_step()
        inputs = self._upload(host)
        for role, key in ((_TARGET, "target_copies"), (_DRAFT, "draft_copies")):
            if plan[key]:
                self._pools[_TARGET if self.shares_target_cache else role].copy_blocks(plan[key])
        B, K = plan["batch"], plan["k"]
        s = _StepState(plan, host, inputs, B, K,
                       draft_tokens=_view(inputs, plan["draft_tokens"], B * K,
                                          torch.int32).view(B, K),
                       policy=self._policy(plan["policy"], inputs, B),
                       keys=self._keys(plan["policy"], host, inputs, B),
                       timer=_Timer(self.device))
        timer = s.timer
        if B == 0:  # prefill chunks only: the target caches them, nothing is verified
            with timer("target_forward"), self._nvtx("verispec.target_forward"):
                self._forward(_TARGET, plan["passes"][-1], s)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the chunk is cached before the commit
            none = torch.empty(0, dtype=torch.int32).numpy()
            times = self._agreed_times([], [], sum(timer.seconds("target_forward")), 0.0,
                                       time.perf_counter() - start)
            committed = self._core.commit(plan["step_id"], none, none, none, None, *times,
                                          none if plan["tree"] else None)
            return committed, {}
        deferred = getattr(self._ops, "deferred_errors", None)
        with self._lp_lock:
            lp_rows = [(b, seq, self._lp[seq][0]) for b, seq in enumerate(plan["seqs"])
                       if seq in self._lp]
        with deferred() if deferred is not None else contextlib.nullcontext() as errors:
            q = self._draft_passes(s)
            result, logits = self._verify_pass(s, q)
            nodes = None
            if plan["tree"]:  # the accepted path's K/V into place; its logits rows
                result, nodes = result[:3], result[3]
                self._move_accepted(s, nodes, result[2])
                logits = self._path_logits(logits, nodes, result[2]) if lp_rows else logits
            lp = self._logprobs(logits, result[0], s.policy, lp_rows) if lp_rows else None
            records = errors.records() if errors is not None else None
            tokens, emitted, accepted, drafts, host_records, host_lp, host_nodes = self._download(
                self.staging, result, s.draft_tokens if plan["draft_model"] else None, records,
                lp, nodes)
            if records is not None:
                errors.raise_first(host_records)
        times = self._agreed_times(
            timer.seconds("draft_forward"), timer.seconds("draft_sample"),
            sum(timer.seconds("target_forward")), sum(timer.seconds("verify")),
            time.perf_counter() - start)
        committed = self._core.commit(plan["step_id"], tokens, emitted, accepted, drafts, *times,
                                      host_nodes)
        return committed, self._record_logprobs(committed, lp_rows, host_lp, K + 1)

    def _agreed_times(self, draft_forward, draft_sample, target_forward, verify, total):
        """The step's times for commit. Tensor parallel with k="auto": their maximum over
        the ranks, so every rank's cost model, hence its k, is the same."""
        if self._tp is not None and self.adaptive:
            return self._tp.agree_times(draft_forward, draft_sample, target_forward, verify,
                                        total)
        return draft_forward, draft_sample, target_forward, verify, total

    def _move_accepted(self, s: _StepState, nodes, num_accepted) -> None:
        """Tree steps: the accepted path's K/V moved to consecutive positions, the one
        place of this rule. Row b's node i was cached at index C + i (the slot of its
        verify input root + 1 + i, root being the row's last committed input); accepted
        node nodes[b, j] (j < num_accepted[b]) moves to index C + j. Sources never lie
        below their destination (nodes[b, j] >= j), and the copy reads every source
        before it writes (gather, then scatter), so the order of the moves is free. The
        rest is dropped by commit's rollback to C + a. On the device, no wait."""
        B, K = s.batch, s.k
        if K == 0:
            return
        p = s.plan["passes"][-1]
        slots = s.view(p["slot_mapping"], p["num_tokens"], torch.int32).long()
        root = s.view(p["logits_indices"], B * (K + 1), torch.int64).view(B, K + 1)[:, :1]
        j = torch.arange(K, device=root.device)
        valid = j[None, :] < num_accepted.long()[:, None]
        # padding moves the root's own slot onto itself (never a destination)
        dst = slots[torch.where(valid, root + 1 + j, root).view(-1)]
        src = slots[torch.where(valid, root + 1 + nodes.long(), root).view(-1)]
        self._pools[_TARGET].move_slots(src, dst)

    @staticmethod
    def _path_logits(logits, nodes, num_accepted):
        """[B, K + 1, V]: the target's logits along each row's accepted path (position j:
        the logits the j-th emitted token was drawn from: the root's, then the accepted
        nodes'), so that logprobs read them as a chain's."""
        B, K1, V = logits.shape
        j = torch.arange(K1 - 1, device=logits.device)
        after = torch.where(j[None, :] < num_accepted.long()[:, None], nodes.long() + 1, 0)
        index = torch.cat([after.new_zeros(B, 1), after], dim=1)
        return logits.gather(1, index[:, :, None].expand(B, K1, V))

    def _top_width(self, lp_rows) -> int:
        """How many alternatives the step's logprobs carry per token: the most any row
        asked for, at most V."""
        return min(max(top for _, _, top in lp_rows), self.vocab_size)

    def _logprobs(self, logits, tokens, policy, lp_rows):
        """[r, K + 1, 2 + 3n] float32 for the rows that asked: each position's token's
        policy-applied and raw log-probabilities, then the top n (token id as a float,
        logprob, raw logprob); n the largest asked in the step (at most V). Stays on the
        device."""
        rows = self.staging.put([b for b, _, _ in lp_rows], torch.int64)
        n = self._top_width(lp_rows)
        sel = logits.index_select(0, rows)                                    # [r, K + 1, V]
        r, positions, vocab = sel.shape
        raw = torch.log_softmax(sel.float(), dim=-1)
        row_policy = {name: v.index_select(0, rows).repeat_interleave(positions)
                      if isinstance(v, torch.Tensor) else v
                      for name, v in policy.items()}
        probs = _checked("apply_policy", "probs",
                         self._ops.apply_policy(sel.reshape(r * positions, vocab), **row_policy),
                         (r * positions, vocab), integer=False)
        applied = torch.log(probs.float()).view(r, positions, vocab)
        tok = tokens.index_select(0, rows).long().clamp(min=0).unsqueeze(-1)   # -1: padding
        parts = [applied.gather(-1, tok), raw.gather(-1, tok)]
        if n:
            top_raw, top_ids = raw.topk(n, dim=-1)
            parts += [top_ids.float(), applied.gather(-1, top_ids), top_raw]
        return torch.cat(parts, dim=-1)

    def _record_logprobs(self, committed, lp_rows, host_lp, positions):
        """The committed tokens' TokenLogprobs per sequence that asked (appended to what
        result() reports)."""
        if not lp_rows:
            return {}
        import numpy as np

        n = self._top_width(lp_rows)
        row_of = {seq: (i, min(top, n)) for i, (_, seq, top) in enumerate(lp_rows)}
        table = np.asarray(host_lp).view(np.float32).reshape(len(lp_rows), positions, 2 + 3 * n)
        out = {}
        with self._lp_lock:
            for seq, tokens, _ in committed:
                if seq not in row_of or seq not in self._lp:
                    continue  # released during the step
                i, top = row_of[seq]
                got = []
                for j, token in enumerate(tokens):
                    v = table[i, j]
                    alts = [(int(v[2 + a]), float(v[2 + n + a]), float(v[2 + 2 * n + a]))
                            for a in range(top)]
                    got.append(TokenLogprob(int(token), float(v[0]), float(v[1]), alts))
                self._lp[seq][1].extend(got)
                out[seq] = got
        return out

    def _keys(self, pol: dict, host: torch.Tensor, inputs: torch.Tensor, B: int):
        """The step's keyed rows (sequences added with a seed), or None when it has none:
        their indices (a host list and a device tensor), and each step row's seed and
        first position on the device."""
        if not pol["any_keyed"]:
            return None
        if not hasattr(self._ops, "verify_keyed"):
            raise ValueError("SpecDecoder: sequences added with a seed need ops with "
                             f"verify_keyed (keyed sampling); {self._ops!r} has none")
        flags = _view(host, pol["keyed_rows"], B, torch.int32).tolist()
        rows = [b for b, f in enumerate(flags) if f]
        return dict(all=pol["all_keyed"], rows=rows,
                    index=self.staging.put(rows, torch.int64),
                    seeds=_view(inputs, pol["seed_rows"], B, torch.int64),
                    positions=_view(inputs, pol["position_rows"], B, torch.int64))

    def _draft_passes(self, s: _StepState):
        """K draft passes; each row's proposals go to draft_tokens[row, j] and q[row, j]
        on the device (pass j >= 1 reads its input from pass j - 1's proposals)."""
        plan = s.plan
        if not plan["draft_model"]:
            return None
        if plan["draft_tree"]:
            return self._draft_tree_passes(s)
        B, K, timer = s.batch, s.k, s.timer
        q = self._draft_probs(B, K)
        flat_tokens, flat_q = s.draft_tokens.view(-1), q.view(B * K, -1)
        previous = None
        for j, p in enumerate(plan["passes"][:-1]):
            ids = None
            if j > 0:
                ids = previous.index_select(0, s.view(p["prev_index"], p["num_rows"],
                                                      torch.int64)).long()
            with timer("draft_forward"), self._nvtx("verispec.draft_forward"):
                logits = self._forward(_DRAFT, p, s, ids)
            rows = s.view(p["rows"], p["num_rows"], torch.int64)
            with timer("draft_sample"), self._nvtx("verispec.draft_sample"):
                tokens, probs = self._sample_draft(logits, self._rows_policy(s.policy, rows, B),
                                                   plan["seed"], plan["offset"] + 1 + j)
                if s.keys is not None:  # keyed rows race q at their own seed and position
                    tokens = self._keyed_proposals(tokens, probs, rows, s.keys, j)
            where = s.view(p["draft_index"], p["num_rows"], torch.int64)
            flat_tokens.index_copy_(0, where, tokens.to(torch.int32))
            flat_q.index_copy_(0, where, self._kept_q(probs))
            previous = tokens
        return q

    def _draft_tree_passes(self, s: _StepState):
        """Draft-tree steps (draft_branches = f > 1; the shape is in spec_decoder.h "Draft
        trees"): pass j draws each row's num_children children of level j from one q and
        stores q at the row's q_index of the [B, K + 1, V] draft probabilities; pass j >= 1
        reads the first child of the previous level (the spine). Returns those probabilities."""
        plan, B, K, f, timer = s.plan, s.batch, s.k, self.draft_branches, s.timer
        q = self._draft_probs(B, K + 1)
        flat_tokens, flat_q = s.draft_tokens.view(-1), q.view(B * (K + 1), -1)
        children = torch.arange(f, device=self.device)
        previous = None
        for j, p in enumerate(plan["passes"][:-1]):
            R = p["num_rows"]
            ids = None
            if j > 0:
                ids = previous.index_select(0, s.view(p["prev_index"], R, torch.int64)).long()
            with timer("draft_forward"), self._nvtx("verispec.draft_forward"):
                logits = self._forward(_DRAFT, p, s, ids)
            rows = s.view(p["rows"], R, torch.int64)
            row_policy = self._rows_policy(s.policy, rows, B)
            with timer("draft_sample"), self._nvtx("verispec.draft_sample"):
                tokens, probs = self._sample_children(logits, row_policy, plan["seed"],
                                                      plan["offset"] + 1 + j)
                if s.keys is not None:  # keyed rows are chains: one keyed sample of q
                    first = self._keyed_proposals(tokens[:, 0], probs, rows, s.keys, j)
                    tokens = torch.cat([first[:, None].to(tokens.dtype), tokens[:, 1:]], dim=1)
            # the drawn children that exist (child c < the row's num_children), chosen on
            # the host from the plan's copy: a boolean mask on the device would wait for it
            count = s.view(p["num_children"], R, torch.int64, on_host=True)
            valid = (torch.arange(f)[None, :] < count[:, None]).view(-1).nonzero().view(-1)
            pick = self.staging.put(valid)
            where = (s.view(p["draft_index"], R, torch.int64)[:, None] + children).view(-1)
            flat_tokens.index_copy_(0, where.index_select(0, pick),
                                    tokens.reshape(-1).index_select(0, pick).to(torch.int32))
            flat_q.index_copy_(0, s.view(p["q_index"], R, torch.int64), self._kept_q(probs))
            previous = tokens[:, 0]
        return q

    def _sample_children(self, logits, policy, seed, offset):
        """f children per row from the draft's logits [R, V']: (tokens [R, f], the q [R, V]
        the sampled ones were drawn from). Sampled rows: i.i.d. from q
        (draft_replacement=True: one sample call over the rows repeated f times, row
        r * f + c drawing child c) or without replacement (child c drawn from q without
        children 0..c-1, renormalised: the law verify_tree's replacement=False assumes;
        call c at row r * f + c again, so every draw has its own coin). Greedy rows
        (temperature 0): the draft's f most likely tokens, most likely first
        (deterministic candidates; verify_tree walks greedy rows by the target's argmax)."""
        f, vocab = self.draft_branches, self.vocab_size
        if logits.shape[1] > vocab:
            logits = logits[:, :vocab]
        rows, width = logits.shape
        probs = _checked("apply_policy", "probs", self._ops.apply_policy(logits, **policy),
                         (rows, width), integer=False)
        temperature = policy["temperature"]
        greedy = (temperature == 0) if isinstance(temperature, torch.Tensor) else None
        if greedy is None and temperature == 0:  # every row greedy: nothing to sample
            tokens = None
        elif self.draft_replacement:
            tokens = _checked("sample", "tokens", self._ops.sample(
                probs.repeat_interleave(f, dim=0), seed=seed, offset=offset),
                (rows * f,), integer=True).view(rows, f).long()
        else:
            taken = torch.zeros_like(probs, dtype=torch.bool)
            picks = []
            for c in range(f):
                left = probs.masked_fill(taken, 0.0)
                mass = left.sum(dim=-1, keepdim=True)
                left = torch.where(mass > 0, left / mass.clamp(min=1e-30), probs)
                draw = _checked("sample", "tokens", self._ops.sample(
                    left.repeat_interleave(f, dim=0), seed=seed,
                    offset=offset), (rows * f,), integer=True).view(rows, f)[:, c].long()
                if c > 0:
                    # No mass left (f beyond q's support): repeat the token that used it up.
                    # Its rejection left the residual nothing on it, and a sibling with no
                    # q mass adds none, so verify_tree never accepts the repeat.
                    draw = torch.where(mass[:, 0] > 0, draw, picks[-1])
                taken.scatter_(1, draw[:, None], True)
                picks.append(draw)
            tokens = torch.stack(picks, dim=1)
        if greedy is not None or temperature == 0:
            top = logits.float().topk(min(f, width), dim=-1).indices
            if top.shape[1] < f:  # fewer tokens than children: repeat the last
                top = torch.cat([top, top[:, -1:].expand(rows, f - top.shape[1])], dim=1)
            tokens = top if greedy is None else torch.where(greedy[:, None], top, tokens)
        if width < vocab:
            probs = torch.nn.functional.pad(probs, (0, vocab - width))
        return tokens, probs

    def _sample_draft(self, logits, policy, seed, offset):
        """Proposals from the draft's logits: (tokens [R], the distribution q [R, V] they
        were drawn from, over the target's vocabulary V).

        A draft with a larger (padded) vocabulary proposes only ids the target has: its
        logits past V are dropped before the policy, so q is its distribution given an
        id below V. A smaller one proposes ids below its size: q is zero past it. Either
        way q is exactly the distribution the proposal was drawn from, which is all that
        exactness needs."""
        vocab = self.vocab_size
        if logits.shape[1] > vocab:
            logits = logits[:, :vocab]
        rows, width = logits.shape
        probs = _checked("apply_policy", "probs", self._ops.apply_policy(logits, **policy),
                         (rows, width), integer=False)
        tokens = _checked("sample", "tokens", self._ops.sample(probs, seed=seed, offset=offset),
                          (rows,), integer=True)
        if width < vocab:
            probs = torch.nn.functional.pad(probs, (0, vocab - width))
        return tokens, probs

    def _keyed_proposals(self, tokens, probs, rows, keys, j):
        """Draft pass j's proposals with the keyed rows' replaced by keyed samples of q at
        (their seed, their position + j): the same exponentials the target's keyed verify
        races at that position, so the two agree as often as the coupling allows."""
        keyed = _checked("sample", "tokens", self._ops.sample(
            probs, seeds=keys["seeds"].index_select(0, rows),
            positions=keys["positions"].index_select(0, rows) + j), (probs.shape[0],),
            integer=True)
        if keys["all"]:
            return keyed
        is_keyed = torch.zeros(len(keys["seeds"]), dtype=torch.bool, device=tokens.device)
        is_keyed[keys["index"]] = True
        return torch.where(is_keyed.index_select(0, rows), keyed.to(tokens.dtype), tokens)

    def _verify_pass(self, s: _StepState, q):
        """The target's pass over every row's inputs and drafts, then verify: ((tokens,
        num_emitted, num_accepted[, accepted_nodes for a tree]), the target's logits
        [B, K + 1, V])."""
        plan, B, K, timer = s.plan, s.batch, s.k, s.timer
        draft_tokens, policy, keys = s.draft_tokens, s.policy, s.keys
        p = plan["passes"][-1]
        ids = None
        if p["num_fill"]:
            ids = s.view(p["input_ids"], p["num_tokens"], torch.int64).clone()
            fill = s.view(p["fill_positions"], p["num_fill"], torch.int64)
            src = s.view(p["fill_sources"], p["num_fill"], torch.int64)
            ids.index_copy_(0, fill, draft_tokens.view(-1).index_select(0, src).long())
        with timer("target_forward"), self._nvtx("verispec.target_forward"):
            logits = self._forward(_TARGET, p, s, ids)
        target = logits.view(B, K + 1, -1)
        num_draft = s.view(plan["num_draft"], B, torch.int32)
        if plan["tree"]:
            with timer("verify"), self._nvtx("verispec.verify"):
                return self._verify_tree(s, target, num_draft, q), target
        with timer("verify"), self._nvtx("verispec.verify"):
            out = None
            if keys is None or not keys["all"]:
                # block verification for a draft model's sampled proposals (q kept);
                # one-hot proposals (n-gram) are verified token-wise either way
                block = q is not None and self.verify_method == "block"
                method = {"method": "block"} if block else {}
                if q is not None and self._draft_index is not None:
                    method["draft_index"] = self._draft_index
                out = self._verify_outputs("verify", self._ops.verify(
                    target, draft_tokens, q, num_draft=num_draft, seed=plan["seed"],
                    offset=plan["offset"], **policy, **method), B, K)
            if keys is not None:
                index = keys["index"]
                n = len(keys["rows"])
                keyed = self._verify_outputs("verify_keyed", self._ops.verify_keyed(
                    target.index_select(0, index), draft_tokens.index_select(0, index),
                    num_draft=num_draft.index_select(0, index),
                    seeds=keys["seeds"].index_select(0, index),
                    positions=keys["positions"].index_select(0, index),
                    **self._rows_policy(policy, index, B)), n, K)
                if out is None:
                    out = keyed
                else:  # the keyed rows' results replace the decoder stream's
                    out = tuple(o.index_copy(0, index, kd.to(o.dtype)) for o, kd in zip(out, keyed))
        return out, target

    def _verify_tree(self, s: _StepState, target, num_draft, q):
        """A tree step's verify: ops.verify_tree over every row's nodes (a chain row is a
        tree too); keyed rows (chains) take verify_keyed's outputs, their accepted nodes
        being 0..a-1. Returns (tokens, num_emitted, num_accepted, accepted_nodes)."""
        plan, B, K = s.plan, s.batch, s.k
        draft_tokens, policy, keys = s.draft_tokens, s.policy, s.keys
        _check_tree_ops(self._ops)  # ops may have been swapped since construction
        parents = s.view(plan["tree_parents"], B * K, torch.int32).view(B, K)
        extra = {}
        if q is not None:  # a draft model's tree: its children were drawn from q
            extra = dict(replacement=self.draft_replacement)
            if self._draft_index is not None:
                extra["draft_index"] = self._draft_index
        out = self._ops.verify_tree(target, draft_tokens, parents, q, num_nodes=num_draft,
                                    seed=plan["seed"], offset=plan["offset"], **policy, **extra)
        if not isinstance(out, (tuple, list)) or len(out) != 3:
            raise ValueError(f"ops.verify_tree must return (tokens, num_emitted, "
                             f"accepted_nodes), got {type(out).__name__}")
        tokens = _checked("verify_tree", "tokens", out[0], (B, K + 1), integer=True)
        emitted = _checked("verify_tree", "num_emitted", out[1], (B,), integer=True)
        nodes = _checked("verify_tree", "accepted_nodes", out[2], (B, K), integer=True)
        accepted = emitted - 1
        if keys is not None:
            index = keys["index"]
            keyed = self._verify_outputs("verify_keyed", self._ops.verify_keyed(
                target.index_select(0, index), draft_tokens.index_select(0, index),
                num_draft=num_draft.index_select(0, index),
                seeds=keys["seeds"].index_select(0, index),
                positions=keys["positions"].index_select(0, index),
                **self._rows_policy(policy, index, B)), len(keys["rows"]), K)
            tokens = tokens.index_copy(0, index, keyed[0].to(tokens.dtype))
            emitted = emitted.index_copy(0, index, keyed[1].to(emitted.dtype))
            accepted = accepted.index_copy(0, index, keyed[2].to(accepted.dtype))
            chain = torch.arange(K, dtype=nodes.dtype, device=nodes.device)
            nodes = nodes.index_copy(0, index, chain.expand(len(keys["rows"]), K).contiguous())
        return tokens, emitted, accepted, nodes

    @staticmethod
    def _verify_outputs(op, out, B, K):
        """ops.verify's (or verify_keyed's) outputs, checked for their shapes."""
        if not isinstance(out, (tuple, list)) or len(out) != 3:
            raise ValueError(f"ops.{op} must return (tokens, num_emitted, num_accepted), "
                             f"got {type(out).__name__}")
        return (_checked(op, "tokens", out[0], (B, K + 1), integer=True),
                _checked(op, "num_emitted", out[1], (B,), integer=True),
                _checked(op, "num_accepted", out[2], (B,), integer=True))

    def _forward(self, role, p, s: _StepState, input_ids=None) -> torch.Tensor:
        """One pass ``p`` of the plan through the ``role``'s model: its PagedBatch from the
        packed inputs (device views, and the host's copy for plans built on the host),
        the logits [p.num_logits, V] checked for shape and device."""
        B, T, M = p["num_rows"], p["num_tokens"], p["max_blocks"]
        host, inputs = s.host, s.inputs

        def fields(buf):
            return dict(
                positions=_view(buf, p["positions"], T, torch.int64),
                slot_mapping=_view(buf, p["slot_mapping"], T, torch.int32),
                block_tables=_view(buf, p["block_tables"], B * M, torch.int32).view(B, M),
                context_lens=_view(buf, p["context_lens"], B, torch.int32),
                query_start=_view(buf, p["query_start"], B + 1, torch.int64),
                logits_indices=_view(buf, p["logits_indices"], p["num_logits"], torch.int64))

        on_device = fields(inputs)
        if input_ids is None:
            input_ids = _view(inputs, p["input_ids"], T, torch.int64)
        if self._vocab[role] < self.vocab_size:
            # a draft with a smaller vocabulary than the target's reads tokens it has no
            # embedding for (the prompt's, the target's corrections) as its last id: its
            # proposals get worse, never wrong (q stays what they are drawn from)
            input_ids = input_ids.clamp(max=self._vocab[role] - 1)
        tree_mask = host_tree = None
        if p.get("has_tree_mask"):
            def tree(buf):
                return _view(buf, p["tree_mask"], T * T, torch.uint8).view(torch.bool).view(T, T)
            tree_mask, host_tree = tree(inputs), tree(host)
        host_fields = dict(fields(host), tree_mask=host_tree)
        batch = PagedBatch(
            input_ids=input_ids, kv=self._pools[role], host=host_fields, tree_mask=tree_mask,
            staging=self.staging, **on_device,
            target_features=self._feature_view(p, s) if role == _DRAFT and self._feature_keys
            else None)
        with torch.inference_mode():
            logits = self._models[role].forward(batch)
        expect = (p["num_logits"], self._vocab[role])
        if not isinstance(logits, torch.Tensor) or tuple(logits.shape) != expect:
            got = list(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
            raise ValueError(f"{role.name} model: forward must return logits [R, V] = "
                             f"{list(expect)}, got {got}")
        if logits.device != self.device:
            raise ValueError(f"{role.name} model: forward must return logits on {self.device}, "
                             f"got {logits.device}")
        return logits

    def _feature_view(self, p, s: _StepState) -> FeatureView:
        """What draft pass ``p`` reads of the target's hidden states: the target's feature
        pools and the pass's rows' target block tables (the verify pass's tables, which
        hold every step row's committed tokens; device views, no wait)."""
        v = s.plan["passes"][-1]
        tables = s.view(v["block_tables"], v["num_rows"] * v["max_blocks"],
                        torch.int32).view(v["num_rows"], v["max_blocks"])
        rows = s.view(p["rows"], p["num_rows"], torch.int64)
        # the target's cache before this step: after the verify pass less its new tokens
        starts = s.view(v["query_start"], v["num_rows"] + 1, torch.int64)
        cached = s.view(v["context_lens"], v["num_rows"], torch.int32).long() - (
            starts[1:] - starts[:-1])
        return FeatureView(pools=self._pools[_TARGET].features,
                           block_tables=tables.index_select(0, rows),
                           block_size=self.block_size,
                           num_layers=self.target.geometry.num_layers,
                           cached=cached.index_select(0, rows))

    def _upload(self, host: torch.Tensor) -> torch.Tensor:
        """The step's packed inputs on the model's device: one asynchronous copy through
        the step's staging (a pinned host buffer on CUDA; models/staging.py)."""
        return self.staging.put(host)

    @staticmethod
    def _download(staging, result, draft_tokens, records, logprobs=None, accepted_nodes=None):
        """verify's results, a draft model's proposals, the ops' deferred error records and
        the logprobs asked for (float32, carried bit for bit as int32) on the host: one
        copy (the step's one wait for the device)."""
        tokens, emitted, accepted = result
        parts = [tokens.reshape(-1), emitted.reshape(-1), accepted.reshape(-1),
                 draft_tokens.reshape(-1) if draft_tokens is not None else None, records,
                 logprobs.reshape(-1).view(torch.int32) if logprobs is not None else None,
                 accepted_nodes.reshape(-1) if accepted_nodes is not None else None]
        present = [t.to(torch.int32) for t in parts if t is not None]
        flat = staging.download(torch.cat(present)).numpy()
        out, at = [], 0
        for t in parts:
            if t is None:
                out.append(None)
                continue
            out.append(flat[at:at + t.numel()])
            at += t.numel()
        return out

    def _draft_probs(self, B: int, K: int) -> torch.Tensor:
        """The [B, K, W] float32 draft-probability buffer (W: q_width, the vocabulary or
        the compact q's draft vocabulary), reused across steps (rows past a row's k are
        never read by verify, so it is never cleared)."""
        n = B * K * self.q_width
        if self._q is None or self._q.numel() < n:
            self._q = torch.empty(n, dtype=torch.float32, device=self.device)
        return self._q[:n].view(B, K, self.q_width)

    def _kept_q(self, probs: torch.Tensor) -> torch.Tensor:
        """A draft pass's q rows [R, V] as stored: the draft vocabulary's columns under
        compact q (the others are 0: the draft's logits are -inf there)."""
        probs = probs.float()
        return probs if self._q_cols is None else probs.index_select(1, self._q_cols)

    def q_memory(self, batch: int, k: int) -> dict:
        """Bytes of the draft probabilities a step of ``batch`` rows and ``k`` drafts keeps
        (float32 [batch, k, W]), beside the full vocabulary's [batch, k, V]: what compact
        q saves per step."""
        full = 4 * batch * k * self.vocab_size
        kept = 4 * batch * k * self.q_width
        return {"width": self.q_width, "vocab_size": self.vocab_size, "bytes": kept,
                "full_bytes": full, "saved_bytes": full - kept}

    def _policy(self, pol: dict, inputs: torch.Tensor, B: int) -> dict:
        """Scalars when every row agrees (cheaper kernels), else per-row device tensors."""
        if pol["uniform"]:
            return dict(temperature=pol["temperature"], top_k=pol["top_k"], top_p=pol["top_p"],
                        min_p=pol["min_p"])
        return dict(temperature=_view(inputs, pol["temperature_rows"], B, torch.float32),
                    top_k=_view(inputs, pol["top_k_rows"], B, torch.int32),
                    top_p=_view(inputs, pol["top_p_rows"], B, torch.float32),
                    min_p=_view(inputs, pol["min_p_rows"], B, torch.float32))

    @staticmethod
    def _rows_policy(policy: dict, rows: torch.Tensor, B: int) -> dict:
        if rows.numel() == B:  # every row takes part (rows are 0..B-1 in order)
            return policy
        return {name: v.index_select(0, rows) if isinstance(v, torch.Tensor) else v
                for name, v in policy.items()}

    # -- sequences -------------------------------------------------------------------
    def abort(self, seq: int) -> None:
        """Stops a sequence (finish reason "aborted") and frees its cache blocks; from
        any thread (during a step: when that step ends)."""
        self._core.abort(seq)

    def release(self, seq: int) -> None:
        """Forgets a sequence (aborting it if it runs) and frees its id; KeyError for an
        unknown id. From any thread (during a step: when that step ends)."""
        with self._lp_lock:
            self._core.release(seq)
            self._lp.pop(seq, None)
            self._tenant.pop(seq, None)

    def result(self, seq: int) -> GenerateResult:
        """The sequence's tokens so far (new tokens only), finish reason, statistics and,
        when it asked for them, its tokens' logprobs."""
        with self._lp_lock:
            logprobs = list(self._lp[seq][1]) if seq in self._lp else None
        return GenerateResult(self._core.generated(seq), self._core.finish_reason(seq),
                              self._core.stats(seq), logprobs)

    def has_running(self) -> bool:
        """Whether any added sequence is still running or waiting (step() has work)."""
        return self._core.has_running()

    def num_waiting(self) -> int:
        """Sequences waiting to run: added but not admitted yet (``max_num_seqs``), or
        preempted (their cache blocks were needed by older sequences)."""
        return self._core.num_waiting()

    def num_preemptions(self) -> int:
        """How many times a sequence was preempted, over the decoder's life."""
        return self._core.num_preemptions()

    def timings(self) -> dict:
        """Wall time by phase summed over all steps: draft_forward_s, draft_sample_s,
        target_forward_s, verify_s, bookkeeping_s (plan, commit, rollback, glue), steps."""
        return self._core.times()

    def cost_model(self) -> dict:
        """What adaptive k uses (csrc/include/verispec/adaptive_k.h): ``draft_pass_s`` (one
        draft pass; None until measured), ``target_pass_s[n - 1]``: the fitted cost of a
        target pass of n TOTAL tokens (n = 1..k + 1: one row alone), ``target_fit``: that
        fit as ``flat_s + slope_s_per_token * max(0, n - knee_tokens)``,
        ``target_measured``: the measurements (average tokens, seconds) by size bucket, and
        ``acceptance_prior``: the acceptance rate a new sequence starts from (per n-gram
        match length; one value for a draft model): every sequence's trials so far,
        weighted as at most 8 trials of its own (0.5 before any)."""
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
                 top_p: float = 1.0, min_p: float = 0.0,
                 seed: int | Sequence[int] | None = None,
                 eos_token_id: int | Sequence[int] | None = None,
                 stop: Sequence[Sequence[int]] | None = None,
                 logprobs: int | None = None, tenant: str = "default") -> list[GenerateResult]:
        """Decodes every prompt to completion; one result per prompt, in order, whatever
        the number of prompts and the pool size (they wait in the queue).
        ``logprobs=n``: each result carries its tokens' TokenLogprobs (see ``add``);
        ``tenant``: every prompt's (see ``add``).

        ``seed``: a list of ints gives prompt i the request seed ``seed[i]`` (see
        ``add``); an int s gives prompt i the seed ``request_seed(s, i)``; each request
        then gets the tokens it gets alone with that seed, in any batch. None: every
        prompt draws from the decoder's stream, restarted at seed 0 (reproducible for the
        same prompts and parameters, but a request's tokens depend on its batch).
        """
        if self._core.has_running():
            raise RuntimeError("generate: sequences added with add() are still running; "
                               "finish them with step() (or abort them) first")
        if isinstance(prompts, (str, bytes)):
            raise TypeError("generate: prompts must be a list of token-id lists")
        prompts = list(prompts)  # a generator is read once, here
        if not all(isinstance(p, (list, tuple)) for p in prompts):
            raise TypeError("generate: prompts must be a list of token-id lists")
        seeds = _request_seeds(seed, len(prompts))
        ids = []
        try:
            for p, request in zip(prompts, seeds):
                ids.append(self.add(p, max_new_tokens=max_new_tokens, greedy=greedy,
                                    temperature=temperature, top_k=top_k, top_p=top_p,
                                    min_p=min_p, eos_token_id=eos_token_id, stop=stop,
                                    logprobs=logprobs, seed=request, tenant=tenant))
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
                self._tenant.pop(i, None)
