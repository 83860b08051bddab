"""One rank of tests/test_tp.py: python tests/tp_worker.py SCENARIO OUT_DIR, with
RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in the environment (as torchrun sets them).

Writes OUT_DIR/rank{RANK}.json (its results) and exits 0, or 3 for the rank that the
"kill" scenario ends on purpose.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from verispec.models.llama import LlamaConfig, LlamaModel, LlamaWeights

VOCAB = 211
PROMPTS = [[5, 17, 42, 42, 9, 100, 3, 7, 7, 50, 1], [88, 2, 13], [4, 4, 4, 4, 4, 4, 4]]


def tiny_model(seed: int, layers: int = 3, *, kv_heads: int = 2) -> LlamaModel:
    """A random Llama (2 query heads per KV head, head size 16, vocabulary 211: prime, so
    the LM head's slices are uneven), the same in every process for the same seed.
    kv_heads=3 splits 1 + 2 over 2 ranks, as SmolLM2's."""
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                      num_hidden_layers=layers, num_attention_heads=2 * kv_heads,
                      num_key_value_heads=kv_heads,
                      head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                      max_position_embeddings=256, tie_word_embeddings=False)
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=0.2):
        return torch.randn(*shape, generator=g) * scale

    h, i = cfg.hidden_size, cfg.intermediate_size
    state = {"model.embed_tokens.weight": rnd(VOCAB, h, scale=1.0),
             "model.norm.weight": 1 + rnd(h, scale=0.1), "lm_head.weight": rnd(VOCAB, h, scale=0.5)}
    for n in range(layers):
        p = f"model.layers.{n}."
        state.update({p + "input_layernorm.weight": 1 + rnd(h, scale=0.1),
                      p + "post_attention_layernorm.weight": 1 + rnd(h, scale=0.1),
                      p + "self_attn.q_proj.weight": rnd(32 * kv_heads, h),
                      p + "self_attn.k_proj.weight": rnd(16 * kv_heads, h),
                      p + "self_attn.v_proj.weight": rnd(16 * kv_heads, h),
                      p + "self_attn.o_proj.weight": rnd(h, 32 * kv_heads),
                      p + "mlp.gate_proj.weight": rnd(i, h),
                      p + "mlp.up_proj.weight": rnd(i, h),
                      p + "mlp.down_proj.weight": rnd(h, i)})
    return LlamaModel(cfg, LlamaWeights.from_state_dict(cfg, state))


# Tiny random transformers models of the adapter test (HFModel), by name: llama with
# biases on every projection (the row-parallel O and down add theirs once, after the
# sum), qwen2 (Q/K/V biases), qwen3 (per-head q/k norms: replicated entries of its plan),
# gemma2 (tied LM head, attention and final softcaps, a sliding window), phi (a plan of
# other names: dense, fc1 / fc2; partial rotary), and a llama of 3 KV heads (split 1 + 2
# over 2 ranks).
HF_CONFIGS = {
    "llama": dict(attention_bias=True, mlp_bias=True),
    "qwen2": dict(),
    "qwen3": dict(head_dim=16),
    "gemma2": dict(head_dim=16, sliding_window=5, attn_logit_softcapping=2.0,
                   final_logit_softcapping=3.0),
    "phi": dict(partial_rotary_factor=0.5),
    "llama_kv3": dict(num_attention_heads=6, num_key_value_heads=3, head_dim=16, hidden_size=96),
}


def hf_tiny(name: str, seed: int = 0, layers: int = 2, **overrides):
    """A tiny random transformers *ForCausalLM (float32, vocabulary 211), the same in
    every process for the same name and seed (not wrapped)."""
    import transformers

    from verispec.models.testing import randomize_weights

    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
    kw.update(HF_CONFIGS[name], **overrides)
    model_type = name.split("_")[0]
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(model_type, **kw)).float().eval()
    randomize_weights(model, seed=seed + 1)
    if model_type.startswith("gemma"):  # its RMSNorm scales by (1 + weight): centre on 0
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.sub_(1.0)
    return model


