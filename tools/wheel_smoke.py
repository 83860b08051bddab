"""Smoke test of an installed verispec wheel, run away from the source tree.

    python -I -W error tools/wheel_smoke.py [--device cuda]   # prints one JSON line

What a user touches first: build_info, the three sampling ops (exact greedy results),
the block allocator, and a short greedy generate with a tiny random Llama through
SpecDecoder: speculative (n-gram and early-exit drafts) and plain must agree token for
token. With --device cuda the ops and the decoder run on the GPU and the ops must match
the CPU path exactly. Fails with a traceback; prints a JSON summary when all pass.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def check_ops(torch, ops, device) -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, generator=g)
    want = logits.argmax(-1)
    probs = ops.apply_policy(logits.to(device), temperature=0.0).cpu()
    assert torch.equal(probs, torch.nn.functional.one_hot(want, 7).float()), probs
    tokens = ops.sample(probs.to(device), seed=1, offset=0).cpu()
    assert tokens.tolist() == want.tolist(), tokens

    # Greedy verify, K = 3: row 0 proposes the argmax everywhere (3 accepted + bonus),
    # row 1 only at position 0 (1 accepted, then the argmax as the correction).
    target = torch.randn(2, 4, 11, generator=g)
    best = target.argmax(-1).to(torch.int32)                     # [B, K+1]
    draft = best[:, :3].clone()
    draft[1, 1] = (draft[1, 1] + 1) % 11
    out, emitted, accepted = (t.cpu() for t in ops.verify(
        target.to(device), draft.to(device), greedy=True, seed=3, offset=7))
    assert accepted.tolist() == [3, 1] and emitted.tolist() == [4, 2], (accepted, emitted)
    assert out[0].tolist() == best[0].tolist(), out
    assert out[1].tolist() == [best[1, 0].item(), best[1, 1].item(), -1, -1], out

    if device != "cpu":  # same Philox coins on both paths: sampled results agree too
        soft = torch.randn(5, 301, generator=g)
        for kw in ({}, {"temperature": 0.7, "top_p": 0.9}):
            cpu = ops.apply_policy(soft, **kw)
            gpu = ops.apply_policy(soft.to(device), **kw).cpu()
            torch.testing.assert_close(gpu, cpu, rtol=1e-5, atol=1e-6)
            assert torch.equal(ops.sample(cpu, seed=9, offset=2),
                               ops.sample(gpu.to(device), seed=9, offset=2).cpu())


def check_allocator(verispec) -> None:
    a = verispec.BlockAllocator(num_blocks=4, block_size=4)
    s = a.add_sequence()
    slots = a.append(s, 6)
    table = a.block_table(s)
    assert slots == [table[p // 4] * 4 + p % 4 for p in range(6)] and a.length(s) == 6
    child = a.fork(s)
    a.append(child, 1)                                  # shared partial tail: copy on write
    (copy,) = a.take_block_copies()
    assert copy == (table[1], a.block_table(child)[1], 2), copy
    a.rollback(s, 3)                                    # releases s's second block
    assert a.block_table(s) == table[:1] and a.length(s) == 3
    try:
        a.append(s, 100)
    except verispec.CacheFullError:
        pass
    else:
        raise AssertionError("append beyond the pool must raise CacheFullError")
    assert a.length(s) == 3 and a.block_table(s) == table[:1]
    a.free(s)
    a.free(child)
    assert a.num_free_blocks == 4


def tiny_llama(torch, device, *, seed: int, layers: int = 2):
    """A random Llama with transformers' tensor names, loaded through LlamaWeights."""
    from verispec.models import LlamaConfig, LlamaModel, LlamaWeights
    from verispec.models.testing import randomize_weights

    c = LlamaConfig(vocab_size=211, hidden_size=64, intermediate_size=96,
                    num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                    max_position_embeddings=256, tie_word_embeddings=False)
    h, v, kv = c.hidden_size, c.vocab_size, c.num_key_value_heads * c.head_dim
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,),
              "lm_head.weight": (v, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (c.intermediate_size, h),
            p + "mlp.up_proj.weight": (c.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, c.intermediate_size)})
    root = torch.nn.Module()
    for name, shape in shapes.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(torch.empty(shape)))
    randomize_weights(root, seed, norm_spread=0.1)
    return LlamaModel(c, LlamaWeights.from_state_dict(c, root.state_dict(), device=device))


def check_generate(torch, device) -> dict:
    from verispec.decoder import SpecDecoder
    from verispec.drafters import EarlyExit, NGram

    target = tiny_llama(torch, device, seed=0)
    prompts = [[5, 17, 42, 42, 9, 100, 3, 7, 7, 50, 1], [88, 2, 13], [4, 4, 4, 4, 4, 4, 4]]

    def greedy(draft, k):
        dec = SpecDecoder(target, draft, k=k, num_blocks=64, block_size=4)
        results = dec.generate(prompts, max_new_tokens=16, greedy=True)
        assert dec.num_free_blocks() == dec.num_blocks()
        return [r.tokens for r in results], sum(r.stats["proposed"] for r in results)

    want, _ = greedy(None, 0)
    assert all(len(t) == 16 for t in want), want
    proposed = {}
    for name, draft in (("ngram", NGram(1, 3)), ("early_exit", EarlyExit(target, num_layers=1))):
        got, proposed[name] = greedy(draft, 3)
        assert got == want, (name, got, want)
        assert proposed[name] > 0, f"{name}: the draft proposed nothing"
    return {"tokens": want, "proposed": proposed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()

    import torch

    import verispec
    from verispec import ops

    info = verispec.build_info()
    if args.device == "cuda":
        assert info["cuda_compiled"] and torch.cuda.is_available(), (info, torch.__version__)
    check_ops(torch, ops, args.device)
    check_allocator(verispec)
    generated = check_generate(torch, args.device)
    print(json.dumps({
        "verispec_file": os.path.realpath(verispec.__file__), "prefix": os.path.realpath(sys.prefix),
        "torch": torch.__version__, "device": args.device, "build_info": info,
        "generate": generated}))


if __name__ == "__main__":
    main()
