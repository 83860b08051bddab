"""The FastAPI app: ``create_app`` wires the routes to a ``_Service`` (the decoder, the
tokenizer, the engine and the served name, with the checks a request passes before it
reaches the engine); a ``_Generation`` (generation.py) answers one request."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Mapping
from typing import Any, AsyncIterator, Optional

import fastapi
import uvicorn
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from verispec.cache import blocks_for
from verispec.server.auth import DEFAULT_TENANT, PROTECTED_PREFIX, ApiKeys
from verispec.server.engine import Engine, EngineStopped, _Request
from verispec.server.generation import _Generation
from verispec.server.params import APIError, _bad, _error_body, _is_int, _parse_params, _Params
from verispec.server.text import format_metrics


# --- the app and its routes -----------------------------------------------------------------


def create_app(decoder: Any, tokenizer: Any, model_name: str, *,
               default_max_tokens: int = 256,
               api_keys: Optional[Mapping[str, str]] = None) -> fastapi.FastAPI:
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
    service = _Service(decoder, tokenizer, model_name, default_max_tokens)
    engine = service.engine

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
    app.exception_handler(APIError)(_api_error)
    app.exception_handler(StarletteHTTPException)(_http_error)
    keys = ApiKeys(api_keys)
    app.state.api_keys = keys

    @app.middleware("http")
    async def authenticate(request: fastapi.Request, call_next):
        tenant = keys.tenant(request.headers.get("authorization"))
        if tenant is None and request.url.path.startswith(PROTECTED_PREFIX):
            given = request.headers.get("authorization")
            what = "no Authorization header" if not given else "an unknown key"
            return JSONResponse(status_code=401, headers={"WWW-Authenticate": "Bearer"},
                                content=_error_body(
                                    f"invalid API key: expected 'Authorization: Bearer KEY' "
                                    f"with a key this server accepts, got {what}",
                                    "invalid_request_error", None, "invalid_api_key"))
        request.state.tenant = tenant
        return await call_next(request)

    @app.post("/v1/completions")
    async def completions(request: fastapi.Request) -> Any:
        return await service.generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: fastapi.Request) -> Any:
        return await service.generate(request, chat=True)

    @app.get("/v1/models")
    async def models() -> dict:
        return service.models()

    @app.get("/health")
    async def health() -> Any:
        return service.health()

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(format_metrics(engine.snapshot()),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


async def _api_error(request: fastapi.Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def _http_error(request: fastapi.Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return JSONResponse(status_code=exc.status_code,
                        content=_error_body(f"{request.method} {request.url.path}: "
                                            f"{exc.detail}", kind))


def serve(decoder: Any, tokenizer: Any, model_name: str, *, host: str = "127.0.0.1",
          port: int = 8000, log_level: str = "info", default_max_tokens: int = 256,
          api_keys: Optional[Mapping[str, str]] = None) -> None:
    """Serves ``create_app(decoder, tokenizer, model_name)`` with uvicorn until interrupted."""
    app = create_app(decoder, tokenizer, model_name, default_max_tokens=default_max_tokens,
                     api_keys=api_keys)
    uvicorn.run(app, host=host, port=port, log_level=log_level)


# --- the app's state and a request's checks ---------------------------------------------------


class _Service:
    """What the routes share: the decoder, the tokenizer, the engine and the served name;
    the checks a request passes before it reaches the engine (each a 400 naming the
    field), and the answers of /v1/models and /health."""

    def __init__(self, decoder: Any, tokenizer: Any, model_name: str,
                 default_max_tokens: int) -> None:
        self.decoder, self.tokenizer, self.model_name = decoder, tokenizer, model_name
        self.default_max_tokens = default_max_tokens
        self.engine = Engine(decoder)
        self.max_context = decoder.target.geometry.max_context
        self.vocab_size = decoder.vocab_size
        self.block_size = decoder.block_size
        self.eos = list(getattr(tokenizer, "eos_token_ids", ()) or ())
        self.created = int(time.time())

    async def generate(self, request: fastapi.Request, chat: bool) -> Any:
        """One completion (``chat``: a chat completion), streamed or whole."""
        body = await self.read_body(request)
        params = _parse_params(body, chat=chat)
        prompt = self.chat_prompt(body) if chat else self.completion_prompt(body)
        max_new = self.budget(prompt, params, "messages" if chat else "prompt")
        req = self.submit(prompt, params, max_new,
                          getattr(request.state, "tenant", None) or DEFAULT_TENANT)
        return await _Generation(self, request, req, prompt, params, chat).respond()

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model",
                                            "created": self.created, "owned_by": "verispec",
                                            "max_model_len": self.max_context}]}

    def health(self) -> Any:
        thread = self.engine._thread
        if thread is None or not thread.is_alive():
            return JSONResponse(status_code=503, content={"status": "decode thread not running"})
        return {"status": "ok"}

    async def read_body(self, request: fastapi.Request) -> dict:
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
        if model != self.model_name:
            raise APIError(404, f"model: this server serves {self.model_name!r}, got "
                                f"{json.dumps(model)}", param="model", code="model_not_found")
        return body

    def token_ids(self, value: Any, param: str) -> list[int]:
        if not value or not all(_is_int(t) and 0 <= t < self.vocab_size for t in value):
            raise _bad(param, f"token ids in [0, {self.vocab_size})", value)
        return [int(t) for t in value]

    def completion_prompt(self, body: dict) -> list[int]:
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]  # one prompt in a batch of one
        if isinstance(p, str):
            ids = self.tokenizer.encode(p)
        elif isinstance(p, list) and all(_is_int(t) for t in p):
            ids = self.token_ids(p, "prompt")
        else:
            raise _bad("prompt", "a string or a list of token ids (one prompt per request)", p)
        if not ids:
            raise _bad("prompt", "text that encodes to at least one token", p)
        return list(ids)

    def chat_prompt(self, body: dict) -> list[int]:
        clean = _chat_messages(body.get("messages"))
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise APIError(400, f"messages: the model {self.model_name!r} has no chat template; "
                                f"use /v1/completions", param="messages", code="invalid_value")
        try:
            ids = self.tokenizer.apply_chat_template(clean, tokenize=True,
                                                     add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - the template's own error (raise_exception)
            raise APIError(400, f"messages: the chat template refused them: {e}",
                           param="messages", code="invalid_value") from None
        return list(ids)

    def budget(self, prompt: list[int], params: _Params, param: str) -> int:
        """max_new_tokens for the request; 400 when it cannot fit the context or cache."""
        n, max_context = len(prompt), self.max_context
        if n >= max_context:
            raise APIError(400, f"{param}: the prompt has {n} tokens; the model's context is "
                                f"{max_context} (at most {max_context - 1} prompt tokens)",
                           param=param, code="context_length_exceeded")
        if params.max_tokens is None:
            max_new = min(self.default_max_tokens, max_context - n)
        else:
            max_new = params.max_tokens
            if n + max_new > max_context:
                raise APIError(400, f"max_tokens: the prompt ({n} tokens) plus max_tokens "
                                    f"({max_new}) exceeds the model's context of {max_context}",
                               param="max_tokens", code="context_length_exceeded")
        need = blocks_for(n + max_new, self.block_size, spare=0)
        decoder = self.decoder
        roles = ["target"] + (["draft"] if decoder.draft is not None
                              and not decoder.shares_target_cache else [])
        for role in roles:
            have = decoder.num_blocks(role)
            if need > have:
                raise APIError(400, f"max_tokens: the prompt ({n} tokens) plus max_tokens "
                                    f"({max_new}) needs {need} KV blocks of {self.block_size} "
                                    f"tokens; the server's {role} cache has {have}",
                               param="max_tokens", code="context_length_exceeded")
        return max_new

    def submit(self, prompt: list[int], params: _Params, max_new: int,
               tenant: str = DEFAULT_TENANT) -> _Request:
        kwargs: dict = dict(max_new_tokens=max_new, eos_token_id=self.eos,
                            logprobs=params.logprobs, **params.policy)
        if getattr(self.decoder, "ngram_memory", None) is not None:
            kwargs["tenant"] = tenant   # the n-gram memory is kept per tenant
        if params.seed is not None:  # the request's own stream: the same text in any batch
            kwargs["seed"] = params.seed
        if params.priority:
            kwargs["priority"] = params.priority
        try:
            return self.engine.submit(prompt, **kwargs)
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e), code="invalid_value") from None
        except EngineStopped as e:
            raise APIError(503, str(e), type="server_error") from None


def _chat_messages(messages: Any) -> list[dict]:
    """The request's messages as {role, content} with string content (text parts joined)."""
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
    return clean
