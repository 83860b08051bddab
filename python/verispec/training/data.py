"""Training data for a head: prompts (the user's file, or written by the target itself)
and the target's own answers to them.

A head learns to predict what the target will say, so the answers come from the
target: greedy answers are exactly what the head meets at greedy decoding; sampled
ones (temperature > 0) widen the data toward sampled decoding. Without a prompts file
the target writes the questions itself (Magpie, arXiv 2406.08464): an aligned chat
model given only its chat template up to the user turn writes a user's message.

Everything here is deterministic for a seed: request i is generated with the request
seed ``request_seed(seed, i)`` (verispec.decoder), so its text does not depend on the
batch it ran in, and a resumed run regenerates nothing it already has.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

__all__ = ["Example", "chat_prompt_ids", "generate", "magpie_prefix", "read_prompts_file",
           "self_written_prompts", "split_held_out"]

Progress = Optional[Callable[[int, int, str], None]]
_SENTINEL = "\x00VERISPEC_USER_TURN\x00"


@dataclass
class Example:
    """One training sequence: the prompt's ids (chat template applied) and the target's
    answer ids after it (its stop token included when it stopped)."""

    prompt: list[int]
    answer: list[int]

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.answer


# --- prompts --------------------------------------------------------------------------


def read_prompts_file(path: str | os.PathLike) -> list[list[dict]]:
    """Conversations from ``path``: JSONL objects with "prompt" (a user message) or
    "messages" (a chat, answered after its last user turn), or plain text, one user
    message per non-empty line. ValueError naming the line that is neither."""
    path = os.fspath(path)
    conversations: list[list[dict]] = []
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if not text:
            continue
        if not text.startswith("{"):
            conversations.append([{"role": "user", "content": text}])
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: expected a JSON object with \"prompt\" or "
                             f"\"messages\", or a plain-text line, got invalid JSON ({e.msg})"
                             ) from None
        if isinstance(obj.get("prompt"), str):
            conversations.append([{"role": "user", "content": obj["prompt"]}])
        elif isinstance(obj.get("messages"), list) and obj["messages"]:
            messages = list(obj["messages"])
            while messages and messages[-1].get("role") == "assistant":
                messages.pop()   # the target writes the answer itself
            if not messages or not all(isinstance(m, dict) and "role" in m and "content" in m
                                       for m in messages):
                raise ValueError(f"{path}:{number}: expected \"messages\" as a list of "
                                 f"{{\"role\", \"content\"}} ending in a user turn, got "
                                 f"{obj['messages']!r:.80}")
            conversations.append(messages)
        else:
            raise ValueError(f"{path}:{number}: expected a JSON object with a string "
                             f"\"prompt\" or a list \"messages\", got keys {sorted(obj)}")
    if not conversations:
        raise ValueError(f"{path}: expected at least one prompt, got none")
    return conversations


def chat_prompt_ids(tokenizer: Any, conversation: list[dict]) -> list[int]:
    """The ids the target reads before answering: its chat template with the generation
    prompt, or the last user message as plain text when it has no template."""
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                                  tokenize=True))
    return list(tokenizer.encode(conversation[-1]["content"]))


def magpie_prefix(tokenizer: Any) -> tuple[list[int], list[int]]:
    """(the ids of the chat template up to the user's message, the ids the template
    writes right after it: the end of the user turn, a stop for the question)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("self-written prompts need the target's chat template; this "
                         "tokenizer has none (give a prompts file)")
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}],
                                         add_generation_prompt=False, tokenize=False)
    if _SENTINEL not in text:
        raise ValueError("self-written prompts: the chat template does not write the "
                         "user's message verbatim; give a prompts file")
    before, after = text.split(_SENTINEL, 1)
    prefix = tokenizer.encode(before, add_special_tokens=False)
    suffix = tokenizer.encode(after, add_special_tokens=False) if after else []
    return prefix, suffix[:1]


def _normal(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


# --- generation -----------------------------------------------------------------------


def generate(target: Any, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
             temperature: float, seed: int, stop_ids: Sequence[int], batch: int = 16,
             first_index: int = 0, chunk: Optional[int] = None,
             progress: Progress = None, label: str = "answers",
             on_chunk: Optional[Callable[[int, list], None]] = None) -> list:
    """The target's continuations of ``prompts`` (plain decoding through SpecDecoder,
    ``batch`` sequences at once): GenerateResults in order. Prompt j is request
    ``first_index + j``, sampled with ``request_seed(seed, first_index + j)`` (or greedy
    at temperature 0). ``on_chunk(start, results)`` is called after each chunk."""
    from verispec.cache import blocks_for
    from verispec.decoder import SpecDecoder

    prompts = [list(p) for p in prompts]
    if not prompts:
        return []
    longest = max(len(p) for p in prompts) + max_new_tokens
    decoder = SpecDecoder(target, None, num_blocks=batch * blocks_for(longest, 16),
                          block_size=16, max_num_seqs=batch)
    chunk = chunk or 4 * batch
    out: list = []
    for start in range(0, len(prompts), chunk):
        part = prompts[start:start + chunk]
        from verispec.decoder import request_seed

        seeds = [request_seed(seed, first_index + start + j) for j in range(len(part))]
        results = decoder.generate(part, max_new_tokens=max_new_tokens,
                                   temperature=float(temperature), seed=seeds,
                                   eos_token_id=list(stop_ids))
        out.extend(results)
        if on_chunk is not None:
            on_chunk(start, results)
        if progress is not None:
            progress(len(out), len(prompts), label)
    return out


def self_written_prompts(target: Any, tokenizer: Any, count: int, *, seed: int,
                         temperature: float = 1.0, max_tokens: int = 96,
                         min_chars: int = 12, batch: int = 16,
                         progress: Progress = None) -> list[str]:
    """``count`` distinct user messages the target writes itself (module doc): sampled
    after the template's user-turn prefix, kept when they ended by themselves (not cut
    at ``max_tokens``), have at least ``min_chars`` characters and differ from every
    kept one (case and whitespace folded). Fewer when 4 * count attempts do not find
    enough."""
    prefix, turn_end = magpie_prefix(tokenizer)
    stops = list(dict.fromkeys([*tokenizer.eos_token_ids, *turn_end]))
    kept: list[str] = []
    seen: set[str] = set()
    attempts = 0
    while len(kept) < count and attempts < 4 * count:
        n = min(max(count - len(kept), batch), 4 * count - attempts)
        results = generate(target, [prefix] * n, max_new_tokens=max_tokens,
                           temperature=temperature, seed=seed, stop_ids=stops, batch=batch,
                           first_index=attempts)
        attempts += n
        for r in results:
            if r.finish_reason == "length" or len(kept) == count:
                continue
            ids = [t for t in r.tokens if t not in stops]
            text = tokenizer.decode(ids, skip_special_tokens=True).strip()
            key = _normal(text)
            if len(text) >= min_chars and key not in seen:
                seen.add(key)
                kept.append(text)
        if progress is not None:
            progress(len(kept), count, f"self-written prompts ({attempts} tried)")
    return kept


def split_held_out(n: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train indices, held-out indices) of n examples: a seeded permutation, at least
    one held out when n >= 2 and fraction > 0, both sorted."""
    if not 0 <= fraction < 1:
        raise ValueError(f"split_held_out: fraction must be in [0, 1), got {fraction}")
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(n, generator=g).tolist()
    held = 0 if fraction == 0 or n < 2 else max(1, round(fraction * n))
    return sorted(order[held:]), sorted(order[:held])
