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

The package, one unit per job: ``engine`` (the decode thread), ``params`` (a request's
parameters, checked, and the errors in OpenAI's shape), ``text`` (detokenizing, stop
strings, logprobs, server-sent events, metrics), ``app`` (the FastAPI app: its routes
and a request's checks) and ``generation`` (one request answered, streamed or whole).
"""

from __future__ import annotations

try:
    import fastapi  # noqa: F401 - checked here, used by app and params
    import uvicorn  # noqa: F401
except ModuleNotFoundError as e:  # pragma: no cover - exercised by a subprocess test
    raise ModuleNotFoundError(
        f"verispec.server needs the Python package {e.name!r} (fastapi and uvicorn): "
        f"pip install 'verispec[serve]'", name=e.name) from None

from verispec.server.app import create_app, serve
from verispec.server.engine import Engine, EngineStopped
from verispec.server.params import MAX_STOP_STRINGS, MAX_TOP_LOGPROBS, APIError
from verispec.server.text import FINISH_REASONS, format_metrics

__all__ = ["Engine", "create_app", "serve", "FINISH_REASONS", "MAX_TOP_LOGPROBS"]
