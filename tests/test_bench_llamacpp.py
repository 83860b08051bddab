"""bench/bench_llamacpp.py without llama-cpp-python (or matplotlib): verispec's side is
still measured, the targets that need llama.cpp say "not measured", the hint is printed."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "bench_llamacpp.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_llamacpp", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_llama_cpp(tmp_path):
    out = tmp_path / "llamacpp.json"
    hide = ("import runpy, sys; sys.modules['llama_cpp'] = None; "
            f"sys.argv = [{str(BENCH)!r}, '--max-new-tokens', '2', '--repeats', '1', "
            f"'--prompts', 'chat', '--out', {str(out)!r}]; "
            f"runpy.run_path({str(BENCH)!r}, run_name='__main__')")
    p = subprocess.run([sys.executable, "-c", hide], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    bench = _bench()
    assert bench.INSTALL_HINT in p.stderr and "llama.cpp: not measured" in p.stdout
    result = json.loads(out.read_text())
    assert result["llama_cpp"].startswith("llama-cpp-python is not installed")
    assert {r["prompt"] for r in result["rows"]} == {"open chat"}
    assert not any(r["engine"].startswith("llama.cpp") for r in result["rows"])
    # (generation-only tok/s is time(N) - time(1) over N - 1: with N = 2 on a loaded
    # machine its sign is noise, so only its presence is checked)
    assert all(isinstance(r["gen_tok_s"], float) and r["incl_prefill_tok_s"] > 0
               and r["first_token_s"] > 0 for r in result["rows"])
    checks = result["targets"]["open chat"]
    assert [checks[k]["met"] for k in ("plain_vs_llama_cpp_plain", "ngram_vs_llama_cpp_best")
            ] == [bench.NOT_MEASURED] * 2
    bound = checks["plain_vs_bandwidth_bound"]
    assert isinstance(bound["met"], bool) and isinstance(bound["ratio"], float)  # sign: noise
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_prompts_and_plot_without_matplotlib(tmp_path, monkeypatch):
    bench = _bench()
    assert list(bench.pick_prompts("copy-heavy,open chat")) == list(bench.PROMPTS)
    for bad in ("nothing", "", "o"):  # none, no name, several
        with pytest.raises(ValueError):
            bench.pick_prompts(bad)
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)
    note = bench.plot([], ["open chat"], 1.0, "t", tmp_path / "x.png")
    assert note.startswith("PNG skipped") and not (tmp_path / "x.png").exists()
