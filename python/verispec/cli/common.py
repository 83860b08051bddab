"""What the commands share: the constants, the usage error, device checks, loading a
model, the sampling policy and its description, the draft, and the warm-up."""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any, Optional

from verispec._policy import DEFAULTS, fold_greedy
from verispec.cache import blocks_for

PROG = "verispec"
DEFAULT_MODEL = "smollm2"
DTYPES = ("auto", "float32", "bfloat16", "float16")
BLOCK_SIZE = 16
DEFAULT_MAX_K = 8
NGRAM_DEFAULTS = (1, 4)   # --ngram-min, --ngram-max


class UsageError(Exception):
    """A mistake the user can fix; printed as one line, exit status 2."""


# --- the device and the model ------------------------------------------------------------


def _check_device(device: str, arg: str = "--device") -> None:
    if device == "cpu":
        return
    import torch

    if not torch.cuda.is_available():
        raise UsageError(f"argument {arg}: expected cpu or a visible CUDA device, got {device!r}, "
                         f"but torch.cuda.is_available() is False (torch {torch.__version__}, "
                         f"CUDA {torch.version.cuda})")
    index = int(device[5:]) if ":" in device else 0
    if index >= torch.cuda.device_count():
        raise UsageError(f"argument {arg}: expected a CUDA device index < "
                         f"{torch.cuda.device_count()}, got {device!r}")


def _load(name: str, arg: str, *, device: str = "cpu", dtype: Any = None,
          batch_invariant: bool = False, cuda_graphs: bool = True):
    """models.load(name) with the loaders' actionable errors turned into UsageError
    (dtype None: the loaders' default); ``cuda_graphs`` False turns a CUDA model's
    graphs off (--no-cuda-graphs)."""
    try:
        from verispec import models
    except ModuleNotFoundError as e:
        raise UsageError(_missing_package(e, "loading models")) from None
    try:
        model, tok = models.load(name, device=device, dtype=dtype, batch_invariant=batch_invariant)
    except ModuleNotFoundError as e:
        raise UsageError(f"argument {arg}: {_missing_package(e, f'loading {name!r}')}") from None
    except (FileNotFoundError, ValueError, KeyError) as e:
        message = e.args[0] if isinstance(e, KeyError) and e.args else e
        raise UsageError(f"argument {arg}: {message}") from None
    if not cuda_graphs and getattr(model, "cuda_graphs", False):
        model.cuda_graphs = False
    return model, tok


def _missing_package(e: ModuleNotFoundError, what: str) -> str:
    if e.name is None or e.name.startswith("verispec"):
        return str(e)  # the loaders' own message, with the install command
    package = e.name.split(".")[0]
    return f"{what} needs the Python package {package!r}: pip install {package}"


# --- the sampling policy -------------------------------------------------------------------


def _sampling(args: argparse.Namespace) -> dict:
    """SpecDecoder.add's policy arguments (greedy is temperature 0, as everywhere in
    verispec); --greedy excludes the sampling options."""
    names = ("temperature", "top_k", "top_p", "min_p")
    given = [f"--{n.replace('_', '-')}" for n in names if getattr(args, n) is not None]
    if args.greedy and given:
        raise UsageError(f"argument --greedy: not allowed with {', '.join(given)} "
                         f"(greedy decoding ignores the sampling policy)")
    policy = {n: DEFAULTS[n] if getattr(args, n) is None else getattr(args, n) for n in names}
    policy["temperature"] = fold_greedy("generate", args.greedy, policy["temperature"])
    return policy


def _greedy(policy: dict) -> bool:
    return policy["temperature"] == 0


def _describe_policy(policy: dict) -> str:
    if _greedy(policy):
        return "greedy"
    parts = [f"temperature {policy['temperature']:g}"]
    if policy["top_k"]:
        parts.append(f"top-k {policy['top_k']}")
    if policy["top_p"] < 1:
        parts.append(f"top-p {policy['top_p']:g}")
    if policy["min_p"] > 0:
        parts.append(f"min-p {policy['min_p']:g}")
    return ", ".join(parts)


# --- the model and the draft as the header names them, and the draft itself ----------------


def _default_draft(args: argparse.Namespace) -> str:
    """The drafter a user gets without --draft: n-gram lookup, which costs next to nothing
    when it finds no match (k auto then proposes nothing) and pays on text that repeats.
    The EAGLE-3 head shipped for the bundled model is asked for (--draft eagle3): on
    this build's measurements (bench/bench_eagle3.py) it does not beat n-gram lookup on
    every prompt class, so it is not the default."""
    return "ngram"


def _draft_choice(args: argparse.Namespace) -> tuple[str, str]:
    """(what --draft / --draft-model ask for, the argument that asked): --draft-model X is
    --draft X, and the two must not disagree."""
    if args.draft_model is None:
        return (args.draft or _default_draft(args)), "--draft"
    if args.draft is not None and args.draft != args.draft_model:
        raise UsageError(f"argument --draft-model: not allowed with --draft {args.draft} "
                         f"(expected one draft: --draft-model {args.draft_model} is the same as "
                         f"--draft {args.draft_model})")
    return args.draft_model, "--draft-model"


