"""verispec.models.HFModel against transformers' own forward.

Tiny random-weight models (hidden 64, 3 layers, vocab 97) are built locally with
transformers (no downloads), wrapped in HFModel and driven through PagedRunner (the real
block allocator, small blocks). Every returned logit row is compared with transformers'
full-sequence forward of the row's tokens (the reference keeps its own sdpa / eager
attention): max |difference| <= ATOL = 1e-5 in float32, and equal argmax.

The schedule covers ragged multi-row prefill, decode rows, verify rows of 2..8 tokens
followed by rollback of the rejected tokens, chunked prefill, non-contiguous block tables
(interleaved appends, a freed sequence's blocks reused), rows that keep only their last
logits, and draft trees (PagedBatch.tree_mask). Power: with the sliding window, softcap or
sink handling switched off in the adapter, the same comparison fails for the models that
use them (and still passes for llama, which uses none).
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import pytest
import torch
import transformers

import verispec.models.hf.model as hf_mod
from verispec.models import HFModel
from verispec.models.base import KVPools, PagedBatch
from verispec.models.testing import PagedRunner, randomize_weights
from verispec.models.layers.attention import TorchAttention

ATOL = 1e-5  # absolute, float32 logits of O(1..10)
# With a feature's handling switched off, the comparison must miss by far more than ATOL.
POWER_MIN_DIFF = 100 * ATOL
VOCAB = 97
WINDOW = 5  # sliding window of the windowed configs; sequences run to ~40 tokens
BLOCK_SIZE = 4
TREE_NODES = 18  # the random tree's size: more queries than hf.SMALL_ROW_QUERIES (SDPA path)

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               bos_token_id=1, eos_token_id=2, pad_token_id=0)
_NO_KV = ("num_key_value_heads",)


def _cfg(model_type: str, drop=(), **kw):
    args = {k: v for k, v in _COMMON.items() if k not in drop}
    args.update(kw)
    return transformers.AutoConfig.for_model(model_type, **args)


CONFIGS = {
    # the issue's twelve
    "llama": lambda: _cfg("llama"),
    "mistral": lambda: _cfg("mistral", sliding_window=WINDOW),
    "qwen2": lambda: _cfg("qwen2", sliding_window=WINDOW, use_sliding_window=True,
                          max_window_layers=1,
                          layer_types=["full_attention", "sliding_attention",
                                       "sliding_attention"]),
    "qwen3": lambda: _cfg("qwen3", head_dim=16),
    "phi3": lambda: _cfg("phi3"),
    "gemma": lambda: _cfg("gemma", head_dim=16),
    "gemma2": lambda: _cfg("gemma2", head_dim=16, sliding_window=WINDOW,
                           attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
    "gemma3_text": lambda: _cfg("gemma3_text", head_dim=16, sliding_window=WINDOW,
                                sliding_window_pattern=2),
    "starcoder2": lambda: _cfg("starcoder2", sliding_window=WINDOW),
    "gpt_neox": lambda: _cfg("gpt_neox", drop=_NO_KV + ("pad_token_id",)),
    "mixtral": lambda: _cfg("mixtral", num_local_experts=4, num_experts_per_tok=2,
                            sliding_window=None),
    "gpt_oss": lambda: _cfg("gpt_oss", head_dim=16, sliding_window=WINDOW, num_local_experts=4,
                            num_experts_per_tok=2,
                            layer_types=["sliding_attention", "full_attention",
                                         "sliding_attention"]),
    # cheap extras
    "olmo2": lambda: _cfg("olmo2"),
    "granite": lambda: _cfg("granite", attention_multiplier=0.3, residual_multiplier=0.5,
                            embedding_multiplier=2.0, logits_scaling=4.0),
    "phi": lambda: _cfg("phi", partial_rotary_factor=0.5),
    "cohere2": lambda: _cfg("cohere2", sliding_window=WINDOW, logit_scale=0.5,
                            layer_types=["sliding_attention", "sliding_attention",
                                         "full_attention"]),
    "smollm3": lambda: _cfg("smollm3", no_rope_layers=[1, 0, 1]),
    "qwen3_moe": lambda: _cfg("qwen3_moe", head_dim=16, num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=32),
    # MLA: K head dim (16 + 8) != V head dim (12)
    "deepseek_v3": lambda: _cfg("deepseek_v3", num_key_value_heads=4, kv_lora_rank=16,
                                q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16,
                                v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2,
                                n_group=1, topk_group=1, moe_intermediate_size=32,
                                first_k_dense_replace=1,
                                rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "gpt2": lambda: transformers.AutoConfig.for_model(
        "gpt2", vocab_size=VOCAB, n_embd=64, n_layer=3, n_head=4, n_positions=256,
        bos_token_id=1, eos_token_id=2),
    "opt": lambda: _cfg("opt", drop=_NO_KV + ("intermediate_size",), ffn_dim=96,
                        word_embed_proj_dim=64),
    # KV sharing: layers 2 and 3 reuse the K/V of layers 0 and 1
    "gemma3n_text": lambda: _cfg("gemma3n_text", head_dim=16, sliding_window=WINDOW,
                                 num_hidden_layers=4, num_kv_shared_layers=2,
                                 layer_types=["sliding_attention", "full_attention"] * 2,
                                 intermediate_size=[96] * 4, activation_sparsity_pattern=[0.0] * 4,
                                 laurel_rank=8, altup_num_inputs=2, hidden_size_per_layer_input=8,
                                 vocab_size_per_layer_input=VOCAB),
    # BERT as a causal decoder (is_decoder=True): absolute positions, post-norm
    "bert_decoder": lambda: transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        intermediate_size=96, is_decoder=True, pad_token_id=0, max_position_embeddings=256),
    # their decoder layers call the attention module without the forward's keyword
    # arguments (the plan reaches the attention function through a context variable)
    "stablelm": lambda: _cfg("stablelm"),
    "nemotron": lambda: _cfg("nemotron", head_dim=16),
    # more families
    "qwen2_moe": lambda: _cfg("qwen2_moe", num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=32, shared_expert_intermediate_size=32),
    "glm": lambda: _cfg("glm", head_dim=16),
    "glm4": lambda: _cfg("glm4", head_dim=16),
    "glm4_moe": lambda: _cfg("glm4_moe", head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=32, first_k_dense_replace=1, n_group=1,
                             topk_group=1),
    "phimoe": lambda: _cfg("phimoe", num_local_experts=4, num_experts_per_tok=2,
                           sliding_window=None),
    "granitemoe": lambda: _cfg("granitemoe", num_local_experts=4, num_experts_per_tok=2,
                               attention_multiplier=0.3),
    "olmo": lambda: _cfg("olmo"),
    "olmo3": lambda: _cfg("olmo3", sliding_window=WINDOW,
                          layer_types=["sliding_attention", "sliding_attention",
                                       "full_attention"]),
    "exaone4": lambda: _cfg("exaone4", head_dim=16, sliding_window=WINDOW,
                            layer_types=["sliding_attention", "sliding_attention",
                                         "full_attention"]),
    "ernie4_5": lambda: _cfg("ernie4_5", head_dim=16),
    "seed_oss": lambda: _cfg("seed_oss", head_dim=16),
    "hunyuan_v1_dense": lambda: _cfg("hunyuan_v1_dense", head_dim=16),
    "ministral": lambda: _cfg("ministral", head_dim=16, sliding_window=WINDOW,
                              layer_types=["sliding_attention", "full_attention",
                                           "sliding_attention"]),
    "cohere": lambda: _cfg("cohere", logit_scale=0.5),
    "vaultgemma": lambda: _cfg("vaultgemma", head_dim=16, sliding_window=WINDOW),
    "gptj": lambda: transformers.AutoConfig.for_model(
        "gptj", vocab_size=VOCAB, n_embd=64, n_layer=3, n_head=4, n_positions=256, rotary_dim=8,
        bos_token_id=1, eos_token_id=2),
    "gpt_bigcode": lambda: transformers.AutoConfig.for_model(
        "gpt_bigcode", vocab_size=VOCAB, n_embd=64, n_layer=3, n_head=4, n_positions=256,
        multi_query=True, bos_token_id=1, eos_token_id=2),
    "deepseek_v2": lambda: _cfg("deepseek_v2", num_key_value_heads=4, kv_lora_rank=16,
                                q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16,
                                v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2,
                                n_group=1, topk_group=1, moe_intermediate_size=32,
                                first_k_dense_replace=1),
    "minimax_m2": lambda: _cfg("minimax_m2", head_dim=16, num_local_experts=4,
                               num_experts_per_tok=2),
    # found by tools/hf_arch_sweep.py with family sizes: a nested attention config with QKV
    # clipping (dbrx), a fused QKV laid out in model-parallel chunks with partial
    # interleaved RoPE (codegen), a deepseek-style MoE with shared experts (dots1)
    "dbrx": lambda: transformers.AutoConfig.for_model(
        "dbrx", vocab_size=VOCAB, d_model=64, n_heads=4, n_layers=3, max_seq_len=256,
        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        ffn_config={"moe_num_experts": 4, "moe_top_k": 2, "ffn_hidden_size": 32},
        pad_token_id=0),
    "codegen": lambda: transformers.AutoConfig.for_model(
        "codegen", vocab_size=VOCAB, n_embd=64, n_layer=3, n_head=4, n_positions=256,
        n_ctx=256, rotary_dim=8, bos_token_id=1, eos_token_id=2),
    "dots1": lambda: _cfg("dots1", head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=32, first_k_dense_replace=1, n_group=1,
                          topk_group=1, n_shared_experts=1, routed_scaling_factor=1.0),
    # windows on layers 0 and 2 that transformers applies through its mask alone (the
    # module keeps its window but does not pass it down)
    "qwen2_moe_sliding": lambda: _cfg("qwen2_moe", num_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=32,
                                      shared_expert_intermediate_size=32,
                                      use_sliding_window=True, sliding_window=WINDOW,
                                      max_window_layers=3),
}


def _calls_the_interface(config) -> bool:
    """transformers' own answer, without HFModel: does every layer of a model of ``config``
    call the function selected from transformers.AttentionInterface? (A stand-in that
    counts its callers and returns zeros.)"""
    callers = []

    def count(module, query, key, value, attention_mask, **kwargs):
        callers.append(id(module))
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1],
                               value.shape[3]), None

    transformers.AttentionInterface.register("verispec_test_count", count)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.set_attn_implementation("verispec_test_count")  # kept as is by models outside it
    with torch.no_grad():
        model(torch.tensor([[3, 4]]), use_cache=False)
    return len(set(callers)) == config.num_hidden_layers


# Falcon's layers call the attention interface from transformers 5.25 on (before, they
# computed attention themselves and HFModel refused them): pinned with the others where
# they do, refused where they do not (test_takes_a_model_exactly_when_its_layers_call_it).
FALCON = {
    # Falcon-7B's layout: multi-query (one KV head in the fused QKV), attention and MLP
    # in parallel
    "falcon": lambda: _cfg("falcon", drop=_NO_KV + ("intermediate_size",), ffn_hidden_size=96),
    # Falcon-40B's and 180B's: grouped KV heads, each group's queries then its K and V
    "falcon_grouped": lambda: _cfg("falcon", drop=_NO_KV + ("intermediate_size",),
                                   ffn_hidden_size=96, new_decoder_architecture=True,
                                   num_kv_heads=2),
}
FALCON_CALLS_THE_INTERFACE = _calls_the_interface(FALCON["falcon"]())
if FALCON_CALLS_THE_INTERFACE:
    CONFIGS.update(FALCON)
# Models whose float32 forward in transformers is itself further than ATOL from its float64
# forward on these tiny configs (Gemma 4 attends with scaling 1.0 after its q/k norms,
# which amplifies rounding): the adapter is checked against the float64 forward instead,
# and must be about as close to it as transformers' own float32 forward (within 2x; with the
# same argmax everywhere).
F64_CONFIGS = {
    # per-layer head sizes (the full-attention layer's 512), proportional partial RoPE,
    # per-layer input embeddings
    "gemma4_text": lambda: _cfg("gemma4_text", head_dim=16, sliding_window=WINDOW,
                                vocab_size_per_layer_input=VOCAB,
                                hidden_size_per_layer_input=8),
    # multi-head latent attention with embedding, residual and logit scales (found by
    # tools/hf_arch_sweep.py): transformers' float32 forward is 1.5e-5 from its float64
    "minicpm3": lambda: _cfg("minicpm3", num_key_value_heads=4, kv_lora_rank=16,
                             q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16,
                             v_head_dim=12),
}
ISSUE_TWELVE = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3_text",
                "starcoder2", "gpt_neox", "mixtral", "gpt_oss"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The models are tiny: one intra-op thread is several times faster than spinning up a
    pool on a shared machine (and keeps the runtime stable under load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.lru_cache(maxsize=None)
def _reference(name: str):
    """The tiny float32 model with fixed random weights, in transformers' own attention.
    Never wrapped: tests wrap a deep copy (HFModel switches the wrapped model's attention)."""
    torch.manual_seed(0)
    config = CONFIGS[name]() if name in CONFIGS else F64_CONFIGS[name]()
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    randomize_weights(model, seed=1)
    with torch.no_grad():
        for module in model.modules():
            # Gemma's RMSNorm scales by (1 + weight): centre its weights on 0, not 1, so its
            # logits stay O(1..10) like the others' (else 2x per norm, and transformers'
            # own prefix-vs-full forwards already differ by ~5e-6)
            if type(module).__name__ in ("GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm",
                                         "VaultGemmaRMSNorm", "NemotronLayerNorm1P"):
                module.weight -= 1.0
    return model


def _ref_logits(ref, tokens) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([list(tokens)])).logits[0]


