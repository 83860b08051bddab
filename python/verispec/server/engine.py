"""The decode thread: ``Engine`` is the only caller of ``decoder.step()`` and
``decoder.release()``, and routes each step's tokens to the requests' asyncio queues."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from verispec import CacheFullError


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
