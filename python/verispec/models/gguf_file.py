"""Llama-family GGUF files: metadata, dequantised tensors, and the LlamaConfig they describe.

The header is parsed here with struct over an mmap: gguf.GGUFReader builds a numpy view
per metadata element and needs ~5 s for SmolLM2's 98k tokenizer strings; this takes
~0.1 s. Tensor payloads are dequantised in torch for F32/F16/BF16/Q4_0/Q4_1/Q8_0 (same
values as gguf.quants, several times faster) and by gguf.quants.dequantize otherwise
(K-quants, IQ types, ...).

llama.cpp stores Q/K projection rows permuted for its interleaved-pair RoPE; `LlamaGGUF`
undoes that so the weights are in transformers' rotate-half layout (what transformers'
own GGUF loader does too).
"""

from __future__ import annotations

import mmap
import os
import struct
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from verispec.models.llama import LlamaConfig

GGUF_MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
          10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order (ggml lists the fastest dimension first)
    ggml_type: int
    offset: int             # absolute byte offset in the file
    nbytes: int


class GGUFFile:
    """A GGUF file's metadata and tensor table; tensors are read (dequantised) on demand."""

    def __init__(self, path: str | os.PathLike):
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = os.fspath(path)
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = self._map
        if buf[:4] != GGUF_MAGIC:
            raise ValueError(f"{self.path}: not a GGUF file (expected magic b'GGUF', "
                             f"got {bytes(buf[:4])!r})")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"{self.path}: GGUF version {version} is not supported (expected 2 or 3)")
        pos = 24
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key, pos = self._string(pos)
            (vtype,) = struct.unpack_from("<I", buf, pos)
            self.metadata[key], pos = self._value(vtype, pos + 4)

        entries = []
        for _ in range(n_tensors):
            name, pos = self._string(pos)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            entries.append((name, tuple(reversed(dims)), ggml_type, offset))
        alignment = int(self.metadata.get("general.alignment", 32))
        data_start = (pos + alignment - 1) // alignment * alignment

        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, ggml_type, offset in entries:
            if ggml_type not in GGML_QUANT_SIZES:
                raise ValueError(f"{self.path}: tensor {name} has unknown ggml type {ggml_type}")
            qtype = GGMLQuantizationType(ggml_type)
            block, type_size = GGML_QUANT_SIZES[qtype]
            n = int(np.prod(shape)) if shape else 1
            row = shape[-1] if shape else 1
            if row % block:
                raise ValueError(f"{self.path}: tensor {name} is {qtype.name} (blocks of {block}) "
                                 f"but its rows have {row} elements, not a multiple of {block}")
            nbytes = n // block * type_size
            if data_start + offset + nbytes > len(buf):
                raise ValueError(f"{self.path}: tensor {name} ({qtype.name} {list(shape)}) needs "
                                 f"{nbytes} bytes at offset {data_start + offset}, but the file "
                                 f"has {len(buf)} bytes")
            self.tensors[name] = TensorInfo(name, shape, ggml_type, data_start + offset, nbytes)

    def _string(self, pos: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", self._map, pos)
        return self._map[pos + 8:pos + 8 + n].decode("utf-8", errors="replace"), pos + 8 + n

    def _value(self, vtype: int, pos: int) -> tuple[Any, int]:
        if vtype in _SCALARS:
            fmt = _SCALARS[vtype]
            return struct.unpack_from(fmt, self._map, pos)[0], pos + struct.calcsize(fmt)
        if vtype == _STRING:
            return self._string(pos)
        if vtype == _ARRAY:
            etype, count = struct.unpack_from("<IQ", self._map, pos)
            pos += 12
            if etype in _NUMPY:
                arr = np.frombuffer(self._map, dtype=_NUMPY[etype], count=count, offset=pos)
                return arr.tolist(), pos + arr.nbytes
            values = []
            for _ in range(count):
                v, pos = self._value(etype, pos)
                values.append(v)
            return values, pos
        raise ValueError(f"{self.path}: unknown GGUF metadata value type {vtype} at byte {pos}")

    def type_name(self, name: str) -> str:
        """The ggml type of tensor ``name`` ("Q5_0")."""
        from gguf.constants import GGMLQuantizationType

        return GGMLQuantizationType(self.tensors[name].ggml_type).name

    def type_counts(self) -> dict[str, int]:
        """{ggml type name: number of tensors of that type}, in the order of ggml's ids."""
        from gguf.constants import GGMLQuantizationType

        counts = Counter(info.ggml_type for info in self.tensors.values())
        return {GGMLQuantizationType(i).name: counts[i] for i in sorted(counts)}

    def quantized(self, name: str) -> "QuantizedMatrix | None":
        """Matrix ``name`` kept in its quantized format (a copy of the file's blocks; F16 and
        BF16 as 16-bit values), or None when its type is not one of verispec's quantized
        kernels' (F32, other quantizations, F16 / BF16 rows not a multiple of 32: read
        those with ``tensor``)."""
        from verispec.models.layers.quantized import QUANT_FORMATS, QuantizedMatrix, quant_format_name

        if name not in self.tensors:
            raise KeyError(f"{self.path}: no tensor {name!r}")
        info = self.tensors[name]
        fmt = quant_format_name(info.ggml_type)
        # (F16 / BF16 rows are kept in runs of 32 values: another row length is converted)
        if fmt is None or len(info.shape) != 2 or info.shape[1] % QUANT_FORMATS[fmt][1]:
            return None
        raw = np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        data = torch.from_numpy(np.array(raw, copy=True)).view(info.shape[0], -1)
        return QuantizedMatrix.from_bytes(data, fmt, info.shape[1])

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor ``name`` dequantised to float32, in torch order ([rows, cols] for a matrix)."""
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize, quant_shape_to_byte_shape

        if name not in self.tensors:
            raise KeyError(f"{self.path}: no tensor {name!r}")
        info = self.tensors[name]
        qtype = GGMLQuantizationType(info.ggml_type)
        raw = np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        fast = dequantize_torch(raw, info.ggml_type)
        if fast is not None:
            return fast.reshape(info.shape)
        try:
            values = dequantize(raw.reshape(quant_shape_to_byte_shape(info.shape, qtype)), qtype)
        except NotImplementedError as e:
            raise ValueError(f"{self.path}: tensor {name} is {qtype.name}, which gguf cannot "
                             f"dequantise: {e}") from None
        return torch.from_numpy(np.array(values, dtype=np.float32, copy=True).reshape(info.shape))


def dequantize_torch(raw: np.ndarray, ggml_type: int) -> "torch.Tensor | None":
    """Flat float32 values of the common types, computed like gguf.quants (bit for bit) but
    several times faster; None for the other types (left to gguf.quants)."""
    b = torch.from_numpy(np.array(raw, copy=True))  # uint8 [nbytes], writable

    def scale(block: torch.Tensor, at: int) -> torch.Tensor:  # fp16 scale at byte `at`: [n, 1]
        return block[:, at:at + 2].contiguous().view(torch.float16).float()

    def nibbles(qs: torch.Tensor) -> torch.Tensor:  # 16 bytes -> low nibbles then high nibbles
        return torch.cat([qs & 0x0F, qs >> 4], dim=1)

    if ggml_type == 0:    # F32
        return b.view(torch.float32)
    if ggml_type == 1:    # F16
        return b.view(torch.float16).float()
    if ggml_type == 30:   # BF16
        return b.view(torch.bfloat16).float()
    if ggml_type == 8:    # Q8_0: d (f16), 32 x int8;  x = d * q
        blocks = b.view(-1, 34)
        return (blocks[:, 2:].contiguous().view(torch.int8).float() * scale(blocks, 0)).flatten()
    if ggml_type == 2:    # Q4_0: d (f16), 16 bytes of nibbles;  x = d * (q - 8)
        blocks = b.view(-1, 18)
        q = nibbles(blocks[:, 2:]).to(torch.int8) - 8
        return (scale(blocks, 0) * q.float()).flatten()
    if ggml_type == 3:    # Q4_1: d, m (f16), 16 bytes of nibbles;  x = d * q + m
        blocks = b.view(-1, 20)
        q = nibbles(blocks[:, 4:]).float()
        return (scale(blocks, 0) * q + scale(blocks, 2)).flatten()
    return None


_LAYER_TENSORS = {  # GGUF name in blk.N -> transformers name in model.layers.N
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                   "output": "lm_head"}
SUPPORTED_ARCHITECTURES = ("llama",)


def unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's convert_hf_to_gguf `permute` of Q/K rows: per head, the rows
    [r0, r1, r2, ...] interleave the two rotate-half halves; put them back as halves."""
    head_dim = w.shape[0] // n_heads
    return (w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2)
            .reshape(w.shape))