def _wrap(name: str) -> HFModel:
    ref = _reference(name)
    model = HFModel(copy.deepcopy(ref))
    assert ref.config._attn_implementation != hf_mod.ATTN_IMPLEMENTATION
    return model


def _consecutive(table: list[int]) -> bool:
    return table == list(range(table[0], table[0] + len(table)))


class _Driver:
    """Drives an HFModel through a PagedRunner and compares every logit row it returns
    with the reference forward of the row's sequence as it stands after the step."""

    def __init__(self, name: str, *, num_blocks: int = 64, seed: int = 7,
                 truth: torch.dtype = torch.float32):
        self.ref = _reference(name)
        # the forward the logits are compared with (float64: a copy of the reference)
        self.truth = self.ref if truth == torch.float32 else copy.deepcopy(self.ref).to(truth)
        self.worst_transformers = 0.0  # transformers' float32 forward against that one
        self.model = _wrap(name)
        self.runner = PagedRunner(self.model, num_blocks=num_blocks, block_size=BLOCK_SIZE)
        self.gen = torch.Generator().manual_seed(seed)
        self.seqs: dict[str, int] = {}
        self.hist: dict[str, list[int]] = {}
        self.rejected: dict[str, int] = {}
        self.worst = 0.0
        self.argmax_mismatches = 0
        self.rows_compared = 0
        self.steps = 0
        self.noncontiguous: list[tuple[int, str]] = []  # (step, sequence) read through holes

    def tokens(self, name: str, n: int) -> list[int]:
        toks = torch.randint(0, VOCAB, (n,), generator=self.gen).tolist()
        # after a rollback, the next token differs from the rejected one at that position
        if name in self.rejected and toks and toks[0] == self.rejected.pop(name):
            toks[0] = (toks[0] + 1) % VOCAB
        return toks

    def seq(self, name: str) -> int:
        if name not in self.seqs:
            self.seqs[name] = self.runner.add_sequence()
            self.hist[name] = []
        return self.seqs[name]

    def compare(self, got: torch.Tensor, want: torch.Tensor) -> None:
        assert got.shape == want.shape and got.dtype == torch.float32
        self.worst = max(self.worst, (got - want).abs().max().item())
        self.argmax_mismatches += int((got.argmax(-1) != want.argmax(-1)).sum())
        self.rows_compared += got.shape[0]

    def step(self, counts: dict[str, int], *, last_only: bool = False) -> None:
        new = {name: self.tokens(name, n) for name, n in counts.items()}
        batch = self.runner.make_batch({self.seq(k): v for k, v in new.items()},
                                       all_logits=not last_only)
        for i, (name, length) in enumerate(zip(new, batch.context_lens.tolist())):
            if not _consecutive(batch.block_tables[i, :-(-length // BLOCK_SIZE)].tolist()):
                self.noncontiguous.append((self.steps, name))
        self.steps += 1
        logits = self.model.forward(batch)
        assert logits.shape == (batch.logits_indices.shape[0], VOCAB)
        per_row = logits.split(1) if last_only else logits.split([len(t) for t in new.values()])
        for (name, toks), got in zip(new.items(), per_row):
            self.hist[name] += toks
            assert self.runner.length(self.seqs[name]) == len(self.hist[name])
            want = _ref_logits(self.truth, self.hist[name])[-got.shape[0]:].float()
            if self.truth is not self.ref:
                ref32 = _ref_logits(self.ref, self.hist[name])[-got.shape[0]:]
                self.worst_transformers = max(self.worst_transformers,
                                              (ref32 - want).abs().max().item())
            self.compare(got, want)

    def rollback(self, name: str, drop: int) -> None:
        keep = len(self.hist[name]) - drop
        self.rejected[name] = self.hist[name][keep]
        self.runner.rollback(self.seqs[name], keep)
        del self.hist[name][keep:]

    def free(self, name: str) -> None:
        self.runner.free(self.seqs.pop(name))
        del self.hist[name]


# (new tokens per sequence, tokens rejected per sequence after the step, sequences freed,
#  last logits only). A is prefilled at once, B and E in chunks; D is freed so that its
# blocks are reused (holes), and rows appended together interleave their blocks.
SCHEDULE = [
    ({"A": 20, "B": 3, "D": 6, "C": 1}, {}, ["D"], False),       # ragged prefill (A: 20 queries)
    ({"B": 18, "A": 1, "C": 4}, {}, [], False),                  # chunked prefill + decode
    ({"A": 8, "B": 7, "C": 6}, {"A": 5, "C": 3}, [], False),     # verify 8/7/6, one padded group
    ({"A": 1, "B": 1, "C": 1}, {}, [], False),                   # decode rows, one group
    ({"E": 5, "A": 1, "B": 1, "C": 1}, {}, [], True),            # E's first chunk; last logits
    ({"E": 5, "A": 4, "C": 2}, {"A": 4, "C": 1}, [], False),     # verify 4/2, all of A rejected
    ({"E": 7, "A": 1, "B": 3, "C": 1}, {"B": 2}, [], False),     # E's last chunk, verify 3
    ({"A": 2, "B": 3, "C": 5, "E": 8}, {"E": 6, "A": 1}, [], False),  # verify 2/3/5/8
    ({"A": 1, "B": 1, "C": 1, "E": 1}, {}, [], False),           # decode after the rollbacks
]


def _run_schedule(name: str, truth: torch.dtype = torch.float32) -> _Driver:
    d = _Driver(name, truth=truth)
    for counts, drops, frees, last_only in SCHEDULE:
        d.step(counts, last_only=last_only)
        for seq, n in drops.items():
            d.rollback(seq, n)
        for seq in frees:
            d.free(seq)
    return d


def _torch_attention_only(monkeypatch) -> None:
    """Every layer attends through the adapter's padded torch paths (HFModel's
    native_attention off), so the tests below cover them as well as the paged kernel."""
    original = hf_mod._Plan.prepare
    monkeypatch.setattr(hf_mod._Plan, "prepare", lambda self, native: original(self, False))


@pytest.fixture
def native_calls(monkeypatch) -> list[int]:
    """The layer calls that attended in verispec's paged kernel: the most new tokens of
    a row in each."""
    calls: list[int] = []
    original = hf_mod._Plan._write_attend_native

    def spy(self, query, *args):
        out = original(self, query, *args)
        if out is not None:
            calls.append(max(self.q_lens))
        return out

    monkeypatch.setattr(hf_mod._Plan, "_write_attend_native", spy)
    return calls


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "gemma2", "gpt_oss", "deepseek_v3"])
def test_logits_equal_transformers_through_the_torch_paths(monkeypatch, name):
    _torch_attention_only(monkeypatch)
    d = _run_schedule(name)
    assert d.worst <= ATOL, f"{name}: max |logits - transformers| = {d.worst:.3g} > {ATOL}"
    assert d.argmax_mismatches == 0


def test_paged_kernel_takes_decode_verify_and_tree_rows(native_calls):
    """With native_attention (the default on a float32 CPU model), decode, verify, tree
    rows and prefill chunks attend in the paged kernel, rows longer than
    KERNEL_MAX_QUERIES do not; the schedule's logits equal transformers'."""
    d = _run_schedule("llama")
    assert d.worst <= ATOL
    assert 1 in native_calls and any(1 < n <= hf_mod.SMALL_ROW_QUERIES for n in native_calls)
    native_calls.clear()
    n = hf_mod.KERNEL_MAX_QUERIES
    model = HFModel(copy.deepcopy(_reference("llama")), max_context=2 * n + 2)
    runner = PagedRunner(model, num_blocks=2 * n // BLOCK_SIZE + 2, block_size=BLOCK_SIZE)
    runner.step({runner.add_sequence(): [t % VOCAB for t in range(n + 1)]})
    assert native_calls == []  # a long prompt at once: SDPA
    runner.step({runner.add_sequence(): [t % VOCAB for t in range(n)]})
    assert native_calls == [n] * model.num_layers  # a prefill chunk: the paged kernel
    native_calls.clear()
    d = _run_trees("mistral")  # a sliding window inside the kernel, trees of 4 and 18 nodes
    assert d.worst <= ATOL and d.argmax_mismatches == 0
    assert TREE_NODES in native_calls


def test_schedule_covers_what_it_claims(monkeypatch):
    """The schedule really exercises the adapter's paths: rows attended as one padded group
    and one by one, SDPA rows (> SMALL_ROW_QUERIES queries) and small rows, keys gathered
    through a non-consecutive block table and sliced from consecutive blocks."""
    _torch_attention_only(monkeypatch)
    seen = []
    original = TorchAttention._attend_group

    def spy(g, q, k_flat, v_flat, scaling, window, softcap, sinks, sdpa_groups=False):
        seen.append((g.b, g.n, g.key_start is None))
        return original(g, q, k_flat, v_flat, scaling, window, softcap, sinks, sdpa_groups)

    monkeypatch.setattr(TorchAttention, "_attend_group", staticmethod(spy))
    d = _run_schedule("llama")
    # chunked prefill, verify and decode rows whose block tables have holes
    assert {(1, "B"), (2, "A"), (2, "B"), (3, "C"), (7, "E")} <= set(d.noncontiguous)
    assert any(b > 1 for b, _, _ in seen)
    assert any(b == 1 for b, _, _ in seen)
    assert any(n > hf_mod.SMALL_ROW_QUERIES for _, n, _ in seen)
    assert any(1 < n <= hf_mod.SMALL_ROW_QUERIES for _, n, _ in seen)
    assert any(gathered for _, _, gathered in seen)
    assert any(not gathered for _, _, gathered in seen)
    lengths = sorted(n for counts, _, _, _ in SCHEDULE for n in counts.values())
    assert set(range(1, 9)) <= set(lengths)
    assert TREE_NODES > hf_mod.SMALL_ROW_QUERIES
    assert set(ISSUE_TWELVE) <= set(CONFIGS)


@pytest.fixture
def lean(monkeypatch) -> list[int]:
    """The query counts of the calls that took the lean one-row attention path."""
    calls: list[int] = []
    original = TorchAttention._attend_lean

    def spy(g, q, k_flat, v_flat, scaling, window):
        calls.append(g.n)
        return original(g, q, k_flat, v_flat, scaling, window)

    monkeypatch.setattr(TorchAttention, "_attend_lean", staticmethod(spy))
    _torch_attention_only(monkeypatch)
    return calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma2", "gemma3_text", "stablelm"])
def test_half_precision_models_round_no_worse_than_transformers(name, dtype):
    """A bfloat16 / float16 model (HFModel takes any dtype): prefill, decodes and a verify
    pass after a rollback, against the float32 forward of the same (rounded) weights; the
    adapter's logits are no further from it than twice transformers' own forward in that
    dtype (rounding only: with the window and softcap switched off the adapter misses by
    0.5-3 against transformers' 0.004-0.05), and come back in the model's dtype. (Not
    the MoE models: in bfloat16 a router's near-tie flips an expert and transformers' own
    forward lands ~2 away from float32.)"""
    ref = copy.deepcopy(_reference(name)).to(dtype)
    truth = copy.deepcopy(ref).float()
    runner = PagedRunner(HFModel(copy.deepcopy(ref)), num_blocks=16, block_size=BLOCK_SIZE)
    seq = runner.add_sequence()
    tokens = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    got = [runner.step({seq: tokens[:20]})[0]]
    got += [runner.step({seq: [t]})[0] for t in tokens[20:]]
    runner.rollback(seq, 26)
    got.append(runner.step({seq: tokens[:6]})[0])
    got = torch.cat(got)
    assert got.dtype == dtype and got.shape == (36, VOCAB)
    ids = tokens[:26] + tokens[:6]
    want = torch.cat([_ref_logits(truth, tokens), _ref_logits(truth, ids)[26:]])
    theirs = torch.cat([_ref_logits(ref, tokens), _ref_logits(ref, ids)[26:]])
    err = (got.float() - want).abs().max().item()
    err_transformers = (theirs.float() - want).abs().max().item()
    assert 0 < err_transformers < 0.2  # rounding in that dtype, not a broken reference
    assert err <= 2 * err_transformers, (err, err_transformers)


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2", "gpt_oss"])
def test_one_sequence_alone(name, lean):
    """One sequence in its own consecutive blocks, as plain and speculative decoding of one
    request run it: prefill, decodes, verify passes of 2..8 with rollback, past the
    window. Decode and verify take the lean one-row path (unless the layer softcaps or
    has sinks), and every row equals transformers' forward."""
    ref, model = _reference(name), _wrap(name)
    runner = PagedRunner(model, num_blocks=16, block_size=BLOCK_SIZE)
    seq = runner.add_sequence()
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, VOCAB, (9,), generator=g).tolist()
    worst = 0.0
    got = runner.step({seq: tokens})[0]
    for n in (1, 3, 1, 8, 2, 5, 1):
        new = torch.randint(0, VOCAB, (n,), generator=g).tolist()
        got = runner.step({seq: new})[0]
        want = _ref_logits(ref, tokens + new)[len(tokens):]
        worst = max(worst, (got - want).abs().max().item())
        keep = 1 if n > 1 else n  # a verify pass keeps its first token, as after a rejection
        runner.rollback(seq, len(tokens) + keep)
        tokens += new[:keep]
    assert worst <= ATOL, f"{name}: {worst:.3g}"
    assert len(tokens) > 5  # past the configs' window of 5
    uses_lean = name in ("llama", "mistral")  # gemma2 softcaps, gpt_oss has sinks
    assert (1 in lean and any(n > 1 for n in lean)) == uses_lean, (name, lean)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_equal_transformers(name):
    d = _run_schedule(name)
    assert d.rows_compared >= 100
    assert d.noncontiguous
    assert d.worst <= ATOL, f"{name}: max |logits - transformers| = {d.worst:.3g} > {ATOL}"
    assert d.argmax_mismatches == 0


@pytest.mark.parametrize("name", list(F64_CONFIGS))
def test_logits_equal_the_float64_forward(name):
    d = _run_schedule(name, truth=torch.float64)
    assert d.rows_compared >= 100
    assert d.argmax_mismatches == 0
    # as close to the float64 forward as transformers' own float32 forward, up to the spread
    # of a float32 forward's largest rounding error between summation orders: on an AVX2
    # EPYC, gemma4_text's worst logit is 1.55x transformers' through the native kernels and
    # 1.11x through torch's own paths (minicpm3: 0.25x); a wrong layer misses by O(1)
    assert d.worst <= 2 * d.worst_transformers, (
        f"{name}: max |logits - float64 forward| = {d.worst:.3g}, more than twice "
        f"transformers' float32 forward's {d.worst_transformers:.3g}")
    # why this model is checked this way: transformers' own float32 forward misses ATOL
    assert d.worst_transformers > ATOL, d.worst_transformers


@pytest.mark.parametrize("name", list(CONFIGS))
def test_geometry(name):
    ref = _reference(name)
    model = _wrap(name)
    g = model.geometry
    text = ref.config.get_text_config()
    assert g.num_layers == model.num_layers == text.num_hidden_layers
    assert g.vocab_size == VOCAB
    assert g.dtype == torch.float32 and g.device == torch.device("cpu")
    assert g.max_context == text.max_position_embeddings
    if name in ("deepseek_v3", "deepseek_v2"):
        assert g.layer_kv == ((4, 24, 12),) * 3
    else:
        kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        head_dim = (getattr(text, "head_dim", None)
                    or text.hidden_size // text.num_attention_heads)
        assert g.layer_kv is None
        assert (g.num_kv_heads, g.head_dim) == (kv_heads, head_dim)
    pools = KVPools.allocate(g, num_blocks=3, block_size=BLOCK_SIZE)
    for i in range(g.num_layers):
        kvh, dk, dv = g.kv_shape(i)
        assert pools.k[i].shape == (3, BLOCK_SIZE, kvh, dk)
        assert pools.v[i].shape == (3, BLOCK_SIZE, kvh, dv)
    # the logits width is the geometry's vocabulary
    runner = PagedRunner(model, num_blocks=8, block_size=BLOCK_SIZE)
    (logits,) = runner.step({runner.add_sequence(): [3, 4, 5]})
    assert logits.shape == (3, g.vocab_size)


def test_mla_pools_are_per_layer():
    g = _wrap("deepseek_v3").geometry
    assert g.layer_kv is not None
    assert all(dk != dv for _, dk, dv in g.layer_kv)
    pools = KVPools.allocate(g, num_blocks=2, block_size=BLOCK_SIZE)
    assert [tuple(p.shape[2:]) for p in pools.k] == [(4, 24)] * 3
    assert [tuple(p.shape[2:]) for p in pools.v] == [(4, 12)] * 3


# ---------------------------------------------------------------- power

def _switch_off(monkeypatch, *features: str) -> None:
    """Makes the adapter ignore what the layers pass for the given features."""
    original = hf_mod._Plan.attend

    def attend(self, module, query, key, value, *, scaling, window, softcap, sinks):
        given = {"window": window, "softcap": softcap, "sinks": sinks}
        for f in features:
            given[f] = None
        return original(self, module, query, key, value, scaling=scaling, **given)

    monkeypatch.setattr(hf_mod._Plan, "attend", attend)


@pytest.mark.parametrize("name, feature", [
    ("mistral", "window"), ("qwen2", "window"), ("gemma3_text", "window"),
    ("starcoder2", "window"), ("cohere2", "window"), ("gemma2", "window"),
    ("gemma2", "softcap"), ("gpt_oss", "sinks"), ("gpt_oss", "window"),
])
def test_power_feature_off_fails(monkeypatch, name, feature):
    _switch_off(monkeypatch, feature)
    d = _run_schedule(name)
    assert d.worst > POWER_MIN_DIFF, (
        f"{name} still matches transformers ({d.worst:.3g}) with the {feature} ignored")


def test_power_control_llama_unaffected(monkeypatch):
    """llama passes no window, softcap or sinks: switching their handling off changes
    nothing, so the failures above come from the features, not from the switch."""
    _switch_off(monkeypatch, "window", "softcap", "sinks")
    d = _run_schedule("llama")
    assert d.worst <= ATOL and d.argmax_mismatches == 0


# ---------------------------------------------------------------- tree mask

def _tree_batch(runner, rows):
    """rows: list of (seq, tokens, parents or None for a chain). One batch whose tree rows
    get depth positions (siblings share one) and an ancestor mask; chain rows a causal
    mask. Returns the batch and, per row, each token's path (indices into its tokens)."""
    batch = runner.make_batch({s: toks for s, toks, _ in rows})
    t = batch.input_ids.shape[0]
    mask = torch.zeros(t, t, dtype=torch.bool)
    positions = batch.positions.clone()
    paths = []
    start = 0
    for s, toks, parents in rows:
        n = len(toks)
        if parents is None:
            parents = [i - 1 for i in range(n)]
        row_paths = []
        for i in range(n):
            path, j = [], i
            while j >= 0:
                path.append(j)
                j = parents[j]
            path.reverse()
            row_paths.append(path)
            for j in path:
                mask[start + i, start + j] = True
            positions[start + i] = batch.positions[start] + len(path) - 1
        paths.append(row_paths)
        start += n
    return dataclasses.replace(batch, positions=positions, tree_mask=mask), paths


def _random_parents(n: int, gen: torch.Generator) -> list[int]:
    """A random tree, each node's parent among the three nodes before it: branchy and
    deeper than WINDOW, so windows cut through the tree (by depth positions, not indices)."""
    parents = [-1] + [int(torch.randint(max(0, i - 3), i, (1,), generator=gen))
                      for i in range(1, n)]
    depth = [0] * n
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
    assert max(depth) > WINDOW and len(set(parents)) < n
    return parents


def _run_trees(name: str) -> _Driver:
    d = _Driver(name, seed=5)
    runner = d.runner
    d.step({"P": 12, "Q": 9, "R": 4})
    gen = torch.Generator().manual_seed(9)

    def toks(n):
        return [int(x) for x in torch.randint(0, VOCAB, (n,), generator=gen)]

    def check(rows):
        batch, paths = _tree_batch(runner, [(d.seqs[k], t, par) for k, t, par in rows])
        logits = d.model.forward(batch)
        assert logits.shape == (batch.input_ids.shape[0], VOCAB)
        start = 0
        for (k, t, _), row_paths in zip(rows, paths):
            for i, path in enumerate(row_paths):
                want = _ref_logits(d.ref, d.hist[k] + [t[j] for j in path])[-1:]
                d.compare(logits[start + i:start + i + 1], want)
            start += len(t)

    # a -> {b, c}, b -> d (depth positions 12, 13, 13, 14) next to a chain row and a decode row
    check([("P", toks(4), [-1, 0, 0, 1]), ("Q", toks(3), None), ("R", toks(1), None)])
    # every draft rejected: back to the committed prefixes
    for k in ("P", "Q", "R"):
        runner.rollback(d.seqs[k], len(d.hist[k]))
    # a random tree with more nodes than SMALL_ROW_QUERIES, alone in its batch
    n = TREE_NODES
    check([("P", toks(n), _random_parents(n, gen))])
    runner.rollback(d.seqs["P"], len(d.hist["P"]))
    # plain decoding continues over the committed prefixes (stale tree K/V past them)
    d.step({"P": 1, "Q": 1, "R": 2})
    assert d.rows_compared == 25 + 8 + n + 4
    return d


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_small_tree_alone_takes_the_lean_path(name, lean):
    """One sequence in consecutive blocks verifying a 7-node tree (depth past the window):
    the lean one-row path, with the tree's visibility and depth positions, equals
    transformers' forward of each node's path."""
    ref, model = _reference(name), _wrap(name)
    runner = PagedRunner(model, num_blocks=16, block_size=BLOCK_SIZE)
    seq = runner.add_sequence()
    gen = torch.Generator().manual_seed(21)
    prefix = torch.randint(0, VOCAB, (9,), generator=gen).tolist()
    runner.step({seq: prefix})
    nodes = torch.randint(0, VOCAB, (7,), generator=gen).tolist()
    parents = [-1, 0, 0, 1, 1, 3, 5]  # depth 4: the window of 5 cuts the prefix
    batch, (paths,) = _tree_batch(runner, [(seq, nodes, parents)])
    lean.clear()
    logits = model.forward(batch)
    assert lean == [7] * model.num_layers
    worst = 0.0
    for i, path in enumerate(paths):
        want = _ref_logits(ref, prefix + [nodes[j] for j in path])[-1]
        worst = max(worst, (logits[i] - want).abs().max().item())
    assert worst <= ATOL, f"{name}: {worst:.3g}"


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral", "gemma2", "gemma3_text", "gpt_oss"])
def test_tree_mask(name):
    d = _run_trees(name)
    assert d.worst <= ATOL, f"{name}: tree logits differ by {d.worst:.3g}"
    assert d.argmax_mismatches == 0


def test_power_tree_mask_ignored_fails(monkeypatch):
    """An adapter that read the tree as a chain (the sibling c would see b) must fail."""
    original = hf_mod._Plan.__init__

    def no_tree(self, batch, pool_of, device):
        original(self, dataclasses.replace(batch, tree_mask=None), pool_of, device)

    monkeypatch.setattr(hf_mod._Plan, "__init__", no_tree)
    assert _run_trees("llama").worst > POWER_MIN_DIFF


# ---------------------------------------------------------------- refusals

def _tiny(model_type: str, **kw):
    return transformers.AutoModelForCausalLM.from_config(_cfg(model_type, **kw)).eval()


def _refused(model, *words: str) -> str:
    before = model.config._attn_implementation
    with pytest.raises(ValueError) as info:
        HFModel(model)
    msg = str(info.value)
    assert type(model).__name__ in msg and "not supported" in msg
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"
    # the model is left in its own attention implementation, not verispec's
    assert model.config._attn_implementation == before != hf_mod.ATTN_IMPLEMENTATION
    return msg


def test_refuses_hybrid_conv_layers():
    model = _tiny("lfm2", layer_types=["conv", "full_attention", "conv"], block_ff_dim=96)
    _refused(model, "hybrid", "conv")


def test_refuses_hybrid_linear_attention():
    model = _tiny("qwen3_next", head_dim=16, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=32, shared_expert_intermediate_size=32,
                  linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=16,
                  linear_value_head_dim=16,
                  layer_types=["linear_attention", "full_attention", "linear_attention"])
    _refused(model, "hybrid", "linear_attention")


@pytest.mark.parametrize("model_type", ["falcon", "bloom"])
def test_takes_a_model_exactly_when_its_layers_call_the_interface(model_type):
    """Decided by what the layers do, not by the transformers version: a model whose
    layers call the selected function (falcon from transformers 5.25 on) is taken and
    compared with transformers' forward among CONFIGS; one whose layers compute attention
    themselves (bloom; falcon before 5.25) is refused with the reason."""
    layers = {"n_layer": 3} if model_type == "bloom" else {"num_hidden_layers": 3}
    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, bos_token_id=1,
        eos_token_id=2, **layers)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    if _calls_the_interface(config):
        assert model_type == "falcon" and FALCON.keys() <= CONFIGS.keys()
        assert HFModel(model).num_layers == 3
    else:
        assert not (model_type == "falcon" and FALCON.keys() & CONFIGS.keys())
        _refused(model, "AttentionInterface")


def test_refuses_alibi_falcon():
    """ALiBi Falcon adds its position bias to the attention mask transformers builds for
    its own attention, which it builds for no other function: refused with the reason
    (where its layers call the interface, the forward's own error), not a crash."""
    model = _tiny("falcon", drop=_NO_KV + ("intermediate_size",), ffn_hidden_size=96,
                  alibi=True)
    if FALCON_CALLS_THE_INTERFACE:
        _refused(model, "its forward fails with the attention function 'verispec_paged' "
                        "selected (transformers builds no attention mask for it): ")
    else:
        _refused(model, "AttentionInterface")


def test_refuses_layers_that_pass_their_own_attention_mask():
    """Doge's layers compute a dynamic mask from the values and pass it to the attention
    function, which masks by position, window and tree only: refused at construction
    (silently ignored, the logits would be wrong), and a mask that appears later is an
    error, never ignored."""
    model = _tiny("doge")
    msg = _refused(model, "own attention mask", "DogeAttention")
    assert "float32 [1, 4, 2, 2]" in msg  # the probe's 2 tokens, 4 heads
    wrapped = _wrap("llama")
    runner = PagedRunner(wrapped, num_blocks=4, block_size=BLOCK_SIZE)
    seq = runner.add_sequence()
    runner.step({seq: [3, 4]})
    attention = wrapped.layers[0].module
    original = attention.forward

    def with_mask(*args, **kwargs):
        kwargs["attention_mask"] = torch.zeros(1, 1, 1, 3)
        return original(*args, **kwargs)

    attention.forward = with_mask
    with pytest.raises(RuntimeError, match="passed its own attention mask"):
        runner.step({seq: [5]})


def _bypass(module):
    """An attention module that never calls the attention function."""
    def forward(hidden_states, *args, **kwargs):
        return torch.zeros_like(hidden_states), None
    module.forward = forward


def test_refuses_layers_that_never_call_the_hook():
    model = _tiny("llama")
    for layer in model.model.layers:
        _bypass(layer.self_attn)
    _refused(model, "never called")


def test_refuses_a_layer_that_bypasses_the_hook():
    model = _tiny("llama")
    _bypass(model.model.layers[1].self_attn)
    _refused(model, "only 2 of its 3 layers")


def test_refuses_a_window_only_transformers_mask_would_apply():
    """PhiMoE applies its config's sliding window through transformers' mask alone (its
    layers neither pass it nor keep it): refused, unless the context never exceeds the
    window (then the adapter equals transformers)."""
    model = _tiny("phimoe", num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW)
    ref = copy.deepcopy(model)
    _refused(model, f"sliding_window = {WINDOW}", f"max_context <= {WINDOW}")
    wrapped = HFModel(model, max_context=WINDOW)
    assert wrapped.geometry.max_context == WINDOW
    ids = [3, 4, 5, 6, 7]
    runner = PagedRunner(wrapped, num_blocks=4, block_size=BLOCK_SIZE)
    got = runner.step({runner.add_sequence(): ids})[0]
    assert (got - _ref_logits(ref, ids)).abs().max().item() <= ATOL


def test_refuses_more_attention_layers_than_the_config_counts():
    """BART's causal LM runs its decoder's layers (decoder_layers) while the config's
    num_hidden_layers counts the encoder's: refused with both numbers, not as "only 4 of
    its 3 layers"."""
    model = transformers.BartForCausalLM(transformers.BartConfig(
        vocab_size=VOCAB, d_model=64, encoder_layers=3, decoder_layers=4,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=96,
        decoder_ffn_dim=96, max_position_embeddings=256)).eval()
    msg = _refused(model, "4 attention modules", "num_hidden_layers = 3")
    assert "only" not in msg


def test_refuses_encoder_decoder():
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=96, num_layers=2, num_heads=4,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)).eval()
    _refused(model, "encoder-decoder")


