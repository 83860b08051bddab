"""``verispec generate``: stream a model's text with speculative decoding, then time it
against plain decoding of the same prompt and settings, in the same run (alternating
rounds after a warm-up; the verdict of verispec.cli.speed), with an optional profile
table or torch trace. Under ``--tp N``
(torchrun) every rank runs the same steps on its shard; rank 0 prints."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, TextIO

from verispec.cache import blocks_for
from verispec.cli.common import (BLOCK_SIZE, PROG, UsageError, _check_device,
                                 _check_draft_options, _describe_policy, _greedy, _load,
                                 _make_draft, _model_kind, _sampling, _warm_up, _weights_desc)
from verispec.cli.speed import judge, low_acceptance_note, median

DEFAULT_ROUNDS = 3  # --repeats when speculative and plain decoding are compared

# --- the command, and its tensor-parallel path -------------------------------------------


def cmd_generate(args: argparse.Namespace) -> int:
    if args.tp == 1:
        return _generate(args, None)
    world = os.environ.get("WORLD_SIZE")
    if world != str(args.tp):
        raise UsageError(f"argument --tp: expected the number of processes torchrun started "
                         f"(WORLD_SIZE), got --tp {args.tp} with WORLD_SIZE={world}; launch "
                         f"with: torchrun --nproc-per-node {args.tp} -m verispec generate --tp "
                         f"{args.tp} ...")
    if args.device != "cpu":
        raise UsageError(f"argument --device: --tp runs on the CPU (gloo), got {args.device!r}")
    from verispec import distributed

    tp = distributed.init(timeout_s=args.tp_timeout, check_every=args.tp_check_every)
    finished = False
    try:
        if tp.rank == 0:
            code = _generate(args, tp)
        else:
            # the other ranks run the same loop in lock-step and print nothing
            with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet), \
                    contextlib.redirect_stderr(quiet):
                code = _generate(args, tp)
        finished = True
        return code
    except (RuntimeError, distributed.RankDivergenceError) as e:
        # a collective that failed or timed out (a rank died or stalled), or diverging ranks
        sys.stdout.flush()
        print(f"{PROG} generate: error: rank {tp.rank} of {tp.world_size}: {e}", file=sys.stderr)
        return 1
    finally:
        # after a normal end every rank meets before the sockets close (a rank that tore
        # its group down while its peer was still in it once aborted at exit under load)
        distributed.close(tp, barrier=finished)


def _tp_shard(model, tp, arg: str):
    """This rank's shard of the target (a native Llama, or a transformers model along its
    config's tensor-parallel plan) or of a native Llama draft (other drafts stay whole)."""
    from verispec import distributed
    from verispec.models import HFModel
    from verispec.models.llama import LlamaModel

    if not isinstance(model, LlamaModel) and not (arg == "--model" and isinstance(model, HFModel)):
        return model  # a replicated draft: every rank computes the same proposals
    try:
        return distributed.shard(model, tp)
    except ValueError as e:
        raise UsageError(f"argument --tp: {e}") from None


# --- one run of the command, step by step ------------------------------------------------


@dataclass
class _Setup:
    """What the timed runs share: the loaded models, the prompt and the policy."""

    model: Any
    tok: Any
    draft: Any
    draft_desc: str
    draft_arg: Optional[str]   # the argument that named a draft model, or None
    k: Any                     # draft tokens per step (0 without a draft) or "auto"
    prompt: list
    policy: dict
    eos: Optional[list]
    load_s: float
    tp: Any                    # the tensor-parallel group, or None


def _generate(args: argparse.Namespace, tp) -> int:
    setup = _set_up(args, tp)
    err = sys.stderr
    print(_header(args, setup), file=err, flush=True)
    _warm_up(setup.model, setup.draft, setup.prompt, setup.draft_arg)
    spec_runs, plain_runs = _timed_runs(args, setup)
    print("\n".join(_summary(args, setup, spec_runs, plain_runs)), file=err)
    if args.profile:
        print("\n".join(_profile_table(spec_runs[-1]["timings"], spec_runs[-1]["seconds"])), file=err)
    if args.trace:
        print(f"wrote {args.trace} (open in chrome://tracing or ui.perfetto.dev)", file=err)
    err.flush()
    return 0


