"""The EAGLE-3 head (verispec.drafters.eagle3_head) against the reference implementation.

tests/data/eagle3/ holds heads with random weights written by speculators 0.9.0's own
classes (every norm flag, Llama- and Qwen3-style layers) and in the EAGLE/SpecForge
layout, with the draft logits of speculators' forward for fixed features and tokens
(3 training-time-test steps). They come from tools/eagle3_reference.py, run in a venv
of its own (its header has the commands); the same tool's ``--check`` loads the heads
that ``Eagle3Head.save`` writes back into speculators. Here: verispec's loader and
forward give the same logits within 1e-5 (float32), the comparison sees every flag
(power), our writer round-trips in both layouts, and every refusal names the field and
both values.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open  # a test dependency (Makefile TEST_DEPS)
from safetensors.torch import load_file, save_file

from verispec.drafters.eagle3_head import (
    DenseKV,
    Eagle3Config,
    Eagle3Head,
    TargetShape,
    causal_mask,
    ttt_mask,
)

DATA = Path(__file__).resolve().parent / "data" / "eagle3"
CASES = sorted(p.name for p in DATA.iterdir() if p.is_dir())
STEPS = 3
TOL = dict(atol=1e-5, rtol=0)
EMBEDDING = load_file(str(DATA / "target_embedding.safetensors"))["weight"]


def fixture(case: str) -> tuple[dict, dict]:
    with safe_open(str(DATA / case / "reference.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = json.loads(f.metadata()["meta"])
    return tensors, meta


def load(folder) -> Eagle3Head:
    head = Eagle3Head.load(folder)
    if not head.config.own_embedding:
        head.bind_target_embedding(EMBEDDING)
    return head


def unroll(head: Eagle3Head, x: dict) -> torch.Tensor:
    return head.unroll(x["taps"], x["token_ids"], x["positions"], STEPS)


def copy_case(case: str, tmp_path: Path) -> Path:
    dst = tmp_path / case
    shutil.copytree(DATA / case, dst)
    return dst


def edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    for key, value in changes.items():
        target = raw
        *parents, leaf = key.split("__")
        for p in parents:
            target = target[p]
        if value is _DELETE:
            target.pop(leaf, None)
        else:
            target[leaf] = value
    path.write_text(json.dumps(raw))


def edit_tensors(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


_DELETE = object()


# --- the fixtures are what the tool says ------------------------------------------------


def test_the_fixtures_cover_both_layer_styles_and_every_norm_flag():
    spec = [c for c in CASES if c.startswith("spec_")]
    flags = {(Eagle3Config.from_folder(DATA / c).layer_type,
              Eagle3Config.from_folder(DATA / c).norm_before_fc,
              Eagle3Config.from_folder(DATA / c).fc_norm,
              Eagle3Config.from_folder(DATA / c).norm_before_residual,
              Eagle3Config.from_folder(DATA / c).norm_output) for c in spec}
    for style in ("llama", "qwen3"):
        for nbf, fcn in ((False, False), (True, False), (False, True)):
            for nbr in (False, True):
                for nout in (False, True):
                    assert (style, nbf, fcn, nbr, nout) in flags
    assert {"eagle_llama", "eagle_llama_bin"} <= set(CASES)
    total = sum(p.stat().st_size for p in DATA.rglob("*") if p.is_file())
    assert total < 2_000_000   # identical weight files are one blob in git (~450 KB)


# --- against the reference ----------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_logits_equal_the_reference_forward(case):
    x, meta = fixture(case)
    head = load(DATA / case)
    assert head.config.vocab_size == 96 and head.dtype == torch.float32
    got = unroll(head, x)
    assert got.shape == x["logits"].shape
    torch.testing.assert_close(got, x["logits"], **TOL)
    # The config speculators saw is the one verispec read.
    taps = head.config.resolve_taps(meta.get("target_num_layers", 8))
    assert list(taps) == meta["taps"]
    case_args = meta.get("case", {})
    for flag, key in (("norm_before_residual", "nbr"), ("norm_output", "nout")):
        assert getattr(head.config, flag) == case_args.get(key, getattr(head.config, flag))
    assert head.config.fc_norm == (case_args.get("fc") == "fc_norm")
    assert head.config.norm_before_fc == (case_args.get("fc") == "norm_before_fc")


def test_the_eagle_layout_ids_are_one_less_than_the_entering_layer():
    # eagle_llama's file says eagle_config ids [0, 2, 4] (SGLang: output of layer j);
    # the converter was told [1, 3, 5] (vLLM: entering layer i), and logits agree above.
    raw = json.loads((DATA / "eagle_llama" / "config.json").read_text())
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 4]
    assert Eagle3Config.from_folder(DATA / "eagle_llama").tap_layers == (1, 3, 5)
    cfg = Eagle3Config.from_folder(DATA / "eagle_llama_bin")
    assert cfg.tap_layers is None and cfg.resolve_taps(8) == (2, 4, 5)
    assert cfg.resolve_taps(30) == (2, 15, 27)


@pytest.mark.parametrize("case,change", [
    ("spec_llama_plain_nbr0_out0", {"norm_before_residual": True}),
    ("spec_llama_plain_nbr1_out0", {"norm_before_residual": False}),
    ("spec_qwen3_plain_nbr0_out0", {"norm_output": True}),
    ("spec_qwen3_plain_nbr0_out1", {"norm_output": False}),
    ("spec_llama_plain_nbr0_out0", {"rms_norm_eps": 1e-2}),
    ("spec_llama_plain_nbr0_out0", {"rope_theta": 500.0}),
    ("spec_qwen3_plain_nbr0_out0", {"qk_norm": False}),
])
def test_the_comparison_sees_each_flag(case, change):
    """Power: each flag of the config changes the logits far beyond the tolerance, so
    a loader that read one wrong would fail the comparison above."""
    x, _ = fixture(case)
    head = load(DATA / case)
    weights = dict(head.weights)
    if change.get("qk_norm") is False:
        weights = {k: v for k, v in weights.items() if "_norm.weight" not in k
                   or "self_attn" not in k}
    wrong = Eagle3Head(Eagle3Config(**{**_fields(head.config), **change}),
                       {**weights, **_maps(head)})
    if not wrong.config.own_embedding:
        wrong.bind_target_embedding(EMBEDDING)
    assert (unroll(wrong, x) - x["logits"]).abs().max() > 1e-2


def test_the_comparison_sees_a_wrong_embedding_and_a_position_gap():
    x, _ = fixture("spec_qwen3_plain_nbr0_out0")
    head = Eagle3Head.load(DATA / "spec_qwen3_plain_nbr0_out0")
    head.bind_target_embedding(EMBEDDING.roll(1, dims=0))
    assert (unroll(head, x) - x["logits"]).abs().max() > 1e-2
    head = load(DATA / "spec_qwen3_plain_nbr0_out0")
    # RoPE sees relative positions only: shifting all changes nothing, a gap does.
    shifted = dict(x, positions=x["positions"] + 100)
    torch.testing.assert_close(unroll(head, shifted), x["logits"], atol=1e-4, rtol=0)
    gap = x["positions"].clone()
    gap[3:] += 1
    assert (unroll(head, dict(x, positions=gap)) - x["logits"]).abs().max() > 1e-2


def _fields(cfg: Eagle3Config) -> dict:
    import dataclasses
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


def _maps(head: Eagle3Head) -> dict:
    return {} if head.d2t is None else {"d2t": head.d2t, "t2d": head.t2d}


# --- our writer -------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_save_load_round_trip_keeps_config_and_logits(case, tmp_path):
    x, _ = fixture(case)
    head = load(DATA / case)
    head.save(tmp_path / "spec", format="speculators")
    again = load(tmp_path / "spec")
    assert again.config == head.config
    raw = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert raw["speculators_model_type"] == "eagle3"
    assert raw["architectures"] == ["Eagle3Speculator"]
    assert "norm_before_residual" in raw       # vLLM reads a missing key as True
    torch.testing.assert_close(unroll(again, x), x["logits"], **TOL)


@pytest.mark.parametrize("case", [c for c in CASES if "llama" in c and "4taps" not in c])
def test_the_eagle_layout_written_from_the_same_weights_gives_the_same_logits(case, tmp_path):
    x, _ = fixture(case)
    head = load(DATA / case)
    head.save(tmp_path / "eagle", format="eagle")
    raw = json.loads((tmp_path / "eagle" / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"]
    if head.config.tap_layers is not None:
        assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [
            t - 1 for t in head.config.tap_layers]
    names = set(load_file(str(tmp_path / "eagle" / "model.safetensors")))
    assert any(n.startswith("midlayer.") for n in names)
    assert not any(n.startswith("layers.") for n in names)
    again = load(tmp_path / "eagle")
    assert again.config == head.config
    torch.testing.assert_close(unroll(again, x), x["logits"], **TOL)


def test_a_sharded_checkpoint_loads_the_same(tmp_path):
    case = "spec_qwen3_fc_norm_nbr1_out0"
    folder = copy_case(case, tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for shard, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(folder / shard))
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: shard for shard, part in shards.items() for n in part}}))
    x, _ = fixture(case)
    torch.testing.assert_close(unroll(load(folder), x), x["logits"], **TOL)


def test_save_in_bfloat16_writes_bfloat16_and_loads_as_float32(tmp_path):
    head = load(DATA / "spec_llama_plain_nbr0_out0")
    head.save(tmp_path / "h", dtype=torch.bfloat16)
    on_disk = load_file(str(tmp_path / "h" / "model.safetensors"))
    assert on_disk["fc.weight"].dtype == torch.bfloat16 and on_disk["d2t"].dtype == torch.int64
    assert json.loads((tmp_path / "h" / "config.json").read_text())["dtype"] == "bfloat16"
    again = Eagle3Head.load(tmp_path / "h")
    assert again.dtype == torch.float32
    # The fixture's weights are bfloat16 already: nothing is lost.
    assert all(torch.equal(again.weights[k], v) for k, v in head.weights.items())


def test_a_tied_head_uses_its_embedding_as_lm_head_and_is_saved_untied(tmp_path):
    folder = copy_case("spec_qwen3_fullvocab", tmp_path)    # draft vocab = target vocab
    x, _ = fixture("spec_qwen3_fullvocab")
    edit_tensors(folder, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ValueError, match="lm_head.weight must be present"):
        Eagle3Head.load(folder)
    edit_config(folder, transformer_layer_config__tie_word_embeddings=True)
    head = load(folder)
    assert head.lm_head is EMBEDDING
    logits, _ = head.forward(x["token_ids"], x["positions"], taps=x["taps"])
    assert logits.shape == (7, 96)
    head.save(tmp_path / "untied")
    again = load(tmp_path / "untied")
    assert not again.config.tie_word_embeddings and torch.equal(again.lm_head, EMBEDDING)
    torch.testing.assert_close(again.forward(x["token_ids"], x["positions"], taps=x["taps"])[0],
                               logits, **TOL)


def test_the_eagle_writer_refuses_what_the_layout_cannot_say(tmp_path):
    with pytest.raises(ValueError, match=r"layer_type must be 'llama', got 'qwen3'"):
        load(DATA / "spec_qwen3_plain_nbr0_out0").save(tmp_path / "q", format="eagle")
    with pytest.raises(ValueError, match=r"tap_layers must be >= 1, got \[0, 2, 4, 6\]"):
        load(DATA / "spec_llama_bias_4taps").save(tmp_path / "t", format="eagle")
    with pytest.raises(ValueError, match=r"format must be 'speculators' or 'eagle', got 'gguf'"):
        load(DATA / "spec_llama_bias_4taps").save(tmp_path / "g", format="gguf")


# --- the forward as a decoder uses it ---------------------------------------------------


@pytest.mark.parametrize("case", ["spec_llama_fc_norm_nbr1_out1", "spec_qwen3_fullvocab"])
def test_token_by_token_with_a_kv_cache_equals_one_pass(case):
    x, _ = fixture(case)
    head = load(DATA / case)
    whole, whole_hidden = head.forward(x["token_ids"], x["positions"], taps=x["taps"])
    kv = head.new_kv()
    for t in range(len(x["token_ids"])):
        logits, hidden = head.forward(x["token_ids"][t:t + 1], x["positions"][t:t + 1],
                                      taps=x["taps"][t:t + 1], kv=kv)
        torch.testing.assert_close(logits[0], whole[t], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(hidden[0], whole_hidden[t], atol=1e-5, rtol=1e-5)
    assert len(kv) == len(x["token_ids"])
    # Roll back two tokens and redo them: the same logits.
    kv.truncate(len(kv) - 2)
    redo, _ = head.forward(x["token_ids"][-2:], x["positions"][-2:], taps=x["taps"][-2:], kv=kv)
    torch.testing.assert_close(redo, whole[-2:], atol=1e-5, rtol=1e-5)


def test_a_chain_drafted_step_by_step_equals_the_unroll_row():
    """Row t of step s of the training-time-test layout is a drafter's step s at t."""
    x, _ = fixture("spec_llama_plain_nbr1_out1")
    head = load(DATA / "spec_llama_plain_nbr1_out1")
    ref = x["logits"]
    t = 3
    kv = head.new_kv()
    logits, hidden = head.forward(x["token_ids"][:t + 1], x["positions"][:t + 1],
                                  taps=x["taps"][:t + 1], kv=kv)
    torch.testing.assert_close(logits[t], ref[0, t], **TOL)
    h = hidden[t:t + 1]
    for s in range(1, STEPS):
        ids = x["token_ids"][t + s:t + s + 1]
        logits, h = head.forward(ids, x["positions"][t:t + 1] + s, hidden=h, kv=kv)
        torch.testing.assert_close(logits[0], ref[s, t], **TOL)


