"""``verispec train-head``: train an EAGLE-3 head for a target (verispec.training) and
write it in the speculators layout, loadable with ``--draft eagle3 --draft-head DIR``
here and by vLLM, SGLang, speculators and llama.cpp's converter."""

from __future__ import annotations

import argparse
import os
import sys
import time

from verispec.cli.common import DEFAULT_MODEL, UsageError, _check_device, _load


# Argument types: each names what it expected and what it got. (parser.py has the same
# three; importing them from there would make an import circle, parser -> train_head.)


def _int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an int >= {minimum}, got {value}")
        return value
    return parse


def _float_in(low: float, high: float, *, low_open: bool = False, high_open: bool = False):
    expected = (f"a number in {'(' if low_open else '['}{low:g}, {high:g}"
                f"{')' if high_open else ']'}")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        ok = ((value > low if low_open else value >= low)
              and (value < high if high_open else value <= high))
        if not ok:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text}")
        return value
    return parse


def _device_value(text: str) -> str:
    if text == "cpu" or text == "cuda" or (text.startswith("cuda:") and text[5:].isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")


def add_parser(commands) -> None:
    """Registers ``train-head`` on the CLI's subparsers."""
    from verispec.training.options import TrainConfig, TrainHeadOptions

    d, t = TrainHeadOptions(), TrainConfig()
    p = commands.add_parser(
        "train-head", help="train an EAGLE-3 head for a target on its own answers",
        description="Train an EAGLE-3 draft head for --model: prompts (--prompts, or written "
                    "by the target itself), the target's answers, a draft vocabulary of its "
                    "most frequent answer tokens, the frozen target's hidden states and "
                    "distributions (computed once, kept on disk), then a training-time-test "
                    "loop with soft targets. Resumable (--resume) and deterministic for a "
                    "seed. Writes config.json + model.safetensors (speculators layout) to "
                    "--out, and train_report.json.")
    p.add_argument("--model", default=DEFAULT_MODEL, metavar="NAME_PATH_OR_ID",
                   help=f"the target, as 'verispec generate --model' takes it (default: %(default)s)")
    p.add_argument("--out", required=True, metavar="DIR", help="folder for the head and its state")
    p.add_argument("--prompts", metavar="FILE",
                   help="one user message per line, or JSONL with \"prompt\" or \"messages\" "
                        "(default: prompts the target writes itself from its chat template)")
    p.add_argument("--num-prompts", type=_int_at_least(0), default=d.num_prompts,
                   help="prompts to write, or the first N of --prompts (0: all of the file) "
                        "(default: %(default)s)")
    p.add_argument("--max-answer-tokens", type=_int_at_least(1), default=d.max_answer_tokens,
                   help="(default: %(default)s)")
    p.add_argument("--answer-temperature", type=_float_in(0, 100), default=d.answer_temperature,
                   help="the target's answers: 0 greedy (what greedy decoding meets) "
                        "(default: %(default)s)")
    p.add_argument("--draft-vocab", type=_int_at_least(1), default=d.draft_vocab,
                   help="draft vocabulary size, at most the target's (default: %(default)s)")
    p.add_argument("--keep-draft-vocab", type=_int_at_least(0), default=d.keep_draft_vocab,
                   help="write the head drafting over only this many draft ids, the most "
                        "frequent in the answers first (0: all; a smaller file and pass) "
                        "(default: %(default)s)")
    p.add_argument("--save-dtype", choices=("float32", "bfloat16", "float16"),
                   default=d.save_dtype, help="the written tensors' dtype (default: %(default)s)")
    p.add_argument("--ttt-steps", type=_int_at_least(1), default=t.ttt_steps,
                   help="training-time-test steps (default: %(default)s)")
    steps = p.add_mutually_exclusive_group()
    # default None, resolved below: argparse misses the conflict with --steps when the
    # value given is the default object itself (--epochs 2 --steps 3)
    steps.add_argument("--epochs", type=_int_at_least(1),
                       help=f"passes over the data (default: {t.epochs})")
    steps.add_argument("--steps", type=_int_at_least(1), help="optimizer steps instead of --epochs")
    p.add_argument("--lr", type=_float_in(0, 1, low_open=True), default=t.lr,
                   help="peak learning rate (default: %(default)s)")
    p.add_argument("--batch-tokens", type=_int_at_least(1), default=t.batch_tokens,
                   help="tokens per optimizer step (default: %(default)s)")
    p.add_argument("--held-out", type=_float_in(0, 1, high_open=True), default=d.held_out,
                   help="fraction of the data kept to measure acceptance (default: %(default)s)")
    p.add_argument("--seed", type=_int_at_least(0), default=t.seed, help="(default: %(default)s)")
    p.add_argument("--threads", type=_int_at_least(1), help="torch CPU threads (default: torch's)")
    p.add_argument("--resume", action="store_true",
                   help="continue the interrupted run in --out with the same settings")
    p.add_argument("--device", type=_device_value, default="cpu", help="cpu, cuda or cuda:N (default: %(default)s)")
    p.set_defaults(run=cmd_train_head)


def cmd_train_head(args: argparse.Namespace) -> int:
    import torch

    from verispec.cli.bench import ProgressBar
    from verispec.training import TrainConfig, TrainHeadOptions, train_head
    from verispec.training.run import STATE

    _check_device(args.device)
    if args.prompts is not None and not os.path.isfile(args.prompts):
        raise UsageError(f"argument --prompts: expected a readable file, got {args.prompts!r} "
                         f"(no such file)")
    state = os.path.join(args.out, STATE, "settings.json")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise UsageError(f"argument --out: expected a folder, got {args.out!r} (a file)")
    if args.resume and not os.path.isfile(state):
        raise UsageError(f"argument --resume: expected --out to hold an interrupted run "
                         f"({STATE}/settings.json), got none in {args.out!r}")
    if not args.resume and os.path.isfile(state):
        raise UsageError(f"argument --out: expected a folder without a training state, got "
                         f"{args.out!r} holding one ({STATE}/); pass --resume to continue it")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    target, tok = _load(args.model, "--model", device=args.device)
    vocab = target.geometry.vocab_size
    if args.draft_vocab > vocab:
        raise UsageError(f"argument --draft-vocab: expected an int in [1, {vocab}] (the "
                         f"target's vocabulary), got {args.draft_vocab}")
    if target.geometry.hidden_size is None or not getattr(target, "writes_features", False):
        raise UsageError(f"argument --model: expected a target that writes its hidden states "
                         f"(a verispec LlamaModel or HFModel), got {type(target).__name__}")
    cfg = TrainConfig(ttt_steps=args.ttt_steps, lr=args.lr, batch_tokens=args.batch_tokens,
                      epochs=(args.epochs or TrainConfig.epochs) if args.steps is None else 0,
                      steps=args.steps or 0, seed=args.seed)
    opts = TrainHeadOptions(prompts_file=args.prompts, num_prompts=args.num_prompts,
                            max_answer_tokens=args.max_answer_tokens,
                            answer_temperature=args.answer_temperature,
                            draft_vocab=args.draft_vocab, held_out=args.held_out,
                            keep_draft_vocab=args.keep_draft_vocab, save_dtype=args.save_dtype,
                            train=cfg)
    bars: list = []

    def progress(stage: str):
        bar = ProgressBar(sys.stderr)
        bars.append(bar)
        return lambda done, total, label: bar(done, total, f"{stage}: {label}")

    def close_all():
        for b in bars:
            b.close()
        bars.clear()

    def log(message: str) -> None:
        close_all()
        print(message, file=sys.stderr, flush=True)

    started = time.perf_counter()
    try:
        report = train_head(target, tok, args.out, opts, model_name=args.model,
                            resume=args.resume, progress=progress, log=log)
    except (ValueError, FileExistsError) as e:
        raise UsageError(str(e)) from None
    finally:
        close_all()
    held = report["held_out"]
    acc = "/".join(f"{a:.2f}" for a in held["acceptance"])
    print(f"wrote {os.path.join(args.out, 'config.json')} and model.safetensors: "
          f"{report['parameters'] / 1e6:.1f}M parameters, draft vocabulary "
          f"{report['written_draft_vocab_size']}, taps {report['taps']}; {report['steps']} steps on "
          f"{report['tokens']} tokens in {time.perf_counter() - started:.0f} s; held-out "
          f"acceptance per step {acc} (tau {held['tau']:.2f})")
    print(f"use it: verispec generate --model {args.model} --draft eagle3 --draft-head {args.out}")
    return 0
