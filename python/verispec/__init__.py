"""verispec: exact speculative decoding with a native paged KV cache.

The native core lives in the private module ``verispec._C``; this package
re-exports its public names and adds the Python layers (ops, models, reference).
"""

from verispec._C import BlockAllocator, CacheFullError
from verispec._C import build_info as _native_build_info
from verispec.cache import slot_mapping

__version__: str = _native_build_info()["version"]

__all__ = [
    "BlockAllocator",
    "CacheFullError",
    "__version__",
    "build_info",
    "slot_mapping",
]


def build_info() -> dict:
    """What this build of verispec is and what it can use right now.

    Keys: ``version``; ``cuda_compiled`` and ``cuda_architectures`` (how the native
    module was built); ``cuda_runtime_version``; ``num_gpus`` and ``gpu_available``
    (probed now through the CUDA runtime: False on a machine without a GPU or
    driver, even for a CUDA build); ``dlpack_version``; ``compiler``.
    """
    return dict(_native_build_info())