def test_masks():
    assert causal_mask(2, 3).tolist() == [[True, True, True, True, False],
                                          [True, True, True, True, True]]
    m = ttt_mask(3, 2)
    assert m.shape == (3, 9)
    assert m[:, :3].tolist() == causal_mask(3, 0).tolist()
    assert torch.equal(m[:, 3:6], torch.eye(3, dtype=torch.bool))
    assert torch.equal(m[:, 6:], torch.eye(3, dtype=torch.bool))


def test_dense_kv_refuses_a_bad_mask_and_a_bad_truncate():
    kv = DenseKV(2, 6)
    q = torch.zeros(2, 4, 6)
    k = v = torch.zeros(2, 2, 6)
    with pytest.raises(ValueError, match=r"mask must be bool \[2, 2\], got torch.bool \[2, 3\]"):
        kv.attend(q, k, v, torch.ones(2, 3, dtype=torch.bool))
    assert len(kv) == 0                            # a refused call stores nothing
    kv.attend(q, k, v)
    with pytest.raises(ValueError, match=r"length must be in \[0, 2\], got 5"):
        kv.truncate(5)


def test_forward_refuses_bad_inputs():
    x, _ = fixture("spec_llama_plain_nbr0_out0")
    head = load(DATA / "spec_llama_plain_nbr0_out0")
    ids, pos = x["token_ids"], x["positions"]
    with pytest.raises(ValueError, match=r"taps must be \[T, 72\] \(k = 3 taps of 24\), "
                                         r"got \[7, 48\]"):
        head.forward(ids, pos, taps=x["taps"][:, :48])
    with pytest.raises(ValueError, match="exactly one of taps"):
        head.forward(ids, pos)
    with pytest.raises(ValueError, match=r"hidden must be \[7, 24\], got \[7, 23\]"):
        head.forward(ids, pos, hidden=torch.zeros(7, 23))
    with pytest.raises(ValueError, match=r"T = 7 rows each, got 7 and \[6\]"):
        head.forward(ids, pos[:6], taps=x["taps"])


