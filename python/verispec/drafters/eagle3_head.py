"""The EAGLE-3 head: its config, loader (two shared layouts), forward and writer.

One decoder layer that drafts from the target's own hidden states (arXiv 2503.01840):

    g       = fc(concat(tap_1, ..., tap_k))          step 0: k taps of the target, [T, k*H_t]
    g       = previous step's hidden_out              steps >= 1: the head's own output, [T, H]
    x       = concat(input_layernorm(embed(token)), hidden_norm(g))           [T, 2H]
    h       = residual + o_proj(attention(q(x), k(x), v(x)))   residual = g, or hidden_norm(g)
    h       = h + mlp(post_attention_layernorm(h))                            (norm_before_residual)
    logits  = lm_head(norm(h))                        over the DRAFT vocabulary [T, V_draft]
    hidden_out = h (pre-norm), or norm(h) when norm_output

This module is plain torch and reads nothing else of verispec (tools/eagle3_reference.py
imports it by path from the `speculators` venv). The attention is a separate small
function (``dense_attention``) behind a callable, so a paged attention can replace it.

Layouts read and written
------------------------
- EAGLE / SpecForge (``"architectures": ["LlamaForCausalLMEagle3"]``): a flat Llama
  config with ``draft_vocab_size``, optional ``target_hidden_size``,
  ``norm_before_residual`` and ``eagle_config.eagle_aux_hidden_state_layer_ids``;
  tensors ``midlayer.*``, ``fc``, ``norm``, ``lm_head``, ``d2t``, ``t2d``, optional
  ``embed_tokens``.
- speculators (``"speculators_model_type": "eagle3"``, architectures
  ``Eagle3Speculator`` / ``Eagle3DraftModel``): ``transformer_layer_config`` (model_type
  ``llama`` or ``qwen3``), top-level ``draft_vocab_size``, ``target_hidden_size``,
  ``eagle_aux_hidden_state_layer_ids``, ``norm_before_residual``, ``norm_before_fc``,
  ``fc_norm``, ``norm_output``; tensors ``layers.0.*``, ``input_norm`` (norm_before_fc),
  ``fc_norm.{i}`` (fc_norm).

Tap layers: one convention inside verispec
------------------------------------------
``Eagle3Config.tap_layers[j] = i`` means "the target's residual stream ENTERING layer i"
(0: the embeddings; N: the output of the last layer, before the final norm). Each
layout's ids are converted to it when read and back when written:

- speculators / vLLM ids are already this convention: vLLM records
  ``hidden_states + residual`` before running layer i of its loop, and speculators
  0.9.0 accepts ids in [0, N] with N "the final hidden state"
  (``speculators/models/utils.py: resolve_target_layer_ids``). Stored as is.
- EAGLE / SpecForge ``eagle_config.eagle_aux_hidden_state_layer_ids`` mean "the OUTPUT
  of layer j": SGLang, which serves this layout, captures before layer ``j + 1`` for an
  explicit id j (``set_eagle3_layers_to_capture``: ``[val + 1 for val in layer_ids]``),
  while its default list is already "entering". Read as ``j + 1``, written as ``i - 1``.
  (The speculators converter ignores these ids and takes vLLM-convention ids as an
  argument instead.) A top-level ``eagle_aux_hidden_state_layer_ids`` in an EAGLE
  config is vLLM's key and is read as is.
- No ids in the file: ``tap_layers`` is None and means the default of every engine,
  entering layers (2, N // 2, N - 3) of an N-layer target (``resolve_taps``).

A wrong tap keeps decoding exact and only lowers acceptance, so only a comparison with
the reference (tests/test_eagle3_head.py) catches it.

norm_before_residual when the key is missing
--------------------------------------------
speculators' own config reads a missing key as False
(``Eagle3SpeculatorConfig.norm_before_residual``); vLLM's adapter for the speculators
layout reads it as True; EAGLE/SpecForge, SGLang and vLLM's reader of the EAGLE layout
read False. verispec follows the reference implementation's loader: False in both
layouts. ``save`` always writes the key, so every reader agrees on what we write.

What ``save`` writes
--------------------
config.json + model.safetensors. speculators layout (the default): architectures
``["Eagle3Speculator"]`` (published speculators heads and third-party readers key on
it; speculators 0.9.0 itself writes ``Eagle3DraftModel`` and loads either), every flag
spelled out, RoPE as both ``rope_parameters`` and ``rope_theta``/``rope_scaling``, a
tied lm_head written out. tools/eagle3_reference.py --check loads what it writes in
speculators 0.9.0 (a head with target_hidden_size != hidden_size excepted: speculators
0.9.0's model sizes fc by hidden_size alone; vLLM and SGLang read target_hidden_size).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

__all__ = [
    "DenseKV",
    "Eagle3Config",
    "Eagle3Head",
    "RopeScaling",
    "TargetShape",
    "causal_mask",
    "dense_attention",
    "ttt_mask",
]

# q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D] of the new tokens (k after RoPE) -> [T, Hq, D]
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

EAGLE_ARCHITECTURE = "LlamaForCausalLMEagle3"
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
_SPECULATORS_ARCHITECTURES = ("Eagle3Speculator", "Eagle3DraftModel")
_LAYER_TYPES = ("llama", "qwen3")


def _fail(where: str, name: str, expected: Any, got: Any) -> ValueError:
    return ValueError(f"{where}: {name} must be {expected}, got {got}")


# --- config ----------------------------------------------------------------------------


@dataclass(frozen=True)
class RopeScaling:
    """The RoPE frequency rule (transformers' ``rope_parameters`` / ``rope_scaling``).

    rope_type "default": inv_freq_i = theta^(-2i/D); "linear": inv_freq / factor;
    "llama3": long wavelengths (> original_max_position_embeddings / low_freq_factor)
    divided by factor, short ones (< .../high_freq_factor) kept, smooth in between.
    """

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0          # llama3 only
    high_freq_factor: float = 4.0         # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only

    def to_dict(self, rope_theta: float) -> dict:
        out: dict[str, Any] = {"rope_type": self.rope_type, "rope_theta": rope_theta}
        if self.rope_type in ("linear", "llama3"):
            out["factor"] = self.factor
        if self.rope_type == "llama3":
            out.update(low_freq_factor=self.low_freq_factor,
                       high_freq_factor=self.high_freq_factor,
                       original_max_position_embeddings=self.original_max_position_embeddings)
        return out


@dataclass(frozen=True)
class TargetShape:
    """What ``Eagle3Head.check_target`` compares: any object with these attributes works."""

    hidden_size: int
    vocab_size: int
    num_layers: int


@dataclass(frozen=True)
class Eagle3Config:
    """Every option of an EAGLE-3 head that changes its math, with its default.

    Defaults are those of transformers' LlamaConfig / Qwen3Config and of speculators
    0.9.0's Eagle3SpeculatorConfig where a key is missing from a file.
    """

    hidden_size: int                     # H: the head's width (embedding, residual stream)
    intermediate_size: int               # the MLP's inner width
    num_attention_heads: int             # query heads
    vocab_size: int                      # V: the TARGET's vocabulary (embed_tokens rows, t2d length)
    num_key_value_heads: Optional[int] = None  # K/V heads (GQA); None: = num_attention_heads
    head_dim: Optional[int] = None       # per head; None: hidden_size // num_attention_heads
    draft_vocab_size: Optional[int] = None  # V_draft: lm_head rows; None: = vocab_size (no d2t/t2d)
    target_hidden_size: Optional[int] = None  # H_t: width of one tap; None: = hidden_size
    tap_layers: Optional[tuple[int, ...]] = None  # "entering target layer i" (module doc); None: defaults
    num_taps: int = 3                    # k: fc reads k*H_t; = len(tap_layers) when given
    rms_norm_eps: float = 1e-6           # every RMSNorm of the head
    rope_theta: float = 10000.0          # RoPE base
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position_embeddings: int = 2048  # informational (llama3 scaling has its own)
    hidden_act: str = "silu"             # the MLP's gate activation (only silu is built)
    norm_before_residual: bool = False   # residual after attention is hidden_norm(g), not g
    norm_before_fc: bool = False         # one RMSNorm (input_norm, [k*H_t]) over the concat taps
    fc_norm: bool = False                # one RMSNorm per tap (fc_norm.{i}, [H_t]) before concat
    norm_output: bool = False            # feed norm(h) back (and lm_head reads it), not h
    own_embedding: bool = True           # the file has embed_tokens; False: the target's is bound
    qk_norm: bool = False                # Qwen3 layer: RMSNorm over each q and k head before RoPE
    attention_bias: bool = False         # q/k/v/o projections have biases
    mlp_bias: bool = False               # gate/up/down have biases (Llama's mlp_bias)
    tie_word_embeddings: bool = False    # no lm_head in the file: it is the embedding (V_draft = V)
    layer_type: str = "llama"            # "llama" or "qwen3" (the decoder layer's family)

    def __post_init__(self) -> None:
        where = "Eagle3Config"
        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise _fail(where, name, "a positive int", repr(value))
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.draft_vocab_size is None:
            object.__setattr__(self, "draft_vocab_size", self.vocab_size)
        if self.target_hidden_size is None:
            object.__setattr__(self, "target_hidden_size", self.hidden_size)
        if self.tap_layers is not None:
            taps = tuple(int(t) for t in self.tap_layers)
            object.__setattr__(self, "tap_layers", taps)
            object.__setattr__(self, "num_taps", len(taps))
            if not taps or min(taps) < 0 or len(set(taps)) != len(taps):
                raise _fail(where, "tap_layers", "distinct layer ids >= 0", list(taps))
        if self.num_attention_heads % self.num_key_value_heads:
            raise _fail(where, "num_key_value_heads", f"a divisor of num_attention_heads = "
                        f"{self.num_attention_heads}", self.num_key_value_heads)
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise _fail(where, "draft_vocab_size", f"in [1, vocab_size = {self.vocab_size}]",
                        self.draft_vocab_size)
        if self.norm_before_fc and self.fc_norm:
            raise _fail(where, "norm_before_fc and fc_norm", "not both set (one norm before fc)",
                        "both True")
        if self.hidden_act != "silu":
            raise _fail(where, "hidden_act", "'silu'", repr(self.hidden_act))
        if self.layer_type not in _LAYER_TYPES:
            raise _fail(where, "layer_type", f"one of {_LAYER_TYPES}", repr(self.layer_type))
        if self.rope_scaling.rope_type not in ("default", "linear", "llama3"):
            raise _fail(where, "rope_scaling.rope_type", "'default', 'linear' or 'llama3'",
                        repr(self.rope_scaling.rope_type))

    # The derived sizes the tensors must have.
    @property
    def uses_draft_vocab(self) -> bool:
        """True when the draft vocabulary is a subset mapped back by d2t."""
        return self.draft_vocab_size != self.vocab_size

    def resolve_taps(self, num_target_layers: int) -> tuple[int, ...]:
        """The tap layers ("entering layer i") for a target of ``num_target_layers``
        layers: the file's, or the engines' default (2, N // 2, N - 3)."""
        if self.tap_layers is not None:
            return self.tap_layers
        n = num_target_layers
        taps = (2, n // 2, n - 3)
        if len(set(taps)) != 3 or min(taps) < 0:
            raise ValueError(f"Eagle3Config: the default taps (2, N // 2, N - 3) need a target "
                             f"of at least 7 layers, got num_layers = {n}; give tap_layers")
        return taps

    # --- reading ----------------------------------------------------------------------

    @classmethod
    def from_folder(cls, path: str | os.PathLike) -> "Eagle3Config":
        """The config of the head in ``path`` (its config.json, either layout)."""
        config_path = os.path.join(os.fspath(path), "config.json")
        if not os.path.isfile(config_path):
            raise FileNotFoundError(f"Eagle3Config.from_folder: no config.json in {path}")
        with open(config_path) as f:
            raw = json.load(f)
        return cls.from_dict(raw, where=config_path)

    @classmethod
    def from_dict(cls, raw: dict, *, where: str = "config.json") -> "Eagle3Config":
        """Parse a config dict in either layout (``layout_of`` says which)."""
        layout = layout_of(raw, where=where)
        if layout == "speculators":
            return cls._from_speculators(raw, where)
        return cls._from_eagle(raw, where)

    @classmethod
    def _from_speculators(cls, raw: dict, where: str) -> "Eagle3Config":
        layer = raw.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise _fail(where, "transformer_layer_config", "a dict", type(layer).__name__)
        layer_type = layer.get("model_type", "qwen3")   # speculators' default layer class
        ids = raw.get("eagle_aux_hidden_state_layer_ids")
        return cls(**_layer_fields(layer, f"{where}: transformer_layer_config", layer_type),
                   draft_vocab_size=raw.get("draft_vocab_size", 32000),
                   target_hidden_size=raw.get("target_hidden_size"),
                   tap_layers=tuple(ids) if ids else None,
                   norm_before_residual=bool(raw.get("norm_before_residual", False)),
                   norm_before_fc=bool(raw.get("norm_before_fc", False)),
                   fc_norm=bool(raw.get("fc_norm", False)),
                   norm_output=bool(raw.get("norm_output", False)))

    @classmethod
    def _from_eagle(cls, raw: dict, where: str) -> "Eagle3Config":
        layer_type = raw.get("model_type", "llama")
        nested = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        top = raw.get("eagle_aux_hidden_state_layer_ids")
        taps = None
        if nested:   # SGLang's "output of layer j" -> entering layer j + 1
            taps = tuple(int(j) + 1 for j in nested)
        if top:      # vLLM's key: already "entering"
            if taps is not None and tuple(top) != taps:
                raise ValueError(
                    f"{where}: eagle_config.eagle_aux_hidden_state_layer_ids {list(nested)} "
                    f"(output of layer j, entering {list(taps)}) and "
                    f"eagle_aux_hidden_state_layer_ids {list(top)} (entering) disagree")
            taps = tuple(top)
        return cls(**_layer_fields(raw, where, layer_type),
                   draft_vocab_size=raw.get("draft_vocab_size"),
                   target_hidden_size=raw.get("target_hidden_size"),
                   tap_layers=taps,
                   norm_before_residual=bool(raw.get("norm_before_residual", False)),
                   norm_before_fc=bool(raw.get("norm_before_fc", False)),
                   fc_norm=bool(raw.get("fc_norm", False)),
                   norm_output=bool(raw.get("norm_output", False)))

    # --- writing ----------------------------------------------------------------------

    def _layer_dict(self) -> dict:
        out = {
            "model_type": self.layer_type,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": 1,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": self.hidden_act,
            "attention_bias": self.attention_bias,
            "tie_word_embeddings": self.tie_word_embeddings,
            # transformers >= 5 reads rope_parameters; older readers (and llama.cpp's
            # converter) rope_theta / rope_scaling: both are written, saying the same.
            "rope_parameters": self.rope_scaling.to_dict(self.rope_theta),
            "rope_theta": self.rope_theta,
            "rope_scaling": (None if self.rope_scaling.rope_type == "default"
                             else self.rope_scaling.to_dict(self.rope_theta)),
        }
        if self.layer_type == "llama":
            out["mlp_bias"] = self.mlp_bias
        return out

    def to_speculators_dict(self, *, verifier_name_or_path: Optional[str] = None,
                            verifier_architectures: tuple[str, ...] = (),
                            speculative_tokens: int = 3) -> dict:
        """config.json of the speculators layout (what speculators 0.9.0 loads)."""
        return {
            "architectures": [SPECULATORS_ARCHITECTURE],
            "speculators_model_type": "eagle3",
            "transformer_layer_config": self._layer_dict(),
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": (None if self.target_hidden_size == self.hidden_size
                                   else self.target_hidden_size),
            "eagle_aux_hidden_state_layer_ids": (list(self.tap_layers)
                                                 if self.tap_layers is not None else None),
            "norm_before_residual": self.norm_before_residual,
            "norm_before_fc": self.norm_before_fc,
            "fc_norm": self.fc_norm,
            "norm_output": self.norm_output,
            "tie_word_embeddings": False,
            "speculators_config": {
                "algorithm": "eagle3",
                "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy",
                                      "speculative_tokens": speculative_tokens}],
                "verifier": {"name_or_path": verifier_name_or_path,
                             "architectures": list(verifier_architectures)},
            },
        }

    def to_eagle_dict(self) -> dict:
        """config.json of the EAGLE / SpecForge layout (Llama layer only)."""
        if self.layer_type != "llama":
            raise ValueError(f"Eagle3Config.to_eagle_dict: the EAGLE layout "
                             f"({EAGLE_ARCHITECTURE}) has a Llama layer; layer_type must be "
                             f"'llama', got {self.layer_type!r} (write format='speculators')")
        out = {"architectures": [EAGLE_ARCHITECTURE], **self._layer_dict(),
               "draft_vocab_size": self.draft_vocab_size,
               "target_hidden_size": self.target_hidden_size,
               "norm_before_residual": self.norm_before_residual}
        for name in ("norm_before_fc", "fc_norm", "norm_output"):
            if getattr(self, name):
                out[name] = True
        if self.tap_layers is not None:
            if min(self.tap_layers) < 1:
                raise ValueError(f"Eagle3Config.to_eagle_dict: the EAGLE layout names taps as "
                                 f"'output of layer j' (j >= 0), so tap_layers must be >= 1, "
                                 f"got {list(self.tap_layers)}")
            out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids":
                                   [t - 1 for t in self.tap_layers],
                                   "use_aux_hidden_state": True}
        return out