def hf_decode_cases():
    """The decode cases the adapter's tensor-parallel test runs (a subset: HF passes are
    slower than the native Llama's)."""
    keep = ("ngram-k3-greedy", "ngram-k3-seeded", "model-k3-greedy", "model-k3-seeded",
            "model-auto-greedy", "early_exit-k3-seeded")
    return [c for c in decode_cases() if c[0] in keep]


def prefill_logits(model) -> list:
    """Logits of every prompt token (one batched prefill), then of a 3-token verify-like
    pass per row: [rows of logits]."""
    from verispec.models.testing import PagedRunner

    runner = PagedRunner(model, num_blocks=32, block_size=4)
    seqs = [runner.add_sequence() for _ in PROMPTS]
    first = runner.step(dict(zip(seqs, PROMPTS)))
    second = runner.step({s: [1, 2, 3] for s in seqs})
    return [t.tolist() for t in (*first, *second)]


def feature_states(model) -> dict:
    """Every stream (KVPools.features, keys 0..N + 1) of each PROMPTS row after a ragged
    prefill, a 3-token verify-like pass per row, row 0's last 2 tokens rolled back (a
    rejected draft) and its slots written again: {str(key): [rows [positions [hidden]]]}."""
    from verispec.models.testing import PagedRunner

    keys = list(range(model.geometry.num_layers + 2))
    runner = PagedRunner(model, num_blocks=32, block_size=4, features=keys)
    seqs = [runner.add_sequence() for _ in PROMPTS]
    runner.step(dict(zip(seqs, PROMPTS)))
    runner.step({s: [1, 2, 3] for s in seqs})
    runner.rollback(seqs[0], runner.length(seqs[0]) - 2)
    runner.step({seqs[0]: [4, 5]})
    return {str(k): [runner.features_of(s, k).tolist() for s in seqs] for k in keys}


# The HF_CONFIGS models of the feature scenario (tp_worker features)
HF_FEATURE_MODELS = ("llama", "gemma2")


def decode_cases():
    """(name, draft kind, k, generate kwargs) of the decode comparison."""
    cases = []
    for draft in ("ngram", "model", "early_exit"):
        cases += [(f"{draft}-k3-greedy", draft, 3, dict(greedy=True)),
                  (f"{draft}-k3-stream", draft, 3, dict(temperature=1.0, seed=None)),
                  (f"{draft}-k3-seeded", draft, 3, dict(temperature=0.8, top_p=0.9, seed=7)),
                  (f"{draft}-auto-greedy", draft, "auto", dict(greedy=True)),
                  (f"{draft}-auto-seeded", draft, "auto", dict(temperature=1.0, seed=11))]
    # rank 1's draft passes take 6 ms longer: the ranks measure different costs, and
    # only agreeing on the times keeps their k (hence their passes) the same
    cases.append(("skewed-auto-greedy", "skewed", "auto", dict(greedy=True)))
    return cases


class SkewedDraft:
    """A draft model whose forward sleeps ``delay_s`` more on rank 1 than elsewhere."""

    def __init__(self, model, delay_s: float):
        self.model, self.delay_s = model, delay_s
        self.geometry, self.tp = model.geometry, getattr(model, "tp", None)

    def forward(self, batch):
        if self.tp is not None and self.tp.rank == 1:
            time.sleep(self.delay_s)
        return self.model.forward(batch)