def _check_draft_options(args: argparse.Namespace) -> None:
    """A drafter's own option given with another drafter is an error, not ignored; then
    the options' defaults are filled in (they parse as None so that this can tell). Runs
    once per parse (it is called before loading, and again by _make_draft)."""
    if getattr(args, "draft_options_checked", False):
        return
    choice, arg = _draft_choice(args)
    keyword = (choice if arg == "--draft" and choice in ("ngram", "eagle3", "early-exit", "none")
               else "model")
    named = {"ngram": "--draft ngram", "eagle3": "--draft eagle3",
             "early-exit": "--draft early-exit", "none": "--draft none",
             "model": f"the draft model {choice}"}[keyword]

    def refuse(option: str, value, applies_to: str) -> None:
        raise UsageError(f"argument {option}: applies to {applies_to}, got {option} {value} "
                         f"with {named}")

    for option, name in (("--ngram-min", "ngram_min"), ("--ngram-max", "ngram_max")):
        if getattr(args, name) is not None and keyword != "ngram":
            refuse(option, getattr(args, name), "--draft ngram")
    if args.early_exit_layers is not None and keyword != "early-exit":
        refuse("--early-exit-layers", args.early_exit_layers, "--draft early-exit")
    if getattr(args, "ngram_memory", None) and keyword != "ngram":
        refuse("--ngram-memory", args.ngram_memory, "--draft ngram")
    if getattr(args, "ngram_memory_shared", False) and not getattr(args, "ngram_memory", None):
        raise UsageError("argument --ngram-memory-shared: applies to --ngram-memory TOKENS, "
                         "got it without")
    if getattr(args, "draft_head", None) is not None and keyword != "eagle3":
        refuse("--draft-head", args.draft_head, "--draft eagle3")
    if keyword == "none" and args.k not in (None, 0):
        raise UsageError(f"argument --k: expected 0 or nothing with --draft none (plain decoding "
                         f"drafts nothing), got --k {args.k}")
    if args.max_k is not None and (keyword == "none" or (args.k is not None and args.k != "auto")):
        given = "--draft none" if keyword == "none" else f"--k {args.k}"
        raise UsageError(f"argument --max-k: applies to --k auto (the bound of adaptive k), "
                         f"got --max-k {args.max_k} with {given}")
    if args.ngram_min is None:
        args.ngram_min = min(NGRAM_DEFAULTS[0], args.ngram_max or NGRAM_DEFAULTS[0])
    if args.ngram_max is None:
        args.ngram_max = max(NGRAM_DEFAULTS[1], args.ngram_min)
    if args.ngram_min > args.ngram_max:
        raise UsageError(f"argument --ngram-min: expected <= --ngram-max ({args.ngram_max}), "
                         f"got {args.ngram_min}")
    if args.k is None:
        args.k = "auto"
    if args.max_k is None:
        args.max_k = DEFAULT_MAX_K
    args.draft_options_checked = True


def _model_kind(model) -> str:
    from verispec.models import HFModel

    if isinstance(model, HFModel):
        return f"transformers {model.model_type}"
    return "native"


# Converted tensors the header names before it only counts the rest.
_CONVERTED_NAMED = 3


def _weights_desc(model) -> str:
    """The model's weights as the header says them: its dtype, or the quantized formats
    it keeps, every type of the file and what was converted to float32 (activations in
    its dtype)."""
    from verispec.models import QuantizedMatrix

    dtype = str(model.geometry.dtype).removeprefix("torch.")
    if not getattr(model, "quantized", False):
        return dtype
    w = model.weights
    matrices = [w.embed, w.lm_head] + [m for lw in w.layers
                                       for m in (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down)]
    formats = sorted({f for m in matrices if isinstance(m, QuantizedMatrix) for f in m.formats})
    file_types = getattr(w, "file_types", {})
    converted = getattr(w, "converted", ())
    types = (f" (file: {', '.join(f'{n} {t}' for t, n in file_types.items())})"
             if file_types else "")
    if converted:
        named = ", ".join(converted[:_CONVERTED_NAMED])
        more = (f" and {len(converted) - _CONVERTED_NAMED} more"
                if len(converted) > _CONVERTED_NAMED else "")
        conv = f", converted to float32: {named}{more}"
    else:
        conv = ", nothing converted"
    return f"{'/'.join(formats)} weights{types}{conv}, {dtype} activations"


def _fingerprint(model, tok) -> str:
    from verispec.models.tokenizer import vocabulary_fingerprint

    return getattr(model, "tokenizer_fingerprint", None) or vocabulary_fingerprint(tok)