def layout_of(raw: dict, *, where: str = "config.json") -> str:
    """"speculators" or "eagle": the layout of a parsed config.json."""
    archs = raw.get("architectures") or []
    if raw.get("speculators_model_type") is not None:
        if raw["speculators_model_type"] != "eagle3":
            raise _fail(where, "speculators_model_type", "'eagle3'",
                        repr(raw["speculators_model_type"]))
        return "speculators"
    if any(a in _SPECULATORS_ARCHITECTURES for a in archs):
        return "speculators"
    if any(str(a).endswith("Eagle3") for a in archs):
        return "eagle"
    raise _fail(where, "architectures", f"[{EAGLE_ARCHITECTURE!r}] or "
                f"[{SPECULATORS_ARCHITECTURE!r}] (or speculators_model_type 'eagle3')", archs)


def _rope_from(layer: dict, where: str) -> tuple[float, RopeScaling]:
    params = layer.get("rope_parameters") or layer.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise _fail(where, "rope_parameters", "a dict", type(params).__name__)
    if "sliding_attention" in params or "full_attention" in params:
        raise _fail(where, "rope_parameters", "one rule for the head's one layer",
                    sorted(params))
    theta = float(params.get("rope_theta", layer.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "linear", "llama3"):
        raise _fail(where, "rope type", "'default', 'linear' or 'llama3'", repr(rope_type))
    if rope_type == "default":
        return theta, RopeScaling()
    return theta, RopeScaling(
        rope_type=rope_type, factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings",
                                                        8192)))


