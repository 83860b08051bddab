"""The step's plan reaches the device through verispec.models.staging.PlanStaging: values
round-trip, device addresses repeat step after step, growth is geometric, and a decode
step makes one blocking device -> host transfer and no unstaged upload (batch 1, 8, 32;
n-gram and early-exit drafts; LlamaModel's and HFModel's torch plan paths). On CUDA the
same step is checked with torch.cuda.set_sync_debug_mode.

On the CPU the step's reads are counted by standins.DeviceReadAudit: a tensor is the
device's by where its values came from (weights, pools, uploads, what a model or a CPU
kernel returns), not by how it was allocated, and it stands in for the copy stream's
event, so a step that begins with uploads in flight counts as a rollover. Controls that
read or upload on purpose show that each check fires.
"""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from verispec.decoder import SpecDecoder  # noqa: E402
from verispec.drafters import EarlyExit, NGram  # noqa: E402
from verispec.models.loaders import load_model  # noqa: E402
from verispec.models.staging import MIN_BYTES, PlanStaging, TransferAudit, upload  # noqa: E402
from verispec.models.testing import randomize_weights  # noqa: E402
from standins import DeviceReadAudit  # noqa: E402

VOCAB = 97


def test_put_round_trips_values_and_shapes():
    st = PlanStaging("cpu")
    st.begin_step()
    a = st.put([3, -1, 7], torch.int64)
    b = st.put(torch.tensor([[True, False], [False, True]]))
    c = st.put(torch.arange(5, dtype=torch.int32), torch.float32)
    assert a.dtype == torch.int64 and a.tolist() == [3, -1, 7]
    assert b.dtype == torch.bool and b.tolist() == [[True, False], [False, True]]
    assert c.dtype == torch.float32 and c.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    for t in (a, b, c):  # 64-byte aligned: any dtype's view, vector loads
        assert t.data_ptr() % 64 == 0
    assert st.uploads == 3 and st.upload_bytes == 24 + 4 + 20 and st.blocking_reads == 0
    with pytest.raises(ValueError, match="dtype is required"):
        st.put([1, 2])


def test_same_step_shapes_get_the_same_device_addresses():
    st = PlanStaging("cpu")
    ptrs = []
    for step in range(4):
        st.begin_step()
        x = st.put(list(range(10 + step % 2)), torch.int64)  # 80 or 88 bytes: one 64-byte slot pair
        y = st.put([step] * 3, torch.int32)
        assert x.tolist()[:3] == [0, 1, 2] and y.tolist() == [step] * 3
        ptrs.append((x.data_ptr(), y.data_ptr()))
    assert len(set(ptrs)) == 1, ptrs
    assert st.device_buffers == 1 and st.host_buffers == 1 and st.host_rollovers == 0


def test_growth_is_geometric_and_keeps_earlier_views():
    st = PlanStaging("cpu")
    st.begin_step()
    small = st.put([1, 2, 3], torch.int64)
    big = st.put(list(range(MIN_BYTES)), torch.int64)  # 8x the first arena
    assert small.tolist() == [1, 2, 3], "a view carved before growth changed"
    assert big[-1].item() == MIN_BYTES - 1
    size = st.stats()["device_bytes"]
    assert size >= 8 * MIN_BYTES + 64 and size & (size - 1) == 0, size  # a power of two
    before = st.device_buffers
    for _ in range(3):  # the whole step now fits: no more allocations
        st.begin_step()
        st.put([1, 2, 3], torch.int64)
        st.put(list(range(MIN_BYTES)), torch.int64)
    assert st.device_buffers == before and st.host_buffers == 2, st.stats()


def test_upload_without_staging_or_for_another_device_copies_plainly():
    t = upload(None, [4, 5], torch.int32, torch.device("cpu"))
    assert t.tolist() == [4, 5] and t.dtype == torch.int32
    st = PlanStaging("cpu")
    st.begin_step()
    assert upload(st, [4, 5], torch.int32, torch.device("cpu")).tolist() == [4, 5]
    assert st.uploads == 1


