"""verispec.training and ``verispec train-head``: the head it writes loads and drafts
exactly, training raises held-out acceptance, an interrupted run resumed gives the
uninterrupted run's weights bit for bit, and bad inputs are one-line usage errors.

The target is a tiny random Llama (97 tokens, 3 layers); its greedy answers fall into
loops that a head can learn, so acceptance rising is a real effect, not noise: every
run here is seeded and deterministic, the random-init head accepts about 1% (the
draft vocabulary's 64 ids among 97, argmax by chance) and the trained one about 25%.
"""

import json
import os

import pytest
import torch
import transformers
from safetensors.torch import load_file

from verispec import cli
from verispec.decoder import SpecDecoder
from verispec.drafters import Eagle3
from verispec.drafters.eagle3_head import Eagle3Head
from verispec.models import load_model
from verispec.models.testing import randomize_weights
from verispec.training import TrainConfig, TrainHeadOptions, train_head
from verispec.training.data import (magpie_prefix, read_prompts_file, self_written_prompts,
                                    split_held_out)
from verispec.training.features import FeatureStore
from verispec.training.run import STATE, _read_json
from verispec.training.trainer import (Trainer, default_taps, head_config, init_head,
                                       target_tensors)
from verispec.training.vocab import DraftVocab, choose_draft_vocab

from toymodels import write_tiny_llama

VOCAB = 97
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _options(**train):
    cfg = dict(ttt_steps=3, steps=18, batch_tokens=256, lr=3e-3, eval_every=6,
               checkpoint_every=4, seed=5)
    cfg.update(train)
    return TrainHeadOptions(max_answer_tokens=40, draft_vocab=64, held_out=0.2,
                            train=TrainConfig(**cfg))