# --- vocabulary maps --------------------------------------------------------------------


def test_draft_to_target_and_the_full_vocabulary_scatter():
    head = load(DATA / "spec_llama_plain_nbr0_out0")
    target_ids = torch.arange(24) + head.d2t
    assert torch.equal(head.draft_to_target(torch.arange(24)), target_ids)
    assert torch.equal(head.target_ids, target_ids)
    assert torch.equal(head.t2d.nonzero().flatten(), target_ids.sort().values)
    logits = torch.randn(5, 24)
    full = head.scatter_to_target(logits)
    assert full.shape == (5, 96)
    assert torch.equal(full[:, target_ids], logits)
    outside = torch.ones(96, dtype=torch.bool)
    outside[target_ids] = False
    assert torch.isneginf(full[:, outside]).all()
    # q over the full vocabulary: the compact softmax, zeros outside.
    torch.testing.assert_close(full.softmax(-1)[:, target_ids], logits.softmax(-1))
    # No reduced vocabulary: the identity.
    same = load(DATA / "spec_qwen3_fullvocab")
    assert same.d2t is None and torch.equal(same.draft_to_target(torch.tensor([5, 95])),
                                            torch.tensor([5, 95]))
    assert same.scatter_to_target(logits) is logits


# --- refusals ----------------------------------------------------------------------------


