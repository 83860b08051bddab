"""verispec.server: an OpenAI-compatible HTTP server over one SpecDecoder.

    from verispec.server import create_app, serve
    app = create_app(decoder, tokenizer, "smollm2")       # a FastAPI app (ASGI)
    serve(decoder, tokenizer, "smollm2", host="127.0.0.1", port=8000)   # uvicorn, blocking

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming by
server-sent events or not), ``GET /v1/models``, ``GET /health``, ``GET /metrics``
(Prometheus text). See docs/serving.md.

Threads: one decode thread (``Engine``) is the only caller of ``decoder.step()`` and of
``decoder.release()``. Request handlers run on the event loop; they add sequences
(``decoder.add`` is safe from any thread) and abort them (client gone, stop string
matched); the decode thread delivers each step's tokens to the request's asyncio queue
through ``loop.call_soon_threadsafe`` and, when idle, waits on a condition variable.
Releasing only on the decode thread, between steps, is what keeps a sequence id from
being reused while a step's output for it is still being delivered.

Needs the ``serve`` extra (``pip install 'verispec[serve]'``: fastapi and uvicorn);
``import verispec`` never imports this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import numbers
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional, Sequence

try:
    import fastapi
    import uvicorn
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException
except ModuleNotFoundError as e:  # pragma: no cover - exercised by a subprocess test
    raise ModuleNotFoundError(
        f"verispec.server needs the Python package {e.name!r} (fastapi and uvicorn): "
        f"pip install 'verispec[serve]'", name=e.name) from None

from verispec import CacheFullError
from verispec._policy import policy_error
from verispec.cache import blocks_for

__all__ = ["Engine", "create_app", "serve", "FINISH_REASONS", "MAX_TOP_LOGPROBS"]

# verispec's finish reasons -> OpenAI's ("aborted" never reaches a client: an aborted
# request is one whose client left, or whose stop string matched).
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}
MAX_TOP_LOGPROBS = 20      # SpecDecoder.add's logprobs range, [0, 20]
MAX_STOP_STRINGS = 16
_LOGPROB_FLOOR = -9999.0   # JSON has no -inf; a token the policy excludes reads as this
_SEED_MAX = 2 ** 64 - 1
_PRIORITY_MAX = 2 ** 63 - 1


# --- the decode thread ---------------------------------------------------------------


@dataclass(eq=False)
class _Request:
    """One request's sequence and where its tokens go (an asyncio queue on ``loop``)."""

    seq: int
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    order: int                 # arrival order
    done: bool = False         # finished, failed or cancelled: nothing more is delivered


@dataclass
class _Counters:
    requests_total: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    requests_failed: int = 0
    steps: int = 0
    step_errors: int = 0
    target_passes: int = 0      # summed over sequences: rows of target passes
    emitted: int = 0
    proposed: int = 0
    accepted: int = 0
    finish: dict = field(default_factory=dict)


class EngineStopped(RuntimeError):
    """The engine is shutting down and takes no new request."""