def _make_draft(args: argparse.Namespace, model, tok, device: str, dtype,
                prompt: Optional[list] = None):
    """(draft for SpecDecoder, description, the argument naming a draft model or None).
    Early exit without --early-exit-layers gets its depth from acceptance measured on
    ``prompt`` (verispec.cli.calibrate), with a warning when no depth pays."""
    from verispec.drafters import EarlyExit, NGram, NGramMemory

    _check_draft_options(args)
    choice, arg = _draft_choice(args)
    keyword = choice if arg == "--draft" else None  # --draft-model is always a model
    if keyword == "none":
        return None, "none (plain decoding)", None
    if keyword == "ngram":
        branches = getattr(args, "branches", 1)
        tokens = getattr(args, "ngram_memory", None)
        shared = getattr(args, "ngram_memory_shared", False)
        memory = NGramMemory(tokens, shared=shared) if tokens else None
        return (NGram(args.ngram_min, args.ngram_max, branches=branches, memory=memory),
                f"n-gram lookup {args.ngram_min}..{args.ngram_max}"
                + (f", tries of {branches} branches" if branches > 1 else "")
                + (f", memory of {tokens} tokens per tenant" if memory and not shared else "")
                + (f", memory of {tokens} tokens shared by all tenants" if shared else ""),
                None)
    if keyword == "eagle3":
        from verispec.drafters import Eagle3

        head = getattr(args, "draft_head", None)
        head_arg = "--draft-head" if head is not None else "--draft"
        if head is not None and not os.path.isdir(head):
            raise UsageError(f"argument --draft-head: expected the folder of an EAGLE-3 head "
                             f"(config.json + model.safetensors), got {head!r}: not a folder")
        try:
            drafter = Eagle3(model, head)
        except (ValueError, OSError) as e:
            raise UsageError(f"argument {head_arg}: {e}") from None
        d = drafter.describe()
        return (drafter, f"EAGLE-3 head {d['path']} (taps {d['taps']}, draft vocabulary "
                         f"{d['draft_vocab_size']} of {d['vocab_size']})", None)
    layers = model.geometry.num_layers
    if keyword == "early-exit":
        if layers < 2:
            raise UsageError(f"argument --draft: early-exit needs a target with >= 2 layers, "
                             f"the target has {layers}")
        how = ""
        n = args.early_exit_layers
        if n is None and prompt is not None and layers > 2:
            from verispec.cli.calibrate import calibrate_early_exit

            cal = calibrate_early_exit(model, prompt, args.max_k)
            n, how = cal.depth, f" ({cal.describe()})"
            if not cal.pays:
                print(f"{PROG}: warning: {cal.advice()}", file=sys.stderr, flush=True)
        elif n is None:
            n = max(1, math.ceil(layers / 2))
        if not 1 <= n < layers:
            raise UsageError(f"argument --early-exit-layers: expected an int in [1, {layers - 1}] "
                             f"(the target has {layers} layers), got {n}")
        return EarlyExit(model, num_layers=n), f"early exit after {n} of {layers} layers{how}", None
    draft, draft_tok = _load(choice, arg, device=device, dtype=dtype,
                             cuda_graphs=getattr(args, "cuda_graphs", True))
    # Token ids mean the same in both models only with the same tokenizer; the vocabulary
    # sizes (embedding rows) may differ, the decoder pads the shorter one.
    target_fp, draft_fp = _fingerprint(model, tok), _fingerprint(draft, draft_tok)
    if target_fp != draft_fp:
        raise UsageError(
            f"argument {arg}: expected a draft with the target's tokenizer, got another one: "
            f"the target {args.model} has a tokenizer of {tok.vocab_size} tokens (vocabulary "
            f"fingerprint {target_fp}), the draft {choice} one of {draft_tok.vocab_size} tokens "
            f"(fingerprint {draft_fp}); a draft's token ids must mean the target's tokens")
    tv, dv = model.geometry.vocab_size, draft.geometry.vocab_size
    vocab = "" if tv == dv else f", vocabulary {dv} rows vs the target's {tv}, same tokenizer"
    return (draft, f"model {choice} ({_model_kind(draft)}, {draft.geometry.num_layers} "
                   f"layers{vocab})", arg)


def _warm_up(model, draft, prompt: list[int], draft_arg: Optional[str] = None) -> None:
    """Short runs, plain and with the draft, so one-time costs (first calls of the ops and
    of each model's shapes, thread pools) land in neither timed run. A draft model the
    decoder refuses (``draft_arg`` names it) is a usage error."""
    from verispec.decoder import SpecDecoder

    head = prompt[:64]
    for d, k in ((None, 0),) + (((draft, 2),) if draft is not None else ()):
        try:
            dec = SpecDecoder(model, d, k=k, block_size=BLOCK_SIZE,
                              num_blocks=blocks_for(len(head) + 8, BLOCK_SIZE, spare=1))
        except ValueError as e:
            if d is None or draft_arg is None:
                raise
            raise UsageError(f"argument {draft_arg}: {e}") from None
        dec.generate([head], max_new_tokens=3, temperature=0.0)  # greedy