def test_check_target_refuses_a_mismatched_target():
    head = load(DATA / "spec_llama_plain_nbr0_out0")       # taps 1, 3, 5
    assert head.check_target(TargetShape(hidden_size=24, vocab_size=96, num_layers=8)) == (1, 3, 5)
    assert head.check_target(TargetShape(24, 96, 5)) == (1, 3, 5)   # 5: the last output
    with pytest.raises(ValueError, match=r"hidden_size must be the head's target_hidden_size "
                                         r"= 24, got 32"):
        head.check_target(TargetShape(32, 96, 8))
    with pytest.raises(ValueError, match=r"vocab_size must be the head's vocab_size = 96, "
                                         r"got 100"):
        head.check_target(TargetShape(24, 100, 8))
    with pytest.raises(ValueError, match=r"tap_layers must be <= the target's num_layers = 4 .*"
                                         r"got \[1, 3, 5\]"):
        head.check_target(TargetShape(24, 96, 4))
    with pytest.raises(TypeError, match="target must have hidden_size, got object"):
        head.check_target(object())
    ht = load(DATA / "spec_llama_ht40")
    assert ht.check_target(TargetShape(40, 96, 8)) == (1, 3, 5)
    default = load(DATA / "eagle_llama_bin")
    with pytest.raises(ValueError, match=r"at least 7 layers, got num_layers = 5"):
        default.check_target(TargetShape(24, 96, 5))