def _set_up(args: argparse.Namespace, tp) -> _Setup:
    """Checks the arguments, loads the target (this rank's shard under --tp), encodes the
    prompt and makes the draft."""
    import torch

    policy = _sampling(args)
    _check_draft_options(args)
    _check_device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    # (under --tp too: a GGUF's shards keep its quantized formats, cut at whole blocks)
    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    if args.trace:
        _check_writable(args.trace, "--trace")

    t0 = time.perf_counter()
    model, tok = _load(args.model, "--model", device=args.device, dtype=dtype,
                       batch_invariant=args.batch_invariant, cuda_graphs=args.cuda_graphs)
    if tp is not None:
        model = _tp_shard(model, tp, "--model")
    load_s = time.perf_counter() - t0
    prompt = _prompt_ids(args, tok)
    _check_prompt_fits(args, prompt, model.geometry.max_context)
    draft, draft_desc, draft_arg = _make_draft(args, model, tok, args.device, dtype, prompt)
    if tp is not None and draft is not None and draft_arg is not None:
        draft = _tp_shard(draft, tp, draft_arg)
    k = 0 if draft is None else args.k
    _check_trees_and_verify(args, draft, draft_desc, policy)
    eos = None if args.ignore_eos else list(tok.eos_token_ids)
    return _Setup(model, tok, draft, draft_desc, draft_arg, k, prompt, policy, eos, load_s, tp)


def _check_prompt_fits(args: argparse.Namespace, prompt: list, max_context: int) -> None:
    """The decoder takes a prompt shorter than the model's context (it needs room for one
    new token); a longer one is the user's to shorten."""
    if len(prompt) >= max_context:
        arg = "--chat" if args.chat is not None else "--prompt"
        raise UsageError(f"argument {arg}: expected a prompt of fewer than {max_context} tokens "
                         f"(the model's context length), got {len(prompt)} tokens")


def _check_trees_and_verify(args: argparse.Namespace, draft, draft_desc: str,
                            policy: dict) -> None:
    """--branches, --distinct-siblings and --verify against the draft they need."""
    from verispec.drafters import NGram

    if args.branches > 1 and draft is None:
        raise UsageError(f"argument --branches: trees need a draft (--draft ngram, early-exit "
                         f"or a model), got {args.branches} with the draft {draft_desc}")
    if args.distinct_siblings and (args.branches == 1 or draft is None
                                   or isinstance(draft, NGram)):
        raise UsageError(f"argument --distinct-siblings: expected draft-model trees (--branches "
                         f"> 1 and a draft model), got --branches {args.branches} with the draft "
                         f"{draft_desc}")
    if args.verify == "block" and args.branches > 1:
        raise UsageError(f"argument --verify: block verification verifies chains, got --branches "
                         f"{args.branches} (trees are verified by verify_tree)")
    if args.verify == "block":
        if draft is None or isinstance(draft, NGram):
            raise UsageError(f"argument --verify: block verification needs sampled proposals "
                             f"from a draft model (--draft early-exit or a model), got the "
                             f"draft {draft_desc}")
        if _greedy(policy):
            raise UsageError("argument --verify: block verification needs sampling, got greedy "
                             "decoding (greedy drafts are verified token by token)")


def _header(args: argparse.Namespace, s: _Setup) -> str:
    """The bracketed line on stderr before the text: the model, the draft and the policy."""
    model, k = s.model, s.k
    shard = (f", tensor parallel over {s.tp.world_size} ranks ({model.geometry.num_kv_heads} KV "
             f"heads here)" if s.tp is not None else "")
    return (f"[{args.model}: {_model_kind(model)}{shard}, {model.geometry.num_layers} layers, "
            f"{_weights_desc(model)} on {args.device}"
            f"{', batch-invariant' if args.batch_invariant else ''}, "
            f"loaded in {s.load_s:.1f} s; prompt {len(s.prompt)} tokens; draft {s.draft_desc}, "
            f"k {k if k != 'auto' else f'auto (<= {args.max_k})'}; {_describe_policy(s.policy)}"
            f"{'; block verification' if args.verify == 'block' else ''}"
            f"{_tree_desc(args, s.draft)}]")


def _tree_desc(args, draft) -> str:
    from verispec.drafters import NGram

    if args.branches == 1 or draft is None or isinstance(draft, NGram):
        return ""  # an n-gram trie is named with the draft
    siblings = "distinct" if args.distinct_siblings else "i.i.d."
    return f"; draft trees of {args.branches} branches ({siblings} siblings)"


def _read_text(value: str) -> str:
    return sys.stdin.read() if value == "-" else value


def _prompt_ids(args: argparse.Namespace, tok) -> list[int]:
    if args.chat is not None:
        messages = [{"role": "user", "content": _read_text(args.chat)}]
        try:
            ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        except ValueError as e:
            raise UsageError(f"argument --chat: {e}; use --prompt for raw text") from None
    else:
        ids = tok.encode(_read_text(args.prompt))
    ids = list(ids)
    if not ids:
        raise UsageError("argument --prompt: expected text that encodes to at least one token, got ''")
    return ids


