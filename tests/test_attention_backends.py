"""The attention interface both models share (models/layers/attention.py): which backend a
name resolves to on a device, the errors where one cannot run, and the models' switch."""

import pytest
import torch

from verispec.models.layers import attention
from verispec.models.layers.attention import select_backend
from verispec.models.testing import PagedRunner, random_llama

SHAPE = dict(vocab=97, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2,
             head_dim=16, max_context=256)


def test_auto_is_sdpa_off_cuda_and_a_named_backend_stays_itself():
    assert select_backend("auto", torch.device("cpu"), torch.float32) == "sdpa"
    assert select_backend("auto", "cpu", torch.bfloat16) == "sdpa"
    assert select_backend("sdpa", "cpu", torch.bfloat16) == "sdpa"
    assert select_backend("native", "cpu", torch.float32) == "native"


@pytest.mark.parametrize("name,device,dtype,message", [
    ("flash", "cpu", torch.float32,
     "attention_backend: must be one of 'auto', 'native', 'sdpa', 'flashinfer', got 'flash'"),
    ("native", "cpu", torch.bfloat16,
     "backend 'native' (verispec's paged CPU kernels) needs a float32 model on the CPU, "
     "got torch.bfloat16 on cpu"),
    ("flashinfer", "cpu", torch.float32,
     "attention_backend: backend 'flashinfer' needs a CUDA device, got cpu"),
])
def test_a_backend_that_cannot_run_is_refused_by_name(name, device, dtype, message):
    with pytest.raises(ValueError) as e:
        select_backend(name, device, dtype)
    assert message in str(e.value)


def test_flashinfer_without_the_package_names_the_extra(monkeypatch):
    monkeypatch.setattr(attention, "_FLASHINFER", [None])
    assert not attention.flashinfer_available()
    # CUDA need not exist: the device's type is all the rule reads
    with pytest.raises(ValueError, match=r"needs the flashinfer package \(pip install "
                                         r"'verispec\[gpu\]'\)"):
        select_backend("flashinfer", torch.device("cuda", 0), torch.bfloat16)
    assert select_backend("auto", torch.device("cuda", 0), torch.bfloat16) == "sdpa"


def _logits(model, prompt, step):
    run = PagedRunner(model)
    seq = run.add_sequence()
    run.step({seq: prompt})
    return run.step({seq: step})[0][0]


def test_llama_model_switches_backend_and_refuses_without_changing(monkeypatch):
    """The "sdpa" backend runs every layer through TorchAttention: a prompt longer than
    SMALL_ROW_QUERIES through scaled_dot_product_attention itself, a 3-token step
    through the two batched matmuls of the lean path (counted, both)."""
    from verispec.models.layers.paged import SMALL_ROW_QUERIES

    calls, sdpa = [], []
    real = attention.TorchAttention.attend
    real_sdpa = attention.F.scaled_dot_product_attention

    def counted(self, *args, **kwargs):
        calls.append(1)
        return real(self, *args, **kwargs)

    def counted_sdpa(*args, **kwargs):
        sdpa.append(args[0].shape[-2])  # the queries of the call
        return real_sdpa(*args, **kwargs)

    monkeypatch.setattr(attention.TorchAttention, "attend", counted)
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", counted_sdpa)
    model = random_llama(**SHAPE, seed=3)
    assert model.attention_backend == "auto"
    prompt = [(7 * i + 5) % SHAPE["vocab"] for i in range(SMALL_ROW_QUERIES + 4)]
    nxt = [11, 12, 13]
    native = _logits(model, prompt, nxt)
    assert calls == [] and sdpa == []   # float32 on the CPU: "auto" is verispec's kernels
    with pytest.raises(ValueError, match="LlamaModel.attention_backend: backend 'flashinfer' "
                                         "needs a CUDA device, got cpu"):
        model.attention_backend = "flashinfer"
    assert model.attention_backend == "auto"   # a refused switch leaves the model as it was
    model.attention_backend = "sdpa"
    assert model.attention_backend == "sdpa"
    torch_path = _logits(model, prompt, nxt)
    assert len(calls) == 2 * SHAPE["layers"]    # two forwards, every layer
    assert sdpa == [len(prompt)] * SHAPE["layers"]  # the prompt's layers in SDPA
    # the torch path is another summation order of the same attention
    assert torch_path.shape == native.shape
    assert torch.allclose(torch_path, native, atol=1e-4, rtol=1e-4)
    assert (torch_path.argmax(-1) == native.argmax(-1)).all()
    # power: a step of other tokens gives logits far outside that tolerance
    other = _logits(model, prompt, [14, 12, 13])
    assert (other - native).abs().max().item() > 1e-2