def test_embedding_binding_refusals():
    head = Eagle3Head.load(DATA / "spec_qwen3_plain_nbr0_out0")
    x, _ = fixture("spec_qwen3_plain_nbr0_out0")
    with pytest.raises(RuntimeError, match="bind_target_embedding"):
        head.forward(x["token_ids"], x["positions"], taps=x["taps"])
    with pytest.raises(ValueError, match=r"weight.shape must be \[96, 24\], got \[96, 32\]"):
        head.bind_target_embedding(torch.zeros(96, 32))
    own = load(DATA / "spec_llama_plain_nbr0_out0")
    with pytest.raises(ValueError, match="own_embedding must be False, got True"):
        own.bind_target_embedding(EMBEDDING)


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.__setitem__("fc.weight", torch.zeros(24, 71)),
     r"fc.weight.shape must be \[24, 72\], got \[24, 71\]"),
    (lambda t: t.pop("layers.0.hidden_norm.weight"),
     r"the tensors must be all present, got no \['layers.0.hidden_norm.weight'\]"),
    (lambda t: t.__setitem__("layers.1.mlp.up_proj.weight", torch.zeros(48, 24)),
     r"got also \['layers.1.mlp.up_proj.weight'\]"),
    (lambda t: t.__setitem__("d2t", t["d2t"] + 200),
     r"d2t must be offsets mapping draft ids into \[0, 96\), got target ids from \d+ to \d+"),
    (lambda t: t["d2t"].__setitem__(1, t["d2t"][0] - 1),   # draft 1 -> draft 0's target
     r"d2t must be 24 distinct target ids, got 23"),
    (lambda t: t.__setitem__("t2d", t["t2d"].roll(1)),
     r"t2d must be True exactly at the 24 target ids of d2t, got 24 True entries, other ids"),
    (lambda t: t.pop("t2d"), r"d2t and t2d must be present \(draft_vocab_size 24 < vocab_size "
                             r"96\), got d2t present, t2d missing"),
    (lambda t: t.__setitem__("lm_head.weight", torch.zeros(24, 24, dtype=torch.int32)),
     r"lm_head.weight.dtype must be floating point, got torch.int32"),
    (lambda t: t.pop("lm_head.weight"), r"lm_head.weight must be present"),
])
def test_load_refuses_tensors_that_do_not_fit(edit, message, tmp_path):
    folder = copy_case("spec_llama_plain_nbr0_out0", tmp_path)
    edit_tensors(folder, edit)
    with pytest.raises(ValueError, match=message):
        Eagle3Head.load(folder)


