"""HFModel's captured forwards (verispec.models.hf.capture) against its eager forwards.

Two wrappers of copies of the same tiny random model, one capturing (the default) and one
with ``capture=False``, are driven through the same batches: a prompt, then decode steps
(one token) and verify steps (five tokens, most rejected and rolled back), so a key's
program serves forwards at new positions over new blocks. Every logit row must be equal
bit for bit. The guards are checked by changing what a program would bake in after it
is captured (a hook, a reassigned weight, train mode) and by models whose forward reads
tensor values.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from test_hf_adapter import BLOCK_SIZE, VOCAB, _cfg, _reference
from verispec.models import HFModel
from verispec.models.hf import capture as hf_capture
from verispec.models.testing import PagedRunner

STEPS = 10  # decode + verify pairs after the prompt
# steps after which each key (decode, verify) has been recorded, checked and replayed once
WARM = hf_capture.RECORD_AFTER + 3


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class _Pair:
    """The same batches through a capturing and an eager wrapper of one model."""

    def __init__(self, ref: torch.nn.Module, *, seed: int = 3):
        self.cap = HFModel(copy.deepcopy(ref))
        self.eager = HFModel(copy.deepcopy(ref), capture=False)
        self.runners = [PagedRunner(m, num_blocks=48, block_size=BLOCK_SIZE)
                        for m in (self.cap, self.eager)]
        self.seqs = [r.add_sequence() for r in self.runners]
        self.gen = torch.Generator().manual_seed(seed)
        self.steps = 0

    def step(self, n: int, *, drop: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        toks = torch.randint(0, VOCAB, (n,), generator=self.gen).tolist()
        out = []
        for runner, seq in zip(self.runners, self.seqs):
            batch = runner.make_batch({seq: toks}, all_logits=n > 1)
            out.append(runner.model.forward(batch))
            if drop:
                runner.rollback(seq, runner.length(seq) - drop)
        self.steps += 1
        assert out[0].shape == out[1].shape
        assert torch.equal(out[0], out[1]), (
            f"step {self.steps}: captured logits differ from eager by "
            f"{(out[0] - out[1]).abs().max().item():.3g}")
        return out[0], out[1]

    def run(self, steps: int = STEPS) -> None:
        self.step(9)
        for _ in range(steps):
            self.step(1)
            self.step(5, drop=3)


@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma2", "gpt_neox", "phi3", "gemma3_text"])
def test_captured_forwards_equal_eager_bit_for_bit(name):
    pair = _Pair(_reference(name))
    pair.run()
    caps = pair.cap._captures
    assert not caps.refused, caps.refused
    # decode (1 token, 1 row kept) and verify (5 tokens, 5 rows) each have a checked program
    assert sorted(k[:2] for k, p in caps.programs.items() if p.checked) == [(1, 1), (5, 5)]
    # a key's first RECORD_AFTER forwards run eagerly, the next is recorded, the next
    # checks the program against eager; every later one is served by the program
    assert caps.replays == 2 * (STEPS - hf_capture.RECORD_AFTER - 2)
    assert pair.eager._captures is None


def test_capture_serves_a_draft_cut_by_early_exit():
    ref = _reference("llama")
    target = HFModel(copy.deepcopy(ref))
    draft = target.early_exit(2)
    eager = HFModel(copy.deepcopy(ref), capture=False).early_exit(2)
    runners = [PagedRunner(m, num_blocks=32, block_size=BLOCK_SIZE) for m in (draft, eager)]
    seqs = [r.add_sequence() for r in runners]
    for n in [7] + [1] * 6:
        toks = list(range(3, 3 + n))
        got, want = (r.model.forward(r.make_batch({s: toks})) for r, s in zip(runners, seqs))
        assert torch.equal(got, want)
    assert draft._captures.replays == 6 - hf_capture.RECORD_AFTER - 2


def test_a_hook_registered_after_capture_runs():
    pair = _Pair(_reference("llama"))
    pair.run(WARM)
    before = pair.cap._captures.replays
    assert before > 0
    calls = []
    layer = pair.cap.model.model.layers[1]
    handle = layer.register_forward_hook(lambda m, args, out: calls.append(1))
    pair.step(1)
    pair.step(1)
    assert len(calls) == 2  # a replay would have skipped the hook
    assert pair.cap._captures.replays == before
    handle.remove()
    pair.step(1)
    assert pair.cap._captures.replays == before + 1


def test_a_global_hook_registered_after_capture_runs():
    pair = _Pair(_reference("llama"))
    pair.run(WARM)
    mine = {id(m) for m in pair.cap.model.modules()}
    calls = []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda m, args, out: calls.append(1) if id(m) in mine else None)
    try:
        pair.step(1)
    finally:
        handle.remove()
    assert calls  # a replay would have skipped the hook


def test_a_weight_reassigned_after_capture_is_used():
    pair = _Pair(_reference("llama"))
    pair.run(WARM)
    old = pair.cap.model.model.embed_tokens.weight
    for m in (pair.cap.model, pair.eager.model):
        m.model.embed_tokens.weight = torch.nn.Parameter(old.detach() * 1.5)
    # equal to the eager model with the same new weight: the program read the old one as
    # a constant (F.embedding's argument), so it must not serve this forward
    pair.step(1)
    for m in (pair.cap.model, pair.eager.model):
        m.model.embed_tokens.weight = torch.nn.Parameter(old.detach().clone())
    pair.run(2)
    assert pair.cap._captures.invalidations >= 1


def test_an_in_place_weight_update_is_seen_by_the_program():
    pair = _Pair(_reference("llama"))
    pair.run(WARM)
    replays = pair.cap._captures.replays
    with torch.no_grad():
        for m in (pair.cap.model, pair.eager.model):
            m.model.embed_tokens.weight.mul_(1.5)
            m.model.norm.weight.add_(0.25)
    pair.step(1)
    pair.step(5, drop=3)
    assert pair.cap._captures.replays == replays + 2  # served by the programs, still equal


def test_train_mode_runs_eagerly():
    pair = _Pair(_reference("llama"))
    pair.run(WARM)
    replays = pair.cap._captures.replays
    pair.cap.model.model.layers[0].mlp.train()
    pair.eager.model.model.layers[0].mlp.train()
    pair.step(1)
    assert pair.cap._captures.replays == replays
    pair.cap.model.model.layers[0].mlp.eval()
    pair.eager.model.model.layers[0].mlp.eval()
    pair.step(1)
    assert pair.cap._captures.replays == replays + 1


def test_autocast_and_a_callers_torch_function_mode_run_eagerly():
    pair = _Pair(_reference("llama"))
    pair.run(WARM)
    replays = pair.cap._captures.replays
    with torch.autocast("cpu", dtype=torch.bfloat16):  # eager in both: equal bits
        pair.step(1)
    with torch.device("cpu"):  # a TorchFunctionMode: it changes what factories make
        pair.step(1)
    assert pair.cap._captures.replays == replays
    pair.step(1)
    assert pair.cap._captures.replays == replays + 1


def test_a_forward_that_reads_tensor_values_is_not_captured():
    # dynamic RoPE scaling compares the largest position with a Python int every forward
    config = _cfg("llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    pair = _Pair(ref)
    pair.run(WARM)
    caps = pair.cap._captures
    assert caps.replays == 0 and not caps.programs
    assert caps.refused and all("reads tensor values" in why for why in caps.refused.values())


def test_a_program_that_disagrees_with_eager_is_dropped(monkeypatch):
    pair = _Pair(_reference("llama"))
    real = hf_capture.Program.__init__

    def broken(self, run, source, calls):  # every program returns its logits plus one
        real(self, lambda *a: run(*a) + 1, source, calls)

    monkeypatch.setattr(hf_capture.Program, "__init__", broken)
    pair.run(hf_capture.RECORD_AFTER + 2)  # the wrong logits never reach the caller (equal to eager every step)
    caps = pair.cap._captures
    assert caps.replays == 0 and not caps.programs
    assert all("did not give the eager forward's logits" in w for w in caps.refused.values())
    assert len(caps.refused) == 2


def test_long_forwards_run_eagerly():
    pair = _Pair(_reference("llama"))
    n = hf_capture.MAX_TOKENS + 1
    for _ in range(3):
        pair.step(n, drop=n)
    assert not pair.cap._captures.seen


def test_the_capture_switch():
    pair = _Pair(_reference("llama"))
    assert pair.cap.capture and not pair.eager.capture
    pair.run(WARM)
    replays = pair.cap._captures.replays
    pair.cap.capture = False
    pair.step(1)
    assert pair.cap._captures.replays == replays
    pair.cap.capture = True
    pair.step(1)
    assert pair.cap._captures.replays == replays + 1
    pair.eager.capture = True  # starts capturing now
    pair.run(hf_capture.RECORD_AFTER + 3)
    assert pair.eager._captures.replays > 0


def test_programs_are_bounded_least_recently_used_first(monkeypatch):
    monkeypatch.setattr(hf_capture, "MAX_PROGRAMS", 2)
    pair = _Pair(_reference("llama"))
    for n in (1, 2, 3):  # three keys, each recorded and checked
        for _ in range(hf_capture.RECORD_AFTER + 3):
            pair.step(n, drop=n - 1)
    caps = pair.cap._captures
    assert [k[0] for k in caps.programs] == [2, 3]  # 1 was the least recently used
    pair.step(2, drop=1)  # a replay makes 2 the most recently used
    assert [k[0] for k in caps.programs] == [3, 2]
    for _ in range(hf_capture.RECORD_AFTER + 1):  # 1 is recorded again: 3 goes
        pair.step(1)
    assert [k[0] for k in caps.programs] == [2, 1]


def test_a_forward_that_registers_a_buffer_is_not_captured():
    pair = _Pair(_reference("llama"))
    for model in (pair.cap.model, pair.eager.model):
        rotary = model.model.rotary_emb
        original = rotary.forward

        def forward(*args, _rotary=rotary, _original=original, **kwargs):
            _rotary.register_buffer("calls", torch.zeros(1), persistent=False)
            return _original(*args, **kwargs)

        rotary.forward = forward
    pair.run(WARM)
    caps = pair.cap._captures
    assert caps.replays == 0 and not caps.programs
    assert set(caps.refused.values()) == {
        "the forward assigns parameters, buffers or submodules of the model's modules"}


def test_numpy_scalars_in_a_call_are_held_as_constants():
    # a numpy float64 is a float whose repr ("np.float64(8.0)") is no code here
    import numpy as np

    rec = hf_capture._Recorder([])
    assert rec._src(np.float64(8.0), []) == "c0" and rec.consts == [8.0]
    assert rec._src(8.0, []) == "8.0" and rec._src(3, []) == "3"
    assert rec._src(float("inf"), []) == "c1"
