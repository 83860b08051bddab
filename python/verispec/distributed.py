"""Tensor parallelism over torch.distributed: one target split across processes.

Every rank runs the same SpecDecoder loop: the native core is deterministic, so given
the same inputs every rank plans the same rows, k, passes and cache blocks. What makes
the inputs the same:

- the model's forward ends in the same logits on every rank: the layers' row-parallel
  products are summed by an all-reduce (every rank receives the same bits), and the
  vocabulary-parallel LM head's slices are all-gathered, so each rank holds all
  V logits and runs the unchanged verify kernel (one collective of R x V floats per
  forward next to the 2 x layers all-reduces of T x hidden floats: on loopback and
  ethernet at decode sizes the count of collectives, not their bytes, sets the cost;
  a distributed verify would need several dependent collectives per step: the
  softmax's max and sum, the sample's prefix sums across the vocabulary slices);
- the random stream is Philox addressed by (seed, offset, row, position): the same on
  every rank with nothing sent, so every rank accepts the same tokens by construction;
- with ``k="auto"`` the measured pass times, which differ per rank, are replaced by
  their maximum over the ranks before they reach the cost model (one all-reduce of a
  few floats per step): a step is as slow as its slowest rank.

A cheap check backs the "by construction": every ``check_every`` steps the ranks
all-gather a hash of each step's committed tokens and raise ``RankDivergenceError``
naming the first step where they differ.

Usage (``torchrun --nproc-per-node 2 script.py``)::

    from verispec import distributed, models
    from verispec.decoder import SpecDecoder

    tp = distributed.init(timeout_s=60)          # gloo from torchrun's environment
    model, tok = models.load("smollm2")          # every rank loads, then keeps its shard
    model = distributed.shard(model, tp)
    dec = SpecDecoder(model, NGram(1, 3), k=4)   # the decoder finds model.tp
    out = dec.generate([prompt], max_new_tokens=64, greedy=True)
    if tp.rank == 0: print(out[0].tokens)
    distributed.close(tp)
"""

from __future__ import annotations

import datetime
import hashlib
import os
import time
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["AgreementCheck", "RankDivergenceError", "TensorParallel", "close", "init", "shard"]


class RankDivergenceError(RuntimeError):
    """The ranks of a tensor-parallel decoder committed different tokens."""


class TensorParallel:
    """The collectives of one tensor-parallel rank, and their measured cost.

    ``group``: the process group (None: the default one); ``check_every``: steps between
    agreement checks (0: never). ``comm`` adds up this rank's collectives by kind
    ("all_reduce": the layers', "gather_vocab": the LM head's, "agree_times" and
    "check": the decoder's) as {kind: [calls, seconds]}, wall time (waiting for a slower
    rank counts too); ``comm_s`` and ``comm_calls`` are the totals.
    """

    def __init__(self, *, group: Any = None, check_every: int = 8,
                 timeout_s: Optional[float] = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("TensorParallel: torch.distributed must be initialised first "
                               "(verispec.distributed.init, or dist.init_process_group)")
        if isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 0:
            raise ValueError(f"TensorParallel: check_every must be an int >= 0 (0: never), "
                             f"got {check_every!r}")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.check_every = check_every
        self.timeout_s = timeout_s
        self.comm: dict[str, list] = {kind: [0, 0.0] for kind in
                                      ("all_reduce", "gather_vocab", "agree_times", "check")}

    def __repr__(self) -> str:
        return (f"TensorParallel(rank={self.rank}, world_size={self.world_size}, "
                f"check_every={self.check_every})")

    @property
    def comm_s(self) -> float:
        return sum(s for _, s in self.comm.values())

    @property
    def comm_calls(self) -> int:
        return sum(n for n, _ in self.comm.values())

    # -- the model's collectives -------------------------------------------------------
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sums ``t`` over the ranks, in place; returns it."""
        if self.world_size == 1:
            return t
        start = time.perf_counter()
        dist.all_reduce(t, group=self.group)
        self._count("all_reduce", start)
        return t

    def gather_vocab(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Each rank's [R, padded slice] logits -> every rank's [R, vocab_size]."""
        if self.world_size == 1:
            return local[:, :vocab_size]
        start = time.perf_counter()
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        self._count("gather_vocab", start)
        return torch.cat(parts, dim=1)[:, :vocab_size]

    def _count(self, kind: str, start: float) -> None:
        entry = self.comm[kind]
        entry[0] += 1
        entry[1] += time.perf_counter() - start

    # -- the decoder's -----------------------------------------------------------------
    def agree_times(self, draft_forward: Sequence[float], draft_sample: Sequence[float],
                    target_forward: float, verify: float, total: float):
        """The step's measured times as every rank will commit them: each the maximum
        over the ranks (adaptive k then picks the same k everywhere)."""
        n = len(draft_forward)
        values = torch.tensor([*draft_forward, *draft_sample, target_forward, verify, total],
                              dtype=torch.float64)
        if self.world_size > 1:
            start = time.perf_counter()
            dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.group)
            self._count("agree_times", start)
        v = values.tolist()
        return v[:n], v[n:2 * n], v[2 * n], v[2 * n + 1], v[2 * n + 2]

    def agreement(self) -> "AgreementCheck":
        """A new agreement check over these ranks (each SpecDecoder makes its own)."""
        return AgreementCheck(self)