def _prompts(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(torch.randint(3, 12, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """(target, prompts, the folder of a head trained uninterrupted, its report)."""
    folder = tmp_path_factory.mktemp("train_target")
    cfg = transformers.LlamaConfig(
        hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=512,
        tie_word_embeddings=False, rms_norm_eps=1e-5)
    randomize_weights(transformers.LlamaForCausalLM(cfg), 0, norm_spread=0.2).eval() \
        .save_pretrained(folder, safe_serialization=True)
    target = load_model(folder)
    prompts = _prompts(40)
    out = tmp_path_factory.mktemp("head")
    report = train_head(target, None, out, _options(), prompts=prompts, stop_ids=[])
    return target, prompts, out, report


def test_the_written_head_loads_and_drafts_exactly(toy):
    """speculators layout (config.json + model.safetensors, d2t/t2d, no embed_tokens:
    the target's is bound), and Eagle3 drafting with it gives plain greedy's tokens."""
    target, prompts, out, report = toy
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    assert config["speculators_model_type"] == "eagle3"
    assert config["architectures"] == ["Eagle3Speculator"]
    assert config["draft_vocab_size"] == 64
    assert config["eagle_aux_hidden_state_layer_ids"] == list(default_taps(3)) == report["taps"]
    tensors = load_file(os.path.join(out, "model.safetensors"))
    assert "embed_tokens.weight" not in tensors and tensors["lm_head.weight"].shape == (64, 48)
    head = Eagle3Head.load(out)
    assert head.config.draft_vocab_size == 64 and head.d2t is not None

    new = _prompts(8, seed=9)
    want = SpecDecoder(target, None, num_blocks=512, block_size=8).generate(
        new, max_new_tokens=40, greedy=True)
    dec = SpecDecoder(target, Eagle3(target, out), k=3, num_blocks=512, block_size=8)
    got = dec.generate(new, max_new_tokens=40, greedy=True)
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert sum(r.stats["proposed"] for r in got) > 50   # it drafted


def test_training_lowers_the_loss_and_raises_held_out_acceptance(toy):
    _, _, _, report = toy
    losses = [h["loss"] for h in report["history"]]
    assert len(losses) == 18
    assert sum(losses[-4:]) / 4 < 0.9 * sum(losses[:4]) / 4
    before = report["acceptance_before"]["acceptance"]
    after = report["held_out"]["acceptance"]
    assert report["held_out"]["rows"] > 200
    assert before[0] < 0.05                      # the random-init head: chance
    assert after[0] > before[0] + 0.1 and after[1] > before[1] + 0.1
    assert report["held_out"]["tau"] > report["acceptance_before"]["tau"] + 0.15


def test_an_interrupted_run_resumed_gives_the_same_weights(toy, tmp_path):
    """Stopped at step 10 (the last checkpoint at 8), resumed: bit-identical to the
    uninterrupted run of the fixture (answers, vocabulary and features are read back)."""
    target, prompts, out, _ = toy

    class Stop(Exception):
        pass

    def interrupting(stage):
        def progress(done, total, label):
            if stage == "training" and done == 10:
                raise Stop
        return progress

    with pytest.raises(Stop):
        train_head(target, None, tmp_path, _options(), prompts=prompts, stop_ids=[],
                   progress=interrupting)
    state = torch.load(tmp_path / STATE / "checkpoint.pt", weights_only=False)
    assert state["position"]["step"] == 8
    with pytest.raises(FileExistsError, match="resume"):
        train_head(target, None, tmp_path, _options(), prompts=prompts, stop_ids=[])
    with pytest.raises(ValueError, match="train.lr must be the interrupted run's 0.003"):
        train_head(target, None, tmp_path, _options(lr=1e-3), prompts=prompts, stop_ids=[],
                   resume=True)
    train_head(target, None, tmp_path, _options(), prompts=prompts, stop_ids=[], resume=True)
    want = load_file(os.path.join(out, "model.safetensors"))
    got = load_file(tmp_path / "model.safetensors")
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_the_same_loop_from_another_seed_or_position_differs(toy, tmp_path):
    """Power of the bit-identity check: the loop is deterministic, and one step more or
    another seed changes the weights."""
    target, _, out, _ = toy
    store = FeatureStore.open(os.path.join(out, STATE, "features"))
    vocab = DraftVocab(torch.tensor(_read_json(os.path.join(out, STATE, "vocab.json"))
                                    ["target_ids"]), VOCAB)
    prompts = _read_json(os.path.join(out, STATE, "prompts.json"))["ids"]
    train, held = split_held_out(len(store), 0.2, 5)
    config = head_config(target, vocab, default_taps(3))

    def weights(seed, steps, folder, reset_optimizer_at=None):
        head = init_head(config, vocab, target_tensors(target, vocab.target_ids), seed=seed)
        cfg = TrainConfig(ttt_steps=3, steps=steps, batch_tokens=256, lr=3e-3,
                          checkpoint_every=2, eval_every=100, seed=seed)
        trainer = Trainer(head, store, train, held, [len(p) for p in prompts], vocab, cfg,
                          str(folder))
        trainer.run()
        return {n: p.detach().clone() for n, p in trainer.module.named().items()}

    a = weights(5, 2, tmp_path / "a")
    b = weights(5, 2, tmp_path / "b")
    assert all(torch.equal(a[n], b[n]) for n in a)           # deterministic
    c = weights(6, 2, tmp_path / "c")
    assert not all(torch.equal(a[n], c[n]) for n in a)
    d = weights(5, 3, tmp_path / "d")
    assert not all(torch.equal(a[n], d[n]) for n in a)


# --- the pieces ---------------------------------------------------------------------------


def test_draft_vocab_takes_stops_then_frequent_answer_tokens_then_fills():
    answers = [[5, 5, 5, 7, 7, 9], [7, 5, 3]]
    v = choose_draft_vocab(answers, 20, 5, prompts=[[11, 11, 2]], always=[19])
    assert v.target_ids.tolist() == [3, 5, 7, 9, 19]   # 3 before 9: a tie, the smaller id
    assert v.size == 5
    assert torch.equal(torch.arange(5) + v.d2t, v.target_ids)
    assert v.t2d.sum() == 5 and v.t2d[v.target_ids].all()
    assert v.draft_index()[7] == 2 and v.draft_index()[0] == -1
    filled = choose_draft_vocab(answers, 20, 8, prompts=[[11, 11, 2]])
    assert filled.target_ids.tolist() == [0, 1, 2, 3, 5, 7, 9, 11]  # prompts' 11, 2; then 0, 1
    assert choose_draft_vocab([[1, 1, 2]], 4, 100).target_ids.tolist() == [0, 1, 2, 3]


def test_prompts_file_formats_and_errors(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("How do tides work?\n\n"
                 '{"prompt": "Name three rivers."}\n'
                 '{"messages": [{"role": "user", "content": "hi"}, '
                 '{"role": "assistant", "content": "hello"}, {"role": "user", "content": "why?"}, '
                 '{"role": "assistant", "content": "dropped"}]}\n')
    convs = read_prompts_file(f)
    assert convs[0] == [{"role": "user", "content": "How do tides work?"}]
    assert convs[1] == [{"role": "user", "content": "Name three rivers."}]
    assert [m["content"] for m in convs[2]] == ["hi", "hello", "why?"]
    f.write_text('ok\n{"text": "x"}\n')
    with pytest.raises(ValueError, match=r"p.txt:2: expected a JSON object with a string "
                                         r"\"prompt\" or a list \"messages\", got keys \['text'\]"):
        read_prompts_file(f)
    f.write_text("\n\n")
    with pytest.raises(ValueError, match="at least one prompt"):
        read_prompts_file(f)


def test_self_written_prompts_come_from_the_template_up_to_the_user_turn(tmp_path,
                                                                          monkeypatch):
    """The prefix is the template up to the user's message and the question stops at the
    turn's end; questions cut at max_tokens, too short or repeated (case and spaces
    folded) are dropped, and each attempt is its own request (seeded by its index)."""
    from types import SimpleNamespace

    from verispec.models import load
    from verispec.training import data

    target, tok = load(write_tiny_llama(tmp_path, CHAT_TEMPLATE))
    prefix, turn_end = magpie_prefix(tok)
    assert tok.decode(prefix) == "<|im_start|>user\n"
    assert tok.decode(turn_end) == "<|im_end|>"
    end = turn_end[0]
    written = [("the quick fox?", "eos"), ("The  quick fox?", "eos"), ("dog", "eos"),
               ("the lazy dog jumps", "length"), ("over the lazy dog", "eos"),
               ("brown fox jumps over", "eos")]
    calls = []

    def fake_generate(target_, prompts, *, first_index, seed, stop_ids, **kw):
        calls.append((first_index, len(prompts), seed))
        assert all(p == prefix for p in prompts) and end in stop_ids
        out = []
        for j in range(len(prompts)):
            text, reason = written[(first_index + j) % len(written)]
            out.append(SimpleNamespace(tokens=tok.encode(text) + [end], finish_reason=reason))
        return out

    monkeypatch.setattr(data, "generate", fake_generate)
    texts = self_written_prompts(target, tok, 3, seed=7, min_chars=5, batch=2)
    assert texts == ["the quick fox?", "over the lazy dog", "brown fox jumps over"]
    assert calls == [(0, 3, 7), (3, 2, 7), (5, 2, 7)]   # at least a batch per round


# --- the command line ---------------------------------------------------------------------


def run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_usage_error(code, err, *needles):
    assert code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) >= 1
    for needle in needles:
        assert needle in err, f"{needle!r} not in {err!r}"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), CHAT_TEMPLATE)


def test_cli_trains_from_a_prompts_file_and_refuses_to_overwrite(capsys, tiny_model, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(["the quick brown fox", "over the lazy dog", "the dog jumps",
                                  "brown fox the lazy", "quick quick dog"]))
    out = tmp_path / "head"
    args = ["train-head", "--model", tiny_model, "--out", out, "--prompts", prompts,
            "--max-answer-tokens", 16, "--steps", 2, "--draft-vocab", 40, "--threads", 1,
            "--held-out", 0.2, "--batch-tokens", 64]
    code, stdout, err = run(capsys, *args)
    assert code == 0, err
    assert "held-out acceptance" in stdout and "--draft-head" in stdout
    head = Eagle3Head.load(out)
    assert head.config.draft_vocab_size == 40
    code, _, err = run(capsys, *args)
    assert_usage_error(code, err, "argument --out", "--resume")
    code, stdout, err = run(capsys, *args, "--resume")
    assert code == 0, err


@pytest.mark.parametrize("argv, needles", [
    (["--lr", "0"], ["argument --lr", "expected a number in (0, 1]", "got 0"]),
    (["--ttt-steps", "0"], ["argument --ttt-steps", "expected an int >= 1", "got 0"]),
    (["--held-out", "1"], ["argument --held-out", "expected a number in [0, 1)", "got 1"]),
    (["--device", "tpu"], ["argument --device", "expected cpu, cuda or cuda:N", "'tpu'"]),
    (["--epochs", "2", "--steps", "3"], ["argument --steps", "not allowed with argument --epochs"]),
    (["--prompts", "/nonexistent/p.txt"], ["argument --prompts", "expected a readable file",
                                            "'/nonexistent/p.txt'"]),
    (["--resume"], ["argument --resume", "expected --out to hold an interrupted run"]),
])
def test_cli_usage_errors(capsys, tmp_path, argv, needles):
    code, _, err = run(capsys, "train-head", "--out", tmp_path / "h", *argv)
    assert_usage_error(code, err, *needles)


def test_cli_draft_vocab_larger_than_the_target_is_refused(capsys, tiny_model, tmp_path):
    code, _, err = run(capsys, "train-head", "--model", tiny_model, "--out", tmp_path / "h",
                       "--draft-vocab", 100000)
    assert_usage_error(code, err, "argument --draft-vocab", "expected an int in [1, ",
                       "got 100000")


def test_a_finished_run_rewritten_with_a_smaller_vocabulary_and_dtype(toy, tmp_path):
    """--resume of a finished run with keep_draft_vocab / save_dtype (settings that do not
    change the training) rewrites the head: the kept ids' lm_head rows are the full
    head's, in the dtype asked, and the head still drafts exactly."""
    import shutil

    target, prompts, out, _ = toy
    shutil.copytree(out, tmp_path / "h")
    opts = _options()
    opts.keep_draft_vocab, opts.save_dtype = 24, "bfloat16"
    report = train_head(target, None, tmp_path / "h", opts, prompts=prompts, stop_ids=[],
                        resume=True)
    assert report["written_draft_vocab_size"] == 24 and report["draft_vocab_size"] == 64
    full, small = Eagle3Head.load(out), Eagle3Head.load(tmp_path / "h")
    tensors = load_file(tmp_path / "h" / "model.safetensors")
    assert tensors["lm_head.weight"].dtype == torch.bfloat16
    assert small.config.draft_vocab_size == 24
    kept = small.target_ids
    assert set(kept.tolist()) <= set(full.target_ids.tolist())
    rows = {int(t): i for i, t in enumerate(full.target_ids)}
    want = full.lm_head[[rows[int(t)] for t in kept]].to(torch.bfloat16).float()
    assert torch.equal(small.lm_head.float(), want)
    new = _prompts(4, seed=9)
    plain = SpecDecoder(target, None, num_blocks=512, block_size=8).generate(
        new, max_new_tokens=24, greedy=True)
    got = SpecDecoder(target, Eagle3(target, tmp_path / "h"), k=3, num_blocks=512,
                      block_size=8).generate(new, max_new_tokens=24, greedy=True)
    assert [r.tokens for r in got] == [r.tokens for r in plain]
    with pytest.raises(ValueError, match="save_dtype must be one of"):
        bad = _options()
        bad.save_dtype = "int8"
        train_head(target, None, tmp_path / "h", bad, prompts=prompts, stop_ids=[], resume=True)