def _layer_fields(layer: dict, where: str, layer_type: str) -> dict:
    """The decoder layer's fields of an Eagle3Config from a (flat) Llama/Qwen3 config."""
    if layer_type not in _LAYER_TYPES:
        raise _fail(where, "model_type", f"one of {_LAYER_TYPES}", repr(layer_type))
    for name in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
        if name not in layer:
            raise _fail(where, name, "present", "nothing")
    layers = layer.get("num_hidden_layers", 1)
    if layers != 1:
        raise _fail(where, "num_hidden_layers", "1 (an EAGLE-3 head has one layer)", layers)
    if layer.get("use_sliding_window") or "sliding_attention" in (layer.get("layer_types") or []):
        raise _fail(where, "use_sliding_window / layer_types", "full attention",
                    "a sliding window")
    partial = layer.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise _fail(where, "partial_rotary_factor", 1.0, partial)
    theta, scaling = _rope_from(layer, where)
    return dict(
        hidden_size=layer["hidden_size"], intermediate_size=layer["intermediate_size"],
        num_attention_heads=layer["num_attention_heads"], vocab_size=layer["vocab_size"],
        num_key_value_heads=layer.get("num_key_value_heads"), head_dim=layer.get("head_dim"),
        rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)), rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(layer.get("max_position_embeddings",
                                              32768 if layer_type == "qwen3" else 2048)),
        hidden_act=layer.get("hidden_act", "silu"), qk_norm=layer_type == "qwen3",
        attention_bias=bool(layer.get("attention_bias", False)),
        mlp_bias=bool(layer.get("mlp_bias") or False) if layer_type == "llama" else False,
        tie_word_embeddings=bool(layer.get("tie_word_embeddings", False)),
        layer_type=layer_type)