def test_refuses_bidirectional_encoder():
    model = transformers.BertLMHeadModel(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=96, is_decoder=False, pad_token_id=0)).eval()
    _refused(model, "bidirectional")


def test_refuses_bidirectional_gemma3():
    model = _tiny("gemma3_text", head_dim=16, use_bidirectional_attention=True)
    _refused(model, "bidirectional")


def _llama4_chunked():
    # layer_types: ["chunked_attention"] * 3
    return _tiny("llama4_text", head_dim=16, attention_chunk_size=4, num_local_experts=2,
                 num_experts_per_tok=1, intermediate_size_mlp=96, interleave_moe_layer_step=1)


def test_refuses_chunked_attention():
    _refused(_llama4_chunked())


def test_chunked_attention_refusal_names_the_reason():
    msg = _refused(_llama4_chunked(), "chunked attention")
    assert "hybrid" not in msg


# ---------------------------------------------------------------- bad input

def test_rejects_non_models():
    with pytest.raises(TypeError, match="transformers model"):
        HFModel(object())
    with pytest.raises(TypeError, match="transformers model"):
        HFModel(torch.nn.Linear(2, 2))


def test_rejects_bad_max_context():
    with pytest.raises(ValueError, match="max_context"):
        HFModel(copy.deepcopy(_reference("llama")), max_context=0)
    model = HFModel(copy.deepcopy(_reference("llama")), max_context=6)
    assert model.geometry.max_context == 6
    runner = PagedRunner(model, num_blocks=8, block_size=BLOCK_SIZE)
    with pytest.raises(ValueError, match="max_context"):
        runner.step({runner.add_sequence(): list(range(7))})