@pytest.mark.parametrize("changes,message", [
    ({"transformer_layer_config__num_hidden_layers": 2},
     r"num_hidden_layers must be 1 \(an EAGLE-3 head has one layer\), got 2"),
    ({"transformer_layer_config__rope_parameters": {"rope_type": "yarn", "factor": 2.0}},
     r"rope type must be 'default', 'linear' or 'llama3', got 'yarn'"),
    ({"transformer_layer_config__hidden_act": "gelu"}, r"hidden_act must be 'silu', got 'gelu'"),
    ({"transformer_layer_config__model_type": "mistral"},
     r"model_type must be one of \('llama', 'qwen3'\), got 'mistral'"),
    ({"transformer_layer_config__layer_types": ["sliding_attention"]},
     r"use_sliding_window / layer_types must be full attention, got a sliding window"),
    ({"transformer_layer_config__hidden_size": _DELETE}, r"hidden_size must be present"),
    ({"norm_before_fc": True, "fc_norm": True},
     r"norm_before_fc and fc_norm must be not both set"),
    ({"draft_vocab_size": 200}, r"draft_vocab_size must be in \[1, vocab_size = 96\], got 200"),
    ({"eagle_aux_hidden_state_layer_ids": [1, 1, 5]},
     r"tap_layers must be distinct layer ids >= 0, got \[1, 1, 5\]"),
    ({"speculators_model_type": "dflash"}, r"speculators_model_type must be 'eagle3', got 'dflash'"),
    ({"transformer_layer_config__num_key_value_heads": 3},
     r"num_key_value_heads must be a divisor of num_attention_heads = 4, got 3"),
])
def test_load_refuses_configs_that_do_not_fit(changes, message, tmp_path):
    folder = copy_case("spec_llama_plain_nbr0_out0", tmp_path)
    edit_config(folder, **changes)
    with pytest.raises(ValueError, match=message):
        Eagle3Head.load(folder)