def run_decodes(target, draft_model, cases=None) -> dict:
    """Every decode case (default: decode_cases()) on these models (whole or shards):
    tokens and k histories."""
    from verispec.decoder import SpecDecoder
    from verispec.drafters import EarlyExit, NGram

    out = {}
    for name, kind, k, kwargs in (decode_cases() if cases is None else cases):
        draft = {"ngram": lambda: NGram(1, 3), "model": lambda: draft_model,
                 "skewed": lambda: SkewedDraft(draft_model, 0.006),
                 "early_exit": lambda: EarlyExit(target, num_layers=1)}[kind]()
        dec = SpecDecoder(target, draft, k=k, max_k=4, num_blocks=64, block_size=4)
        results = dec.generate(PROMPTS, max_new_tokens=14, **kwargs)
        out[name] = dict(tokens=[r.tokens for r in results],
                         k_history=[r.stats.get("k_history") for r in results])
    return out


def run_hf(tp) -> dict:
    """The adapter's scenario on this rank: every HF_CONFIGS model's KV heads and logits,
    the decodes through a sharded HF target, and two wrong cuts (power)."""
    from verispec import distributed
    import verispec.models.hf.model as hf_mod
    import verispec.models.hf.tp as hf_tp
    from verispec.models import HFModel
    from verispec.models.layers.tp import split_heads

    out: dict = {"kv_heads": {}, "logits": {}}
    for name in HF_CONFIGS:
        model = HFModel(hf_tiny(name), tp=tp)
        out["kv_heads"][name] = model.geometry.num_kv_heads
        out["logits"][name] = prefill_logits(model)
    # the decodes: a target cut by HFModel(tp=), a draft model cut by distributed.shard
    target = HFModel(hf_tiny("llama", layers=3), tp=tp)
    whole = HFModel(hf_tiny("llama", seed=5, layers=1))
    draft = distributed.shard(whole, tp)
    try:  # its modules are the shard's now
        prefill_logits(whole)
        out["void"] = None
    except RuntimeError as e:
        out["void"] = str(e)
    out["decodes"] = run_decodes(target, draft, hf_decode_cases())
    # power: cuts that are wrong on purpose; the cut's own check refuses them, and with
    # the check switched off their logits are what the test compares
    wrong = {"no_all_reduce": (hf_tp, "_sum_over_ranks", lambda module, inputs, output: output),
             # each rank's query heads with the other rank's KV heads
             "other_ranks_kv_heads": (hf_tp, "split_heads", lambda h, kvh, ws, rank: (
                 split_heads(h, kvh, ws, rank)[0], split_heads(h, kvh, ws, ws - 1 - rank)[1]))}
    out["wrong"] = {}
    for what, (module, attr, fake) in wrong.items():
        original = getattr(module, attr)
        setattr(module, attr, fake)
        try:
            try:
                HFModel(hf_tiny("llama"), tp=tp)
                refusal = None
            except ValueError as e:
                refusal = str(e)
            checks = hf_mod.SHARD_CHECK_RTOL
            hf_mod.SHARD_CHECK_RTOL = {None: float("inf")}
            try:
                logits = prefill_logits(HFModel(hf_tiny("llama"), tp=tp))
            finally:
                hf_mod.SHARD_CHECK_RTOL = checks
        finally:
            setattr(module, attr, original)
        out["wrong"][what] = dict(refusal=refusal, logits=logits)
    return out


# The decode cases of the quantized scenario: greedy text (plain speculation with an
# n-gram draft at a fixed and an adaptive k, the target's early exit) and a seeded sample.
QUANT_DECODE_CASES = ("ngram-k3-greedy", "ngram-auto-greedy", "early_exit-k3-greedy",
                      "early_exit-k3-seeded")


def quant_cases():
    return [c for c in decode_cases() if c[0] in QUANT_DECODE_CASES]


def quant_layout(model) -> dict:
    """What a (sharded) quantized LlamaModel holds: per matrix its class, formats and
    shape ({"layers": [{"wqkv": [class, formats, shape], ...}], "lm_head": ..., ...})."""
    def one(m):
        return [type(m).__name__, list(getattr(m, "formats", ())), list(m.shape)]

    w = model.weights
    return dict(quantized=model.quantized, embed=one(w.embed), lm_head=one(w.lm_head),
                layers=[{name: one(getattr(lw, name)) for name in
                         ("wqkv", "wo", "w_gate_up", "w_down")} for lw in w.layers],
                kv_heads=model.geometry.num_kv_heads)


