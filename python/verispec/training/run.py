"""``train_head``: prompts -> the target's answers -> draft vocabulary -> features ->
training -> a head in the speculators layout. What ``verispec train-head`` runs.

Every stage keeps its result in ``OUT/train-state/`` and a rerun with ``resume=True``
takes it from there (answers are appended chunk by chunk, features are complete or
recomputed, training continues from its last checkpoint). The settings that change
the result are written in ``settings.json``; resuming with other values is refused,
naming the setting. The head is written to ``OUT`` (config.json + model.safetensors)
with ``train_report.json`` beside it: the settings, the data's size, the loss curve
and the held-out acceptance.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any, Optional

import torch

from verispec.training import data as data_mod
from verispec.training.features import FeatureStore, extract_features
from verispec.training.options import TrainHeadOptions
from verispec.training.trainer import (Trainer, default_taps, head_config, init_head,
                                       target_tensors)
from verispec.training.vocab import DraftVocab, choose_draft_vocab

__all__ = ["TrainHeadOptions", "train_head"]

STATE = "train-state"


def _fingerprint(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def _write_json(path: str, obj: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def _read_json(path: str) -> Any:
    with open(path) as f:
        return json.load(f)


# Settings a resumed run may change: how fast, not what.
_FREE = ("generation_batch", "feature_batch_tokens", "train.checkpoint_every",
         "train.eval_every", "keep_draft_vocab", "save_dtype")
_SAVE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _settings(opts: TrainHeadOptions, model_name: str) -> dict:
    out = {k: v for k, v in asdict(opts).items() if k != "train"}
    out["taps"] = list(opts.taps) if opts.taps is not None else None
    out.update({f"train.{k}": (list(v) if isinstance(v, tuple) else v)
                for k, v in asdict(opts.train).items()})
    out["model"] = model_name
    return out


def _check_resume(saved: dict, now: dict) -> None:
    for key in sorted(set(saved) | set(now)):
        if key in _FREE:
            continue
        if saved.get(key) != now.get(key):
            raise ValueError(f"resume: {key} must be the interrupted run's {saved.get(key)!r}, "
                             f"got {now.get(key)!r} (or start afresh in another folder)")


def _prompt_ids(opts: TrainHeadOptions, target: Any, tokenizer: Any, state: str, seed: int,
                prompts: Optional[Sequence[Sequence[int]]], log, bar) -> list[list[int]]:
    path = os.path.join(state, "prompts.json")
    if os.path.isfile(path):
        return _read_json(path)["ids"]
    texts: list[str] = []
    if prompts is not None:
        ids = [list(p) for p in prompts]
    elif opts.prompts_file is not None:
        conversations = data_mod.read_prompts_file(opts.prompts_file)
        if opts.num_prompts:
            conversations = conversations[: opts.num_prompts]
        ids = [data_mod.chat_prompt_ids(tokenizer, c) for c in conversations]
        texts = [c[-1]["content"] for c in conversations]
    else:
        progress = bar("prompts")
        texts = data_mod.self_written_prompts(
            target, tokenizer, opts.num_prompts, seed=seed, temperature=opts.prompt_temperature,
            max_tokens=opts.max_prompt_tokens, batch=opts.generation_batch, progress=progress)
        _close(progress)
        ids = [data_mod.chat_prompt_ids(tokenizer, [{"role": "user", "content": t}])
               for t in texts]
    limit = target.geometry.max_context - opts.max_answer_tokens
    kept = [i for i, p in enumerate(ids) if 1 <= len(p) <= limit]
    if len(kept) < len(ids):
        log(f"dropped {len(ids) - len(kept)} prompts longer than {limit} tokens")
    ids = [ids[i] for i in kept]
    if len(ids) < 2:
        raise ValueError(f"train-head: expected at least 2 usable prompts, got {len(ids)}")
    _write_json(path, {"ids": ids, "texts": [texts[i] for i in kept] if texts else []})
    return ids


def _answers(opts: TrainHeadOptions, target: Any, prompts: list[list[int]], stop_ids,
             state: str, seed: int, bar) -> list[list[int]]:
    path = os.path.join(state, "answers.jsonl")
    answers: dict[int, list[int]] = {}
    if os.path.isfile(path):
        with open(path) as f:
            for line in f:
                if line.strip():
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError:
                        break   # a line cut by an interruption: regenerate from there
                    answers[row["i"]] = row["answer"]
    todo = [i for i in range(len(prompts)) if i not in answers]
    if todo:
        first = todo[0]
        # contiguous from the first missing one (answers are appended in order)
        progress = bar("answers")

        def keep(start: int, results) -> None:
            with open(path, "a") as f:
                for j, r in enumerate(results):
                    i = first + start + j
                    answers[i] = list(r.tokens)
                    f.write(json.dumps({"i": i, "answer": answers[i]}) + "\n")

        # answers use their own seed stream: request i of prompt i, offset from the prompts'
        data_mod.generate(target, prompts[first:], max_new_tokens=opts.max_answer_tokens,
                          temperature=opts.answer_temperature, seed=seed + 1, stop_ids=stop_ids,
                          batch=opts.generation_batch, first_index=first,
                          progress=progress, on_chunk=keep)
        _close(progress)
    return [answers[i] for i in range(len(prompts))]


def _close(progress) -> None:
    close = getattr(progress, "close", None)
    if close is not None:
        close()


def train_head(target: Any, tokenizer: Any, out: str | os.PathLike,
               opts: Optional[TrainHeadOptions] = None, *, model_name: str = "",
               prompts: Optional[Sequence[Sequence[int]]] = None, resume: bool = False,
               progress: Optional[Callable[[str], Callable[[int, int, str], None]]] = None,
               log: Callable[[str], None] = lambda s: None,
               stop_ids: Optional[Sequence[int]] = None) -> dict:
    """Train a head for ``target`` and write it to ``out`` (module doc); returns the
    report. ``prompts``: token-id prompts instead of a file or self-written ones (then
    ``tokenizer`` may be None). ``progress(stage)``: a progress callable per stage
    (``(done, total, label)``; closed through its ``close`` when it has one)."""
    opts = opts or TrainHeadOptions()
    cfg = opts.train
    cfg.check()
    if opts.save_dtype not in _SAVE_DTYPES:
        raise ValueError(f"train-head: save_dtype must be one of {sorted(_SAVE_DTYPES)}, got "
                         f"{opts.save_dtype!r}")
    if opts.keep_draft_vocab < 0:
        raise ValueError(f"train-head: keep_draft_vocab must be an int >= 0, got "
                         f"{opts.keep_draft_vocab}")
    out = os.fspath(out)
    state = os.path.join(out, STATE)
    bar = progress or (lambda stage: None)
    settings = _settings(opts, model_name)
    settings_path = os.path.join(state, "settings.json")
    if os.path.isfile(settings_path):
        if not resume:
            raise FileExistsError(f"train-head: {out} holds a training state ({STATE}/); "
                                  f"pass resume (--resume) to continue it, or choose another "
                                  f"folder")
        _check_resume(_read_json(settings_path), settings)
    os.makedirs(state, exist_ok=True)
    _write_json(settings_path, settings)
    seed = cfg.seed
    g = target.geometry
    if stop_ids is None:
        stop_ids = list(getattr(tokenizer, "eos_token_ids", ()) or ())
    t0 = time.perf_counter()

    prompt_ids = _prompt_ids(opts, target, tokenizer, state, seed, prompts, log, bar)
    log(f"{len(prompt_ids)} prompts ({time.perf_counter() - t0:.0f} s)")
    answers = _answers(opts, target, prompt_ids, stop_ids, state, seed, bar)
    examples = [data_mod.Example(p, a) for p, a in zip(prompt_ids, answers) if a]
    log(f"{len(examples)} answers, {sum(len(e.answer) for e in examples)} answer tokens "
        f"({time.perf_counter() - t0:.0f} s)")
    train_idx, held_idx = data_mod.split_held_out(len(examples), opts.held_out, seed)

    vocab_path = os.path.join(state, "vocab.json")
    if os.path.isfile(vocab_path):
        vocab = DraftVocab(torch.tensor(_read_json(vocab_path)["target_ids"]), g.vocab_size)
    else:
        vocab = choose_draft_vocab([examples[i].answer for i in train_idx], g.vocab_size,
                                   opts.draft_vocab,
                                   prompts=[examples[i].prompt for i in train_idx],
                                   always=stop_ids)
        _write_json(vocab_path, {"target_ids": vocab.target_ids.tolist()})
    taps = tuple(opts.taps) if opts.taps is not None else default_taps(g.num_layers)

    data_print = _fingerprint({"settings": {k: v for k, v in settings.items()
                                            if not k.startswith("train.") and k not in _FREE},
                               "tokens": [e.tokens for e in examples],
                               "vocab": vocab.target_ids.tolist(), "taps": list(taps)})
    feature_dir = os.path.join(state, "features")
    if FeatureStore.is_complete(feature_dir, data_print):
        store = FeatureStore.open(feature_dir)
    else:
        p = bar("features")
        store = extract_features(target, [e.tokens for e in examples], feature_dir,
                                 taps=taps, draft_ids=vocab.target_ids, top_k=opts.top_k,
                                 batch_tokens=opts.feature_batch_tokens,
                                 fingerprint=data_print, progress=p)
        _close(p)
    log(f"features of {store.meta['num_tokens']} tokens ({time.perf_counter() - t0:.0f} s)")

    config = head_config(target, vocab, taps)
    device = torch.device(g.device)
    head = init_head(config, vocab, target_tensors(target, vocab.target_ids), seed=seed,
                     device=device)
    loss_from = [len(e.prompt) for e in examples]
    train_print = _fingerprint({"data": data_print, "train": {
        k: v for k, v in settings.items() if k.startswith("train.") and k not in _FREE}})
    trainer = Trainer(head, store, train_idx, held_idx, loss_from, vocab, cfg, state,
                      fingerprint=train_print)
    before = None
    if not (resume and trainer.load_checkpoint()):
        before = trainer.evaluate()
        log("held-out acceptance before training: "
            + "/".join(f"{a:.3f}" for a in before["acceptance"]))
    p = bar("training")
    final = trainer.run(p)
    _close(p)
    written = trainer.module.frozen_head()
    if 0 < opts.keep_draft_vocab < vocab.size:
        # the first keep_draft_vocab ids of the draft vocabulary's own order of choice
        kept = choose_draft_vocab([examples[i].answer for i in train_idx], g.vocab_size,
                                  opts.keep_draft_vocab,
                                  prompts=[examples[i].prompt for i in train_idx],
                                  always=stop_ids)
        written = written.with_draft_vocab(kept.target_ids)
        log(f"the head written drafts over {written.config.draft_vocab_size} of its "
            f"{vocab.size} ids")
    written.save(out, verifier_name_or_path=model_name or None,
                 dtype=_SAVE_DTYPES[opts.save_dtype])
    report = {
        "settings": settings, "taps": list(taps), "draft_vocab_size": vocab.size,
        "sequences": len(examples), "train_sequences": len(train_idx),
        "held_out_sequences": len(held_idx), "tokens": store.meta["num_tokens"],
        "answer_tokens": sum(len(e.answer) for e in examples),
        "steps": trainer.pos.step, "acceptance_before": before, "held_out": final,
        "written_draft_vocab_size": written.config.draft_vocab_size,
        "history": trainer.history, "seconds": time.perf_counter() - t0,
        "parameters": sum(p.numel() for p in trainer.module.parameters()),
    }
    _write_json(os.path.join(out, "train_report.json"), report)
    return report