class AgreementCheck:
    """Compares the ranks' committed tokens every ``tp.check_every`` steps of one decoder.

    ``after_step`` records a hash of each step's committed tokens (sequence ids, tokens,
    finish reasons); every ``check_every`` steps, and after the step that leaves nothing
    running, the ranks all-gather their hashes (one collective of check_every int64s)
    and raise RankDivergenceError naming the first step, counted from the decoder's
    first, where they differ. Between checks a divergence can also surface earlier as
    a collective error (ranks whose plans differ send tensors of different sizes).
    """

    def __init__(self, tp: TensorParallel) -> None:
        self.tp = tp
        self.steps = 0
        self._pending: list[tuple[int, int]] = []  # (step, hash) not compared yet

    def after_step(self, committed: Sequence[tuple], *, last: bool = False) -> None:
        self.steps += 1
        if self.tp.check_every == 0 or self.tp.world_size == 1:
            return
        digest = hashlib.blake2b(repr([(s, list(t), r) for s, t, r in committed]).encode(),
                                 digest_size=8).digest()
        self._pending.append((self.steps, int.from_bytes(digest, "little", signed=True)))
        if last or len(self._pending) >= self.tp.check_every:
            self.check()

    def check(self) -> None:
        """Compares the hashes of the steps since the last check across the ranks."""
        pending, self._pending = self._pending, []
        tp = self.tp
        if not pending or tp.world_size == 1:
            return
        mine = torch.tensor([h for _, h in pending], dtype=torch.int64)
        start = time.perf_counter()
        everyone = [torch.empty_like(mine) for _ in range(tp.world_size)]
        dist.all_gather(everyone, mine, group=tp.group)
        tp._count("check", start)
        table = torch.stack(everyone)                                    # [world, steps]
        differs = (table != table[0]).any(dim=0).nonzero().flatten().tolist()
        if differs:
            i = differs[0]
            ranks = [r for r in range(tp.world_size) if table[r, i] != table[0, i]]
            raise RankDivergenceError(
                f"verispec.distributed: the ranks committed different tokens at step "
                f"{pending[i][0]} (rank 0 hash {int(table[0, i]):#x}; ranks {ranks} differ: "
                f"{[hex(int(table[r, i])) for r in ranks]}); their inputs, weights or random "
                f"streams are not the same")


def init(*, backend: str = "gloo", timeout_s: float = 60.0, check_every: int = 8,
         rank: Optional[int] = None, world_size: Optional[int] = None,
         init_method: Optional[str] = None) -> TensorParallel:
    """Initialises the default process group and returns its TensorParallel.

    Without ``rank``/``world_size``/``init_method`` the group comes from torchrun's
    environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). ``timeout_s`` bounds every
    collective: a rank that dies or stalls makes the others raise within it (a peer
    whose connection closes is usually noticed at once).
    """
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
        raise ValueError(f"init: timeout_s must be a number > 0, got {timeout_s!r}")
    if rank is None and "RANK" not in os.environ:
        raise RuntimeError("init: expected torchrun's environment (RANK, WORLD_SIZE, "
                           "MASTER_ADDR, MASTER_PORT) or rank, world_size and init_method; "
                           "got none of them")
    kwargs: dict[str, Any] = {}
    if init_method is not None:
        kwargs["init_method"] = init_method
    if rank is not None:
        kwargs.update(rank=rank, world_size=world_size)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return TensorParallel(check_every=check_every, timeout_s=timeout_s)