def test_audit_sees_unstaged_uploads_and_device_reads():
    device = torch.device("cpu")
    weights = torch.randn(4)  # a "device" tensor: not declared host
    with TransferAudit(device) as audit:
        torch.tensor([1, 2], device=device)         # an upload outside the staging
        torch.tensor([1, 2]).to(device)             # a host tensor moved to the device
        host = torch.tensor([1, 2, 3])              # host values: no transfer
        host.tolist()
        (host + 1).tolist()
        host[host > 1].nonzero()
        weights.sum().item()                        # a device read
        weights[weights > 0]                        # a boolean mask on the device
        bool(weights.any())                         # and a device value as a bool
    assert audit.unstaged_uploads == 2 and audit.reads == 3, audit.sites


# --- a decode step -------------------------------------------------------------------------


def _tiny_llama(folder):
    cfg = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
        tie_word_embeddings=False)
    hf = randomize_weights(transformers.LlamaForCausalLM(cfg), 3, norm_spread=0.1)
    hf.save_pretrained(folder, safe_serialization=True)
    return hf


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("staging_llama")
    hf = _tiny_llama(folder)
    llama = load_model(folder)
    # the torch plan path (_AttentionPlan / KVWrite), the one a GPU runs, not the CPU kernels
    llama.native_layer_ops = False
    from verispec.models.hf import HFModel

    wrapped = HFModel(hf.eval())
    wrapped.native_attention = False  # the padded-group plan (_Group), as on a GPU
    return {"llama": llama, "hf": wrapped}


def _prompts(batch):
    g = torch.Generator().manual_seed(batch)
    base = torch.randint(1, VOCAB, (6,), generator=g).tolist()
    return [(base * 3)[b % 5:b % 5 + 12 + b % 3] for b in range(batch)]  # ragged, repetitive


def _decoder(model, source):
    if source == "ngram_tree":
        return SpecDecoder(model, NGram(1, 3, branches=2), k=3, num_blocks=8 * 40, block_size=4)
    draft = NGram(1, 3) if source == "ngram" else EarlyExit(model, num_layers=1)
    return SpecDecoder(model, draft, k=3, num_blocks=8 * 40, block_size=4,
                       draft_branches=2 if source == "draft_tree" else 1)


def step_audit(dec):
    """An audit of ``dec``'s steps: its models and pools are the device's."""
    return DeviceReadAudit(dec.device, dec.staging, (*dec._models.values(), *dec._pools.values()))


def _audited_steps(dec, steps=4, prefill=True):
    """Audits up to ``steps`` decode steps of ``dec`` (after its prefill); returns the
    audit, the steps run and the staging's counters before and after."""
    if prefill:
        dec.step()
    audit = step_audit(dec)
    before = dec.staging.stats()
    n = 0
    while dec.has_running() and n < steps:
        with audit:
            dec.step()
        n += 1
    return audit, n, before, dec.staging.stats()


@pytest.mark.parametrize("name", ["llama", "hf"])
@pytest.mark.parametrize("source", ["ngram", "draft", "ngram_tree", "draft_tree"])
@pytest.mark.parametrize("batch", [1, 8, 32])
def test_a_step_makes_one_blocking_transfer(models, name, source, batch):
    model = models[name]
    dec = _decoder(model, source)
    seqs = [dec.add(p, max_new_tokens=12, greedy=True) for p in _prompts(batch)]
    audit, steps, before, after = _audited_steps(dec)
    assert steps >= 2
    # the one blocking read: the step's results, through the staging
    assert after["blocking_reads"] - before["blocking_reads"] == steps, (before, after)
    assert audit.reads == steps, audit.sites
    assert audit.unstaged_uploads == 0, audit.sites
    # the inputs and the plan's indices went through the staging, and every step began
    # after the previous one's uploads were done (its download waited for them)
    assert after["uploads"] - before["uploads"] >= steps
    assert after["host_rollovers"] == 0
    while dec.has_running():
        dec.step()
    plain = SpecDecoder(model, None, num_blocks=8 * 40, block_size=4)
    want = [r.tokens for r in plain.generate(_prompts(batch), max_new_tokens=12, greedy=True)]
    assert [dec.result(s).tokens for s in seqs] == want  # still exact