def test_a_tensor_that_no_longer_fits_the_config_is_named(tmp_path):
    folder = copy_case("spec_llama_plain_nbr0_out0", tmp_path)
    edit_config(folder, transformer_layer_config__intermediate_size=40)
    with pytest.raises(ValueError, match=r"layers.0.mlp.\w+_proj.weight.shape must be "
                                         r"\[(40, 24|24, 40)\], got \[(48, 24|24, 48)\]"):
        Eagle3Head.load(folder)


def test_unknown_layouts_and_missing_files_are_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match=r"architectures must be \['LlamaForCausalLMEagle3'\] "
                                         r"or .* got \['LlamaForCausalLM'\]"):
        Eagle3Head.load(tmp_path)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        Eagle3Head.load(tmp_path / "nothing")
    folder = copy_case("spec_llama_plain_nbr0_out0", tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        Eagle3Head.load(folder)


# --- conventions -------------------------------------------------------------------------


def _eagle_raw(**extra) -> dict:
    return {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 24,
            "intermediate_size": 48, "num_attention_heads": 4, "vocab_size": 96,
            "draft_vocab_size": 24, **extra}


def test_tap_conventions_per_layout():
    # speculators / vLLM: "entering layer i", stored as is.
    spec = json.loads((DATA / "spec_llama_plain_nbr0_out0" / "config.json").read_text())
    assert Eagle3Config.from_dict(spec).tap_layers == tuple(
        spec["eagle_aux_hidden_state_layer_ids"])
    # EAGLE nested ids: output of layer j (SGLang adds 1); vLLM's top-level key as is.
    nested = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26]}}
    assert Eagle3Config.from_dict(_eagle_raw(**nested)).tap_layers == (2, 15, 27)
    top = {"eagle_aux_hidden_state_layer_ids": [2, 15, 27]}
    assert Eagle3Config.from_dict(_eagle_raw(**top)).tap_layers == (2, 15, 27)
    assert Eagle3Config.from_dict(_eagle_raw(**nested, **top)).tap_layers == (2, 15, 27)
    with pytest.raises(ValueError, match=r"entering \[2, 15, 27\]\) and eagle_aux_hidden_state_layer_ids "
                                         r"\[3, 15, 27\] \(entering\) disagree"):
        Eagle3Config.from_dict(_eagle_raw(**nested, eagle_aux_hidden_state_layer_ids=[3, 15, 27]))
    # Written back: EAGLE ids one less, speculators ids the same.
    cfg = Eagle3Config.from_dict(_eagle_raw(**nested))
    assert cfg.to_eagle_dict()["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]
    assert cfg.to_speculators_dict()["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]


def test_a_missing_norm_before_residual_is_false_in_both_layouts():
    spec = json.loads((DATA / "spec_llama_plain_nbr1_out0" / "config.json").read_text())
    assert Eagle3Config.from_dict(spec).norm_before_residual is True
    del spec["norm_before_residual"]
    assert Eagle3Config.from_dict(spec).norm_before_residual is False   # speculators' default
    assert Eagle3Config.from_dict(_eagle_raw()).norm_before_residual is False


def test_defaults_of_a_minimal_eagle_config():
    cfg = Eagle3Config.from_dict(_eagle_raw())
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.target_hidden_size) == (4, 6, 24)
    assert (cfg.rms_norm_eps, cfg.rope_theta, cfg.rope_scaling.rope_type) == (1e-6, 10000.0,
                                                                             "default")
    assert cfg.layer_type == "llama" and not cfg.qk_norm and cfg.uses_draft_vocab
    legacy = Eagle3Config.from_dict(_eagle_raw(rope_theta=500000.0, rope_scaling={
        "type": "linear", "factor": 8.0}))
    assert legacy.rope_theta == 500000.0 and legacy.rope_scaling.rope_type == "linear"
    assert legacy.rope_scaling.factor == 8.0
