"""The build: what build_info reports, and that the module needs no GPU to import."""

import os

import torch

import verispec


def test_build_info_reports_the_build_and_the_machine():
    info = verispec.build_info()
    assert info["version"] == verispec.__version__
    assert isinstance(info["cuda_compiled"], bool)
    assert info["dlpack_version"].startswith("1.")
    # A GPU is usable now exactly when torch sees one (CUDA builds probe the runtime;
    # CPU builds never claim one).
    if info["cuda_compiled"]:
        assert info["gpu_available"] == torch.cuda.is_available()
        assert info["num_gpus"] == torch.cuda.device_count()
        assert info["cuda_architectures"]
    else:
        assert info["gpu_available"] is False and info["num_gpus"] == 0


def test_ci_builds_the_cuda_kernels_when_nvcc_is_present():
    """CI sets VERISPEC_EXPECT_CUDA=1 when nvcc is on PATH: the build must then have
    compiled the CUDA sources (for the default architectures unless overridden)."""
    expect = os.environ.get("VERISPEC_EXPECT_CUDA")
    info = verispec.build_info()
    if expect == "1":
        assert info["cuda_compiled"], info
        assert info["cuda_architectures"] == "80-real,89-real,90"
        assert info["nvtx"], "a CUDA build brings the toolkit's NVTX3 header: ranges on"
    elif expect == "0":
        assert not info["cuda_compiled"], info
    if not info["cuda_compiled"]:
        assert info["nvtx"] is False


def test_native_module_does_not_link_libtorch():
    with open(verispec._C.__file__, "rb") as f:
        blob = f.read()
    assert b"libtorch" not in blob and b"libc10" not in blob