# --- the timed runs ------------------------------------------------------------------------


def _timed_runs(args: argparse.Namespace, s: _Setup) -> tuple[list, list]:
    """(speculative runs, plain runs): --repeats rounds of each (DEFAULT_ROUNDS when they
    are compared, else one), alternating so drifting machine load hits both alike; the first speculative run streams its text (and is the traced
    one under --trace). No plain runs under --no-compare or without a draft."""
    compare = not args.no_compare and s.draft is not None
    repeats = args.repeats if args.repeats is not None else (DEFAULT_ROUNDS if compare else 1)
    spec_runs, plain_runs = [], []
    for i in range(repeats):
        spec_runs.append(_spec_run(args, s) if i > 0 else _streamed_run(args, s))
        if compare:
            plain_runs.append(_decode_run(s.model, None, 0, 1, s.prompt, s.policy, args,
                                          eos=s.eos))
    return spec_runs, plain_runs


def _spec_run(args: argparse.Namespace, s: _Setup,
              on_tokens: Optional[Callable[[list[int]], None]] = None) -> dict:
    return _decode_run(s.model, s.draft, s.k, args.max_k, s.prompt, s.policy, args, eos=s.eos,
                       on_tokens=on_tokens)


def _streamed_run(args: argparse.Namespace, s: _Setup) -> dict:
    """A speculative run that prints its text as it comes (under the profiler with --trace)."""
    stream = _Stream(s.tok, sys.stdout)

    def streamed() -> dict:
        return _spec_run(args, s, stream.push)

    result = _traced(streamed, args.trace, args.device) if args.trace else streamed()
    stream.push([], final=True)
    sys.stdout.write("\n")
    sys.stdout.flush()
    return result


class _Stream:
    """Prints decoded text as tokens arrive; holds back an incomplete UTF-8 character."""

    def __init__(self, tok, out: TextIO) -> None:
        self.tok, self.out = tok, out
        self.tokens: list[int] = []
        self.printed = ""

    def push(self, tokens: Sequence[int], *, final: bool = False) -> None:
        self.tokens.extend(tokens)
        text = self.tok.decode(self.tokens, skip_special_tokens=True)
        if not final:
            text = text.rstrip("\ufffd")  # the rest of the character comes with a later token
        # Byte-level decoding of a longer token list extends the shorter one's text, so
        # what is new is the tail (printed text cannot be taken back anyway).
        new = text[len(self.printed):]
        if new:
            self.out.write(new)
            self.out.flush()
            self.printed = text


def _decode_run(model, draft, k, max_k: int, prompt: list[int], policy: dict, args, *,
                eos, on_tokens: Optional[Callable[[list[int]], None]] = None) -> dict:
    """One sequence through SpecDecoder.add/step; timing covers only step() calls."""
    import torch

    from verispec.decoder import SpecDecoder

    lookahead = k if isinstance(k, int) else max_k  # draft tokens a step may append
    need = len(prompt) + args.max_new_tokens + lookahead + 2
    num_blocks = blocks_for(need, BLOCK_SIZE)
    # block verification is not the keyed rule: the request draws from the decoder's
    # stream, seeded by --seed (reproducible for the same command)
    from verispec.drafters import NGram

    block = getattr(args, "verify", "token") == "block" and draft is not None
    model_draft = draft is not None and not isinstance(draft, NGram)
    branches = getattr(args, "branches", 1) if model_draft else 1
    dec = SpecDecoder(model, draft, k=k, max_k=max_k, num_blocks=num_blocks,
                      block_size=BLOCK_SIZE, seed=args.seed,
                      verify_method="block" if block else "token", draft_branches=branches,
                      draft_replacement=not getattr(args, "distinct_siblings", False))
    seq = dec.add(prompt, max_new_tokens=args.max_new_tokens, eos_token_id=eos,
                  seed=None if block else args.seed, **policy)
    elapsed = 0.0
    while dec.has_running():
        t0 = time.perf_counter()
        with torch.profiler.record_function("verispec.step"):
            outs = dec.step()
        elapsed += time.perf_counter() - t0
        if on_tokens is not None:
            for o in outs:
                if o.seq == seq and o.tokens:
                    on_tokens(o.tokens)
    result = dec.result(seq)
    dec.release(seq)
    return dict(tokens=result.tokens, finish_reason=result.finish_reason, stats=result.stats,
                seconds=elapsed, timings=dec.timings())


# --- the report ------------------------------------------------------------------------------