def test_rejects_pools_of_the_wrong_shape():
    model = _wrap("deepseek_v3")
    runner = PagedRunner(model, num_blocks=8, block_size=BLOCK_SIZE)
    batch = runner.make_batch({runner.add_sequence(): [1, 2, 3]})
    model.forward(batch)  # the right pools pass
    # layer 1's V with the K head size (uniform pools for an MLA model)
    v = list(batch.kv.v)
    v[1] = torch.zeros(8, BLOCK_SIZE, 4, 24)
    bad = dataclasses.replace(batch, kv=KVPools(k=batch.kv.k, v=v, block_size=BLOCK_SIZE))
    with pytest.raises(ValueError, match="layer 1's KV pools"):
        model.forward(bad)
    short = KVPools(k=batch.kv.k[:2], v=batch.kv.v[:2], block_size=BLOCK_SIZE)
    with pytest.raises(ValueError, match="3 K and V pools"):
        model.forward(dataclasses.replace(batch, kv=short))


def test_rejects_tree_mask_of_the_wrong_shape_or_dtype():
    model = _wrap("llama")
    runner = PagedRunner(model, num_blocks=8, block_size=BLOCK_SIZE)
    batch = runner.make_batch({runner.add_sequence(): [1, 2, 3]})
    ok = torch.ones(3, 3, dtype=torch.bool).tril()
    model.forward(dataclasses.replace(batch, tree_mask=ok))
    for bad, got in ((torch.ones(3, 4, dtype=torch.bool), r"torch\.bool \[3, 4\]"),
                     (torch.ones(2, 2, dtype=torch.bool), r"torch\.bool \[2, 2\]"),
                     (ok.float(), r"torch\.float32 \[3, 3\]")):
        with pytest.raises(ValueError, match=r"^HFModel\.forward: batch\.tree_mask must be bool "
                                             r"\[T, T\] = \[3, 3\], got " + got + "$"):
            model.forward(dataclasses.replace(batch, tree_mask=bad))
    blind = ok.clone()
    blind[1, 1] = False  # node 1 cannot see itself
    with pytest.raises(ValueError, match=r"^HFModel\.forward: batch\.tree_mask must let every "
                                         r"token see itself \(a True diagonal\); token 1 does "
                                         r"not$"):
        model.forward(dataclasses.replace(batch, tree_mask=blind))


