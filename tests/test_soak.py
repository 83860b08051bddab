"""Soak: 10,000 steps of random traffic through a tiny pool, then nothing leaked.

Random adds (greedy and sampled), aborts of running and waiting requests, requests run
to their max tokens, releases, a pool so small that sequences are preempted, and a token
budget so small that prompts are prefilled in chunks. At the end: every cache block of
the target and the draft is free, nothing runs or waits, every request added was either
finished or aborted, and the resident memory after a warm-up stayed flat.
"""

from __future__ import annotations

import os
import random
import time

from toymodels import CacheModel

from verispec.decoder import SpecDecoder

V = 13
STEPS = 10_000
WALL_S = 90.0          # the loop stops here even if STEPS are not done (2 cores, loaded)
MIN_STEPS = 2_000      # ... but a soak must have soaked
WARMUP = 1_000         # steps before the first memory reading
RSS_GROWTH_MB = 16.0   # allowed growth of the resident set after the warm-up


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        resident_pages = int(f.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_soak_random_traffic_leaks_nothing():
    rng = random.Random(1234)
    target = CacheModel(V, seed=1, max_context=64)
    draft = CacheModel(V, base=target, noise=0.7, seed=2, max_context=64)
    dec = SpecDecoder(target, draft, k=2, num_blocks=8, draft_num_blocks=8, block_size=4,
                      max_tokens_per_step=6, max_num_seqs=4)
    live: dict[int, int] = {}      # seq id -> request number (ids are reused after release)
    outcome: dict[int, str] = {}   # request number -> finish reason, recorded at release
    added = preempted_seen = chunked = 0
    start = time.perf_counter()
    rss_first = None
    steps = 0
    while steps < STEPS and time.perf_counter() - start < WALL_S:
        roll = rng.random()
        if roll < 0.25 and len(live) < 10:
            prompt = [rng.randrange(V) for _ in range(rng.randint(1, 8))]
            sampled = rng.random() < 0.5
            seed = rng.randrange(2**64) if sampled and rng.random() < 0.5 else None
            seq = dec.add(prompt, max_new_tokens=rng.randint(1, 12), greedy=not sampled,
                          temperature=0.8 if sampled else 1.0, seed=seed)
            live[seq] = added
            added += 1
        elif roll < 0.30 and live:
            dec.abort(rng.choice(list(live)))
        for seq in [s for s in live if dec.result(s).finish_reason != "running"]:
            result = dec.result(seq)  # finished (run to max tokens, EOS-free) or aborted
            assert result.finish_reason in ("length", "aborted"), result.finish_reason
            chunked += result.stats["prefill_chunks"]
            outcome[live.pop(seq)] = result.finish_reason
            dec.release(seq)
        dec.step()
        steps += 1
        if steps == WARMUP:
            rss_first = rss_mb()
    elapsed = time.perf_counter() - start
    preempted_seen = dec.num_preemptions()
    # drain: what still runs finishes, then everything is released
    while dec.has_running():
        dec.step()
    for seq, request in live.items():
        result = dec.result(seq)
        assert result.finish_reason in ("length", "aborted")
        outcome[request] = result.finish_reason
        dec.release(seq)
    rss_last = rss_mb()
    print(f"\nsoak: {steps} steps in {elapsed:.1f} s, {added} requests "
          f"({sum(r == 'aborted' for r in outcome.values())} aborted), "
          f"{preempted_seen} preemptions, {chunked} prefill chunks; "
          f"RSS after warm-up {rss_first:.1f} MiB, at the end {rss_last:.1f} MiB")
    assert steps >= MIN_STEPS
    assert sorted(outcome) == list(range(added)), "a request was lost"
    assert not dec.has_running() and dec.num_waiting() == 0
    for role in ("target", "draft"):
        assert dec.num_free_blocks(role) == dec.num_blocks(role), role
    assert dec._core.num_sequences() == 0
    assert preempted_seen > 0 and chunked > 0  # the pool and the budget were tight
    assert rss_first is not None and rss_last - rss_first < RSS_GROWTH_MB