class Engine:
    """Runs ``decoder.step()`` on its own thread and routes the outputs to requests.

    ``submit`` (from an event loop) adds a sequence and returns a request whose queue
    receives ``("tokens", tokens, logprobs, finish_reason)`` per step and finally, on a
    failure, ``("error", status, message, type)``. ``cancel`` aborts it (its blocks are
    freed at once, or when the running step ends) and hands it to the decode thread for
    release. A step that raises fails the affected requests and the thread keeps going.
    """

    def __init__(self, decoder: Any) -> None:
        self.decoder = decoder
        self._cond = threading.Condition()
        self._requests: dict[int, _Request] = {}   # seq -> request, until released
        self._to_release: list[int] = []
        self._stopping = False
        self._thread: Optional[threading.Thread] = None
        self._order = 0
        self.counters = _Counters()

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("Engine.start: already started")
        self._thread = threading.Thread(target=self._run, name="verispec-decode", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stops the decode thread (after its current step) and fails what is left with
        503."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        with self._cond:
            left = [r for r in self._requests.values() if not r.done]
            self._fail(left, 503, "the server is shutting down", "server_error")
            self._release_pending()

    # -- from the event loop ---------------------------------------------------------------
    def submit(self, prompt: Sequence[int], **add_kwargs: Any) -> _Request:
        """Adds a sequence (ValueError/TypeError from ``decoder.add`` propagate)."""
        loop = asyncio.get_running_loop()
        with self._cond:
            if self._stopping:
                raise EngineStopped("the server is shutting down")
            seq = self.decoder.add(prompt, **add_kwargs)
            self._order += 1
            req = _Request(seq, loop, asyncio.Queue(), self._order)
            self._requests[seq] = req
            self.counters.requests_total += 1
            self._cond.notify()
        return req

    def cancel(self, req: _Request, *, stop_string: bool = False) -> None:
        """Ends a request that is not done: its client left (counted as aborted) or its
        stop string matched (``stop_string``: counted as finished, reason "stop")."""
        with self._cond:
            if req.done:
                return
            req.done = True
            if stop_string:
                self.counters.requests_finished += 1
                self.counters.finish["stop"] = self.counters.finish.get("stop", 0) + 1
            else:
                self.counters.requests_aborted += 1
            self.decoder.abort(req.seq)
            self._to_release.append(req.seq)
            self._cond.notify()

    def snapshot(self) -> dict:
        """What /metrics reports."""
        d = self.decoder
        with self._cond:
            active = sum(1 for r in self._requests.values() if not r.done)
            c = self.counters
            snap = dict(
                active=active, waiting=min(d.num_waiting(), active),
                requests_total=c.requests_total, requests_finished=c.requests_finished,
                requests_aborted=c.requests_aborted, requests_failed=c.requests_failed,
                steps=c.steps, step_errors=c.step_errors, target_passes=c.target_passes,
                emitted=c.emitted, proposed=c.proposed, accepted=c.accepted,
                finish=dict(c.finish))
        snap["running"] = snap["active"] - snap["waiting"]
        snap["preemptions"] = d.num_preemptions()
        snap["blocks"] = {"target": (d.num_free_blocks("target"), d.num_blocks("target"))}
        if getattr(d, "draft", None) is not None and not getattr(d, "shares_target_cache", False):
            snap["blocks"]["draft"] = (d.num_free_blocks("draft"), d.num_blocks("draft"))
        return snap

    # -- the decode thread -------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                self._release_pending()
                while (not self._stopping and not self._to_release
                       and not self.decoder.has_running()):
                    self._cond.wait()
                if self._stopping:
                    return
                self._release_pending()
                if not self.decoder.has_running():
                    continue
            try:
                outs = self.decoder.step()
            except CacheFullError as e:
                self._step_failed(e, cache_full=True)
                continue
            except Exception as e:  # noqa: BLE001 - any model/op error: fail, keep serving
                self._step_failed(e, cache_full=False)
                continue
            self._dispatch(outs)
            if not outs:
                with self._cond:  # nothing planned although work is queued: do not spin
                    self._cond.wait(timeout=0.01)

    def _dispatch(self, outs: list) -> None:
        with self._cond:
            self.counters.steps += 1
            for o in outs:
                req = self._requests.get(o.seq)
                if req is None or req.done:
                    continue  # cancelled during the step: released before the next one
                finish = o.finish_reason
                if finish is not None:
                    req.done = True
                    self.counters.requests_finished += 1
                    self.counters.finish[finish] = self.counters.finish.get(finish, 0) + 1
                    self._release(o.seq)  # blocks are free before the client hears the end
                self._deliver(req, ("tokens", list(o.tokens), o.logprobs, finish))

    def _step_failed(self, error: BaseException, *, cache_full: bool) -> None:
        """The step changed nothing (decoder.step restores on failure). A full cache
        reaches here only when one sequence alone does not fit: the oldest request (the
        others were preempted behind it) fails. Any other error fails every request in
        flight: they were the step's rows, or would be the next one's."""
        with self._cond:
            self.counters.step_errors += 1
            live = sorted((r for r in self._requests.values() if not r.done),
                          key=lambda r: r.order)
            if cache_full:
                self._fail(live[:1], 400, f"the request does not fit the KV cache: {error}",
                           "invalid_request_error")
            else:
                self._fail(live, 500, f"decoding failed: {type(error).__name__}: {error}",
                           "server_error")
            self._release_pending()

    def _fail(self, reqs: list, status: int, message: str, kind: str) -> None:
        for req in reqs:
            req.done = True
            self.counters.requests_failed += 1
            self.decoder.abort(req.seq)
            self._to_release.append(req.seq)
            self._deliver(req, ("error", status, message, kind))

    def _release_pending(self) -> None:
        pending, self._to_release = self._to_release, []
        for seq in pending:
            self._release(seq)

    def _release(self, seq: int) -> None:
        stats = self.decoder.result(seq).stats
        c = self.counters
        c.target_passes += int(stats.get("steps", 0))
        c.emitted += int(stats.get("emitted", 0))
        c.proposed += int(stats.get("proposed", 0))
        c.accepted += int(stats.get("accepted", 0))
        self.decoder.release(seq)
        del self._requests[seq]

    @staticmethod
    def _deliver(req: _Request, item: tuple) -> None:
        try:
            req.loop.call_soon_threadsafe(req.queue.put_nowait, item)
        except RuntimeError:
            pass  # the event loop is closed: nobody is listening any more


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

    n = body.get("n")
    if n is not None and not (_is_int(n) and n == 1):
        raise _bad("n", "1 (one choice per request) or null", n)

    max_tokens = body.get("max_completion_tokens") if chat else None
    name = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, name = body.get("max_tokens"), "max_tokens"
    if max_tokens is not None and not (_is_int(max_tokens) and max_tokens >= 1):
        raise _bad(name, "an int >= 1", max_tokens)

    # The policy: JSON types here, ranges by the one rule (_policy.policy_error, the
    # native policy_rules.h that add applies too), which names the field and its range.
    temperature = _policy_field(body, "temperature", 1.0, "a number (0: greedy)")
    top_p = _policy_field(body, "top_p", 1.0, "a number")
    top_k = body.get("top_k", 0)
    top_k = 0 if top_k is None or top_k == -1 else top_k  # -1: off, as other servers take it
    top_k = _policy_field({"top_k": top_k}, "top_k", 0, "an int (0 or -1: off)", integer=True,
                          note=" (0 or -1: off)")
    min_p = _policy_field(body, "min_p", 0.0, "a number")

    seed = body.get("seed")
    if seed is not None and not (_is_int(seed) and 0 <= seed <= _SEED_MAX):
        raise _bad("seed", "an int in [0, 2**64 - 1] or null", seed)
    # an extension (not OpenAI's): admitted and kept running before lower priorities
    priority = body.get("priority")
    priority = 0 if priority is None else priority
    if not (_is_int(priority) and -_PRIORITY_MAX <= priority <= _PRIORITY_MAX):
        raise _bad("priority", f"an int in [-{_PRIORITY_MAX}, {_PRIORITY_MAX}] or null "
                               f"(higher runs first)", priority)

    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)
            and len(stop) <= MAX_STOP_STRINGS):
        raise _bad("stop", f"a non-empty string or a list of at most {MAX_STOP_STRINGS} "
                           f"non-empty strings", body.get("stop"))

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

    if chat:
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
        logprobs = (top or 0) if want else None
    else:
        logprobs = body.get("logprobs")
        if logprobs is not None and not (_is_int(logprobs) and 0 <= logprobs <= MAX_TOP_LOGPROBS):
            raise _bad("logprobs", f"an int in [0, {MAX_TOP_LOGPROBS}] or null", logprobs)

    policy = dict(temperature=float(temperature), top_p=float(top_p), top_k=int(top_k),
                  min_p=float(min_p))
    return _Params(max_tokens, policy, seed, stop, stream, include_usage, logprobs,
                   int(priority))


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


