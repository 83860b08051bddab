"""The decode step as a server embeds it: calls from other threads while steps run, a
custom ops object that breaks its contract, a second concurrent step, a long process
life (ids reused, no reference cycle), and the package front."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import time
import weakref

import pytest
import torch
from toymodels import CacheModel

import verispec
from verispec import _C, ops as native_ops
from verispec.decoder import SpecDecoder
from verispec.drafters import NGram

V = 13
T, D = _C.ModelRole.target, _C.ModelRole.draft


def models():
    target = CacheModel(V, seed=1, max_context=4096)
    draft = CacheModel(V, base=target, noise=0.7, seed=2, max_context=4096)
    return target, draft


def solo_greedy(target, draft, prompt, n, k=3):
    dec = SpecDecoder(target, draft, k=k, num_blocks=64, block_size=4)
    (r,) = dec.generate([prompt], max_new_tokens=n, greedy=True)
    return r.tokens


def snapshot(dec: SpecDecoder, seqs):
    """Everything a failed step must leave as it was."""
    core = dec._core
    rows = {}
    for s in seqs:
        rows[s] = (core.committed(s), core.finish_reason(s), core.cache_len(s, T),
                   core.cache_len(s, D), core.stats(s)["steps"], core.stats(s)["acceptance_estimate"])
    blocks = (dec.num_free_blocks("target"),
              dec.num_free_blocks("draft") if dec.draft is not None else None)
    return rows, blocks, core.offset


class SleepyModel:
    """A CacheModel whose forward sleeps (releasing the GIL, as torch ops do) and may run
    a callback inside the forward, as a re-entrant caller or another thread would."""

    def __init__(self, inner: CacheModel, sleep: float = 0.0) -> None:
        self.inner, self.sleep, self.inside = inner, sleep, None
        self.geometry = inner.geometry

    def forward(self, batch):
        if self.sleep:
            time.sleep(self.sleep)
        if self.inside is not None:
            self.inside()
        return self.inner.forward(batch)


# ---- threads ----------------------------------------------------------------------

def test_abort_release_add_from_another_thread_while_steps_run():
    """A second thread aborts, releases and adds while the main thread steps (the
    model's forward sleeps, so the calls land mid-step). Nothing crashes, no block
    leaks, and every sequence that was never touched decodes exactly its solo run."""
    target, draft = models()
    sleepy = SleepyModel(target, sleep=0.0005)
    dec = SpecDecoder(sleepy, draft, k=3, num_blocks=4096, draft_num_blocks=4096, block_size=4)
    keep_prompts = {dec.add([1, 2, 3], max_new_tokens=40, greedy=True): [1, 2, 3],
                    dec.add([7, 8], max_new_tokens=40, greedy=True): [7, 8]}
    victims: list[int] = []
    lock = threading.Lock()
    stop = threading.Event()
    errors: list[BaseException] = []
    calls = {"add": 0, "abort": 0, "release": 0}

    def churn():
        i = 0
        deadline = time.monotonic() + 60
        try:
            while not stop.is_set() and time.monotonic() < deadline and i < 6000:
                i += 1
                with lock:
                    if len(victims) < 6:
                        victims.append(dec.add([i % V, (i * 7) % V], max_new_tokens=30,
                                               temperature=1.0))
                        calls["add"] += 1
                        continue
                    s = victims.pop(0)
                if i % 2:
                    dec.abort(s)
                    calls["abort"] += 1
                dec.release(s)
                calls["release"] += 1
                time.sleep(0)
        except BaseException as e:  # surfaced below
            errors.append(e)

    worker = threading.Thread(target=churn)
    worker.start()
    steps = 0
    try:
        while any(dec._core.finish_reason(s) == "running" for s in keep_prompts) and steps < 500:
            dec.step()
            steps += 1
    finally:
        stop.set()
        worker.join(timeout=120)
    assert not worker.is_alive() and not errors, errors
    assert calls["release"] > 20 and calls["abort"] > 10, calls
    for s, prompt in keep_prompts.items():
        assert dec.result(s).tokens == solo_greedy(target, draft, prompt, 40)
    with lock:
        for s in victims:
            dec.release(s)
    while dec.has_running():
        dec.step()
    for s in keep_prompts:
        dec.release(s)
    assert dec._core.num_sequences() == 0
    assert dec.num_free_blocks("target") == dec.num_blocks("target")
    assert dec.num_free_blocks("draft") == dec.num_blocks("draft")


def test_calls_from_inside_a_forward_apply_when_the_step_ends():
    """Re-entrant calls (a forward that aborts, releases and adds, and tries a second
    step): the step completes, the abort and release land after it, nothing corrupts."""
    target, draft = models()
    sleepy = SleepyModel(target)
    dec = SpecDecoder(sleepy, draft, k=3, num_blocks=256, block_size=4)
    a = dec.add([1, 2, 3], max_new_tokens=20, greedy=True)
    b = dec.add([4, 5], max_new_tokens=20, greedy=True)
    c = dec.add([6], max_new_tokens=20, greedy=True)
    seen = {}

    def inside():
        sleepy.inside = None
        dec.abort(b)
        dec.release(c)
        seen["added"] = dec.add([9, 9], max_new_tokens=5, greedy=True)
        with pytest.raises(verispec.StepInProgressError, match="one step at a time"):
            dec.step()
        seen["b during"] = dec._core.finish_reason(b)

    sleepy.inside = inside
    out = {o.seq: o for o in dec.step()}
    assert seen["b during"] == "running"  # queued: b is a row of the running step
    assert set(out) == {a, b}             # c was released by the step's end
    assert out[b].finish_reason == "aborted" and out[a].finish_reason is None
    with pytest.raises(KeyError, match=f"unknown sequence id {c}"):
        dec.result(c)
    assert dec.result(seen["added"]).tokens == []  # joins the next step
    while dec.has_running():
        dec.step()
    assert dec.result(a).tokens == solo_greedy(target, draft, [1, 2, 3], 20)
    assert dec.result(seen["added"]).tokens == solo_greedy(target, draft, [9, 9], 5)


# ---- out-of-contract ops ------------------------------------------------------------

class BadOps:
    """verispec.ops, with one kind of out-of-contract verify or sample result."""

    def __init__(self, kind: str | None) -> None:
        self.kind = kind
        self.apply_policy = native_ops.apply_policy

    def sample(self, probs, seed=0, offset=0):
        tokens = native_ops.sample(probs, seed=seed, offset=offset)
        if self.kind == "sample_out_of_vocab":
            tokens = tokens.clone()
            tokens[0] = V + 5
        if self.kind == "sample_wrong_count":
            tokens = tokens[:-1] if tokens.numel() > 1 else torch.cat([tokens, tokens])
        return tokens

    def verify(self, logits, draft_tokens, draft_probs, **kw):
        tokens, emitted, accepted = native_ops.verify(logits, draft_tokens, draft_probs, **kw)
        tokens, emitted, accepted = tokens.clone(), emitted.clone(), accepted.clone()
        kind = self.kind
        if kind == "token_out_of_vocab":
            tokens[0, 0] = 12589
        elif kind == "token_negative":
            tokens[0, 0] = -3
        elif kind == "accepted_past_drafts":
            accepted[0] = int(kw["num_draft"][0]) + 1
            emitted[0] = accepted[0] + 1
        elif kind == "accepted_negative":
            accepted[0] = -1
        elif kind == "emitted_negative":
            emitted[0] = -4
        elif kind == "emitted_not_accepted_plus_one":
            emitted[0] = accepted[0] + 2
        elif kind == "accepted_not_the_draft":
            k = int(kw["num_draft"][0])
            if k > 0:
                accepted[0], emitted[0] = 1, 2
                tokens[0, 0] = (int(draft_tokens[0, 0]) + 1) % V
                tokens[0, 1] = 0
        elif kind == "tokens_wrong_shape":
            tokens = tokens[:, :1]
        elif kind == "counts_wrong_shape":
            emitted = emitted[:1].repeat(3)
        elif kind == "tokens_float":
            tokens = tokens.float()
        elif kind == "verify_not_a_tuple":
            return {"tokens": tokens}
        return tokens, emitted, accepted


BAD_VERIFY = {
    "token_out_of_vocab": r"tokens\[0, 0\] must be in \[0, 13\), got 12589",
    "token_negative": r"tokens\[0, 0\] must be in \[0, 13\), got -3",
    "accepted_past_drafts": r"num_accepted\[0\] must be in \[0, \d\] \(the row's drafts\), got \d",
    "accepted_negative": r"num_accepted\[0\] must be in \[0, \d\].*got -1",
    "emitted_negative": r"num_emitted\[0\] must be num_accepted \+ 1 = \d, got -4",
    "emitted_not_accepted_plus_one": r"num_emitted\[0\] must be num_accepted \+ 1",
    "accepted_not_the_draft": r"tokens\[0, 0\] is accepted, so it must equal the draft",
    "tokens_wrong_shape": r"ops.verify must return an integer tensor \[2, 4\] as tokens, got int32 \[2, 1\]",
    "counts_wrong_shape": r"ops.verify must return an integer tensor \[2\] as num_emitted, got int32 \[3\]",
    "tokens_float": r"ops.verify must return an integer tensor \[2, 4\] as tokens, got float32",
    "verify_not_a_tuple": r"ops.verify must return \(tokens, num_emitted, num_accepted\), got dict",
    "sample_wrong_count": r"ops.sample must return an integer tensor \[2\] as tokens, got int32 \[1\]",
    # ops.verify sees it first here; a verify that does not would meet the core's check
    "sample_out_of_vocab": r"draft_tokens.* must be in \[0, (V\) = \[0, )?13\), got 18",
}


@pytest.mark.parametrize("kind", sorted(BAD_VERIFY))
def test_out_of_contract_ops_fail_cleanly_and_the_next_step_continues(kind):
    """Each kind of bad result: a ValueError naming it, the decoder's state unchanged
    (committed tokens, cache lengths, free blocks, statistics, random offset), and the
    next steps with correct ops give exactly the tokens of an undisturbed run."""
    target, draft = models()
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    want = [r.tokens for r in SpecDecoder(target, draft, k=3, num_blocks=64, block_size=4, seed=5)
            .generate(prompts, max_new_tokens=12, temperature=1.0)]
    dec = SpecDecoder(target, draft, k=3, num_blocks=64, block_size=4)
    dec._core.reseed(5)
    seqs = [dec.add(p, max_new_tokens=12, temperature=1.0) for p in prompts]
    dec.step()  # the caches hold something
    before = snapshot(dec, seqs)
    good = dec._ops
    dec._ops = BadOps(kind)
    if kind == "accepted_not_the_draft":  # needs a row with drafts: k is fixed at 3
        assert dec._core.finish_reason(seqs[0]) == "running"
    with pytest.raises(ValueError, match=BAD_VERIFY[kind]):
        dec.step()
    assert snapshot(dec, seqs) == before
    assert not dec._core.step_open
    dec._ops = good
    while dec.has_running():
        dec.step()
    assert [dec.result(s).tokens for s in seqs] == want


def test_a_model_returning_the_wrong_logits_shape_changes_nothing():
    target, draft = models()
    dec = SpecDecoder(target, NGram(1, 2), k=3, num_blocks=64, block_size=4)
    s = dec.add([1, 2, 1, 2, 1], max_new_tokens=10, greedy=True)
    dec.step()
    before = snapshot(dec, [s])
    real = target.forward
    target.forward = lambda batch: real(batch)[:, :5]
    try:
        with pytest.raises(ValueError, match=r"target model: forward must return logits \[R, V\]"):
            dec.step()
    finally:
        del target.forward
    assert snapshot(dec, [s]) == before
    while dec.has_running():
        dec.step()
    assert dec.result(s).tokens == solo_greedy(target, None, [1, 2, 1, 2, 1], 10)


def test_ngram_drafts_that_differ_from_the_proposals_are_refused():
    """With n-gram drafting the proposals are the core's; a verify that accepted other
    tokens cannot be committed (the n-gram index is unchanged too)."""
    target, _ = models()
    dec = SpecDecoder(target, NGram(1, 2), k=3, num_blocks=64, block_size=4)
    s = dec.add([1, 2, 1, 2, 1, 2, 1], max_new_tokens=10, greedy=True)
    before = snapshot(dec, [s])
    dec._ops = BadOps("accepted_not_the_draft")
    with pytest.raises(ValueError, match="is accepted, so it must equal the draft"):
        dec.step()
    assert snapshot(dec, [s]) == before


# ---- a long process life ------------------------------------------------------------

def test_ids_are_reused_and_running_work_stays_proportional():
    target, _ = models()
    dec = SpecDecoder(target, None, num_blocks=64, block_size=4)
    live = dec.add([1], max_new_tokens=1000, greedy=True)
    for _ in range(2000):
        s = dec.add([2, 3], max_new_tokens=5, greedy=True)
        assert s == live + 1  # the released id comes back
        dec.release(s)
    assert dec._core.num_sequences() == 1
    assert dec._core.num_running() + dec._core.num_waiting() == 1  # live waits to be admitted
    assert dec.num_free_blocks() == dec.num_blocks()


def test_del_frees_the_decoder_and_its_pools_without_the_garbage_collector():
    target, draft = models()
    dec = SpecDecoder(target, draft, k=2, num_blocks=32, block_size=4)
    dec.generate([[1, 2]], max_new_tokens=5, temperature=1.0)
    pool = weakref.ref(dec._pools[T].k[0])
    draft_pool = weakref.ref(dec._pools[D].k[0])
    ref = weakref.ref(dec)
    gc.disable()
    try:
        del dec
        assert ref() is None, "the decoder is held by a reference cycle"
        assert pool() is None and draft_pool() is None, "the KV pools outlived the decoder"
    finally:
        gc.enable()


def test_k_and_policy_bounds_are_one_rule():
    target, draft = models()
    with pytest.raises(ValueError, match=r"k must be in \[0, 64\], got 1000000000000$"):
        SpecDecoder(target, draft, k=10**12)
    dec = SpecDecoder(target, draft, k=2, num_blocks=16, block_size=4)
    with pytest.raises(ValueError, match="temperature must be finite and >= 0, got inf"):
        dec.add([1], max_new_tokens=3, temperature=float("inf"))
    with pytest.raises(TypeError, match="temperature must be a number"):
        dec.add([1], max_new_tokens=3, temperature="0.7")
    s = dec.add([1], max_new_tokens=3, eos_token_id=torch.tensor(2).numpy()[()])  # numpy int
    assert dec.result(s).finish_reason == "running"
    dec.release(s)
    gen = (p for p in [[1, 2], [3]])
    assert [len(r.tokens) for r in dec.generate(gen, max_new_tokens=2)] == [2, 2]


def test_a_draft_with_a_shorter_context_stops_drafting_instead_of_failing():
    target = CacheModel(V, seed=1, max_context=64)
    draft = CacheModel(V, base=target, noise=0.7, seed=2, max_context=12)
    dec = SpecDecoder(target, draft, k=4, num_blocks=64, block_size=4)
    (r,) = dec.generate([[1, 2, 3]], max_new_tokens=30, greedy=True)
    assert r.tokens == solo_greedy(target, None, [1, 2, 3], 30)
    assert r.stats["k_history"][-1] == 0 and max(r.stats["k_history"]) == 4


# ---- the package front --------------------------------------------------------------

def test_import_is_light_and_submodules_resolve_on_first_use():
    code = ("import sys, verispec\n"
            "assert 'torch' not in sys.modules, 'import verispec loaded torch'\n"
            "assert verispec.ops.verify and verispec.models.load and verispec.drafters.NGram\n"
            "assert verispec.SpecDecoder is verispec.decoder.SpecDecoder\n"
            "assert 'torch' in sys.modules\n"
            "try:\n    verispec.nonexistent\nexcept AttributeError as e:\n"
            "    assert 'nonexistent' in str(e)\nelse:\n    raise SystemExit('no AttributeError')\n")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- one copy each way -------------------------------------------------------------

class TableModel:
    """Logits from tensor ops alone (no host reads): the shape a GPU model has."""

    def __init__(self, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(vocab, 64, vocab, generator=g)
        self.geometry = verispec.models.ModelGeometry(
            num_layers=1, num_kv_heads=1, head_dim=2, vocab_size=vocab, max_context=64,
            dtype=torch.float32, device=torch.device("cpu"))

    def forward(self, batch):
        t = batch.logits_indices
        return self.table[batch.input_ids[t], batch.positions[t]]


def test_a_step_reads_the_device_once(monkeypatch):
    """With a model that never reads its tensors back, a whole step (K draft passes, the
    verify pass, the ops) brings data to the host exactly once: verify's results and
    the proposals, in one copy. Counted by wrapping every way a tensor reaches Python."""
    target, draft = TableModel(V, 1), TableModel(V, 2)
    dec = SpecDecoder(target, draft, k=4, num_blocks=64, block_size=4)
    for p in ([1, 2, 3], [4, 5], [6]):
        dec.add(p, max_new_tokens=20, temperature=0.9, top_k=5)
    dec.step()
    reads = []
    for name in ("tolist", "item", "numpy", "__int__", "__index__", "__bool__", "__float__"):
        real = getattr(torch.Tensor, name)

        def counted(self, *a, _real=real, _name=name, **kw):
            reads.append(_name)
            return _real(self, *a, **kw)
        monkeypatch.setattr(torch.Tensor, name, counted)
    out = dec.step()
    monkeypatch.undo()
    assert len(out) == 3 and all(o.tokens for o in out)
    assert reads == ["numpy"], reads