def test_refusal_leaves_the_training_mode_as_it_was():
    model = _llama4_chunked()
    model.train()
    with pytest.raises(ValueError):
        HFModel(model)
    assert model.training


def test_wrapped_model_on_its_own():
    """The wrapped model refuses to run outside HFModel.forward, saying how to get it back;
    switched back to sdpa it runs again, and HFModel then says its layers were not called."""
    model = _wrap("llama")
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(RuntimeError, match="set_attn_implementation"):
        with torch.no_grad():
            model.model(ids)
    model.model.set_attn_implementation("sdpa")
    with torch.no_grad():
        got = model.model(ids).logits[0]
    assert (got - _ref_logits(_reference("llama"), [5, 6, 7])).abs().max().item() <= ATOL
    runner = PagedRunner(model, num_blocks=8, block_size=BLOCK_SIZE)
    with pytest.raises(RuntimeError, match="0 of 3 layers"):
        runner.step({runner.add_sequence(): [5, 6, 7]})


# ---------------------------------------------------------------- verispec's CPU kernels

def test_linear_layers_reading_one_input_share_one_product():
    """q/k/v and gate/up read the same tensor one after another: the probe finds them,
    their weights become views of one stacked matrix (no copy), and the leader's product
    serves all of them. A sibling called on another input computes its own product
    (power: with the stacked product reused it would return q's values)."""
    model = _wrap("llama")
    layer = model.model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
    s = attn.q_proj._verispec_siblings
    assert [m._verispec_sibling for m in qkv] == [0, 1, 2]
    assert all(m._verispec_siblings is s for m in qkv)
    assert s.weight.shape[0] == sum(m.out_features for m in qkv)
    assert all(m.weight.untyped_storage().data_ptr() == s.weight.untyped_storage().data_ptr()
               for m in qkv)
    assert mlp.gate_proj._verispec_siblings is mlp.up_proj._verispec_siblings
    assert not hasattr(attn.o_proj, "_verispec_siblings")  # its input is the attention's
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randn(1, 3, attn.q_proj.in_features, generator=g) for _ in range(2))
    with torch.no_grad():
        q, k_same = attn.q_proj(x), attn.k_proj(x)
        k_other, v = attn.k_proj(y), attn.v_proj(x)
        for got, m, inp in ((q, attn.q_proj, x), (k_same, attn.k_proj, x),
                            (k_other, attn.k_proj, y), (v, attn.v_proj, x)):
            want = inp @ m.weight.t() + (0 if m.bias is None else m.bias)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_linear_layer_on_the_kernel_refuses_an_input_of_the_wrong_width():
    """A wrapped float32 nn.Linear called on an input whose last dimension is not its
    in_features raises as torch's does (F.linear), instead of the kernel reading past the
    weight's rows; a strided input of the right width is made dense and gives torch's
    product."""
    model = _wrap("llama")
    o = model.model.model.layers[0].self_attn.o_proj
    assert "forward" in vars(o)  # on verispec's kernel
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
            o(torch.randn(1, 2, o.in_features + 1, generator=g))
        x = torch.randn(1, 2, 2 * o.in_features, generator=g)[..., ::2]
        assert not x.is_contiguous()
        torch.testing.assert_close(o(x), x @ o.weight.t(), rtol=1e-5, atol=1e-5)


