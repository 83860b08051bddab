"""Hugging Face model folders: config.json -> LlamaConfig, *.safetensors -> lazy state dict.

verispec's native model runs Llama-family decoders; ``native_refusal(config)`` says why
a config.json is not one (None when it is), and verispec.models.load sends such folders
to transformers (verispec.models.HFModel) instead.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from typing import Any, Optional

import torch

from verispec.models.llama import LlamaConfig

SUPPORTED_MODEL_TYPES = ("llama",)


def llama_config_from_hf(cfg: dict[str, Any], source: str) -> LlamaConfig:
    """A LlamaConfig from a transformers config.json dict (v4 rope_scaling or v5 rope_parameters)."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{source}: unsupported model_type {model_type!r}; verispec.models "
                         f"supports {', '.join(SUPPORTED_MODEL_TYPES)} (Llama-family decoders)")
    for flag in ("attention_bias", "mlp_bias"):
        if cfg.get(flag, False):
            raise ValueError(f"{source}: {flag} = true is not supported (Llama without biases)")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{source}: hidden_act {act!r} is not supported (expected 'silu')")

    # transformers 5 writes rope_parameters = {"rope_type", "rope_theta", ...}; 4.x wrote
    # rope_theta plus rope_scaling = {"rope_type" or "type", ...} or null.
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    partial = float(rope.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        raise ValueError(f"{source}: partial_rotary_factor {partial} is not supported")
    rope_type = rope.get("rope_type", "default")
    rope_scaling = None if rope_type == "default" else rope

    heads = int(cfg["num_attention_heads"])
    return LlamaConfig(
        vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_hidden_layers=int(cfg["num_hidden_layers"]), num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=theta,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_scaling=rope_scaling)


class SafetensorsFolder(Mapping):
    """The tensors of model.safetensors or of the shards named by model.safetensors.index.json."""

    def __init__(self, folder: str):
        from safetensors import safe_open

        index = os.path.join(folder, "model.safetensors.index.json")
        single = os.path.join(folder, "model.safetensors")
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as f:
                weight_map: dict[str, str] = json.load(f)["weight_map"]
        elif os.path.isfile(single):
            weight_map = {}
            with safe_open(single, framework="pt") as f:
                weight_map = {name: "model.safetensors" for name in f.keys()}
        else:
            raise FileNotFoundError(f"{folder}: no model.safetensors or model.safetensors.index.json "
                                    f"(verispec loads Hugging Face weights from safetensors)")
        self.folder = folder
        self._weight_map = weight_map
        self._open: dict[str, Any] = {}
        self._safe_open = safe_open

    def __getitem__(self, name: str) -> torch.Tensor:
        shard = self._weight_map[name]
        if shard not in self._open:
            path = os.path.join(self.folder, shard)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{self.folder}: shard {shard} named by the index is missing")
            self._open[shard] = self._safe_open(path, framework="pt")
        return self._open[shard].get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._weight_map)

    def __len__(self) -> int:
        return len(self._weight_map)


def read_config_json(folder: str) -> dict[str, Any]:
    """The folder's config.json as a dict; FileNotFoundError when there is none."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{folder}: no config.json (expected a Hugging Face model folder: "
                                f"config.json + *.safetensors)")
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
    return cfg


def read_hf_config(folder: str) -> LlamaConfig:
    path = os.path.join(folder, "config.json")
    return llama_config_from_hf(read_config_json(folder), path)


def native_refusal(cfg: dict[str, Any], source: str = "config.json") -> Optional[str]:
    """Why verispec's native Llama cannot run this config.json dict, or None when it can.

    The test is llama_config_from_hf's own (model_type llama, no biases, silu, no partial
    rotary, LlamaConfig's RoPE types and head shapes), plus: no quantization_config (the
    native loader reads plain float tensors).
    """
    if cfg.get("quantization_config"):
        method = cfg["quantization_config"].get("quant_method", "?") if isinstance(
            cfg["quantization_config"], dict) else "?"
        return f"{source}: quantized checkpoints (quant_method {method!r}) are not read natively"
    try:
        llama_config_from_hf(cfg, source)
    except (ValueError, KeyError, TypeError) as e:
        return str(e) if not isinstance(e, KeyError) else f"{source}: no {e.args[0]!r} entry"
    return None


def supports_natively(cfg: dict[str, Any]) -> bool:
    """True when verispec's native LlamaModel runs this config.json dict."""
    return native_refusal(cfg) is None


_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}


def checkpoint_dtype(cfg: dict[str, Any]) -> Optional[torch.dtype]:
    """The dtype config.json records for the weights ("dtype", transformers 5, or
    "torch_dtype", 4.x; the text config's for a multimodal config), or None."""
    for c in (cfg, cfg.get("text_config") or {}):
        for key in ("dtype", "torch_dtype"):
            value = c.get(key) if isinstance(c, dict) else None
            if isinstance(value, str):
                name = value.removeprefix("torch.")
                if name in _DTYPES:
                    return _DTYPES[name]
    return None


def check_safetensors(folder: str) -> None:
    """FileNotFoundError unless the folder has model.safetensors or a shard index."""
    if not any(os.path.isfile(os.path.join(folder, name))
               for name in ("model.safetensors", "model.safetensors.index.json")):
        raise FileNotFoundError(f"{folder}: no model.safetensors or model.safetensors.index.json "
                                f"(verispec loads Hugging Face weights from safetensors)")
