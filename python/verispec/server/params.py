"""A request's parameters: parsed and checked, each error a 400 in OpenAI's shape that
names the request field. The policy ranges are the one rule's (verispec._policy), not
restated here."""

from __future__ import annotations

import json
import numbers
from dataclasses import dataclass
from typing import Any, Optional

from fastapi.responses import JSONResponse

from verispec._policy import policy_error

MAX_TOP_LOGPROBS = 20      # SpecDecoder.add's logprobs range, [0, 20]
MAX_STOP_STRINGS = 16
_SEED_MAX = 2 ** 64 - 1
_PRIORITY_MAX = 2 ** 63 - 1


# --- errors in OpenAI's shape ---------------------------------------------------------------


class APIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, param: Optional[str] = None,
                 code: Optional[str] = None, type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content=_error_body(
            self.message, self.type, self.param, self.code))


def _error_body(message: str, kind: str, param: Optional[str] = None,
                code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _bad(param: str, expected: str, got: Any) -> APIError:
    return APIError(400, f"{param}: expected {expected}, got {json.dumps(got)[:200]}",
                    param=param, code="invalid_value")


# --- request parameters -----------------------------------------------------------------------


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _policy_field(body: dict, name: str, default: Any, kind: str, *,
                  integer: bool = False, note: str = "") -> Any:
    """A policy field of the request (null or absent: ``default``): 400 naming it when it
    is not of its JSON ``kind``, or out of the range of the policy rule that ``add``
    applies (the rule's message: the field, its range and the value)."""
    value = body.get(name, default)
    value = default if value is None else value
    if not (_is_int(value) if integer else
            isinstance(value, numbers.Real) and not isinstance(value, bool)):
        raise _bad(name, kind, value)
    error = policy_error(**{name: value})
    if error:
        raise APIError(400, error + note, param=name, code="invalid_value")
    return value


@dataclass
class _Params:
    max_tokens: Optional[int]
    policy: dict
    seed: Optional[int]
    stop: list[str]
    stream: bool
    include_usage: bool
    logprobs: Optional[int]   # top-n asked for, None: off
    priority: int = 0         # higher runs first (SpecDecoder.add)


# Parameters OpenAI defines that this server does not implement, with the value that
# means "off" (a request that sets another value gets a 400 naming the parameter).
_UNSUPPORTED = {"echo": (False, None), "best_of": (1, None), "suffix": (None, ""),
                "logit_bias": (None,), "presence_penalty": (0, 0.0, None),
                "frequency_penalty": (0, 0.0, None), "tools": (None,), "functions": (None,),
                "tool_choice": (None, "none"), "function_call": (None, "none")}


def _parse_params(body: dict, *, chat: bool) -> _Params:
    """The request's parameters, checked in this order (the first error is the answer)."""
    _check_unsupported(body)
    n = body.get("n")
    if n is not None and not (_is_int(n) and n == 1):
        raise _bad("n", "1 (one choice per request) or null", n)
    max_tokens = _max_tokens(body, chat)
    policy = _policy(body)
    seed, priority = _seed_and_priority(body)
    stop = _stop_strings(body)
    stream, include_usage = _stream(body)
    logprobs = _chat_logprobs(body) if chat else _completion_logprobs(body)
    return _Params(max_tokens, policy, seed, stop, stream, include_usage, logprobs, priority)


def _check_unsupported(body: dict) -> None:
    for name, off in _UNSUPPORTED.items():
        value = body.get(name)
        if value in ({},) or value == []:
            continue
        if value not in off:
            raise APIError(400, f"{name}: not supported by this server (verispec); leave it "
                                f"unset, got {json.dumps(value)[:100]}", param=name,
                           code="unsupported_parameter")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise APIError(400, "response_format: only {\"type\": \"text\"} is supported",
                       param="response_format", code="unsupported_parameter")


def _max_tokens(body: dict, chat: bool) -> Optional[int]:
    max_tokens = body.get("max_completion_tokens") if chat else None
    name = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, name = body.get("max_tokens"), "max_tokens"
    if max_tokens is not None and not (_is_int(max_tokens) and max_tokens >= 1):
        raise _bad(name, "an int >= 1", max_tokens)
    return max_tokens


def _policy(body: dict) -> dict:
    """SpecDecoder.add's policy arguments. JSON types here, ranges by the one rule
    (_policy.policy_error, the native policy_rules.h that add applies too), which names
    the field and its range."""
    temperature = _policy_field(body, "temperature", 1.0, "a number (0: greedy)")
    top_p = _policy_field(body, "top_p", 1.0, "a number")
    top_k = body.get("top_k", 0)
    top_k = 0 if top_k is None or top_k == -1 else top_k  # -1: off, as other servers take it
    top_k = _policy_field({"top_k": top_k}, "top_k", 0, "an int (0 or -1: off)", integer=True,
                          note=" (0 or -1: off)")
    min_p = _policy_field(body, "min_p", 0.0, "a number")
    return dict(temperature=float(temperature), top_p=float(top_p), top_k=int(top_k),
                min_p=float(min_p))


def _seed_and_priority(body: dict) -> tuple[Optional[int], int]:
    seed = body.get("seed")
    if seed is not None and not (_is_int(seed) and 0 <= seed <= _SEED_MAX):
        raise _bad("seed", "an int in [0, 2**64 - 1] or null", seed)
    # an extension (not OpenAI's): admitted and kept running before lower priorities
    priority = body.get("priority")
    priority = 0 if priority is None else priority
    if not (_is_int(priority) and -_PRIORITY_MAX <= priority <= _PRIORITY_MAX):
        raise _bad("priority", f"an int in [-{_PRIORITY_MAX}, {_PRIORITY_MAX}] or null "
                               f"(higher runs first)", priority)
    return seed, int(priority)


def _stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)
            and len(stop) <= MAX_STOP_STRINGS):
        raise _bad("stop", f"a non-empty string or a list of at most {MAX_STOP_STRINGS} "
                           f"non-empty strings", body.get("stop"))
    return stop


def _stream(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage)."""
    stream = body.get("stream", False)
    stream = False if stream is None else stream
    if not isinstance(stream, bool):
        raise _bad("stream", "a bool", stream)
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise APIError(400, "stream_options: only allowed with stream: true",
                           param="stream_options", code="invalid_value")
        if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
            raise _bad("stream_options", "{\"include_usage\": bool}", options)
        include_usage = options.get("include_usage", False)
    return stream, include_usage


def _chat_logprobs(body: dict) -> Optional[int]:
    """Chat: logprobs is a bool, top_logprobs the top-n (needs logprobs: true)."""
    want = body.get("logprobs")
    if want is not None and not isinstance(want, bool):
        raise _bad("logprobs", "a bool or null", want)
    top = body.get("top_logprobs")
    if top is not None:
        if not (_is_int(top) and 0 <= top <= MAX_TOP_LOGPROBS):
            raise _bad("top_logprobs", f"an int in [0, {MAX_TOP_LOGPROBS}]", top)
        if not want:
            raise APIError(400, "top_logprobs: needs logprobs: true", param="top_logprobs",
                           code="invalid_value")
    return (top or 0) if want else None


def _completion_logprobs(body: dict) -> Optional[int]:
    """Completions: logprobs is the top-n."""
    logprobs = body.get("logprobs")
    if logprobs is not None and not (_is_int(logprobs) and 0 <= logprobs <= MAX_TOP_LOGPROBS):
        raise _bad("logprobs", f"an int in [0, {MAX_TOP_LOGPROBS}] or null", logprobs)
    return logprobs