def test_cpu_kernels_are_installed_and_agree_with_the_modules_own_code(monkeypatch):
    """float32 on CPU: nn.Linear layers and plain RMSNorm modules get verispec's kernels
    (instance-level forwards; weights row-major (matmul_layout), same values); Gemma's (1 + weight)
    norm is not plain RMSNorm and keeps its own code. Switching the kernels off gives
    the same logits within float32 roundoff, and a verify pass differs from torch's
    products (so the kernel really ran)."""
    from verispec import _C

    calls = {"linear": 0, "norm": 0}
    for kind, fn in (("linear", _C._linear_unchecked), ("norm", _C._rms_norm_unchecked)):
        def counted(*args, _fn=fn, _kind=kind):
            calls[_kind] += 1
            return _fn(*args)
        monkeypatch.setattr(_C, f"_{'linear' if kind == 'linear' else 'rms_norm'}_unchecked",
                            counted)
    for name, plain_norms in (("llama", True), ("gemma", False)):
        model = _wrap(name)
        linears = [m for m in model.model.modules() if type(m) is torch.nn.Linear]
        norms = [m for m in model.model.modules() if type(m).__name__.endswith("RMSNorm")]
        assert linears and norms
        assert all("forward" in vars(m) and m.weight.is_contiguous() for m in linears), name
        assert all(("forward" in vars(m)) == plain_norms for m in norms), name
        assert model.native_linear and model.native_norm
        runner = PagedRunner(model, num_blocks=16, block_size=BLOCK_SIZE)
        seq = runner.add_sequence()
        runner.step({seq: list(range(3, 13))})
        calls.update(linear=0, norm=0)
        fast = runner.step({seq: [20, 21, 22, 23, 24, 25]})[0]
        # a verify pass: every linear layer on verispec's kernels, q/k/v and gate/up
        # each as one product (4 per layer + the head), and, for plain RMSNorm, every
        # norm (2 per layer + the final one)
        layers = model.num_layers
        assert calls["linear"] == 4 * layers + 1, (name, calls)
        assert calls["norm"] == (2 * layers + 1 if plain_norms else 0), (name, calls)
        runner.rollback(seq, 10)
        model.native_linear = model.native_norm = False
        calls.update(linear=0, norm=0)
        slow = runner.step({seq: [20, 21, 22, 23, 24, 25]})[0]
        assert calls == {"linear": 0, "norm": 0}
        assert not model.native_linear and not model.native_norm
        assert (fast - slow).abs().max().item() <= ATOL
        want = _ref_logits(_reference(name), list(range(3, 13)) + [20, 21, 22, 23, 24, 25])[10:]
        assert (fast - want).abs().max().item() <= ATOL