class LlamaGGUF(Mapping):
    """A Llama GGUF seen as a lazy transformers-named state dict plus its LlamaConfig."""

    def __init__(self, path: str | os.PathLike):
        self.file = GGUFFile(path)
        self.path = self.file.path
        self.config = self._config()
        self._names: dict[str, str] = {}  # transformers name -> GGUF name
        for gguf_name in self.file.tensors:
            stem, _, suffix = gguf_name.rpartition(".")
            parts = stem.split(".")
            if gguf_name == "rope_freqs.weight":
                continue
            if suffix == "weight" and len(parts) == 1 and parts[0] in _GLOBAL_TENSORS:
                self._names[f"{_GLOBAL_TENSORS[parts[0]]}.weight"] = gguf_name
            elif (suffix == "weight" and len(parts) == 3 and parts[0] == "blk"
                  and parts[2] in _LAYER_TENSORS):
                self._names[f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.weight"] = gguf_name
            else:
                raise ValueError(f"{self.path}: unsupported tensor {gguf_name!r} for a Llama model "
                                 f"(verispec supports RMSNorm/GQA/SwiGLU without biases or experts)")

    def _config(self) -> LlamaConfig:
        md, path = self.file.metadata, self.path
        arch = md.get("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"{path}: unsupported architecture {arch!r} "
                             f"(general.architecture); supported: {', '.join(SUPPORTED_ARCHITECTURES)}")

        def get(key: str, default: Any = None) -> Any:
            value = md.get(f"{arch}.{key}", default)
            if value is None:
                raise ValueError(f"{path}: missing GGUF metadata {arch}.{key}")
            return value

        hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
        head_dim = int(get("attention.key_length", hidden // heads))
        if int(get("attention.value_length", head_dim)) != head_dim:
            raise ValueError(f"{path}: {arch}.attention.value_length differs from key_length; "
                             f"unsupported")
        rope_dims = int(get("rope.dimension_count", head_dim))
        if rope_dims != head_dim:
            raise ValueError(f"{path}: partial rotary embedding ({arch}.rope.dimension_count = "
                             f"{rope_dims}, head_dim = {head_dim}) is not supported")
        scaling_type = md.get(f"{arch}.rope.scaling.type", "none")
        if scaling_type == "none":
            rope_scaling = None
        elif scaling_type == "linear":
            rope_scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
        else:
            raise ValueError(f"{path}: unsupported rope type {scaling_type!r} "
                             f"({arch}.rope.scaling.type); supported: none, linear, and "
                             f"llama3-style rope_freqs tensors")
        factors = None
        if "rope_freqs.weight" in self.file.tensors:
            factors = tuple(self.file.tensor("rope_freqs.weight").tolist())
        vocab = md.get(f"{arch}.vocab_size")
        if vocab is None:
            vocab = self.file.tensors["token_embd.weight"].shape[0]
        return LlamaConfig(
            vocab_size=int(vocab), hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_hidden_layers=int(get("block_count")), num_attention_heads=heads,
            num_key_value_heads=int(get("attention.head_count_kv", heads)), head_dim=head_dim,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            max_position_embeddings=int(get("context_length")),
            tie_word_embeddings="output.weight" not in self.file.tensors,
            rope_scaling=rope_scaling, rope_freq_factors=factors)

    def __getitem__(self, name: str) -> torch.Tensor:
        w = self.file.tensor(self._names[name])
        if name.endswith("self_attn.q_proj.weight"):
            return unpermute_rows(w, self.config.num_attention_heads)
        if name.endswith("self_attn.k_proj.weight"):
            return unpermute_rows(w, self.config.num_key_value_heads)
        return w

    def quantized(self, name: str) -> "QuantizedMatrix | None":
        """Tensor ``name`` (a transformers name) kept quantized, Q/K rows un-permuted as
        ``self[name]``; None when its format has no quantized kernel."""
        from verispec.models.layers.quantized import QuantizedMatrix, QuantPart

        q = self.file.quantized(self._names[name])
        heads = (self.config.num_attention_heads if name.endswith("self_attn.q_proj.weight")
                 else self.config.num_key_value_heads if name.endswith("self_attn.k_proj.weight")
                 else None)
        if q is None or heads is None:
            return q
        part = q.parts[0]
        return QuantizedMatrix([QuantPart(part.fmt, unpermute_rows(part.data, heads).contiguous())], q.k)

    def describe(self, name: str) -> str:
        """Tensor ``name`` (a transformers name) as the file names it, with its type:
        "blk.0.attn_q.weight (IQ2_XXS)"."""
        gguf_name = self._names[name]
        return f"{gguf_name} ({self.file.type_name(gguf_name)})"

    def type_counts(self) -> dict[str, int]:
        """The file's tensors per ggml type (GGUFFile.type_counts)."""
        return self.file.type_counts()

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)