def _summary(args: argparse.Namespace, s: _Setup, spec_runs: list, plain_runs: list) -> list[str]:
    """The lines after the text: the speculative rate, acceptance, and against plain
    decoding the speed verdict of verispec.cli.speed (and for greedy decoding whether the
    outputs are identical); then a note when the draft accepted almost nothing."""
    # A traced run is slowed by the profiler: its round is left out when there are others.
    skip = 1 if args.trace and len(spec_runs) > 1 else 0
    timed, plain_timed = spec_runs[skip:], plain_runs[skip:]
    spec = dict(spec_runs[-1], seconds=_median([r["seconds"] for r in timed]))

    stats = spec["stats"]
    acc = stats.get("acceptance_rate")
    k_hist = stats.get("k_history") or []
    label = "speculative:" if s.draft is not None else "decoding:   "
    runs = f", median of {len(timed)}" if len(timed) > 1 else ""
    lines = [f"{label} {len(spec['tokens'])} tokens in {spec['seconds']:.2f} s{runs} = "
             f"{_rate(spec):.1f} tokens/s (finish: {spec['finish_reason']})"
             + (" [under the profiler]" if args.trace and not skip else ""),
             f"  acceptance rate {'-' if acc is None else f'{acc:.2f}'}, "
             f"{stats.get('tokens_per_target_pass', 0.0):.2f} tokens per target pass"
             + (f", mean k {sum(k_hist) / len(k_hist):.1f}" if k_hist else "")]
    if plain_timed:
        lines += _comparison(spec, timed, plain_timed, s.policy)
    if s.draft is not None:
        note = low_acceptance_note(stats, _draft_kind(s.draft), s.model.geometry.num_layers, s.k)
        if note:
            lines.append(note)
    return lines


def _draft_kind(draft) -> str:
    from verispec.drafters import EarlyExit, NGram

    return ("ngram" if isinstance(draft, NGram) else
            "early-exit" if isinstance(draft, EarlyExit) else "model")


def _comparison(spec: dict, spec_runs: list, plain_runs: list, policy: dict) -> list[str]:
    """The plain runs' line and the verdict over the paired rounds; greedy outputs identical."""
    plain = dict(plain_runs[-1], seconds=_median([r["seconds"] for r in plain_runs]))
    runs = f", median of {len(plain_runs)}" if len(plain_runs) > 1 else ""
    line = (f"plain:       {len(plain['tokens'])} tokens in {plain['seconds']:.2f} s{runs} = "
            f"{_rate(plain):.1f} tokens/s (same prompt and settings, this run)")
    verdict = judge([_rate(r) for r in spec_runs], [_rate(r) for r in plain_runs],
                    tokens_per_pass=float(spec["stats"].get("tokens_per_target_pass") or 0.0),
                    plain_tokens_per_pass=float(
                        plain["stats"].get("tokens_per_target_pass") or 1.0),
                    proposed=int(spec["stats"].get("proposed") or 0)).line()
    if _greedy(policy):
        if spec["tokens"] == plain["tokens"]:
            verdict += "; greedy outputs identical: yes"
        else:
            first = next((i for i, (a, b) in enumerate(zip(spec["tokens"], plain["tokens"]))
                          if a != b), min(len(spec["tokens"]), len(plain["tokens"])))
            verdict += f"; greedy outputs identical: NO (first difference at token {first})"
    return [line, verdict]


def _rate(run: dict) -> float:
    return len(run["tokens"]) / run["seconds"] if run["seconds"] > 0 else float("inf")


_median = median


def _check_writable(path: str, arg: str) -> None:
    parent = Path(path).resolve().parent
    if not parent.is_dir():
        raise UsageError(f"argument {arg}: expected a path in an existing folder, got {path!r} "
                         f"({parent} does not exist)")


def _traced(fn: Callable[[], dict], path: str, device: str) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        result = fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    return result


PHASES = (("draft forward", "draft_forward_s"), ("draft sample", "draft_sample_s"),
          ("target forward", "target_forward_s"), ("verify", "verify_s"),
          ("bookkeeping", "bookkeeping_s"))


def _profile_table(timings: dict, wall_s: float) -> list[str]:
    """Time per phase (SpecDecoder.timings()) with its share of the phases' total."""
    total = sum(float(timings.get(key, 0.0)) for _, key in PHASES)
    rows = [f"{'phase':<16}{'seconds':>10}{'share':>9}"]
    for name, key in PHASES:
        s = float(timings.get(key, 0.0))
        rows.append(f"{name:<16}{s:>10.4f}{(100 * s / total if total else 0.0):>8.1f}%")
    rows.append(f"{'total':<16}{total:>10.4f}{100.0 if total else 0.0:>8.1f}%"
                f"  ({timings.get('steps', '?')} steps; wall time of step() {wall_s:.4f} s)")
    return rows