def test_model_modules_are_called_straight_through_and_hooks_still_run():
    """Under the CPU kernels the model's own module classes (layers, attention, MLP, ...)
    become same-named subclasses called straight through their forward; torch's modules
    (nn.Linear, nn.Embedding) and the model itself keep their classes. A hook registered
    afterwards still runs (nn.Module.__call__ then), and wrapping again with
    cpu_kernels=False gives every module its own class back."""
    hf = copy.deepcopy(_reference("llama"))
    classes = {name: type(m) for name, m in hf.named_modules()}
    model = HFModel(hf)
    swapped = {name for name, m in hf.named_modules() if type(m) is not classes[name]}
    assert {"model.layers.0.self_attn", "model.layers.0.mlp", "model.layers.0"} <= swapped
    for name, m in hf.named_modules():
        if name in swapped:
            assert isinstance(m, classes[name]) and type(m).__name__ == classes[name].__name__
            assert not classes[name].__module__.startswith("torch.")
        else:
            assert name == "" or classes[name].__module__.startswith("torch."), name
    seen = []
    attn = hf.model.layers[0].self_attn
    handle = attn.register_forward_hook(lambda mod, args, out: seen.append(mod))
    runner = PagedRunner(model, num_blocks=16, block_size=BLOCK_SIZE)
    seq = runner.add_sequence()
    with_hook = runner.step({seq: [3, 4, 5]})[0]
    assert seen == [attn]
    handle.remove()
    runner.rollback(seq, 0)
    assert torch.equal(runner.step({seq: [3, 4, 5]})[0], with_hook)
    assert seen == [attn]
    HFModel(hf, cpu_kernels=False)
    assert all(type(m) is classes[name] for name, m in hf.named_modules())


def test_rope_runs_on_the_kernel_where_the_model_function_computes_its_bits(monkeypatch):
    """A float32 llama's apply_rotary_pos_emb passes the bitwise check, so its modeling
    module's name is bound to the dispatcher: inside the wrapped model's forwards each
    layer's RoPE is one kernel call, with logits bit for bit those of the model's own
    function; outside them (transformers' own forward of an unwrapped model, a model
    wrapped with cpu_kernels=False) the original runs. Power: the check rejects GPT-J's
    interleaved RoPE and a rotate-half with the halves' signs swapped."""
    from transformers.models.gptj import modeling_gptj
    from transformers.models.llama import modeling_llama

    from verispec import _C

    calls = []

    def counted(*args, _fn=_C._rotate_half_rope_unchecked):
        calls.append(args[8])  # tokens
        return _fn(*args)

    monkeypatch.setattr(_C, "_rotate_half_rope_unchecked", counted)
    model = _wrap("llama")
    assert model.native_rope
    bound = modeling_llama.apply_rotary_pos_emb
    original = bound._verispec_original
    assert hf_mod._computes_rotate_half_rope(original)
    runner = PagedRunner(model, num_blocks=16, block_size=BLOCK_SIZE)
    seq = runner.add_sequence()
    runner.step({seq: list(range(3, 13))})
    calls.clear()
    fast = runner.step({seq: [20, 21, 22, 23, 24, 25]})[0]
    assert calls == [6] * model.num_layers
    runner.rollback(seq, 10)
    model.native_rope = False
    calls.clear()
    slow = runner.step({seq: [20, 21, 22, 23, 24, 25]})[0]
    assert calls == [] and not model.native_rope
    assert torch.equal(fast, slow)
    model.native_rope = True
    want = _ref_logits(_reference("llama"), list(range(3, 13)) + [20, 21, 22, 23, 24, 25])
    assert calls == []  # transformers' own forward: the original function
    assert (fast - want[10:]).abs().max().item() <= ATOL
    off = HFModel(copy.deepcopy(_reference("llama")), cpu_kernels=False)
    assert not off.native_rope
    off_runner = PagedRunner(off, num_blocks=16, block_size=BLOCK_SIZE)
    off_runner.step({off_runner.add_sequence(): list(range(3, 13))})
    assert calls == []
    assert modeling_llama.apply_rotary_pos_emb is bound  # bound once, kept

    def swapped(q, k, cos, sin, unsqueeze_dim=1):
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)

        def rot(x):
            half = x.shape[-1] // 2
            return torch.cat((x[..., half:], -x[..., :half]), dim=-1)
        return q * cos + rot(q) * sin, k * cos + rot(k) * sin

    assert not hf_mod._computes_rotate_half_rope(swapped)
    assert not hf_mod._computes_rotate_half_rope(modeling_gptj.apply_rotary_pos_emb)