# --- the audit's power: each way of reading the device, on purpose -------------------------

# (what a forward does with its logits on purpose, the reads it adds)
READS = {
    "cpu": lambda t: t.cpu(),
    "to_cpu": lambda t: t.to("cpu"),
    "item": lambda t: t[0, 0].item(),
    "tolist": lambda t: t.argmax(-1).tolist(),
    "bool": lambda t: bool(t.isfinite().all()),
    "equal": lambda t: torch.equal(t, t),
    "allclose": lambda t: torch.allclose(t, t),
    "unique": lambda t: torch.unique(t.argmax(-1)),
    "repeat_interleave": lambda t: torch.repeat_interleave(
        torch.arange(t.shape[0]), (t[:, 0] > 0).long()),
    "where": lambda t: torch.where(t > 0),
    "nonzero": lambda t: t.nonzero(),
    "mask": lambda t: t[t > 0],
    "copy_to_host": lambda t: torch.empty(t.shape, dtype=t.dtype).copy_(t),
}


@pytest.mark.parametrize("read", sorted(READS))
def test_a_forward_that_reads_its_logits_is_counted(models, monkeypatch, read):
    """Each read in a model's forward, however its logits were made (verispec's linear
    kernel here: a buffer allocated without ``device=``), is one more read a forward."""
    from verispec.models.llama import LlamaModel

    model = models["llama"]
    assert model.native_linear  # the logits come out of the CPU kernel
    forward = LlamaModel.forward
    forwards = []

    def reading(self, batch):
        logits = forward(self, batch)
        forwards.append(1)
        READS[read](logits)
        return logits

    monkeypatch.setattr(LlamaModel, "forward", reading)
    dec = _decoder(model, "ngram")
    dec.add(_prompts(1)[0], max_new_tokens=6, greedy=True)
    dec.step()  # the prefill
    forwards.clear()
    audit, steps, _, _ = _audited_steps(dec, steps=2, prefill=False)
    assert steps == 2 and len(forwards) >= steps
    assert audit.reads == steps + len(forwards), audit.sites


def test_host_values_are_not_reads_and_device_values_are():
    weights = torch.tensor([0.5, -1.0, 2.0, -0.25, 1.5, -3.0])  # three positive
    host = torch.tensor([1, 2, 3])
    with DeviceReadAudit("cpu", device_objects=(weights,)) as audit:
        host.tolist()
        (host + 1).tolist()
        host[host > 1].nonzero()
        torch.equal(host, host)
        torch.repeat_interleave(weights, 2)                    # a count known to the host
        torch.where(weights > 0, weights, 0)                   # three arguments: no size to learn
        weights.masked_fill(weights > 0, 0)
        torch.repeat_interleave(torch.arange(6), (weights > 0).long(), output_size=3)
    assert audit.reads == 0 and audit.unstaged_uploads == 0, audit.sites
    with DeviceReadAudit("cpu", device_objects=(weights,)) as audit:
        mine = weights.cpu()          # a read; the host's copy is the host's
        mine.sum().item()
        mine[mine > 0].tolist()
        (weights * 2).sum().item()    # derived from the device: a read
    assert audit.reads == 2, audit.sites
    assert mine.untyped_storage().data_ptr() != weights.untyped_storage().data_ptr()


