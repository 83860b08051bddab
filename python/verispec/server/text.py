"""What a request's tokens become: text released as it is final (stop strings held
back), logprobs in OpenAI's two shapes, server-sent events, and the Prometheus metrics."""

from __future__ import annotations

import json
import math
from typing import Any, Optional

# verispec's finish reasons -> OpenAI's ("aborted" never reaches a client: an aborted
# request is one whose client left, or whose stop string matched).
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}
_LOGPROB_FLOOR = -9999.0   # JSON has no -inf; a token the policy excludes reads as this


# --- text: incremental detokenizing and stop strings ---------------------------------------------


class _Text:
    """The text of a growing token list, released as it becomes final: an incomplete
    UTF-8 character and a tail that may begin a stop string are held back. A matched stop
    string ends the text before it; the tokens kept are those up to the one that completed
    it."""

    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self.tok, self.stop = tokenizer, stop
        self.tokens: list[int] = []
        self.kept = 0          # tokens reported (usage, logprobs)
        self.sent = 0          # characters of the text released
        self.stopped = False

    def _decode(self, n: int) -> str:
        return self.tok.decode(self.tokens[:n], skip_special_tokens=True)

    def push(self, tokens: list[int], final: bool) -> tuple[str, int]:
        """(new text, how many of ``tokens`` count) after the step's ``tokens``."""
        before = len(self.tokens)
        self.tokens.extend(tokens)
        text = self._decode(len(self.tokens))
        if self.stop:
            at = self._find_stop(text)
            if at is not None:
                cut, _ = at
                # the first token count whose text holds a stop string completed it
                m = next(i for i in range(before + 1, len(self.tokens) + 1)
                         if self._find_stop(self._decode(i)) is not None)
                self.stopped = True
                return self._release(text[:cut]), self._keep(m - before)
        if not final:
            text = text.rstrip("\ufffd")
            hold = max((self._partial(text, s) for s in self.stop), default=0)
            text = text[:len(text) - hold]
        return self._release(text), self._keep(len(tokens))

    def _find_stop(self, text: str) -> Optional[tuple[int, str]]:
        start = max(0, self.sent - max(len(s) for s in self.stop))
        hits = [(i, s) for s in self.stop if (i := text.find(s, start)) != -1]
        return min(hits) if hits else None

    @staticmethod
    def _partial(text: str, stop: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of ``stop``."""
        for n in range(min(len(stop) - 1, len(text)), 0, -1):
            if stop.startswith(text[-n:]):
                return n
        return 0

    def _release(self, text: str) -> str:
        new = text[self.sent:] if len(text) > self.sent else ""
        self.sent = max(self.sent, len(text))
        return new

    def _keep(self, n: int) -> int:
        self.kept += n
        return n


# --- logprobs in OpenAI's two shapes ------------------------------------------------------------------


def _lp(x: float) -> float:
    return x if math.isfinite(x) else _LOGPROB_FLOOR


class _Logprobs:
    """Formats verispec TokenLogprobs (the model's own log-probabilities, ``raw_logprob``)."""

    def __init__(self, tokenizer: Any, top: int) -> None:
        self.tok, self.top, self.offset = tokenizer, top, 0

    def _s(self, token: int) -> str:
        return self.tok.decode([token])

    def completion(self, items: list) -> dict:
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in items:
            s = self._s(lp.token)
            out["tokens"].append(s)
            out["token_logprobs"].append(_lp(lp.raw_logprob))
            out["top_logprobs"].append({self._s(t): _lp(raw) for t, _, raw in lp.top[:self.top]})
            out["text_offset"].append(self.offset)
            self.offset += len(s)
        return out

    def chat(self, items: list) -> list:
        def entry(token: int, value: float) -> dict:
            s = self._s(token)
            return {"token": s, "logprob": _lp(value), "bytes": list(s.encode("utf-8"))}

        return [dict(entry(lp.token, lp.raw_logprob),
                     top_logprobs=[entry(t, raw) for t, _, raw in lp.top[:self.top]])
                for lp in items]


def _merge_completion_logprobs(a: Optional[dict], b: dict) -> dict:
    if a is None:
        return b
    return {key: a[key] + b[key] for key in a}


# --- server-sent events and the Prometheus metrics ------------------------------------------


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'), allow_nan=False)}\n\n"


def format_metrics(s: dict) -> str:
    """Prometheus text exposition of an Engine.snapshot()."""
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: list) -> None:
        lines.append(f"# HELP verispec_{name} {help_}")
        lines.append(f"# TYPE verispec_{name} {kind}")
        for labels, value in samples:
            label = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
            lines.append(f"verispec_{name}{label} {value:g}" if isinstance(value, float)
                         else f"verispec_{name}{label} {value}")

    metric("requests_running", "gauge", "Requests whose sequence is decoding.",
           [({}, s["running"])])
    metric("requests_waiting", "gauge", "Requests waiting for admission (queued or preempted).",
           [({}, s["waiting"])])
    metric("kv_blocks_free", "gauge", "Free KV-cache blocks.",
           [({"cache": role}, free) for role, (free, _) in s["blocks"].items()])
    metric("kv_blocks_total", "gauge", "KV-cache blocks.",
           [({"cache": role}, total) for role, (_, total) in s["blocks"].items()])
    tpp = s["emitted"] / s["target_passes"] if s["target_passes"] else 0.0
    acc = s["accepted"] / s["proposed"] if s["proposed"] else 0.0
    metric("tokens_per_target_pass", "gauge",
           "Tokens emitted per target pass, over released requests.", [({}, float(tpp))])
    metric("acceptance_rate", "gauge",
           "Accepted / proposed draft tokens, over released requests.", [({}, float(acc))])
    metric("generated_tokens_total", "counter", "Tokens emitted, over released requests.",
           [({}, s["emitted"])])
    metric("target_passes_total", "counter",
           "Target passes summed over released requests (one per request per step).",
           [({}, s["target_passes"])])
    metric("draft_tokens_proposed_total", "counter", "Draft tokens proposed.", [({}, s["proposed"])])
    metric("draft_tokens_accepted_total", "counter", "Draft tokens accepted.", [({}, s["accepted"])])
    metric("preemptions_total", "counter", "Sequences preempted for cache blocks.",
           [({}, s["preemptions"])])
    metric("steps_total", "counter", "Decode steps run.", [({}, s["steps"])])
    metric("step_errors_total", "counter", "Decode steps that raised.", [({}, s["step_errors"])])
    metric("requests_total", "counter", "Requests accepted for decoding.",
           [({}, s["requests_total"])])
    metric("requests_finished_total", "counter",
           "Requests that finished (EOS, a stop, max_tokens, the context).",
           [({}, s["requests_finished"])])
    metric("requests_aborted_total", "counter", "Requests whose client disconnected.",
           [({}, s["requests_aborted"])])
    metric("requests_failed_total", "counter", "Requests failed by a decoding error.",
           [({}, s["requests_failed"])])
    return "\n".join(lines) + "\n"