# --- the math --------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight, in float32, as transformers' LlamaRMSNorm."""
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """inv_freq [head_dim // 2] (float32) of the rule, as transformers computes it."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling.rope_type == "linear":
        return inv / scaling.factor
    if scaling.rope_type == "llama3":
        old = scaling.original_max_position_embeddings
        low_wavelen = old / scaling.low_freq_factor
        high_wavelen = old / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
        smooth = (old / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, D] by positions [T]: the half-split (NeoX) layout of Llama."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :].to(positions.device)
    emb = torch.cat([freqs, freqs], dim=-1)
    cos = emb.cos().to(x.dtype)[:, None, :]
    sin = emb.sin().to(x.dtype)[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def causal_mask(num_new: int, num_past: int, device=None) -> torch.Tensor:
    """bool [num_new, num_past + num_new]: new token i sees the past and new tokens <= i."""
    keys = torch.arange(num_past + num_new, device=device)
    return keys[None, :] <= (num_past + torch.arange(num_new, device=device))[:, None]


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    mask: torch.Tensor) -> torch.Tensor:
    """Softmax attention of q [T, Hq, D] over k, v [S, Hkv, D] where mask [T, S] is True.

    GQA: query head h reads K/V head h // (Hq / Hkv). Scores are scaled by D^-0.5 and the
    softmax taken in float32, as transformers' eager attention does. Returns [T, Hq, D].
    """
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).transpose(0, 1)           # [Hq, S, D]
    v = v.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.matmul(q.transpose(0, 1), k.transpose(1, 2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~mask[None], float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v).transpose(0, 1)                 # [T, Hq, D]


def ttt_mask(num_tokens: int, step: int, device=None) -> torch.Tensor:
    """bool [T, (step + 1) * T]: step ``step`` of a training-time-test unroll over T
    tokens sees step 0 causally and the same row of steps 1..step (a chain per row)."""
    causal = causal_mask(num_tokens, 0, device=device)
    eye = torch.eye(num_tokens, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * step, dim=1)


class DenseKV:
    """The head's one-layer K/V cache as dense tensors, and the attention over it.

    ``attend(q, k, v, mask=None)`` appends the new tokens' k, v (after RoPE) and runs
    ``dense_attention`` over everything stored; ``mask`` None means causal (new token i
    sees the past and new tokens <= i); a bool [T, len(self)] mask gives trees or the
    training-time layout. ``truncate(n)`` rolls back to the first n tokens.
    """

    def __init__(self, num_kv_heads: int, head_dim: int, *, dtype=torch.float32,
                 device="cpu") -> None:
        self.k = torch.empty(0, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.empty(0, num_kv_heads, head_dim, dtype=dtype, device=device)

    def __len__(self) -> int:
        return self.k.shape[0]

    def truncate(self, length: int) -> None:
        if not 0 <= length <= len(self):
            raise _fail("DenseKV.truncate", "length", f"in [0, {len(self)}]", length)
        self.k, self.v = self.k[:length], self.v[:length]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        past, total = len(self), len(self) + k.shape[0]
        if mask is None:
            mask = causal_mask(q.shape[0], past, device=q.device)
        elif tuple(mask.shape) != (q.shape[0], total) or mask.dtype != torch.bool:
            raise _fail("DenseKV.attend", "mask", f"bool [{q.shape[0]}, {total}]",
                        f"{mask.dtype} {list(mask.shape)}")
        self.k = torch.cat([self.k, k.to(self.k.dtype)])
        self.v = torch.cat([self.v, v.to(self.v.dtype)])
        return dense_attention(q, self.k, self.v, mask)


# --- the head ---------------------------------------------------------------------------

# Canonical tensor names are the speculators layout's; the EAGLE layout's "midlayer." is
# "layers.0." here.
_LAYER = "layers.0."
_MIDLAYER = "midlayer."


def expected_shapes(cfg: Eagle3Config) -> dict[str, tuple[int, ...]]:
    """Every floating-point tensor the head can hold (canonical name -> shape)."""
    H, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    nq, nkv, k, Ht = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_taps, \
        cfg.target_hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (H, k * Ht),
        _LAYER + "input_layernorm.weight": (H,),
        _LAYER + "hidden_norm.weight": (H,),
        _LAYER + "post_attention_layernorm.weight": (H,),
        _LAYER + "self_attn.q_proj.weight": (nq * D, 2 * H),
        _LAYER + "self_attn.k_proj.weight": (nkv * D, 2 * H),
        _LAYER + "self_attn.v_proj.weight": (nkv * D, 2 * H),
        _LAYER + "self_attn.o_proj.weight": (H, nq * D),
        _LAYER + "mlp.gate_proj.weight": (I, H),
        _LAYER + "mlp.up_proj.weight": (I, H),
        _LAYER + "mlp.down_proj.weight": (H, I),
        "norm.weight": (H,),
        "lm_head.weight": (cfg.draft_vocab_size, H),
        "embed_tokens.weight": (cfg.vocab_size, H),
    }
    if cfg.attention_bias:
        for name, rows in (("q", nq * D), ("k", nkv * D), ("v", nkv * D), ("o", H)):
            shapes[_LAYER + f"self_attn.{name}_proj.bias"] = (rows,)
    if cfg.mlp_bias:
        for name, rows in (("gate", I), ("up", I), ("down", H)):
            shapes[_LAYER + f"mlp.{name}_proj.bias"] = (rows,)
    if cfg.qk_norm:
        shapes[_LAYER + "self_attn.q_norm.weight"] = (D,)
        shapes[_LAYER + "self_attn.k_norm.weight"] = (D,)
    if cfg.norm_before_fc:
        shapes["input_norm.weight"] = (k * Ht,)
    if cfg.fc_norm:
        for i in range(k):
            shapes[f"fc_norm.{i}.weight"] = (Ht,)
    return shapes


_OPTIONAL = ("embed_tokens.weight", "lm_head.weight")
# Written by speculators' trainer and not part of the head's math.
_IGNORED = ("verifier_lm_head.weight", "verifier_norm.weight")


def _read_tensors(folder: str) -> dict[str, torch.Tensor]:
    """model.safetensors, its shards (model.safetensors.index.json) or pytorch_model.bin."""
    single = os.path.join(folder, "model.safetensors")
    index = os.path.join(folder, "model.safetensors.index.json")
    legacy = os.path.join(folder, "pytorch_model.bin")
    if os.path.isfile(single) or os.path.isfile(index):
        from safetensors.torch import load_file
        if os.path.isfile(single):
            return load_file(single)
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        out: dict[str, torch.Tensor] = {}
        for shard in shards:
            out.update(load_file(os.path.join(folder, shard)))
        return out
    if os.path.isfile(legacy):
        return torch.load(legacy, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"Eagle3Head.load: no model.safetensors, "
                            f"model.safetensors.index.json or pytorch_model.bin in {folder}")


class Eagle3Head:
    """An EAGLE-3 head's weights and its forward (module doc). Build with ``load``."""

    def __init__(self, config: Eagle3Config, tensors: dict[str, torch.Tensor],
                 *, where: str = "Eagle3Head") -> None:
        """``tensors``: canonical names (``layers.0.*``), float tensors already in the
        head's dtype, ``d2t`` int64 and ``t2d`` bool when the vocabulary is reduced."""
        self.config = config
        tensors = dict(tensors)
        d2t, t2d = tensors.pop("d2t", None), tensors.pop("t2d", None)
        for name in _IGNORED:
            tensors.pop(name, None)
        shapes = expected_shapes(config)
        unknown = sorted(set(tensors) - set(shapes))
        if unknown:
            raise _fail(where, "the tensors", f"those of a one-layer head with this config "
                        f"({sorted(shapes)})", f"also {unknown}")
        missing = sorted(set(shapes) - set(tensors) - set(_OPTIONAL))
        if missing:
            raise _fail(where, "the tensors", "all present", f"no {missing}")
        for name, tensor in tensors.items():
            if tuple(tensor.shape) != shapes[name]:
                raise _fail(where, f"{name}.shape", list(shapes[name]), list(tensor.shape))
            if not tensor.is_floating_point():
                raise _fail(where, f"{name}.dtype", "floating point", tensor.dtype)
        config = replace(config, own_embedding="embed_tokens.weight" in tensors)
        self.config = config
        if "lm_head.weight" not in tensors and not (
                config.tie_word_embeddings and not config.uses_draft_vocab):
            raise _fail(where, "lm_head.weight", f"present (shape {list(shapes['lm_head.weight'])}"
                        f"; only tie_word_embeddings with draft_vocab_size = vocab_size may "
                        f"omit it)", "nothing")
        self.weights = tensors
        self.d2t, self.t2d = self._check_vocab_maps(d2t, t2d, where)
        ref = next(iter(tensors.values()))
        self.dtype, self.device = ref.dtype, ref.device
        self.inv_freq = rope_inv_freq(config.head_dim, config.rope_theta,
                                      config.rope_scaling).to(self.device)
        self._target_ids = (None if self.d2t is None else
                            torch.arange(config.draft_vocab_size, device=self.device) + self.d2t)
        self._native: dict[str, Any] = {}   # use_native_weights: fused matrices in Q8_0
        self._threads: Optional[int] = None

    # --- native weights ------------------------------------------------------------------

    _FUSED = {"fc": ("fc.weight",),
              "qkv": (_LAYER + "self_attn.q_proj.weight", _LAYER + "self_attn.k_proj.weight",
                      _LAYER + "self_attn.v_proj.weight"),
              "o": (_LAYER + "self_attn.o_proj.weight",),
              "gate_up": (_LAYER + "mlp.gate_proj.weight", _LAYER + "mlp.up_proj.weight"),
              "down": (_LAYER + "mlp.down_proj.weight",)}

    def use_native_weights(self, fmt: str = "Q8_0", *, num_threads: Optional[int] = None) -> dict:
        """Keep the head's matrices for verispec's native CPU kernels (``quant_linear``):
        fc, q|k|v and gate|up fused, o, down and lm_head quantized to ``fmt`` (Q8_0: an
        int8 per weight and a scale per 32; a float32 CPU head only). The drafts change by
        the quantization's rounding alone, and exactness never depends on them (q is
        whatever the head gives). ``"float32"`` goes back to the float matrices. Returns
        {"format", "bytes", "float32_bytes"} of the matrices."""
        from verispec.models.layers.quantized import QuantizedMatrix

        if fmt == "float32":
            self._native = {}
        elif fmt != "Q8_0":
            raise ValueError(f"Eagle3Head.use_native_weights: fmt must be 'Q8_0' or 'float32', "
                             f"got {fmt!r}")
        elif self.device.type != "cpu" or self.dtype != torch.float32:
            raise ValueError(f"Eagle3Head.use_native_weights: the native kernels take a float32 "
                             f"CPU head, got {self.dtype} on {self.device}")
        elif any(b in self.weights for names in self._FUSED.values() for b in
                 (n.replace(".weight", ".bias") for n in names)):
            raise ValueError("Eagle3Head.use_native_weights: a head with projection biases "
                             "stays in float32 (fmt='float32')")
        else:
            native = {}
            for key, names in self._FUSED.items():
                native[key] = QuantizedMatrix.quantize_q8_0(
                    torch.cat([self.weights[n] for n in names]))
            native["lm_head"] = QuantizedMatrix.quantize_q8_0(self.lm_head)
            self._native = native
        self._threads = num_threads
        float_bytes = sum(self.weights[n].numel() * 4 for names in self._FUSED.values()
                          for n in names) + self.lm_head.numel() * 4
        return {"format": "Q8_0" if self._native else "float32",
                "bytes": (sum(m.nbytes for m in self._native.values()) if self._native
                          else float_bytes),
                "float32_bytes": float_bytes}

    @property
    def weight_format(self) -> str:
        return "Q8_0" if self._native else str(self.dtype).replace("torch.", "")

    def _mm(self, x: torch.Tensor, key: str) -> list[torch.Tensor]:
        """The products of x with the matrices of ``key`` (_FUSED, or "lm_head"), one per
        matrix: the native ones when kept, else F.linear with their biases."""
        native = self._native.get(key)
        if native is not None:
            threads = self._threads or torch.get_num_threads()
            out = native.linear(x.float().contiguous(), threads)
            if key == "lm_head":
                return [out]
            sizes = [self.weights[n].shape[0] for n in self._FUSED[key]]
            return list(out.split(sizes, dim=-1))
        if key == "lm_head":
            return [F.linear(x, self.lm_head)]
        return [F.linear(x, self.weights[n], self.weights.get(n.replace(".weight", ".bias")))
                for n in self._FUSED[key]]

    def _check_vocab_maps(self, d2t, t2d, where):
        cfg = self.config
        V, Vd = cfg.vocab_size, cfg.draft_vocab_size
        if not cfg.uses_draft_vocab:
            if d2t is not None and bool(d2t.ne(0).any()):
                raise _fail(where, "d2t", "all zero (draft_vocab_size = vocab_size = "
                            f"{V}: the identity)", f"{int(d2t.ne(0).sum())} non-zero offsets")
            return None, None
        if d2t is None or t2d is None:
            raise _fail(where, "d2t and t2d", f"present (draft_vocab_size {Vd} < vocab_size "
                        f"{V})", f"d2t {'present' if d2t is not None else 'missing'}, "
                        f"t2d {'present' if t2d is not None else 'missing'}")
        if tuple(d2t.shape) != (Vd,) or d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
            raise _fail(where, "d2t", f"integer offsets of shape [{Vd}]",
                        f"{d2t.dtype} {list(d2t.shape)}")
        if tuple(t2d.shape) != (V,):
            raise _fail(where, "t2d.shape", [V], list(t2d.shape))
        d2t, t2d = d2t.to(torch.int64), t2d.to(torch.bool)
        targets = torch.arange(Vd) + d2t.cpu()
        if int(targets.min()) < 0 or int(targets.max()) >= V:
            raise _fail(where, "d2t", f"offsets mapping draft ids into [0, {V})",
                        f"target ids from {int(targets.min())} to {int(targets.max())}")
        if int(targets.unique().numel()) != Vd:
            raise _fail(where, "d2t", f"{Vd} distinct target ids",
                        f"{int(targets.unique().numel())}")
        marked = t2d.cpu().nonzero().flatten()
        if marked.numel() != Vd or not torch.equal(marked, targets.sort().values):
            raise _fail(where, "t2d", f"True exactly at the {Vd} target ids of d2t",
                        f"{marked.numel()} True entries"
                        + ("" if marked.numel() != Vd else ", other ids"))
        return d2t.to(self.weights["fc.weight"].device), t2d.to(self.weights["fc.weight"].device)

    # --- loading and checking ------------------------------------------------------------

    @classmethod
    def load(cls, path: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
             device: str | torch.device = "cpu") -> "Eagle3Head":
        """The head in folder ``path`` (either layout; module doc), weights in ``dtype``."""
        folder = os.fspath(path)
        config = Eagle3Config.from_folder(folder)
        raw = _read_tensors(folder)
        tensors = {}
        for name, tensor in raw.items():
            canonical = _LAYER + name[len(_MIDLAYER):] if name.startswith(_MIDLAYER) else name
            if canonical in tensors:
                raise ValueError(f"Eagle3Head.load: {folder} has both {name} and {canonical}")
            if canonical in ("d2t", "t2d"):
                tensors[canonical] = tensor.to(device)
            else:
                tensors[canonical] = (tensor.to(device=device, dtype=dtype)
                                      if tensor.is_floating_point() else tensor)
        if "fc.weight" in tensors and config.tap_layers is None:
            # No ids in the file: the tap count is fc's width over H_t.
            width = tensors["fc.weight"].shape[-1]
            if width % config.target_hidden_size == 0:
                config = replace(config, num_taps=width // config.target_hidden_size)
        return cls(config, tensors, where=f"Eagle3Head.load({folder})")

    def check_target(self, target: Any) -> tuple[int, ...]:
        """Refuse a target this head cannot draft for; return its tap layers resolved.

        ``target``: any object with ``hidden_size``, ``vocab_size`` and ``num_layers``
        (``TargetShape``). Taps may be 0..num_layers ("entering layer i"; num_layers is
        the last layer's output).
        """
        cfg = self.config
        for name in ("hidden_size", "vocab_size", "num_layers"):
            if not hasattr(target, name):
                raise TypeError(f"Eagle3Head.check_target: target must have {name}, "
                                f"got {type(target).__name__} without it")
        if target.hidden_size != cfg.target_hidden_size:
            raise _fail("Eagle3Head.check_target", "the target's hidden_size",
                        f"the head's target_hidden_size = {cfg.target_hidden_size}",
                        target.hidden_size)
        if target.vocab_size != cfg.vocab_size:
            raise _fail("Eagle3Head.check_target", "the target's vocab_size",
                        f"the head's vocab_size = {cfg.vocab_size}", target.vocab_size)
        taps = cfg.resolve_taps(target.num_layers)
        if max(taps) > target.num_layers:
            raise _fail("Eagle3Head.check_target", "tap_layers",
                        f"<= the target's num_layers = {target.num_layers} "
                        f"(entering layer i; {target.num_layers}: the last layer's output)",
                        list(taps))
        if len(taps) != cfg.num_taps:
            raise _fail("Eagle3Head.check_target", "the number of taps",
                        f"fc's {cfg.num_taps}", len(taps))
        return taps

    def bind_target_embedding(self, weight: torch.Tensor | Callable[[torch.Tensor], torch.Tensor]
                              ) -> None:
        """Use the target's embedding (a head without embed_tokens needs it): its table
        [V, H], or a function ids [T] -> [T, H] (a quantized table looked up in place)."""
        cfg = self.config
        if cfg.own_embedding:
            raise ValueError("Eagle3Head.bind_target_embedding: the head has its own "
                             "embed_tokens; own_embedding must be False, got True")
        if callable(weight) and not isinstance(weight, torch.Tensor):
            self._embed_fn = weight
            return
        if tuple(weight.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise _fail("Eagle3Head.bind_target_embedding", "weight.shape",
                        [cfg.vocab_size, cfg.hidden_size], list(weight.shape))
        self._target_embedding = weight

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[T, H] in the head's dtype: the rows of its table, or the target's bound one."""
        fn = getattr(self, "_embed_fn", None)
        if fn is not None and "embed_tokens.weight" not in self.weights:
            return fn(token_ids).to(self.dtype)
        return F.embedding(token_ids, self.embedding).to(self.dtype)

    @property
    def embedding(self) -> torch.Tensor:
        """[V, H]: the head's embed_tokens, or the target's bound one."""
        own = self.weights.get("embed_tokens.weight")
        if own is not None:
            return own
        bound = getattr(self, "_target_embedding", None)
        if bound is None:
            raise RuntimeError("Eagle3Head: the head has no embed_tokens; call "
                               "bind_target_embedding(target_embedding) first")
        return bound

    @property
    def lm_head(self) -> torch.Tensor:
        """[V_draft, H]."""
        own = self.weights.get("lm_head.weight")
        return own if own is not None else self.embedding

    # --- vocabulary maps ---------------------------------------------------------------

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Target ids of draft ids (i + d2t[i]; the identity without a reduced vocab)."""
        if self._target_ids is None:
            return ids
        return self._target_ids.to(ids.device)[ids]

    @property
    def target_ids(self) -> torch.Tensor:
        """int64 [V_draft]: the target id of each draft id."""
        if self._target_ids is None:
            return torch.arange(self.config.vocab_size, device=self.device)
        return self._target_ids

    def with_draft_vocab(self, target_ids: torch.Tensor) -> "Eagle3Head":
        """This head drafting over a subset of its draft vocabulary: ``target_ids`` (target
        ids it drafts now) keep their lm_head rows, the others are dropped (q = 0 there:
        a smaller file and pass; the kept tokens' logits are unchanged)."""
        ids = torch.as_tensor(target_ids, dtype=torch.long).cpu().unique()
        have = self.target_ids.cpu()
        row_of = torch.full((self.config.vocab_size,), -1, dtype=torch.long)
        row_of[have] = torch.arange(len(have))
        if ids.numel() == 0 or int(ids.max()) >= self.config.vocab_size or bool(
                (row_of[ids] < 0).any()):
            outside = int((row_of[ids.clamp(0, self.config.vocab_size - 1)] < 0).sum()
                          + (ids >= self.config.vocab_size).sum())
            raise _fail("Eagle3Head.with_draft_vocab", "target_ids",
                        "at least one id, each in the head's draft vocabulary",
                        f"{ids.numel()} ids, {outside} outside it")
        tensors = {n: t.detach() for n, t in self.weights.items() if n != "lm_head.weight"}
        tensors["lm_head.weight"] = self.lm_head.detach()[row_of[ids].to(self.device)].clone()
        cfg = replace(self.config, draft_vocab_size=int(ids.numel()), tie_word_embeddings=False)
        if ids.numel() < cfg.vocab_size:
            tensors["d2t"] = (ids - torch.arange(ids.numel())).to(self.device)
            t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
            t2d[ids] = True
            tensors["t2d"] = t2d.to(self.device)
        head = Eagle3Head(cfg, tensors, where="Eagle3Head.with_draft_vocab")
        for bound in ("_embed_fn", "_target_embedding"):   # the target's embedding, if bound
            if getattr(self, bound, None) is not None:
                setattr(head, bound, getattr(self, bound))
        return head

    def scatter_to_target(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """[..., V_draft] -> [..., V] with -inf outside the draft vocabulary (q = 0 there)."""
        if self._target_ids is None:
            return draft_logits
        out = draft_logits.new_full((*draft_logits.shape[:-1], self.config.vocab_size),
                                    float("-inf"))
        out[..., self._target_ids.to(out.device)] = draft_logits
        return out

    # --- forward -------------------------------------------------------------------------

    def new_kv(self) -> DenseKV:
        return DenseKV(self.config.num_key_value_heads, self.config.head_dim,
                       dtype=self.dtype, device=self.device)

    def fuse_taps(self, taps: torch.Tensor) -> torch.Tensor:
        """g [T, H] = fc(taps [T, k*H_t]), with input_norm or fc_norm first where set."""
        cfg, w = self.config, self.weights
        width = cfg.num_taps * cfg.target_hidden_size
        if taps.dim() != 2 or taps.shape[1] != width:
            raise _fail("Eagle3Head.forward", "taps", f"[T, {width}] (k = {cfg.num_taps} taps "
                        f"of {cfg.target_hidden_size})", list(taps.shape))
        x = taps.to(self.dtype)
        if cfg.norm_before_fc:
            x = rms_norm(x, w["input_norm.weight"], cfg.rms_norm_eps)
        if cfg.fc_norm:
            x = torch.cat([rms_norm(chunk, w[f"fc_norm.{i}.weight"], cfg.rms_norm_eps)
                           for i, chunk in enumerate(x.chunk(cfg.num_taps, dim=-1))], dim=-1)
        return self._mm(x, "fc")[0]

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, *,
                taps: Optional[torch.Tensor] = None, hidden: Optional[torch.Tensor] = None,
                kv: Optional[DenseKV] = None,
                attention: Optional[AttentionFn] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass over T tokens: (draft logits [T, V_draft], hidden_out [T, H]).

        Give exactly one of ``taps`` [T, k*H_t] (step 0: the target's features of the
        tokens before ``token_ids``) and ``hidden`` [T, H] (steps >= 1: the previous
        step's hidden_out). ``token_ids`` [T] are TARGET-vocabulary ids, ``positions`` [T]
        their positions. Attention: ``attention(q, k, v)`` if given (a paged one), else
        ``kv.attend`` (causal over what ``kv`` holds), else causal over these T tokens.
        hidden_out is fed back at the next step: h before the final norm, or norm(h)
        when ``norm_output``.
        """
        cfg, w, L = self.config, self.weights, _LAYER
        if (taps is None) == (hidden is None):
            raise ValueError("Eagle3Head.forward: give exactly one of taps (step 0) and "
                             f"hidden (steps >= 1), got taps={'set' if taps is not None else None}"
                             f", hidden={'set' if hidden is not None else None}")
        T = token_ids.shape[0]
        if taps is not None:
            g = self.fuse_taps(taps)
        else:
            if tuple(hidden.shape) != (T, cfg.hidden_size):
                raise _fail("Eagle3Head.forward", "hidden", f"[{T}, {cfg.hidden_size}]",
                            list(hidden.shape))
            g = hidden.to(self.dtype)
        if g.shape[0] != T or tuple(positions.shape) != (T,):
            raise _fail("Eagle3Head.forward", "taps/hidden, token_ids, positions",
                        f"T = {T} rows each", f"{g.shape[0]} and {list(positions.shape)}")
        eps = cfg.rms_norm_eps
        g_normed = rms_norm(g, w[L + "hidden_norm.weight"], eps)
        residual = g_normed if cfg.norm_before_residual else g
        embeds = rms_norm(self.embed(token_ids), w[L + "input_layernorm.weight"], eps)
        x = torch.cat([embeds, g_normed], dim=-1)                    # [T, 2H]
        D, nq, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        q, k, v = self._mm(x, "qkv")
        q, k, v = q.view(T, nq, D), k.view(T, nkv, D), v.view(T, nkv, D)
        if cfg.qk_norm:
            q = rms_norm(q, w[L + "self_attn.q_norm.weight"], eps)
            k = rms_norm(k, w[L + "self_attn.k_norm.weight"], eps)
        q = apply_rope(q, positions, self.inv_freq)
        k = apply_rope(k, positions, self.inv_freq)
        if attention is None:
            attention = (kv if kv is not None else self.new_kv()).attend
        out = attention(q, k, v).reshape(T, nq * D)
        h = residual + self._mm(out, "o")[0]
        m = rms_norm(h, w[L + "post_attention_layernorm.weight"], eps)
        gate, up = self._mm(m, "gate_up")
        h = h + self._mm(F.silu(gate) * up, "down")[0]
        normed = rms_norm(h, w["norm.weight"], eps)
        logits = self._mm(normed, "lm_head")[0]
        return logits, (normed if cfg.norm_output else h)

    def unroll(self, taps: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor,
               steps: int) -> torch.Tensor:
        """The training-time-test unroll of speculators' ``Eagle3DraftModel.forward``:
        logits [steps, T, V_draft].

        Step 0 reads the taps of T tokens (causal). Step s >= 1 reads step s-1's
        hidden_out, the ids shifted left by s (teacher forcing, 0-padded) at positions
        + s, and its row t attends to step 0's rows <= t and to its own row t of steps
        1..s: the chain a drafter at t would have built (``ttt_mask``).
        """
        T = token_ids.shape[0]
        kv, hidden, out = self.new_kv(), None, []
        for s in range(steps):
            ids = torch.cat([token_ids[s:], token_ids.new_zeros(min(s, T))])[:T]
            mask = ttt_mask(T, s, device=token_ids.device)
            inputs = {"taps": taps} if s == 0 else {"hidden": hidden}
            logits, hidden = self.forward(
                ids, positions + s, attention=lambda q, k, v, m=mask: kv.attend(q, k, v, m),
                **inputs)
            out.append(logits)
        return torch.stack(out)

    # --- writing -------------------------------------------------------------------------

    def save(self, path: str | os.PathLike, format: str = "speculators", *,
             dtype: Optional[torch.dtype] = None, verifier_name_or_path: Optional[str] = None,
             verifier_architectures: tuple[str, ...] = ()) -> None:
        """Write config.json + model.safetensors in the speculators layout (default; what
        speculators, vLLM and llama.cpp's converter read) or the EAGLE one (``"eagle"``).
        ``dtype``: the floating tensors' dtype on disk (default: the head's)."""
        from safetensors.torch import save_file

        if format not in ("speculators", "eagle"):
            raise _fail("Eagle3Head.save", "format", "'speculators' or 'eagle'", repr(format))
        cfg = self.config
        lm_head = None
        if "lm_head.weight" not in self.weights:    # tied: written out, so readers agree
            lm_head = self.lm_head
            cfg = replace(cfg, tie_word_embeddings=False)
        if format == "speculators":
            config = cfg.to_speculators_dict(verifier_name_or_path=verifier_name_or_path,
                                             verifier_architectures=verifier_architectures)
        else:
            config = cfg.to_eagle_dict()
        config["dtype"] = str(dtype or self.dtype).removeprefix("torch.")
        tensors = {}
        for name, tensor in self.weights.items():
            if format == "eagle" and name.startswith(_LAYER):
                name = _MIDLAYER + name[len(_LAYER):]
            tensors[name] = tensor.detach().to(device="cpu", dtype=dtype or tensor.dtype)
        if lm_head is not None:
            tensors["lm_head.weight"] = lm_head.detach().to(device="cpu",
                                                            dtype=dtype or lm_head.dtype)
        if self.d2t is not None:
            tensors["d2t"] = self.d2t.cpu()
            tensors["t2d"] = self.t2d.cpu()
        folder = os.fspath(path)
        os.makedirs(folder, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()},
                  os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
            f.write("\n")