def test_the_audit_counts_uploads_outside_the_staging():
    device = torch.device("cpu")
    weights = torch.randn(4)
    with DeviceReadAudit(device, device_objects=(weights,)) as audit:
        torch.tensor([1, 2], device=device)         # Python values straight to the device
        weights.new_tensor([1.0])                   # the same, through a device tensor
        weights.copy_(torch.ones(4))                # a host tensor into a device tensor
        torch.zeros(3, device=device)               # made on the device: no transfer
        torch.tensor([1, 2], device="cpu")          # the host's
    assert audit.unstaged_uploads == 3 and audit.reads == 0, audit.sites


def test_a_step_that_uploads_after_its_download_rolls_the_arena_over(models, monkeypatch):
    """The copy event's stand-in: an upload is in flight until a blocking download waits
    for the stream, so a step beginning after a late upload takes a fresh host arena."""
    from verispec import decoder as decoder_module

    st = PlanStaging("cpu")
    with DeviceReadAudit("cpu", st):
        st.begin_step()
        st.put([1, 2], torch.int64)
        st.download(st.put([3], torch.int64))
        st.begin_step()                      # the download waited: nothing in flight
        st.put([4], torch.int64)
        st.begin_step()                      # no download since the upload
        st.put([5], torch.int64)             # into a fresh host arena
    assert st.host_rollovers == 1 and st.host_buffers == 2, st.stats()
    assert st._event is None  # the stand-in leaves with the audit

    download = decoder_module.SpecDecoder._download

    def late(staging, *args):
        out = download(staging, *args)
        staging.put([0], torch.int64)  # an upload after the step's one wait
        return out

    monkeypatch.setattr(decoder_module.SpecDecoder, "_download", staticmethod(late))
    dec = _decoder(models["llama"], "ngram")
    dec.add(_prompts(1)[0], max_new_tokens=8, greedy=True)
    _, steps, _, after = _audited_steps(dec, steps=3)
    # each audited step after the first began with the previous one's late upload pending
    assert steps == 3 and after["host_rollovers"] == steps - 1, after


def test_the_audit_fails_a_plan_that_uploads_directly(models, monkeypatch):
    """The check above can fail: a plan that builds its indices with torch.tensor(...,
    device=...) (the old way) is counted."""
    from verispec.models.layers import paged as paged_module  # the plan's home

    def unstaged(staging, values, dtype, device):
        if isinstance(values, torch.Tensor):  # the plan builds some indices as tensors
            values = values.tolist()
        return torch.tensor(values, dtype=dtype, device=device)

    monkeypatch.setattr(paged_module, "upload", unstaged)
    model = models["llama"]
    dec = _decoder(model, "ngram")
    for p in _prompts(8):
        dec.add(p, max_new_tokens=6, greedy=True)
    dec.step()
    with TransferAudit(model.geometry.device, dec.staging) as audit:
        dec.step()
    assert audit.unstaged_uploads > 0, audit.sites
    assert any("paged.py" in site for site in audit.sites), audit.sites


def cuda_sync_sites(step) -> list[str]:
    """Runs ``step()`` and returns where torch saw it synchronise with the device
    (set_sync_debug_mode("warn") flags every synchronising call)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message).lower()]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("source", ["ngram", "draft"])
@pytest.mark.parametrize("batch", [1, 8, 32])
def test_a_cuda_step_synchronises_once(tmp_path, source, batch):
    """torch's own count: set_sync_debug_mode("warn") flags every synchronising call."""
    _tiny_llama(tmp_path)
    model = load_model(tmp_path, device="cuda", dtype=torch.bfloat16)
    # the eager path (a capture step checks its graph against eager and waits for that;
    # test_graphs.py counts the syncs of replayed steps)
    model.cuda_graphs = False
    dec = _decoder(model, source)
    for p in _prompts(batch):
        dec.add(p, max_new_tokens=12, greedy=True)
    dec.step()
    dec.step()
    torch.cuda.synchronize()
    steps, syncs = 0, []
    while dec.has_running() and steps < 4:
        syncs.append(cuda_sync_sites(dec.step))
        steps += 1
    assert steps >= 1
    # exactly one: the step's download (none would mean the count saw nothing)
    assert all(len(s) == 1 for s in syncs), syncs
