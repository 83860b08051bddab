"""A Llama-family decoder in PyTorch over verispec's paged KV cache.

RMSNorm, RoPE (default / linear / llama3 scaling, or llama.cpp's per-frequency factors),
grouped-query attention, SwiGLU MLP, tied or untied LM head; no biases. Weights use the
Hugging Face layout (rotate-half RoPE); loaders for GGUF files undo llama.cpp's Q/K row
permutation before they get here.

One forward over a PagedBatch, per layer::

    x  = embed[input_ids]                                   [T, hidden]
    q, k, v = rope(norm(x) @ Wqkv)                          [T, heads, head_dim]
    k_pool[slot_mapping], v_pool[slot_mapping] = k, v       (slot < 0: not written)
    row b, token t: attend to the row's cached keys 0..positions[t]
        (with batch.tree_mask: the keys cached before the row's new tokens, and the
        new tokens the mask lets it see; positions are then RoPE positions only)
    x += attn @ Wo;  x += (silu(norm(x) @ Wg) * (norm(x) @ Wu)) @ Wd

then logits = norm(x[logits_indices]) @ Wlm, in the model's dtype (like transformers).

Speed (decoding is a chain of few-row matmuls plus ~20 small ops per layer):
- float32 products of 1..128 rows on CPU (decode, verify and serving passes, prefill
  chunks) run in verispec's own kernel (``verispec.ops.linear``) on row-major matrices:
  it streams each weight row once for up to 8 rows, so a 1-token pass is ~1.4x faster
  than MKL's best layout on this project's CPU and a 6-token pass costs ~1.16x a 1-token
  pass (MKL: ~1.9x; bench/bench_linear.py), and a token's projections do not depend on
  how many tokens share the pass (plain decoding and verify passes round alike). Longer
  products (a long prompt at once), other dtypes and devices use torch.mm;
- float32 RMSNorm on CPU is one pass of verispec's (``_C._rms_norm_unchecked``): torch's
  is ~10 small ops, ~65 us a call in a decode loop, 61 calls a SmolLM2 token;
- every per-forward decision (slots to write, keys to read, mask) is taken once, not
  per layer; a row whose blocks are consecutive reads its keys as a slice of the pool;
- a row of few queries (decode, verify) attends with two small batched matmuls, which
  costs a third of an SDPA call at these sizes; long rows (prefill) use SDPA.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.nn.functional as F

from verispec import _C
from verispec.models.base import KVPools, KVWrite, ModelGeometry, PagedBatch, check_batch
from verispec.models.layers import batch_invariant as _bi
from verispec.models.layers import quantized as _quantized
from verispec.models.layers.attention import backend_class, resolve_backend, select_backend
from verispec.models.layers.graphs import GraphCache, GraphInputs
from verispec.models.layers.kernels import native_linear, native_rms_norm
from verispec.models.layers.layer_ops import (_BatchInvariantOps, _BucketLayerOps,
                                              _NativeLayerOps, _TorchLayerOps)
from verispec.models.layers.linear import (NATIVE_LINEAR_MAX_ROWS, NATIVE_LINEAR_MIN_ROWS,
                                           matmul_layout)
from verispec.models.layers.norm_rope import rms_norm, rope_inv_freq
from verispec.models.layers.quantized import QUANT_FORMATS, QuantizedMatrix

if TYPE_CHECKING:  # llama_tp builds on this module
    from verispec.models.llama_tp import TPShard

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class LlamaConfig:
    """The shape of a Llama-family model (names follow transformers' LlamaConfig)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # {"rope_type": "default" | "linear" | "llama3", ...} as in transformers, or None.
    rope_scaling: Optional[dict[str, Any]] = None
    # llama.cpp's rope_freqs tensor: inv_freq[i] is divided by rope_freq_factors[i].
    rope_freq_factors: Optional[tuple[float, ...]] = None

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"LlamaConfig: num_attention_heads ({self.num_attention_heads}) must be "
                             f"a multiple of num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig: head_dim must be even for RoPE, got {self.head_dim}")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"LlamaConfig: unsupported rope type {rope_type!r}; "
                             f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        if (self.rope_freq_factors is not None
                and len(self.rope_freq_factors) != self.head_dim // 2):
            raise ValueError(f"LlamaConfig: rope_freq_factors must have head_dim / 2 = "
                             f"{self.head_dim // 2} entries, got {len(self.rope_freq_factors)}")


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [hidden]
    wqkv: torch.Tensor       # [(heads + 2 * kv_heads) * head_dim, hidden]
    wo: torch.Tensor         # [hidden, heads * head_dim]
    mlp_norm: torch.Tensor   # [hidden]
    w_gate_up: torch.Tensor  # [2 * intermediate, hidden]
    w_down: torch.Tensor     # [hidden, intermediate]


@dataclass
class LlamaWeights:
    embed: torch.Tensor      # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor    # [vocab, hidden]; the embed tensor itself when tied
    #: A GGUF's tensors per ggml type ({"F32": 65, "Q5_0": 176, ...}); empty for other sources.
    file_types: dict[str, int] = field(default_factory=dict)
    #: A quantized load's matrices that were dequantized to float32 instead, as
    #: "blk.0.attn_q.weight (IQ2_XXS)": a type without a quantized kernel, or a piece fused
    #: (q|k|v, gate|up) with one.
    converted: tuple[str, ...] = ()

    @classmethod
    def from_state_dict(cls, config: LlamaConfig, state: Mapping[str, torch.Tensor], *,
                        device: torch.device | str = "cpu",
                        dtype: torch.dtype = torch.float32,
                        quantized: bool = False) -> "LlamaWeights":
        """Weights from transformers' LlamaForCausalLM names (``model.layers.0.self_attn.q_proj.weight``...).

        ``state`` may be lazy (any Mapping): each tensor is read once, converted, fused.
        ``quantized`` (CPU, float32 activations; ``state`` a LlamaGGUF): matrices stay in
        the file's formats as QuantizedMatrix where verispec has a kernel for them
        (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS, F16,
        BF16); a fused projection with a piece in any other format is dequantized to
        ``dtype``, and its pieces are listed in ``converted`` ("blk.0.attn_q.weight
        (IQ2_XXS)").
        """
        if quantized and (torch.device(device).type != "cpu" or dtype != torch.float32
                          or not hasattr(state, "quantized")):
            raise ValueError(f"LlamaWeights: quantized weights need a GGUF state on the CPU with "
                             f"dtype float32, got {type(state).__name__} on {device} in {dtype}")
        def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            if name not in state:
                raise KeyError(f"LlamaWeights: missing tensor {name!r} (expected shape {list(shape)})")
            t = state[name]
            if tuple(t.shape) != shape:
                raise ValueError(f"LlamaWeights: {name} must have shape {list(shape)}, "
                                 f"got {list(t.shape)}")
            return t.to(device=device, dtype=dtype)

        converted: list[str] = []

        def matrix(names: list[tuple[str, tuple[int, int]]]):
            """The rows of `names` fused: a QuantizedMatrix when each is quantized, else
            a float matrix in matmul_layout (a quantized load records its pieces as
            converted)."""
            if quantized:
                parts = [state.quantized(name) if name in state else None for name, _ in names]
                if all(p is not None for p in parts):
                    for p, (name, shape) in zip(parts, names):
                        if tuple(p.shape) != shape:
                            raise ValueError(f"LlamaWeights: {name} must have shape {list(shape)}, "
                                             f"got {list(p.shape)}")
                    # In the layout of the arithmetic's kernel, once (int8: packed).
                    m = parts[0] if len(parts) == 1 else QuantizedMatrix.cat(parts)
                    return m.for_arithmetic()
                converted.extend(state.describe(name) for name, _ in names if name in state)
            return matmul_layout(torch.cat([get(name, shape) for name, shape in names]))

        c = config
        h, q_dim = c.hidden_size, c.num_attention_heads * c.head_dim
        kv_dim = c.num_key_value_heads * c.head_dim
        layers = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            layers.append(LayerWeights(
                attn_norm=get(p + "input_layernorm.weight", (h,)),
                wqkv=matrix([(p + "self_attn.q_proj.weight", (q_dim, h)),
                             (p + "self_attn.k_proj.weight", (kv_dim, h)),
                             (p + "self_attn.v_proj.weight", (kv_dim, h))]),
                wo=matrix([(p + "self_attn.o_proj.weight", (h, q_dim))]),
                mlp_norm=get(p + "post_attention_layernorm.weight", (h,)),
                w_gate_up=matrix([(p + "mlp.gate_proj.weight", (c.intermediate_size, h)),
                                  (p + "mlp.up_proj.weight", (c.intermediate_size, h))]),
                w_down=matrix([(p + "mlp.down_proj.weight", (h, c.intermediate_size))]),
            ))
        # One tensor for embedding and head when tied: the head's layout wins (a lookup
        # of a few rows costs microseconds in either layout; the head's product is every
        # step). A quantized table is looked up by dequantizing the rows read.
        embed = matrix([("model.embed_tokens.weight", (c.vocab_size, h))])
        if c.tie_word_embeddings:
            lm_head = embed
        else:
            lm_head = matrix([("lm_head.weight", (c.vocab_size, h))])
        return cls(embed=embed, layers=layers, final_norm=get("model.norm.weight", (h,)),
                   lm_head=lm_head, converted=tuple(converted),
                   file_types=state.type_counts() if hasattr(state, "type_counts") else {})


def _matrix_ref(m: QuantizedMatrix) -> tuple:
    """A QuantizedMatrix as _C._QuantDecodeLayers reads it: (n, k, [(ggml type id, data
    pointer, rows, bytes per row, packed) per part])."""
    return (m.shape[0], m.k, [(QUANT_FORMATS[p.fmt][0], p.data.data_ptr(), p.rows,
                               p.data.stride(0), p.packed) for p in m.parts])


class LlamaModel:
    """A Llama-family model implementing verispec's Model protocol over paged KV pools.

    It writes the hidden states a drafter asks for (``KVPools.features``: the stream
    entering a layer, the final state before or after the final norm) on every path:
    the torch ops, verispec's CPU kernels, the fused quantized layers (run in spans
    between the taps), the batch-invariant mode, CUDA graphs and tensor parallelism
    (every rank holds the whole stream)."""

    #: Writes KVPools.features (verispec.drafters.Feature) for drafters that read them.
    writes_features = True

    def __init__(self, config: LlamaConfig, weights: LlamaWeights, *,
                 max_context: Optional[int] = None, shard: Optional["TPShard"] = None,
                 tp: Any = None, batch_invariant: bool = False):
        """``shard`` and ``tp`` together make a tensor-parallel rank: ``weights`` are then
        that rank's shard (``shard_weights``) and ``tp`` the collectives (an object with
        ``all_reduce(t)`` and ``gather_vocab(t, vocab_size)``, e.g.
        ``verispec.distributed.TensorParallel``); see ``verispec.distributed.shard``.

        ``batch_invariant``: every forward gives a token's logits the same bits whatever
        the number of tokens in the pass (1, a verify pass, a tree) and whatever other
        rows share it, so speculative greedy equals plain greedy bit for bit on any
        device (docs/design.md, "Batch-invariant mode"). A float32 CPU model keeps
        verispec's CPU kernels, which round a row alone at every size then (no torch.mm
        for long products, no SDPA for long rows); elsewhere (a GPU, other dtypes) the
        forward runs ``verispec.models.layers.batch_invariant``'s fixed-shape torch ops. Not
        with tensor parallelism (the all-reduce's algorithm follows the message size)."""
        if (shard is None) != (tp is None):
            raise ValueError(f"LlamaModel: shard and tp must be given together, got "
                             f"shard={shard!r}, tp={tp!r}")
        _bi.refuse_tp("LlamaModel", batch_invariant, tp)
        #: See __init__. Set ``batch_invariant_torch`` too to run the torch implementation
        #: where verispec's CPU kernels would (tests and comparisons on a CPU).
        self.batch_invariant = batch_invariant
        self.batch_invariant_torch = False
        self.config = config
        self.weights = weights
        self.shard = shard
        #: The collectives of a tensor-parallel rank (None: the whole model, one process).
        self.tp = tp
        dtype, device = weights.embed.dtype, weights.embed.device
        max_context = max_context or config.max_position_embeddings
        if shard is None:
            self._nh, self._nkv = config.num_attention_heads, config.num_key_value_heads
            self._inter = config.intermediate_size
        else:
            self._nh = shard.heads[1] - shard.heads[0]
            self._nkv = shard.kv_heads[1] - shard.kv_heads[0]
            self._inter = shard.intermediate[1] - shard.intermediate[0]
        # A rank's pools hold its own KV heads; the logits it returns are the whole
        # vocabulary's (gathered), so vocab_size is the model's.
        self.geometry = ModelGeometry(
            num_layers=len(weights.layers), num_kv_heads=self._nkv,
            head_dim=config.head_dim, vocab_size=config.vocab_size, max_context=max_context,
            dtype=dtype, device=device, hidden_size=config.hidden_size)
        # RoPE tables [max_context, head_dim], angles in float32 as transformers does, laid
        # out so that rope(x) = x * cos + swap_halves(x) * sin:
        # cos = [cos, cos], sin = [-sin, sin] (transformers: x * cos + rotate_half(x) * sin).
        angles = torch.arange(max_context, dtype=torch.float)[:, None] * rope_inv_freq(config)[None, :]
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        self._cos = torch.cat([cos, cos], dim=-1).to(device)
        self._sin = torch.cat([-sin, sin], dim=-1).to(device)
        self._attention_backend = "auto"
        #: The captured forwards (``layers.graphs.GraphCache``; on by default on a CUDA
        #: device, ``cuda_graphs`` turns them off). Off CUDA None unless a test installs a
        #: cache of ``layers.graphs.RecordedGraph``.
        self.graphs: Optional[GraphCache] = GraphCache(device) if device.type == "cuda" else None
        self._bind_weights()

    def _bind_weights(self) -> None:
        """Each layer's tensors in the order forward reads them ([out, in] matrices)."""
        w = self.weights
        self._layers = [(lw.attn_norm, lw.wqkv, lw.wo, lw.mlp_norm, lw.w_gate_up, lw.w_down)
                        for lw in w.layers]
        matrices = [m for lw in self._layers for m in (lw[1], lw[2], lw[4], lw[5])] + [w.lm_head]
        #: Whether some matrices are kept quantized (QuantizedMatrix: products always in
        #: verispec's quantized kernels, see QuantizedMatrix.linear).
        self.quantized = any(isinstance(m, QuantizedMatrix) for m in matrices + [w.embed])
        matrices = [m for m in matrices if not isinstance(m, QuantizedMatrix)]
        # verispec's kernel reads row-major or column-major float32 CPU matrices, and pays
        # off only with vector instructions (its portable fallback is slower than MKL).
        self._native_linear_ok = (
            self.geometry.device.type == "cpu" and self.geometry.dtype == torch.float32
            and _C.linear_best_isa() != "scalar"
            and all((m.stride(1) == 1 and m.stride(0) >= m.shape[1])
                    or (m.stride(0) == 1 and m.stride(1) >= m.shape[0]) for m in matrices))
        #: Use verispec's CPU linear kernel for forwards of at most NATIVE_LINEAR_MAX_ROWS
        #: tokens (when the model can: float32 on an x86 CPU with AVX2 or AVX-512). Set
        #: False to run every product through torch.mm (e.g. to compare).
        self.native_linear = self._native_linear_ok
        norms = [n for lw in self._layers for n in (lw[0], lw[3])] + [w.final_norm]
        self._native_norm_ok = (
            self.geometry.device.type == "cpu" and self.geometry.dtype == torch.float32
            and all(n.is_contiguous() for n in norms))
        #: RMSNorm in verispec's one-pass CPU kernel (float32 on CPU): torch's float32
        #: rms_norm is ~10 small ops. Set False to use torch's.
        self.native_norm = self._native_norm_ok
        #: A quantized model's decoder layers in one native call per forward (any number
        #: of tokens with the int8 arithmetic, at most KERNEL_MAX_ROWS with float; no row
        #: longer than KERNEL_MAX_QUERIES) (_C._QuantDecodeLayers: the same kernels, in the same
        #: order, as the layer loop with native_layer_ops, without ~10 Python calls a
        #: layer). Set False to run the loop.
        self._decode_layers = None
        self._decode_layer_refs: list = []
        qmats = [m for lw in self._layers for m in (lw[1], lw[2], lw[4], lw[5])]
        if self.shard is None and all(isinstance(m, QuantizedMatrix) and len(m.parts) <= 4
                                      for m in qmats):
            self._decode_layer_refs = [
                (an.data_ptr(), mn.data_ptr(), *(_matrix_ref(m) for m in (wqkv, wo, gu, wd)))
                for an, wqkv, wo, mn, gu, wd in self._layers]
            self._decode_layers = _C._QuantDecodeLayers(self._decode_layer_refs)
        # spans of the layers between feature taps, built when first asked for
        self._decode_spans: dict[tuple[int, int], Any] = {}
        self.native_decode_layers = self._decode_layers is not None
        #: The rest of a layer between the products (RoPE with the cache write, attention,
        #: residual adds with the norms, SwiGLU) in verispec's CPU kernels, three calls a
        #: layer (float32 on CPU, verispec/layers/decode_ops.h): a token attends bit for bit the
        #: same whatever shares its pass. Set False (or native_norm False) to use torch's
        #: ops.
        self.native_layer_ops = self._native_norm_ok

    @property
    def attention_backend(self) -> str:
        """How layers attend: "auto" (default: verispec's CPU kernels where
        ``native_layer_ops`` runs them, else FlashInfer on a CUDA device where it
        imports, else SDPA), "native" (as "auto", on a float32 CPU model only), "sdpa"
        (the torch path, ``layers.attention.TorchAttention``) or "flashinfer" (a CUDA
        device with the flashinfer package); ValueError naming the backend where it
        cannot run (``layers.attention.select_backend``)."""
        return self._attention_backend

    @attention_backend.setter
    def attention_backend(self, name: str) -> None:
        select_backend(name, self.geometry.device, self.geometry.dtype,
                       who="LlamaModel.attention_backend")
        self._attention_backend = name

    @property
    def cuda_graphs(self) -> bool:
        """Whether decode and verify forwards that fit a bucket (``layers.graphs``: up to
        MAX_ROWS rows of up to MAX_QUERIES new tokens) replay CUDA graphs, each checked
        bit for bit against an eager run before it is trusted. On by default on a CUDA
        device (off with tensor parallelism, quantized matrices and the batch-invariant
        mode, which run eagerly); set False to run every forward eagerly."""
        return self.graphs is not None and self.graphs.enabled

    @cuda_graphs.setter
    def cuda_graphs(self, on: bool) -> None:
        if on and self.graphs is None:
            if self.geometry.device.type != "cuda":
                raise ValueError(f"LlamaModel.cuda_graphs: CUDA graphs need a CUDA device, "
                                 f"got {self.geometry.device}")
            self.graphs = GraphCache(self.geometry.device)
        if self.graphs is not None:
            self.graphs.enabled = bool(on)
            if not on:
                self.graphs.clear()

    def _backend_class(self, batch: Optional[PagedBatch]) -> type:
        """This forward's attention backend (``layers.attention.resolve_backend``): the
        native one where verispec's CPU kernels run it (``_native_ops_ok``; None: a
        forward that does not run them), else what ``attention_backend`` resolves to."""
        g = self.geometry
        return backend_class(resolve_backend(
            self._attention_backend, g.device, g.dtype,
            native=batch is not None and self._native_ops_ok(batch),
            who="LlamaModel.attention_backend"))

    def _attention(self, cls: type) -> Any:
        """A backend of class ``cls`` for one forward, with LlamaModel's rounding of the
        torch path (``TorchAttention(sdpa_groups=True)``)."""
        return cls(sdpa_groups=True, batch_invariant=self.batch_invariant)

    @property
    def num_layers(self) -> int:
        return self.geometry.num_layers

    def early_exit(self, num_layers: int) -> "LlamaModel":
        """The first ``num_layers`` layers + final norm + LM head, sharing this model's tensors.

        A self-speculation draft: it has its own geometry (so its own KV pools) but no
        weights of its own.
        """
        if not 1 <= num_layers <= self.num_layers:
            raise ValueError(f"early_exit: num_layers must be in [1, {self.num_layers}], "
                             f"got {num_layers}")
        draft = LlamaModel.__new__(LlamaModel)
        draft.config = replace(self.config, num_hidden_layers=num_layers)
        draft.weights = replace(self.weights, layers=self.weights.layers[:num_layers])
        draft.geometry = replace(self.geometry, num_layers=num_layers)
        draft.shard, draft.tp = self.shard, self.tp
        draft._nh, draft._nkv, draft._inter = self._nh, self._nkv, self._inter
        draft._cos, draft._sin = self._cos, self._sin  # share the RoPE tables too
        draft._bind_weights()
        draft.native_linear = self.native_linear and draft._native_linear_ok
        draft.native_norm = self.native_norm and draft._native_norm_ok
        draft.native_layer_ops = self.native_layer_ops and draft._native_norm_ok
        draft.native_decode_layers = self.native_decode_layers and draft._decode_layers is not None
        draft.batch_invariant = self.batch_invariant
        draft.batch_invariant_torch = self.batch_invariant_torch
        draft._attention_backend = self._attention_backend
        # its own graphs: its pools and layers are its own
        draft.graphs = None
        if self.graphs is not None:
            draft.graphs = GraphCache(self.graphs.device, graph=self.graphs.graph_type)
            draft.graphs.enabled = self.graphs.enabled
        return draft

    def __call__(self, batch: PagedBatch) -> torch.Tensor:
        return self.forward(batch)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings [T, hidden] of ids [T] (a quantized table: the rows read,
        dequantized), as the forward looks them up."""
        e = self.weights.embed
        ids = ids.to(self.geometry.device)
        return e.dequantize(ids) if isinstance(e, QuantizedMatrix) else F.embedding(ids, e)

    @torch.inference_mode()
    def forward(self, batch: PagedBatch) -> torch.Tensor:
        """Logits [R, vocab] (model dtype) of the tokens ``batch.logits_indices``.

        Runs under torch.inference_mode(), so the logits are inference tensors: read them
        anywhere, but modify them in place only inside inference_mode (or clone first).
        """
        self._check(batch)
        c, w, g = self.config, self.weights, self.geometry
        reduce = self.tp.all_reduce if self.tp is not None else (lambda t: t)
        device = g.device
        ids = batch.input_ids.to(device)
        positions = batch.positions.to(device=device, dtype=torch.long)
        num_tokens = ids.shape[0]

        ctx_max = int(batch.host_tensor("context_lens").max())
        if ctx_max > g.max_context:
            raise ValueError(f"LlamaModel.forward: context_lens must be <= max_context = "
                             f"{g.max_context}, got {ctx_max}")
        attention = self._backend_class(batch)
        if self._graph_ok(batch, attention):
            kv = batch.kv
            logits = self.graphs.forward(batch, lambda inputs: self._bucket_forward(inputs, kv),
                                         -(-g.max_context // kv.block_size))
            if logits is not None:
                return logits
        # the hidden states a drafter asked for (KVPools.features), written at the tokens'
        # slots as the K/V are; none asked: no tap, no extra work
        tap = self._feature_tap(batch) if batch.kv.features else None
        bi_torch = self._batch_invariant_torch(batch, attention)
        if bi_torch:
            ops = _BatchInvariantOps(self, batch, num_tokens, positions)
        else:
            layer_ops = _NativeLayerOps if attention.layer_kernels else _TorchLayerOps
            ops = layer_ops(self, batch, num_tokens, positions, self._attention(attention))
        linear = self._batch_invariant_linear() if bi_torch else self._linear(num_tokens)
        x = (w.embed.dequantize(ids) if isinstance(w.embed, QuantizedMatrix)
             else F.embedding(ids, w.embed))
        if tap is not None:
            tap(0, x)
        if (type(ops) is _NativeLayerOps and self.native_decode_layers
                and self._decode_layers is not None and not ops.long_rows
                and _quantized.on_kernel(num_tokens)):
            self._run_decode_layers(ops, x, batch.kv, tap)
            layers, h = [], None
        else:
            h = ops.norm(x, self._layers[0][0])
            layers = self._layers
        x = self._layer_loop(ops, linear, x, h, layers, batch.kv, reduce, tap)
        normed_key = self.geometry.num_layers + 1
        if tap is not None and normed_key in batch.kv.features:
            # every token's normed state (rows are normed alone: the logits rows' bits
            # are those of norming them only)
            normed = ops.norm(x, w.final_norm)
            tap(normed_key, normed)
            logits = linear(normed[batch.logits_indices.to(device)], w.lm_head)
        else:
            x = x[batch.logits_indices.to(device)]
            logits = linear(ops.norm(x, w.final_norm), w.lm_head)
        if self.tp is not None:  # this rank's vocabulary slice -> every rank all of it
            logits = self.tp.gather_vocab(logits, c.vocab_size)
        return logits

    def _feature_tap(self, batch: PagedBatch):
        """tap(key, x): stream ``key``'s states x [T, hidden] of this forward's tokens into
        the feature pool a drafter asked for (KVPools.features), at the tokens' slots."""
        write = KVWrite(batch.host_tensor("slot_mapping"), self.geometry.device, batch.staging)
        kv = batch.kv
        return lambda key, x: kv.write_features(write, key, x)

    def _run_decode_layers(self, ops: Any, x: torch.Tensor, kv: Any, tap: Any) -> None:
        """Every decoder layer of a quantized model in native calls: one, or one per span
        between the feature taps asked for (the same kernels in the same order: the
        stream entering layer b is x after the span ending at b)."""
        n = self.geometry.num_layers
        cuts = sorted(key for key in kv.features if 0 < key < n) if tap is not None else []
        if not cuts:
            ops.run_layers(self._decode_layers, x, kv, self._inter)
        else:
            bounds = [0, *cuts, n]
            for a, b in zip(bounds, bounds[1:]):
                span = self._decode_spans.get((a, b))
                if span is None:
                    span = self._decode_spans[(a, b)] = _C._QuantDecodeLayers(
                        self._decode_layer_refs[a:b])
                ops.run_layers(span, x, KVPools(k=kv.k[a:b], v=kv.v[a:b],
                                                block_size=kv.block_size), self._inter)
                if b < n:
                    tap(b, x)
        if tap is not None:
            tap(n, x)

    def _layer_loop(self, ops: Any, linear: Any, x: torch.Tensor, h: Optional[torch.Tensor],
                    layers: list, kv: Any, reduce: Any, tap: Any = None) -> torch.Tensor:
        """The decoder layers over x (h: x normed for the first layer); returns x. ``tap``
        (see _feature_tap): called with (i + 1, x) after layer i."""
        inter = self._inter
        last = len(self._layers) - 1
        for i, ((_, wqkv, wo, mlp_norm, w_gate_up, w_down), k_pool, v_pool) in enumerate(zip(
                layers, kv.k, kv.v)):
            q = ops.rope_write(linear(h, wqkv), k_pool, v_pool)             # [T, nh, hd]
            attn = ops.attend(q, k_pool, v_pool)                            # [T, nh * hd]
            # residual adds after the product (not addmm, which rounds differently)
            # (tensor parallel: each rank's partial product, summed over the ranks)
            x, h = ops.add_norm(x, reduce(linear(attn, wo)), mlp_norm)
            x, h = ops.add_norm(x, reduce(linear(ops.silu_mul(linear(h, w_gate_up), inter),
                                                 w_down)),
                                None if i == last else self._layers[i + 1][0])
            if tap is not None:
                tap(i + 1, x)
        return x

    def _graph_ok(self, batch: PagedBatch, attention: type) -> bool:
        """Whether this forward may run captured (``layers.graphs``): graphs on, the torch
        ops path (not verispec's CPU kernels, not the batch-invariant mode), dense
        weights, one process. The bucket attends through the backend's ``attend_static``
        where it is ``capturable``, else through SDPA's (``_static_backend``)."""
        return (self.graphs is not None and self.graphs.enabled and self.tp is None
                and not self.quantized and not self.batch_invariant
                and not attention.layer_kernels)

    def _static_backend(self) -> type:
        """The backend a captured bucket attends with: the chosen one where a graph can
        capture it, else SDPA's static path (FlashInfer: its own CUDA-graph mode is not
        wired into layers.graphs yet, so captured forwards keep the torch attention they
        had before the backends shared one interface)."""
        cls = self._backend_class(None)
        return cls if cls.capturable else backend_class("sdpa")

    def _bucket_forward(self, inputs: GraphInputs, kv: Any) -> torch.Tensor:
        """The logits of every token of a bucket's forward from its static inputs (the
        body a graph captures): the layers of ``forward`` at fixed shapes."""
        w = self.weights
        # the backend _graph_ok found capturable (these forwards run no CPU kernels)
        ops = _BucketLayerOps(self, inputs, self._attention(self._static_backend()))
        linear = self._linear(inputs.bucket.tokens)
        # feature taps write through the bucket's static slots (padding writes nowhere)
        tap = ((lambda key, t: kv.write_features(inputs.write, key, t)) if kv.features
               else None)
        x = F.embedding(inputs.ids, w.embed)
        if tap is not None:
            tap(0, x)
        x = self._layer_loop(ops, linear, x, ops.norm(x, self._layers[0][0]), self._layers,
                             kv, lambda t: t, tap)
        normed = ops.norm(x, w.final_norm)
        if tap is not None:
            tap(self.geometry.num_layers + 1, normed)
        return linear(normed, w.lm_head)

    def _batch_invariant_torch(self, batch: PagedBatch, attention: Optional[type] = None
                               ) -> bool:
        """Whether this forward runs _BatchInvariantOps and batch_invariant.linear: the
        batch-invariant mode where verispec's CPU kernels do not run every step (a GPU,
        a dtype other than float32, a CPU without their vector instructions) or when
        ``batch_invariant_torch`` asks for it."""
        if not self.batch_invariant:
            return False
        attention = attention or self._backend_class(batch)
        return (self.batch_invariant_torch or not attention.layer_kernels
                or not (self.native_linear and self._native_linear_ok))

    def _batch_invariant_linear(self):
        """Products of the torch batch-invariant mode: dense matrices in fixed
        (ROWS, in) x (in, out) GEMMs; a QuantizedMatrix in verispec's kernels, which
        round a row alone (in chunks of at most KERNEL_MAX_ROWS rows: past that the float
        arithmetic would dequantize tiles into torch.mm)."""
        threads = torch.get_num_threads()

        def linear(x: torch.Tensor, w) -> torch.Tensor:
            if isinstance(w, QuantizedMatrix):
                x = x if x.is_contiguous() else x.contiguous()
                step = _quantized.KERNEL_MAX_ROWS
                return torch.cat([w.linear(x[i:i + step], threads)
                                  for i in range(0, x.shape[0], step)])
            return _bi.linear(x, w)
        return linear

    def _linear(self, num_tokens: int):
        """x [T, in] @ w[out, in]^T for this forward: verispec's kernel or torch.mm (a
        QuantizedMatrix: its own products, QuantizedMatrix.linear). In the batch-invariant
        mode on verispec's kernels, a product of more rows than they take at once runs
        in chunks of them (a row rounds alike in any chunk)."""
        dense = self._dense_linear(num_tokens)
        if not self.quantized:
            return dense
        threads = torch.get_num_threads()
        step = (_quantized.KERNEL_MAX_ROWS if self.batch_invariant and not _quantized.on_kernel(num_tokens)
                else num_tokens)

        def linear(x: torch.Tensor, w) -> torch.Tensor:
            if isinstance(w, QuantizedMatrix):
                x = x if x.is_contiguous() else x.contiguous()
                if step >= x.shape[0]:
                    return w.linear(x, threads)
                return torch.cat([w.linear(x[i:i + step], threads)
                                  for i in range(0, x.shape[0], step)])
            return dense(x, w)
        return linear

    def _dense_linear(self, num_tokens: int):
        if (self.batch_invariant and self.native_linear and self._native_linear_ok
                and num_tokens > NATIVE_LINEAR_MAX_ROWS):
            threads = torch.get_num_threads()
            step = NATIVE_LINEAR_MAX_ROWS

            def chunked(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
                x = x if x.is_contiguous() else x.contiguous()
                return torch.cat([native_linear(x[i:i + step], w, threads)
                                  for i in range(0, x.shape[0], step)])
            return chunked
        if (self.native_linear and self._native_linear_ok
                and NATIVE_LINEAR_MIN_ROWS <= num_tokens <= NATIVE_LINEAR_MAX_ROWS):
            threads = torch.get_num_threads()

            def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
                # x: a float32 CPU activation made in this forward; w: in one of
                # matmul_layout's layouts, checked at bind time
                return native_linear(x if x.is_contiguous() else x.contiguous(), w, threads)
            return linear
        return lambda x, w: torch.mm(x, w.t())

    def _norm_fn(self):
        """RMSNorm for this forward: verispec's one-pass kernel or torch's ops."""
        if not (self.native_norm and self._native_norm_ok):
            return self._norm
        eps = self.config.rms_norm_eps

        def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            # x: a float32 CPU activation made in this forward; weight: checked at bind time
            return native_rms_norm(x if x.is_contiguous() else x.contiguous(), weight, eps)
        return norm

    def _native_ops_ok(self, batch: PagedBatch) -> bool:
        """Whether this forward can run RoPE, the cache write, attention, the residual
        norms and SwiGLU in verispec's CPU kernels (_NativeLayerOps, with the native
        attention backend where ``attention_backend`` resolves to it): a float32 CPU
        model with its switches on, whose pools are contiguous."""
        return (self.native_layer_ops and self.native_norm and self._native_norm_ok
                and all(p.is_contiguous() for p in (batch.kv.k[0], batch.kv.v[0])))

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # torch's fused kernel; in float32 it rounds exactly as transformers' RMSNorm
            return F.rms_norm(x, weight.shape, weight, self.config.rms_norm_eps)
        return rms_norm(x, weight, self.config.rms_norm_eps)

    def _check(self, batch: PagedBatch) -> None:
        check_batch(batch, self.geometry, "LlamaModel.forward")