def run_quant(tp, out_dir: str) -> dict:
    """The quantized scenario: OUT_DIR/model.gguf (written by the test) loaded as one
    process loads it (dtype None on the CPU: quantized) and sharded; what each rank holds,
    its logits and its decodes."""
    from verispec import distributed
    from verispec.models import load_model

    target = distributed.shard(load_model(os.path.join(out_dir, "model.gguf")), tp)
    return dict(layout=quant_layout(target), logits=prefill_logits(target),
                decodes=run_decodes(target, None, quant_cases()))


def main() -> int:
    scenario, out_dir = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    from verispec import distributed
    from verispec.decoder import SpecDecoder
    from verispec.drafters import NGram

    timeout = float(os.environ.get("TP_TEST_TIMEOUT", "20"))
    tp = distributed.init(timeout_s=timeout, check_every=2)
    result: dict = {"rank": tp.rank}
    try:
        if scenario == "quant":
            result.update(run_quant(tp, out_dir))
            return 0
        target = distributed.shard(tiny_model(0), tp)
        if scenario == "main":
            draft = distributed.shard(tiny_model(1, layers=1), tp)
            result["kv_heads"] = target.geometry.num_kv_heads
            result["logits"] = prefill_logits(target)
            uneven = distributed.shard(tiny_model(2, kv_heads=3), tp)
            result["uneven_kv_heads"] = uneven.geometry.num_kv_heads
            result["uneven_logits"] = prefill_logits(uneven)
            result["decodes"] = run_decodes(target, draft)
            # power: rank 1's decoder stream is perturbed (another seed): the check must
            # name the step where the committed tokens first differ
            dec = SpecDecoder(target, draft, k=3, num_blocks=64, block_size=4, seed=tp.rank)
            try:
                dec.generate(PROMPTS, max_new_tokens=30, temperature=1.0)
                result["divergence"] = None
            except distributed.RankDivergenceError as e:
                result["divergence"] = str(e)
            result["comm_calls"] = tp.comm_calls
        elif scenario == "hf":
            result.update(run_hf(tp))
        elif scenario == "features":  # every rank's streams: the native Llama, HFModel
            from verispec.models import HFModel

            result["llama"] = feature_states(target)
            result["hf"] = {name: feature_states(HFModel(hf_tiny(name, layers=3), tp=tp))
                            for name in HF_FEATURE_MODELS}
        elif scenario in ("kill", "stall"):
            dec = SpecDecoder(target, NGram(1, 3), k=3, num_blocks=64, block_size=4)
            for p in PROMPTS:
                dec.add(p, max_new_tokens=100, greedy=True)
            steps, start = 0, time.monotonic()
            try:
                while dec.has_running() and steps < 200:
                    if tp.rank == 1 and steps == 3:
                        if scenario == "stall":  # alive, silent, past the timeout
                            time.sleep(timeout + 6)
                        os._exit(3)  # dies mid-run, without a word to its peer
                    dec.step()
                    steps += 1
                result["error"] = None
            except Exception as e:  # noqa: BLE001 (what a dead peer raises is the point)
                result["error"] = f"{type(e).__name__}: {e}"[:500]
            result["seconds_to_error"] = time.monotonic() - start
            result["steps"] = steps
        else:
            raise ValueError(f"tp_worker: scenario must be 'main', 'hf', 'features', 'quant', "
                             f"'kill' or 'stall', got {scenario!r}")
    finally:
        with open(os.path.join(out_dir, f"rank{tp.rank}.json"), "w") as f:
            json.dump(result, f)
        distributed.close(tp)  # also after a failed collective, as verispec generate does
    return 0


if __name__ == "__main__":
    sys.exit(main())
