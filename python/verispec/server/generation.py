"""One generation: a submitted request's tokens become text (stop strings applied) and
logprobs, answered as one JSON object or as server-sent events; the client's leaving
cancels it."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator, Optional

import fastapi
from fastapi.responses import JSONResponse, StreamingResponse

from verispec.server.engine import _Request
from verispec.server.params import APIError, _error_body, _Params
from verispec.server.text import (FINISH_REASONS, _Logprobs, _merge_completion_logprobs, _sse,
                                  _Text)

if TYPE_CHECKING:
    from verispec.server.app import _Service


# --- one generation, streamed or whole -------------------------------------------------------


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


def _error_of(item: tuple) -> APIError:
    _, status, message, kind = item
    return APIError(status, message, type=kind)


class _Generation:
    """One submitted request: its tokens become text (stop strings applied) and logprobs,
    answered as one JSON object or as server-sent events. The request is cancelled when
    the answer ends for any reason (a no-op once it finished)."""

    def __init__(self, service: _Service, request: fastapi.Request, req: _Request,
                 prompt: list[int], params: _Params, chat: bool) -> None:
        self.service, self.engine, self.req = service, service.engine, req
        self.prompt, self.params, self.chat = prompt, params, chat
        self.model_name = service.model_name
        self.rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.listener = _Listener(request, req)
        self.text = _Text(service.tokenizer, params.stop)
        self.lp = (_Logprobs(service.tokenizer, params.logprobs or 0)
                   if params.logprobs is not None else None)

    def usage(self) -> dict:
        kept = self.text.kept
        return {"prompt_tokens": len(self.prompt), "completion_tokens": kept,
                "total_tokens": len(self.prompt) + kept}

    async def respond(self) -> Any:
        """Waits for the first step's items; then the whole answer or the stream."""
        try:
            items = await self.listener.next()
        except BaseException:
            self.listener.close()
            self.engine.cancel(self.req)
            raise
        if items is None:  # the client left before the first token
            self.listener.close()
            self.engine.cancel(self.req)
            return fastapi.Response(status_code=499)
        if items[0][0] == "error":
            self.listener.close()
            return _error_of(items[0]).response()
        if not self.params.stream:
            return await self.whole(items)
        return StreamingResponse(self.events(items), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    def step_result(self, item: tuple) -> tuple[str, Any, Optional[str]]:
        """(text delta, logprobs of the kept tokens, OpenAI finish reason or None)."""
        _, tokens, logprobs, finish = item
        delta, kept = self.text.push(tokens, final=finish is not None)
        if self.text.stopped:
            self.engine.cancel(self.req, stop_string=True)
            reason = "stop"
        else:
            reason = None if finish is None else FINISH_REASONS.get(finish, "stop")
        formatted = None
        if self.lp is not None and logprobs is not None:
            items = logprobs[:kept]
            formatted = self.lp.chat(items) if self.chat else self.lp.completion(items)
        return delta, formatted, reason

    # -- whole ---------------------------------------------------------------------------------
    async def whole(self, items: list) -> Any:
        try:
            out_text, out_lp, reason = [], None, None
            while True:
                for item in items:
                    if item[0] == "error":
                        return _error_of(item).response()
                    delta, formatted, reason = self.step_result(item)
                    out_text.append(delta)
                    if formatted is not None:
                        out_lp = (formatted if out_lp is None else out_lp + formatted) \
                            if self.chat else _merge_completion_logprobs(out_lp, formatted)
                    if reason is not None:
                        break
                if reason is not None:
                    break
                items = await self.listener.next()
                if items is None:
                    return fastapi.Response(status_code=499)
        finally:
            self.listener.close()
            self.engine.cancel(self.req)  # no-op when it finished; a stop string ends it here
        return self.whole_response("".join(out_text), out_lp, reason)

    def whole_response(self, content: str, out_lp: Any, reason: Optional[str]) -> JSONResponse:
        lp = self.lp
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": content},
                      "logprobs": None if lp is None else {"content": out_lp or []},
                      "finish_reason": reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": content,
                      "logprobs": None if lp is None else (out_lp or lp.completion([])),
                      "finish_reason": reason}
            obj = "text_completion"
        return JSONResponse({"id": self.rid, "object": obj, "created": int(time.time()),
                             "model": self.model_name, "choices": [choice],
                             "usage": self.usage()})

    # -- streamed -------------------------------------------------------------------------------
    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def chunk(self, delta: str, formatted: Any, reason: Optional[str], first: bool) -> str:
        if self.chat:
            d: dict = {"role": "assistant", "content": delta} if first else (
                {"content": delta} if delta or reason is None else {})
            choice = {"index": 0, "delta": d,
                      "logprobs": None if formatted is None else {"content": formatted},
                      "finish_reason": reason}
        else:
            choice = {"index": 0, "text": delta, "logprobs": formatted,
                      "finish_reason": reason}
        payload = {"id": self.rid, "object": self.chunk_object, "created": int(time.time()),
                   "model": self.model_name, "choices": [choice]}
        if self.params.include_usage:
            payload["usage"] = None
        return _sse(payload)

    async def events(self, items: list) -> AsyncIterator[str]:
        first = True
        try:
            while True:
                for item in items:
                    if item[0] == "error":
                        yield _sse(_error_body(item[2], item[3]))
                        return
                    delta, formatted, reason = self.step_result(item)
                    if delta or formatted or reason is not None or first:
                        yield self.chunk(delta, formatted, reason, first)
                        first = False
                    if reason is not None:
                        if self.params.include_usage:
                            yield _sse({"id": self.rid, "object": self.chunk_object,
                                        "created": int(time.time()), "model": self.model_name,
                                        "choices": [], "usage": self.usage()})
                        yield "data: [DONE]\n\n"
                        return
                items = await self.listener.next()
                if items is None:
                    return  # the client left: abort below
        finally:
            self.listener.close()
            self.engine.cancel(self.req)
