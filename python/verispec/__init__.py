"""verispec: exact speculative decoding with a native paged KV cache.

The native core lives in the private module ``verispec._C``; this package re-exports its
public names and adds the Python layers. ``import verispec`` stays light (no torch): the
submodules that need torch load on first use, so ``verispec.SpecDecoder``,
``verispec.ops``, ``verispec.models``, ``verispec.drafters`` and ``verispec.reference``
all resolve after a plain ``import verispec``.
"""

import importlib

from verispec._C import BlockAllocator, CacheFullError, StepInProgressError
from verispec._C import build_info as _native_build_info

__version__: str = _native_build_info()["version"]

__all__ = [
    "BlockAllocator",
    "CacheFullError",
    "StepInProgressError",
    "__version__",
    "build_info",
    "slot_mapping",
]

# name -> (module, attribute or None for the module itself), imported on first use
_LAZY = {
    "SpecDecoder": ("verispec.decoder", "SpecDecoder"),
    "GenerateResult": ("verispec.decoder", "GenerateResult"),
    "StepOutput": ("verispec.decoder", "StepOutput"),
    "TokenLogprob": ("verispec.decoder", "TokenLogprob"),
    "request_seed": ("verispec.decoder", "request_seed"),
    "slot_mapping": ("verispec.cache", "slot_mapping"),
    "cache": ("verispec.cache", None),
    "decoder": ("verispec.decoder", None),
    "distributed": ("verispec.distributed", None),
    "drafters": ("verispec.drafters", None),
    "lab": ("verispec.lab", None),
    "models": ("verispec.models", None),
    "ops": ("verispec.ops", None),
    "reference": ("verispec.reference", None),
}


def __getattr__(name: str):
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'verispec' has no attribute {name!r}") from None
    value = importlib.import_module(module)
    if attr is not None:
        value = getattr(value, attr)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


def build_info() -> dict:
    """What this build of verispec is and what it can use right now.

    Keys: ``version``; ``cuda_compiled`` and ``cuda_architectures`` (how the native
    module was built); ``cuda_runtime_version``; ``num_gpus`` and ``gpu_available``
    (probed now through the CUDA runtime: False on a machine without a GPU or
    driver, even for a CUDA build); ``dlpack_version``; ``compiler``.
    """
    return dict(_native_build_info())