def test_plain_rms_norm_detection():
    llama, gemma = _reference("llama"), _reference("gemma")
    assert hf_mod._is_plain_rms_norm(copy.deepcopy(llama.model.norm))
    assert not hf_mod._is_plain_rms_norm(copy.deepcopy(gemma.model.norm))  # x * (1 + w)
    shifted = copy.deepcopy(llama.model.norm)
    shifted.variance_epsilon = 0.5  # a norm whose eps the kernel would not reproduce
    shifted.forward = lambda x: torch.nn.functional.rms_norm(x, x.shape[-1:], shifted.weight, 1e-6)
    assert not hf_mod._is_plain_rms_norm(shifted)


def test_native_norm_reads_a_weight_kept_as_a_buffer(monkeypatch):
    """An RMSNorm whose weight is a buffer, not a parameter, runs on the kernel too and
    matches its own forward."""
    from verispec import _C

    calls = []
    kernel = _C._rms_norm_unchecked
    monkeypatch.setattr(_C, "_rms_norm_unchecked", lambda *a: calls.append(a[1]) or kernel(*a))
    class BufferRMSNorm(torch.nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.register_buffer("weight", 1 + 0.1 * torch.randn(dim))
            self.variance_epsilon = 1e-6

        def forward(self, x):
            return torch.nn.functional.rms_norm(x, x.shape[-1:], self.weight,
                                                self.variance_epsilon)

    norm = BufferRMSNorm(48)
    assert hf_mod._is_plain_rms_norm(norm)
    norm._verispec_kernels = hf_mod._CpuKernels()
    x = torch.randn(2, 3, 48)
    got = hf_mod._norm_forward(norm, x)
    assert got.shape == x.shape and torch.allclose(got, norm(x), rtol=1e-5, atol=1e-6)
    assert calls[-1] == 6  # the kernel ran, on the 2 x 3 rows


def test_cpu_kernels_off_leaves_the_modules_alone_and_copies_stay_independent():
    ref = _reference("llama")
    untouched = HFModel(copy.deepcopy(ref), cpu_kernels=False)
    assert not untouched.native_linear and not untouched.native_norm
    assert not any("forward" in vars(m) for m in untouched.model.modules()
                   if type(m) is torch.nn.Linear)
    model = _wrap("llama")
    clone = copy.deepcopy(model.model)  # the instance forwards rebind to the copy's modules
    with torch.no_grad():
        for p in clone.parameters():
            p.mul_(0.5)
    lin = model.model.model.layers[0].mlp.down_proj
    lin_copy = clone.model.layers[0].mlp.down_proj
    x = torch.randn(3, lin.in_features)
    assert torch.allclose(lin_copy(x), 0.5 * lin(x), atol=1e-6)


def _device_check(name: str, device: str) -> float:
    ref = copy.deepcopy(_reference(name)).to(device)
    model = HFModel(copy.deepcopy(ref))
    assert model.geometry.device.type == device
    runner = PagedRunner(model, num_blocks=16, block_size=BLOCK_SIZE)
    a, b = runner.add_sequence(), runner.add_sequence()
    g = torch.Generator().manual_seed(5)
    seqs = {a: torch.randint(0, VOCAB, (14,), generator=g).tolist(),
            b: torch.randint(0, VOCAB, (9,), generator=g).tolist()}
    worst = 0.0
    for counts in ({a: 8, b: 3}, {a: 1, b: 6}, {a: 5}):
        step = {s: seqs[s][runner.length(s):runner.length(s) + n] for s, n in counts.items()}
        for s, got in zip(step, runner.step(step)):
            with torch.no_grad():
                ids = torch.tensor([seqs[s][:runner.length(s)]], device=device)
                want = ref(ids).logits[0, -got.shape[0]:]
            assert got.device.type == device
            worst = max(worst, (got - want).abs().max().item())
    return worst


def test_device_check_on_the_cpu():
    """The GPU test's own logic, run on the CPU (so it is known to work before a GPU runs it)."""
    assert _device_check("qwen2", "cpu") <= ATOL


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["qwen2", "gemma2", "gpt_oss"])
def test_on_a_gpu(name):
    """The adapter on a CUDA model: the plan is built on the host and its index tensors
    moved once per forward; the logits equal transformers' forward on the same GPU."""
    worst = _device_check(name, "cuda")
    assert worst <= 1e-4, f"{name}: {worst:.3g}"


# ---------------------------------------------------------------- the architecture sweep

def test_arch_sweep_tool(tmp_path, monkeypatch):
    """tools/hf_arch_sweep.py, which finds architectures beyond the ones pinned here: a
    model that works is "ok" with its difference, a refused one carries HFModel's reason,
    and a wrong answer is a MISMATCH (a model whose mask the adapter ignored), exit 1."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "tools" / "hf_arch_sweep.py"
    spec = importlib.util.spec_from_file_location("hf_arch_sweep", path)
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    out = tmp_path / "sweep.json"
    assert sweep.main(["--only", "llama,doge,xglm", "--out", str(out)]) == 0
    r = json.loads(out.read_text())["results"]
    assert r["llama"]["status"] == "ok" and 0 < r["llama"]["max_abs_diff"] <= 1e-5
    assert r["doge"]["status"] == "refused" and "own attention mask" in r["doge"]["why"]
    assert r["xglm"]["status"] == "refused" and "AttentionInterface" in r["xglm"]["why"]
    # power: with the mask checks switched off (construction and forward), the sweep
    # reports Doge's wrong logits
    for cls in (hf_mod._Probe, hf_mod._Plan):
        monkeypatch.setattr(cls, "masked", lambda self, module, mask: None)
    assert sweep.main(["--only", "doge", "--out", str(out)]) == 1
    assert json.loads(out.read_text())["results"]["doge"]["status"] == "MISMATCH"


def test_query_start_is_checked_by_check_batch_for_hf_models_too():
    """The rule that a batch's rows follow each other (query_start rises from 0 to T)
    has one home, models.base.check_batch, which HFModel.forward applies as LlamaModel's
    does (test_models.py): a start that falls back mid-batch is refused, naming it."""
    model = HFModel(copy.deepcopy(_reference("llama")))
    runner = PagedRunner(model, num_blocks=8, block_size=BLOCK_SIZE)
    batch = runner.make_batch({runner.add_sequence(): [1, 2], runner.add_sequence(): [3],
                               runner.add_sequence(): [4]})
    assert batch.query_start.tolist() == [0, 2, 3, 4]
    bad = PagedBatch(**{**batch.__dict__, "query_start": torch.tensor([0, 3, 2, 4])})
    with pytest.raises(ValueError, match=r"^HFModel\.forward: query_start must rise from 0 to "
                                         r"T = 4, got \[0, 3, 2, 4\]$"):
        model.forward(bad)
    assert model.forward(batch).shape[0] == len(batch.logits_indices)  # the batch is fine
