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
    p = subprocess.run([sys.executable, "-c", hide], capture_output=True, text=True, timeout=300)
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


def test_preset_mix_matches_llama_cpps_360m_file():
    """PRESET_MIX, the stand-in for llama.cpp's quantizer, gives the 360M shape's Q4_K_M
    file what issue 47 found in llama.cpp's: 176 Q5_0 matrices (its K = 960 rows fall back
    from Q4_K), the Q6_K ones of those rows in Q8_0, ffn_down (K = 2560) in Q4_K / Q6_K."""
    bench = _bench()
    hidden, inter, layers = bench.PRESETS["360M"][:3]
    types = [bench.preset_type("Q4_K_M", t, i, layers, inter if t == "ffn_down" else hidden)
             for i in range(layers)
             for t in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")]
    types.append(bench.preset_type("Q4_K_M", "token_embd", None, layers, hidden))
    counts = {t: types.count(t) for t in set(types)}
    assert counts == {"Q5_0": 176, "Q8_0": 17, "Q4_K": 16, "Q6_K": 16}, counts
    assert bench.preset_type("Q4_K_M", "ffn_down", 0, 16, 8192) == "Q6_K"
    assert bench.preset_type("Q4_0", "attn_q", 3, 16, 2048) == "Q4_0"


def test_tiny_preset_plain_only_without_llama_cpp(tmp_path):
    """--preset writes the random-weight file (SmolLM2's tokenizer, PRESET_MIX's types when
    llama-cpp-python is missing, which the output says), every matrix stays quantized, and
    each row has its share of the measured bandwidth."""
    out = tmp_path / "preset.json"
    hide = ("import runpy, sys; sys.modules['llama_cpp'] = None; "
            f"sys.argv = [{str(BENCH)!r}, '--preset', 'tiny', '--plain-only', '--max-new-tokens', "
            f"'3', '--repeats', '1', '--prompts', 'chat', '--out', {str(out)!r}]; "
            f"runpy.run_path({str(BENCH)!r}, run_name='__main__')")
    p = subprocess.run([sys.executable, "-c", hide], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    result = json.loads(out.read_text())
    assert result["preset"] == "tiny" and result["ftype"] == "Q4_K_M"
    assert "approximation of llama.cpp's Q4_K_M mix" in result["quantized_by"]
    assert "llama-cpp-python is not installed" in result["quantized_by"]
    assert result["file_types"] == {"F32": 5, "Q5_0": 12, "Q8_0": 1, "Q4_K": 2}
    assert result["converted"] == []
    assert (tmp_path / "bench/out/presets/tiny-Q4_K_M-verispec-mix.gguf").exists()
    assert {r["engine"] for r in result["rows"]} == {
        "verispec quantized plain", "verispec quantized/float plain", "verispec float32 plain"}
    assert all(r["bandwidth_share"] == pytest.approx(r["gen_tok_s"] / r["bandwidth_bound_tok_s"])
               for r in result["rows"])
    # each row's bound: the bandwidth samples around its runs (before each of its two runs
    # and after the second, per round), their median
    assert all(len(r["read_bandwidth_samples"]) == 3 and min(r["read_bandwidth_samples"]) > 0
               and r["read_bandwidth_gb_s"] == pytest.approx(sorted(r["read_bandwidth_samples"])[1])
               for r in result["rows"])
    assert len(result["read_bandwidth_samples"]) == 3 * len(result["rows"])
    assert all(len(r["bandwidth_share_per_round"]) == 1 and r["bandwidth_share_per_round"][0]
               == pytest.approx(r["bandwidth_share"]) for r in result["rows"])  # one round
    assert result["targets"]["open chat"]["plain_vs_bandwidth_bound"]["target"] == 0.70
    assert "ngram_vs_llama_cpp_best" not in result["targets"]["open chat"]
    assert "bandwidth share" in p.stdout


def test_the_1_7b_q4_k_m_preset_is_held_to_95_percent_of_the_bound():
    """Issue 47's target: `--preset 1.7B` Q4_K_M at 95% of the read bandwidth; other files
    at issue 23's 70%. A row at 90% of its bound meets the one and not the other."""
    bench = _bench()
    assert bench.BANDWIDTH_TARGETS[("1.7B", "Q4_K_M")] == 0.95
    rows = [{"prompt": "p", "engine": "verispec quantized plain", "gen_tok_s": 9.0,
             "bandwidth_bound_tok_s": 10.0}]
    assert bench.targets(rows, "p")["plain_vs_bandwidth_bound"]["met"] is True
    strict = bench.targets(rows, "p", bench.BANDWIDTH_TARGETS[("1.7B", "Q4_K_M")])
    assert strict["plain_vs_bandwidth_bound"] == {
        "ratio_of": "verispec quantized plain / bandwidth-bound", "ratio": 0.9, "target": 0.95,
        "met": False}