# --- the app -------------------------------------------------------------------------------------------


async def _disconnected(request: fastapi.Request) -> None:
    """Returns when the client has gone (the body is already read: the next ASGI message
    is http.disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class _Listener:
    """The next item of a request's queue, or None once the client has disconnected."""

    def __init__(self, request: fastapi.Request, req: _Request) -> None:
        self.req = req
        self.gone = asyncio.ensure_future(_disconnected(request))

    async def next(self) -> Optional[list]:
        """Every item queued now (at least one), or None: the client left."""
        q = self.req.queue
        if q.empty():
            get = asyncio.ensure_future(q.get())
            pending = True
            try:
                await asyncio.wait({get, self.gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:  # also when this wait is cancelled (the response task ends)
                pending = not get.done()
                if pending:
                    get.cancel()
            if pending:
                return None
            items = [get.result()]
        else:
            items = [q.get_nowait()]
        while not q.empty():
            items.append(q.get_nowait())
        return items

    def close(self) -> None:
        self.gone.cancel()


def create_app(decoder: Any, tokenizer: Any, model_name: str, *,
               default_max_tokens: int = 256) -> fastapi.FastAPI:
    """A FastAPI app serving ``decoder`` (a SpecDecoder) under the name ``model_name``.

    ``tokenizer`` encodes prompts, renders chat templates, decodes text, and gives the
    stop ids (``eos_token_ids``). A request without ``max_tokens`` gets
    ``default_max_tokens``, at most what the context leaves. The decode thread starts
    and stops with the app (its lifespan); the decoder must not be stepped by anyone
    else meanwhile.
    """
    if not isinstance(model_name, str) or not model_name:
        raise ValueError(f"create_app: model_name must be a non-empty str, got {model_name!r}")
    if not _is_int(default_max_tokens) or default_max_tokens < 1:
        raise ValueError(f"create_app: default_max_tokens must be an int >= 1, "
                         f"got {default_max_tokens!r}")
    engine = Engine(decoder)
    max_context = decoder.target.geometry.max_context
    vocab_size = decoder.vocab_size
    block_size = decoder.block_size
    eos = list(getattr(tokenizer, "eos_token_ids", ()) or ())
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: fastapi.FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.stop)

    app = fastapi.FastAPI(title="verispec", lifespan=lifespan, docs_url=None, redoc_url=None,
                          openapi_url=None)
    app.state.engine = engine

    @app.exception_handler(APIError)
    async def api_error(request: fastapi.Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: fastapi.Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(status_code=exc.status_code,
                            content=_error_body(f"{request.method} {request.url.path}: "
                                                f"{exc.detail}", kind))

    # -- request checks --------------------------------------------------------------------
    async def read_body(request: fastapi.Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}",
                           code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, f"the request body must be a JSON object, got "
                                f"{type(body).__name__}", code="invalid_json")
        model = body.get("model")
        if model != model_name:
            raise APIError(404, f"model: this server serves {model_name!r}, got "
                                f"{json.dumps(model)}", param="model", code="model_not_found")
        return body

    def token_ids(value: Any, param: str) -> list[int]:
        if not value or not all(_is_int(t) and 0 <= t < vocab_size for t in value):
            raise _bad(param, f"token ids in [0, {vocab_size})", value)
        return [int(t) for t in value]

    def completion_prompt(body: dict) -> list[int]:
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]  # one prompt in a batch of one
        if isinstance(p, str):
            ids = tokenizer.encode(p)
        elif isinstance(p, list) and all(_is_int(t) for t in p):
            ids = token_ids(p, "prompt")
        else:
            raise _bad("prompt", "a string or a list of token ids (one prompt per request)", p)
        if not ids:
            raise _bad("prompt", "text that encodes to at least one token", p)
        return list(ids)

    def chat_prompt(body: dict) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad("messages", "a non-empty list of {role, content} objects", messages)
        clean = []
        for i, m in enumerate(messages):
            param = f"messages[{i}]"
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise _bad(param, "an object with a string role", m)
            content = m.get("content")
            if isinstance(content, list):  # content parts: text only
                if not all(isinstance(part, dict) and part.get("type") == "text"
                           and isinstance(part.get("text"), str) for part in content):
                    raise _bad(f"{param}.content", "a string or a list of text parts", content)
                content = "".join(part["text"] for part in content)
            elif content is None:
                content = ""
            elif not isinstance(content, str):
                raise _bad(f"{param}.content", "a string or a list of text parts", content)
            clean.append({"role": m["role"], "content": content})
        if getattr(tokenizer, "chat_template", None) is None:
            raise APIError(400, f"messages: the model {model_name!r} has no chat template; "
                                f"use /v1/completions", param="messages", code="invalid_value")
        try:
            ids = tokenizer.apply_chat_template(clean, tokenize=True, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - the template's own error (raise_exception)
            raise APIError(400, f"messages: the chat template refused them: {e}",
                           param="messages", code="invalid_value") from None
        return list(ids)

    def budget(prompt: list[int], params: _Params, param: str) -> int:
        """max_new_tokens for the request; 400 when it cannot fit the context or cache."""
        n = len(prompt)
        if n >= max_context:
            raise APIError(400, f"{param}: the prompt has {n} tokens; the model's context is "
                                f"{max_context} (at most {max_context - 1} prompt tokens)",
                           param=param, code="context_length_exceeded")
        if params.max_tokens is None:
            max_new = min(default_max_tokens, max_context - n)
        else:
            max_new = params.max_tokens
            if n + max_new > max_context:
                raise APIError(400, f"max_tokens: the prompt ({n} tokens) plus max_tokens "
                                    f"({max_new}) exceeds the model's context of {max_context}",
                               param="max_tokens", code="context_length_exceeded")
        need = blocks_for(n + max_new, block_size, spare=0)
        roles = ["target"] + (["draft"] if decoder.draft is not None
                              and not decoder.shares_target_cache else [])
        for role in roles:
            have = decoder.num_blocks(role)
            if need > have:
                raise APIError(400, f"max_tokens: the prompt ({n} tokens) plus max_tokens "
                                    f"({max_new}) needs {need} KV blocks of {block_size} tokens; "
                                    f"the server's {role} cache has {have}",
                               param="max_tokens", code="context_length_exceeded")
        return max_new

    def submit(prompt: list[int], params: _Params, max_new: int) -> _Request:
        kwargs: dict = dict(max_new_tokens=max_new, eos_token_id=eos, logprobs=params.logprobs,
                            **params.policy)
        if params.seed is not None:  # the request's own stream: the same text in any batch
            kwargs["seed"] = params.seed
        if params.priority:
            kwargs["priority"] = params.priority
        try:
            return engine.submit(prompt, **kwargs)
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e), code="invalid_value") from None
        except EngineStopped as e:
            raise APIError(503, str(e), type="server_error") from None

    # -- one generation, streamed or whole --------------------------------------------------------
    async def generate(request: fastapi.Request, chat: bool) -> Any:
        body = await read_body(request)
        params = _parse_params(body, chat=chat)
        prompt = chat_prompt(body) if chat else completion_prompt(body)
        max_new = budget(prompt, params, "messages" if chat else "prompt")
        req = submit(prompt, params, max_new)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        listener = _Listener(request, req)
        text = _Text(tokenizer, params.stop)
        lp = _Logprobs(tokenizer, params.logprobs or 0) if params.logprobs is not None else None
        usage = lambda: {"prompt_tokens": len(prompt), "completion_tokens": text.kept,  # noqa: E731
                         "total_tokens": len(prompt) + text.kept}

        def step_result(item: tuple) -> tuple[str, Any, Optional[str]]:
            """(text delta, logprobs of the kept tokens, OpenAI finish reason or None)."""
            _, tokens, logprobs, finish = item
            delta, kept = text.push(tokens, final=finish is not None)
            if text.stopped:
                engine.cancel(req, stop_string=True)
                reason = "stop"
            else:
                reason = None if finish is None else FINISH_REASONS.get(finish, "stop")
            formatted = None
            if lp is not None and logprobs is not None:
                items = logprobs[:kept]
                formatted = lp.chat(items) if chat else lp.completion(items)
            return delta, formatted, reason

        def error_of(item: tuple) -> APIError:
            _, status, message, kind = item
            return APIError(status, message, type=kind)

        try:
            items = await listener.next()
        except BaseException:
            listener.close()
            engine.cancel(req)
            raise
        if items is None:  # the client left before the first token
            listener.close()
            engine.cancel(req)
            return fastapi.Response(status_code=499)
        if items[0][0] == "error":
            listener.close()
            return error_of(items[0]).response()

        if not params.stream:
            try:
                out_text, out_lp, reason = [], None, None
                while True:
                    for item in items:
                        if item[0] == "error":
                            return error_of(item).response()
                        delta, formatted, reason = step_result(item)
                        out_text.append(delta)
                        if formatted is not None:
                            out_lp = (formatted if out_lp is None else out_lp + formatted) if chat \
                                else _merge_completion_logprobs(out_lp, formatted)
                        if reason is not None:
                            break
                    if reason is not None:
                        break
                    items = await listener.next()
                    if items is None:
                        return fastapi.Response(status_code=499)
            finally:
                listener.close()
                engine.cancel(req)  # no-op when it finished; a stop string ends it here
            content = "".join(out_text)
            if chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": content},
                          "logprobs": None if lp is None else {"content": out_lp or []},
                          "finish_reason": reason}
                obj = "chat.completion"
            else:
                choice = {"index": 0, "text": content,
                          "logprobs": None if lp is None else (out_lp or lp.completion([])),
                          "finish_reason": reason}
                obj = "text_completion"
            return JSONResponse({"id": rid, "object": obj, "created": int(time.time()),
                                 "model": model_name, "choices": [choice], "usage": usage()})

        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str, formatted: Any, reason: Optional[str], first: bool) -> str:
            if chat:
                d: dict = {"role": "assistant", "content": delta} if first else (
                    {"content": delta} if delta or reason is None else {})
                choice = {"index": 0, "delta": d,
                          "logprobs": None if formatted is None else {"content": formatted},
                          "finish_reason": reason}
            else:
                choice = {"index": 0, "text": delta, "logprobs": formatted,
                          "finish_reason": reason}
            payload = {"id": rid, "object": obj, "created": int(time.time()),
                       "model": model_name, "choices": [choice]}
            if params.include_usage:
                payload["usage"] = None
            return _sse(payload)

        async def events(items: list) -> AsyncIterator[str]:
            first = True
            try:
                while True:
                    for item in items:
                        if item[0] == "error":
                            yield _sse(_error_body(item[2], item[3]))
                            return
                        delta, formatted, reason = step_result(item)
                        if delta or formatted or reason is not None or first:
                            yield chunk(delta, formatted, reason, first)
                            first = False
                        if reason is not None:
                            if params.include_usage:
                                yield _sse({"id": rid, "object": obj, "created": int(time.time()),
                                            "model": model_name, "choices": [], "usage": usage()})
                            yield "data: [DONE]\n\n"
                            return
                    items = await listener.next()
                    if items is None:
                        return  # the client left: abort below
            finally:
                listener.close()
                engine.cancel(req)

        return StreamingResponse(events(items), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions")
    async def completions(request: fastapi.Request) -> Any:
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: fastapi.Request) -> Any:
        return await generate(request, chat=True)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": created, "owned_by": "verispec",
                                            "max_model_len": max_context}]}

    @app.get("/health")
    async def health() -> Any:
        alive = engine._thread is not None and engine._thread.is_alive()
        if not alive:
            return JSONResponse(status_code=503, content={"status": "decode thread not running"})
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(format_metrics(engine.snapshot()),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


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


def serve(decoder: Any, tokenizer: Any, model_name: str, *, host: str = "127.0.0.1",
          port: int = 8000, log_level: str = "info", default_max_tokens: int = 256) -> None:
    """Serves ``create_app(decoder, tokenizer, model_name)`` with uvicorn until interrupted."""
    app = create_app(decoder, tokenizer, model_name, default_max_tokens=default_max_tokens)
    uvicorn.run(app, host=host, port=port, log_level=log_level)
