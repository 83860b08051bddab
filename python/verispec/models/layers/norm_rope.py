"""RMSNorm and rotate-half RoPE in torch ops, as transformers computes them: the
reference rounding LlamaModel's torch path, the batch-invariant mode and the tests share
(verispec's CPU kernels for both are ``layers.kernels``)."""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["apply_rope", "rms_norm", "rope_inv_freq"]


def rope_inv_freq(config: Any) -> torch.Tensor:
    """RoPE inverse frequencies [head_dim / 2] float32, computed as transformers does, of a
    LlamaConfig (its head_dim, rope_theta, rope_scaling and rope_freq_factors)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_context = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_context / high) * ~(wavelen > old_context / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    if config.rope_freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float)
    return inv_freq


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with the statistics in float32, rounded back before the weight (as transformers)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE, as transformers: x * cos + rotate_half(x) * sin, with the tables
    laid out as LlamaModel keeps them. x: [T, H, D]; cos = [cos, cos], sin = [-sin, sin]:
    [T, 1, D]. Bit-identical to transformers (the negation is exact)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([x[..., half:], x[..., :half]], dim=-1) * sin
