"""Every causal LM the installed transformers knows, through verispec.models.HFModel.

For each model type in transformers' causal-LM mapping: a tiny random float32 model from
a generic small config (4 heads of 16, 3 layers, vocabulary 97, 4 experts where there
are experts, the family's own sliding-window default: a window set where a family has
none can make transformers' attention functions disagree with each other; the pinned
tests set windows where families use them), wrapped by HFModel, then a
prompt of 12 tokens, 8 decode steps (the last 4 served by the captured one-token forward,
``HFModel.capture``) and a verify pass of 5 tokens after a rollback of 2, each row's
logits against transformers' own forward of the whole sequence:

    ok        every row's argmax equal, and max |Δ logit| <= 1e-5; or, where float32
              rounding alone exceeds that, the adapter within 1e-5 of transformers' float64
              forward or no further from it than transformers' own float32 forward
    MISMATCH  otherwise (a wrong answer the construction checks let through)
    refused   HFModel refused it at construction (the reason is printed)
    skipped   no tiny config, or transformers itself failed on it (the error is printed)

Tests pin the architectures listed in the README (tests/test_hf_adapter.py); this sweep
is how new ones are found. Writes JSON (--out) and prints a table; exits 1 on a
MISMATCH.

    .venv/bin/python tools/hf_arch_sweep.py [--only llama,qwen2] [--out bench/out/hf_sweep.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import signal
import sys
import time
import warnings
from pathlib import Path

import torch

VOCAB = 97
DECODE_STEPS = 8  # hf_capture records the one-token forward at the 3rd, checks at the 4th
BLOCK_SIZE = 4
MAX_PARAMS = 20_000_000   # generic configs that come out bigger (a default vocabulary of a
                          # sub-table, a default expert count) are skipped, not built
SECONDS = 60              # per model type
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              bos_token_id=1, eos_token_id=2, pad_token_id=0, head_dim=16,
              vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8,
              # mixture-of-experts sizes, under the names the families use
              num_local_experts=4, num_experts=4, n_routed_experts=4, num_experts_per_tok=2,
              moe_intermediate_size=32, shared_expert_intermediate_size=32)
# Families the generic sizes do not fit, with the names and sizes they need on top of
# COMMON: multi-head latent attention (K head 16 + 8, V head 12, as the pinned
# deepseek tests), partial rotary dimensions, and nested or extra fields.
_DROP = object()  # a COMMON entry the family's config does not take
_MLA = dict(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
            qk_nope_head_dim=16, qk_head_dim=24, v_head_dim=12, n_group=1, topk_group=1,
            first_k_dense_replace=1,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
_MLA_ROPE_HEAD = dict(_MLA, head_dim=8)  # families whose head_dim is the RoPE part
FAMILY = {
    "deepseek_v2": _MLA, "minicpm3": _MLA, "glm4_moe_lite": _MLA, "sarvam_mla": _MLA,
    "deepseek_v3": _MLA_ROPE_HEAD, "deepseek_v32": _MLA_ROPE_HEAD,
    "longcat_flash": _MLA_ROPE_HEAD, "youtu": _MLA_ROPE_HEAD, "axk1": _MLA_ROPE_HEAD,
    "axk2": _MLA_ROPE_HEAD, "glm_moe_dsa": _MLA_ROPE_HEAD,
    "codegen": dict(rotary_dim=8, n_ctx=256), "gptj": dict(rotary_dim=8),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1], [["global"], 1]],
                    window_size=256),
    "falcon": dict(new_decoder_architecture=True, num_kv_heads=2, head_dim=_DROP),
    "dbrx": dict(attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                 ffn_config={"moe_num_experts": 4, "moe_top_k": 2, "ffn_hidden_size": 32},
                 d_model=64, n_heads=4, n_layers=3, max_seq_len=256),
    "gemma3n_text": dict(num_hidden_layers=4, num_kv_shared_layers=2,
                         layer_types=["sliding_attention", "full_attention"] * 2,
                         intermediate_size=[96] * 4, activation_sparsity_pattern=[0.0] * 4,
                         laurel_rank=8, altup_num_inputs=2),
    "cohere_compass_text": dict(
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={t: {"rope_type": "default", "rope_theta": 10000.0}
                         for t in ("full_attention", "sliding_attention")}),
    "lfm2_moe": dict(layer_types=["full_attention", "conv", "full_attention"]),
    "dots1": dict(first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=1.0,
                  n_shared_experts=1),
}
ATOL = 1e-5


class _Timeout(Exception):
    pass


def _tiny(transformers, model_type: str):
    """A tiny config of ``model_type`` from COMMON (dropping what it rejects), or None."""
    args = {k: v for k, v in {**COMMON, **FAMILY.get(model_type, {})}.items() if v is not _DROP}
    for _ in range(len(args) + 1):
        try:
            return transformers.AutoConfig.for_model(model_type, **args)
        except TypeError as e:  # an argument this config does not take
            bad = [k for k in args if f"'{k}'" in str(e)]
            if not bad:
                return None
            for k in bad:
                args.pop(k)
        except Exception:  # noqa: BLE001 - a config that validates against these sizes
            return None
    return None


def _logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double()


def check(transformers, model_type: str) -> dict:
    from verispec.models import HFModel
    from verispec.models.testing import PagedRunner, randomize_weights

    config = _tiny(transformers, model_type)
    if config is None:
        return dict(status="skipped", why="no tiny config")
    cls = transformers.AutoModelForCausalLM._model_mapping[type(config)]
    with torch.device("meta"):
        size = sum(p.numel() for p in cls(config).parameters())
    if size > MAX_PARAMS:
        return dict(status="skipped", why=f"the tiny config has {size / 1e6:.0f}M parameters")
    torch.manual_seed(0)
    ref = cls(config).float().eval()
    randomize_weights(ref, seed=1)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, VOCAB, (12,), generator=g).tolist()
    decode = torch.randint(3, VOCAB, (DECODE_STEPS,), generator=g).tolist()
    verify = torch.randint(3, VOCAB, (5,), generator=g).tolist()
    try:
        _logits(ref, prompt + decode)
    except Exception as e:  # noqa: BLE001 - transformers' own forward on this config
        return dict(status="skipped", why=f"transformers' forward: {type(e).__name__}: {e}")
    try:
        model = HFModel(copy.deepcopy(ref))
    except (ValueError, TypeError) as e:
        return dict(status="refused", why=str(e))
    runner = PagedRunner(model, num_blocks=32, block_size=BLOCK_SIZE)
    seq = runner.add_sequence()
    rows = [runner.step({seq: prompt})[0]]
    rows += [runner.step({seq: [t]})[0] for t in decode]
    runner.rollback(seq, len(prompt) + len(decode) - 2)
    rows.append(runner.step({seq: verify})[0])
    got = torch.cat(rows).double()
    ids = prompt + decode
    kept = prompt + decode[:-2] + verify
    want32 = torch.cat([_logits(ref, ids), _logits(ref, kept)[-len(verify):]])
    err = float((got - want32).abs().max())
    argmax = int((got.argmax(-1) != want32.argmax(-1)).sum())
    caps = model._captures
    r = dict(max_abs_diff=err, argmax_mismatches=argmax, layers=model.num_layers,
             captured_replays=caps.replays,
             capture_refused=sorted(set(caps.refused.values())))
    ok = argmax == 0 and err <= ATOL
    if argmax == 0 and not ok:  # float32 rounding alone, or a real difference?
        try:
            ref64 = copy.deepcopy(ref).double()
            if ref64._can_set_experts_implementation():  # grouped matmuls lack float64
                ref64.set_experts_implementation("eager")
            want64 = torch.cat([_logits(ref64, ids), _logits(ref64, kept)[-len(verify):]])
        except RuntimeError as e:  # e.g. a grouped-matmul MoE kernel without float64
            r["float64"] = f"transformers' float64 forward failed: {e}"
        else:
            r["max_abs_diff_float64"] = float((got - want64).abs().max())
            r["transformers_float32_vs_float64"] = float((want32 - want64).abs().max())
            ok = r["max_abs_diff_float64"] <= max(ATOL, r["transformers_float32_vs_float64"])
    return dict(status="ok" if ok else "MISMATCH", **r)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated model types (default: all)")
    ap.add_argument("--out", type=Path, default=Path("bench/out/hf_sweep.json"))
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    import verispec

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    types = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    if args.only:
        wanted = [t.strip() for t in args.only.split(",")]
        unknown = [t for t in wanted if t not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES]
        if unknown:
            raise SystemExit(f"--only: expected causal-LM model types, got {unknown}")
        types = wanted

    def alarm(*_):
        raise _Timeout()

    signal.signal(signal.SIGALRM, alarm)
    # which models pass changes with the release (falcon joined the interface in 5.25):
    # the README's numbers name it
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, "
          f"verispec {verispec.__version__}", flush=True)
    results = {}
    for model_type in types:
        start = time.perf_counter()
        signal.alarm(SECONDS)
        try:
            r = check(transformers, model_type)
        except _Timeout:
            r = dict(status="skipped", why=f"over {SECONDS} s")
        except Exception as e:  # noqa: BLE001 - reported, and a MISMATCH-free run goes on
            r = dict(status="skipped", why=f"{type(e).__name__}: {e}")
        finally:
            signal.alarm(0)
        r["seconds"] = round(time.perf_counter() - start, 2)
        results[model_type] = r
        if "max_abs_diff" not in r:
            detail = r["why"][:150]
        else:
            detail = f"max |Δ| {r['max_abs_diff']:.2g}, argmax mismatches {r['argmax_mismatches']}"
            if "max_abs_diff_float64" in r:
                detail += (f" (from float64 {r['max_abs_diff_float64']:.2g}, transformers' own "
                           f"float32 {r['transformers_float32_vs_float64']:.2g})")
            detail += (f"; {r['captured_replays']} captured forwards" if r["captured_replays"]
                       else f"; not captured: {'; '.join(r['capture_refused'])[:100]}")
        print(f"{model_type:28} {r['status']:9} {detail}", flush=True)
    counts = {s: sum(r["status"] == s for r in results.values())
              for s in ("ok", "MISMATCH", "refused", "skipped")}
    print(", ".join(f"{n} {s}" for s, n in counts.items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(
        tool="hf_arch_sweep", verispec=verispec.__version__,
        transformers=transformers.__version__, torch=torch.__version__, counts=counts,
        results=results), indent=1))
    print(f"wrote {args.out}")
    return 1 if counts["MISMATCH"] else 0


if __name__ == "__main__":
    sys.exit(main())