def close(tp: Optional[TensorParallel] = None, *, barrier: bool = False) -> None:
    """Destroys the default process group (its sockets closed) if one is initialised.

    ``barrier``: first wait (up to the group's timeout) until every rank has arrived, so
    that no rank tears its connections down while a peer is still finishing with them;
    for the normal end of a run. A failed barrier (a rank gone) does not stop the
    teardown."""
    if dist.is_available() and dist.is_initialized():
        if barrier:
            try:
                dist.barrier()
                # gloo's barrier can return on one rank before a peer has taken its last
                # message; a rank that then closed its connections made that peer's
                # transport thread abort the process at exit ("terminate called without
                # an active exception", seen under load). Each rank says on the store
                # that its collectives are over and waits for all the others to say so.
                store = dist.distributed_c10d._get_default_store()
                store.set(f"verispec/closing/{dist.get_rank()}", "1")
                store.wait([f"verispec/closing/{r}" for r in range(dist.get_world_size())])
            except RuntimeError:
                pass  # a rank is gone: tear down what is left
        dist.destroy_process_group()


def shard(model: Any, tp: TensorParallel) -> Any:
    """This rank's shard of a whole ``LlamaModel`` or ``HFModel``, whose forward runs the
    collectives of ``tp``. Every rank must call it with the same model and the same
    ``tp`` world.

    A LlamaModel's shard is a new LlamaModel (the whole model's tensors are not kept);
    a quantized one's shards keep the GGUF's formats (``shard_weights``): ValueError,
    naming the tensor, its format and block, where a row-parallel cut would split a
    block.
    An HFModel's transformers modules are cut in place, along the config's
    ``base_model_tp_plan`` (``verispec.models.hf.tp``, docs/distributed.md): the shard is
    a new HFModel over them, and the HFModel passed in refuses to run afterwards.
    """
    from verispec.models.hf import HFModel
    from verispec.models.layers import batch_invariant as _bi
    from verispec.models.llama import LlamaModel
    from verispec.models.llama_tp import TPShard, shard_weights

    if getattr(model, "batch_invariant", False):
        raise ValueError(f"shard: model is batch-invariant ({type(model).__name__} with "
                         f"batch_invariant=True), which tensor parallelism cannot keep: "
                         + _bi.TP_REASON)
    if isinstance(model, HFModel):
        if model.tp is not None:
            raise ValueError(f"shard: model is already a shard (rank {model.tp.rank} of "
                             f"{model.tp.world_size})")
        out = HFModel(model.model, max_context=model.geometry.max_context,
                      cpu_kernels=model._kernels is not None, tp=tp)
        out.tokenizer_fingerprint = model.tokenizer_fingerprint
        out.native_linear, out.native_norm = model.native_linear, model.native_norm
        out.native_rope = model.native_rope
        model.model = None  # its modules are this rank's now: the whole-model wrapper is void
        return out
    if not isinstance(model, LlamaModel):
        raise TypeError(f"shard: model must be a verispec LlamaModel or HFModel, got "
                        f"{type(model).__name__}")
    if model.tp is not None:
        raise ValueError(f"shard: model is already a shard ({model.shard})")
    # A quantized model (a GGUF on the CPU) keeps its formats: its shards are cut at whole
    # blocks (TPShard.for_weights refuses, naming the tensor, where they cannot be).
    s = TPShard.for_weights(model.config, model.weights, tp.rank, tp.world_size)
    out = LlamaModel(model.config, shard_weights(model.config, model.weights, s),
                     max_context=model.geometry.max_context, shard=s, tp=tp)
    for name in ("tokenizer_fingerprint",):
        if hasattr(model, name):
            setattr(out, name, getattr(model, name))
    out.native_linear = model.native_linear and out._native_linear_ok
    out.native_norm = model.native_norm and out._native_norm_ok
    return out
