"""How the ops take tensors: through the type's DLPack C exchange API when it has one (torch
>= 2.10; no Python-level __dlpack__ call), else through __dlpack__. Both paths must see the
same tensors and refuse the same things."""

import contextlib
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import verispec
from verispec import _C, ops

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_overhead import DlpackOnly, through  # noqa: E402  (one wrapper for bench and tests)


def header_and_torch_have_the_api():
    return (verispec.build_info()["dlpack_c_exchange_api"]
            and hasattr(torch.Tensor, "__dlpack_c_exchange_api__"))


def test_torch_tensors_take_the_c_exchange_api():
    fast = "c_exchange_api" if header_and_torch_have_the_api() else "__dlpack__"
    assert _C._dlpack_import_path(torch.empty(3)) == fast
    assert _C._dlpack_import_path(torch.nn.Parameter(torch.empty(3), requires_grad=False)) == fast
    assert _C._dlpack_import_path(DlpackOnly(torch.empty(3))) == "__dlpack__"
    # This project pins torch 2.13 and builds against DLPack 1.3: CI runs the fast path.
    torch_version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    if torch_version >= (2, 13) and verispec.build_info()["dlpack_version"] >= "1.3":
        assert fast == "c_exchange_api"


def verify_inputs(dtype):
    gen = torch.Generator().manual_seed(3)
    # strided views with a storage offset: the import must carry offset and strides
    target = torch.randn(3, 8, 6, 40, generator=gen).to(dtype)[1:, :, 1:, 2:39].transpose(0, 1)
    target = target.contiguous().transpose(1, 2)[:, :5].transpose(1, 2)  # [8, 2, 5, 37]
    target = target.reshape(8, 2 * 5, 37)[:, ::2]                           # [8, 5, 37]
    drafts = torch.randint(0, 37, (8, 4), generator=gen)
    q = torch.softmax(torch.randn(8, 4, 37, generator=gen), dim=-1)
    return target, drafts, q


@contextlib.contextmanager
def through_dlpack_only(*names):
    """Within: the named _C entry points get every tensor argument through __dlpack__."""
    with contextlib.ExitStack() as stack:
        for name in names:
            stack.enter_context(through("__dlpack__", name, [0]))
        yield


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_paths_see_the_same_tensors(dtype):
    gen = torch.Generator().manual_seed(3)
    # a strided view with a storage offset: the import must carry offset and strides
    target = torch.randn(9, 11, 40, generator=gen).to(dtype)[1:, 1::2, 2:39]  # [8, 5, 37]
    assert target.storage_offset() > 0 and not target.is_contiguous()
    drafts = torch.randint(0, 37, (8, 4), generator=gen)
    q = torch.softmax(torch.randn(8, 4, 37, generator=gen), dim=-1)
    x, w = target[:, 1], torch.randn(5, 37, generator=gen)
    for kwargs in (dict(seed=5), dict(top_k=5, top_p=0.9, seed=6), dict(greedy=True)):
        fast = ops.verify(target, drafts, q, **kwargs)
        with through_dlpack_only("verify"):
            slow = ops.verify(target, drafts, q, **kwargs)
        assert all(torch.equal(a, b) for a, b in zip(fast, slow))
    fast = (ops.apply_policy(x, top_p=0.8), ops.linear(x.float(), w))
    with through_dlpack_only("apply_policy", "linear"):
        slow = (ops.apply_policy(x, top_p=0.8), ops.linear(x.float(), w))
    assert all(torch.equal(a, b) for a, b in zip(fast, slow))
    assert fast[1].abs().sum() > 0  # outputs land in the caller's tensor on both paths


def test_tensors_that_require_grad_are_refused_on_both_paths():
    x = torch.randn(2, 7, requires_grad=True)
    with pytest.raises(BufferError, match="apply_policy: logits requires grad.*detach"):
        ops.apply_policy(x)
    with through_dlpack_only("apply_policy"), pytest.raises(BufferError):
        ops.apply_policy(x)  # torch's own __dlpack__ refuses it
    out = torch.zeros(2, 3, requires_grad=True)
    with pytest.raises(BufferError, match="linear: out requires grad"):
        ops.linear(torch.randn(2, 4), torch.randn(3, 4), out=out)
    assert not out.detach().any()  # nothing written
    # detached, the same tensor is fine
    assert ops.apply_policy(x.detach()).shape == (2, 7)


def test_non_torch_producers_still_work():
    a = verispec.BlockAllocator(num_blocks=4, block_size=2)
    s = a.add_sequence()
    a.append(s, 3)
    lens = np.zeros(1, dtype=np.int32)
    a.fill_context_lens([s], lens)
    assert lens.tolist() == [3]
    with pytest.raises(TypeError, match="must be a tensor supporting __dlpack__.*got list"):
        a.fill_context_lens([s], [0])
