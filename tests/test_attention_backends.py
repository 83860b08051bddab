"""The attention interface both models share (models/layers/attention/): which backend a
name resolves to on a device, the errors where one cannot run, the models' switch, and
the registry: a backend is one file plus one line, every model calls it the same way
(no caller tests its name) and graphs capture it when its class says it can be.
(FlashInfer's adapter: tests/test_flashinfer_standin.py.)"""

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
    monkeypatch.setattr(attention.flashinfer_paged, "_FLASHINFER", [None])
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
    real_sdpa = torch.nn.functional.scaled_dot_product_attention

    def counted(self, *args, **kwargs):
        calls.append(1)
        return real(self, *args, **kwargs)

    def counted_sdpa(*args, **kwargs):
        sdpa.append(args[0].shape[-2])  # the queries of the call
        return real_sdpa(*args, **kwargs)

    monkeypatch.setattr(attention.TorchAttention, "attend", counted)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted_sdpa)
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


# ---------------------------------------------------------------- the registry

def test_the_registry_is_the_list_of_backends(monkeypatch):
    from verispec.models.layers.attention import registry

    assert attention.BACKENDS == ("auto", *registry.REGISTRY) == (
        "auto", "native", "sdpa", "flashinfer")
    for name in registry.REGISTRY:
        cls = attention.backend_class(name)
        assert issubclass(cls, attention.AttentionBackend) and cls.name == name
    assert attention.backend_class("sdpa") is attention.TorchAttention
    assert attention.backend_class("flashinfer") is attention.FlashInferAttention
    assert set(registry.AUTO_ORDER) <= set(registry.REGISTRY)
    # which can be captured, which comes with the CPU layer kernels
    assert [n for n in registry.REGISTRY if attention.backend_class(n).capturable] == ["sdpa"]
    assert [n for n in registry.REGISTRY if attention.backend_class(n).layer_kernels] == ["native"]
    monkeypatch.setitem(registry.REGISTRY, "broken", "sdpa:attend_matmul")
    with pytest.raises(TypeError, match=r"REGISTRY\['broken'\]: must name an "
                                        r"AttentionBackend subclass whose name is 'broken'"):
        attention.backend_class("broken")


def test_resolve_backend_puts_the_native_kernels_first_where_the_model_runs_them():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    resolve = attention.resolve_backend
    assert resolve("auto", cpu, torch.float32, native=True) == "native"
    assert resolve("auto", cpu, torch.float32, native=False) == "sdpa"
    assert resolve("native", cpu, torch.float32, native=True) == "native"
    assert resolve("native", cpu, torch.float32, native=False) == "sdpa"  # switches off
    assert resolve("sdpa", cpu, torch.float32, native=True) == "sdpa"
    assert resolve("auto", cpu, torch.bfloat16, native=True) == "sdpa"  # native refuses
    assert resolve("auto", cuda, torch.bfloat16, native=True) in ("flashinfer", "sdpa")
    with pytest.raises(ValueError, match="M: backend 'native' .* got torch.bfloat16 on cpu"):
        resolve("native", cpu, torch.bfloat16, native=True, who="M")


class _Recording(attention.TorchAttention):
    """A new backend as a newcomer writes one: a class with a name (here the torch
    backend's math, so its logits must equal "sdpa"'s bit for bit), recording what the
    models pass it."""

    name = "recording"
    calls: list = []

    def plan(self, plan):
        self.calls.append(("plan", plan.num_tokens))
        super().plan(plan)

    def attend(self, plan, q, k_pool, v_pool, **kw):
        self.calls.append(("attend", k_pool.dim(), v_pool.dim()))
        return super().attend(plan, q, k_pool, v_pool, **kw)

    def attend_static(self, inputs, q, k_pool, v_pool, *, scaling):
        self.calls.append(("attend_static", k_pool.dim(), v_pool.dim()))
        return super().attend_static(inputs, q, k_pool, v_pool, scaling=scaling)


@pytest.fixture
def recording(monkeypatch) -> list:
    """_Recording registered: the one registry line a new backend adds (its class
    cached as the line's import would give it)."""
    from verispec.models.layers.attention import registry

    monkeypatch.setitem(registry.REGISTRY, "recording", "test_attention_backends:_Recording")
    monkeypatch.setitem(registry._CLASSES, "recording", _Recording)
    monkeypatch.setattr(_Recording, "calls", [])
    return _Recording.calls


def test_a_new_backend_is_one_class_and_one_registry_line(recording):
    """Both models run a newly registered backend by its name alone: planned once a
    forward, every layer's attend given the pools in their one 4-D form; the logits are
    the torch backend's bit for bit (the same math), so nothing else changed."""
    from verispec.models import HFModel

    model = random_llama(**SHAPE, seed=3)
    model.attention_backend = "sdpa"
    prompt = list(range(5, 25))
    want = _logits(model, prompt, [11, 12, 13])
    model.attention_backend = "recording"
    assert model.attention_backend == "recording"
    got = _logits(model, prompt, [11, 12, 13])
    assert torch.equal(got, want)
    layers = SHAPE["layers"]
    assert recording == ([("plan", 20)] + [("attend", 4, 4)] * layers
                         + [("plan", 3)] + [("attend", 4, 4)] * layers)
    recording.clear()
    with pytest.raises(ValueError, match="must be one of 'auto', 'native', 'sdpa', "
                                         "'flashinfer', 'recording', got 'other'"):
        model.attention_backend = "other"

    import test_hf_adapter as hf_tests

    hf = HFModel(hf_tests._reference("llama"), capture=False)
    hf.attention_backend = "sdpa"
    want = _logits(hf, prompt, [11, 12, 13])
    hf.attention_backend = "recording"
    got = _logits(hf, prompt, [11, 12, 13])
    assert torch.equal(got, want)
    assert recording.count(("attend", 4, 4)) == 2 * hf.num_layers
    assert [c for c in recording if c[0] == "plan"] == [("plan", 20), ("plan", 3)]


@pytest.mark.parametrize("capturable", [True, False])
def test_graphs_capture_the_backend_that_runs_when_it_can_be(recording, monkeypatch,
                                                             capturable):
    """With graphs on (RecordedGraph standing in for CUDA graphs), a capturable
    backend's attend_static is what the captured forwards run; for a backend whose class
    says it cannot be captured (FlashInfer today) the captured forwards attend through
    SDPA's static path, as before the backends shared one interface, and never call
    the backend's attend_static."""
    from verispec.models.layers.graphs import GraphCache, RecordedGraph

    monkeypatch.setattr(_Recording, "capturable", capturable)
    model = random_llama(**SHAPE, seed=3)
    model.attention_backend = "recording"
    model.graphs = GraphCache("cpu", graph=RecordedGraph)
    run = PagedRunner(model)
    seq = run.add_sequence()
    run.step({seq: list(range(5, 15))})
    for t in range(4):
        run.step({seq: [20 + t]})
    stats = model.graphs.stats()
    static = recording.count(("attend_static", 4, 4))
    if capturable:
        assert stats["captures"] >= 1 and stats["replays"] >= 1, stats
        assert static >= 2 * SHAPE["layers"]  # captured, then checked eagerly
    else:
        assert stats["captures"] >= 1 and stats["replays"] >= 1 and static == 0, stats
        # the forwards not replayed (seen once, checked eagerly) ran the backend's attend
        assert 0 < recording.count(("attend", 4, 4)) < 5 * SHAPE["layers"]
