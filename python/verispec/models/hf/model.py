"""HFModel: any transformers causal LM as a verispec model, on verispec's paged KV pools.

    import transformers, verispec
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    target = verispec.models.HFModel(hf)                     # Qwen, Mistral, Gemma, Phi, ...
    dec = verispec.SpecDecoder(target, verispec.drafters.NGram(), k="auto")

How: transformers computes attention through a registry of attention functions
(``transformers.AttentionInterface``). HFModel registers one function,
``ATTN_IMPLEMENTATION``, selects it on the wrapped model, and calls the model with
explicit ``position_ids``, ``use_cache=False`` (no transformers cache, no mask built by
transformers) and ``logits_to_keep`` (the LM head runs on the rows verify needs; the
model's own final softcap / logit scaling stays); the forward's plan reaches the function
through a context variable (so layers that do not pass keyword arguments down work too).
Per layer the function writes the new tokens' K/V into the layer's pools at the
batch's slot mapping and attends each row's queries over the row's context through
its block table, applying what the module passes: ``scaling``, ``sliding_window`` (per
layer), ``softcap``, attention sinks (``s_aux``), and the batch's tree mask.

No per-architecture code: the cache geometry (K/V heads, K and V head sizes per layer)
is probed with one recording forward at construction, which also proves the function is
really called by every layer. Refused at construction, with the reason: models whose
attention does not go through the interface, layers that compute their own attention
mask and pass it to the function (it masks by position, window and tree only), a
config window that no layer passes down or keeps (unless max_context fits in it), hybrids
whose other layers keep state of their own (recurrent, convolution, a sparse-attention
indexer's keys: that state would need its own cache and rollback), bidirectional
(encoder) models, encoder-decoders, chunked attention (applied by transformers' mask,
not passed down), and models whose forward fails without the mask transformers builds
for its own attention (ALiBi Falcon adds its position bias to it).

Tensor parallelism: ``HFModel(hf_model, tp=tp)`` cuts the model in place along its
config's ``base_model_tp_plan`` (``verispec.models.hf.tp``), one rank of a group.

The wrapped model keeps working for transformers' own generate only after
``set_attn_implementation("sdpa")`` (HFModel selected its function on it).
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any, Optional

import torch

from verispec.models.base import ModelGeometry, PagedBatch, check_batch, feature_name
from verispec.models.hf import capture as hf_capture
from verispec.models.hf import features as hf_features
from verispec.models.hf import tp as hf_tp
# The attention function, the probe and the forward's plan (hf.attention); the module
# patching (hf.patch). Their names tests and tools read are importable from here too.
from verispec.models.hf.attention import (_CONTEXT, ATTN_IMPLEMENTATION, _LayerRecord,  # noqa: F401
                                          _Plan, _Probe, register_attention)
from verispec.models.hf.attention import refuse as _refuse
from verispec.models.hf.patch import (_batch_invariant_problems, _computes_rotate_half_rope,  # noqa: F401
                                      _CpuKernels, _install_batch_invariant,
                                      _install_cpu_kernels, _is_plain_rms_norm, _norm_forward,
                                      _uninstall_cpu_kernels)
from verispec.models.layers import batch_invariant as _bi
from verispec.models.layers.attention import (AttentionBackend, make_backend, resolve_backend,
                                              select_backend)
from verispec.models.layers.paged import KERNEL_MAX_QUERIES, SMALL_ROW_QUERIES  # noqa: F401

__all__ = ["ATTN_IMPLEMENTATION", "HFModel"]

# Layer types (config.layer_types) that are plain attention over the KV cache.
_ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "attention", "global", "local")
# The check of a tensor-parallel cut (HFModel._shard): logits of this many tokens before
# and after, within this fraction of their largest (rounding only; a wrong cut misses by
# O(1)), by dtype (None: any other).
SHARD_CHECK_TOKENS = 6
SHARD_CHECK_RTOL = {torch.float64: 1e-6, torch.float32: 1e-4, None: 3e-2}


def _shallow_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A new module object sharing every parameter, buffer and child with ``module``, whose
    children can be replaced without touching the original."""
    clone = copy.copy(module)
    clone._modules = dict(module._modules)
    return clone


def _refuse_config(hf_model: Any, config: Any, text: Any) -> set:
    """Refuse (``refuse``'s TypeError) what the config alone shows HFModel cannot run: an
    encoder-decoder, chunked attention, a hybrid's non-attention layers. Returns the
    config's layer types."""
    if getattr(config, "is_encoder_decoder", False):
        raise _refuse(hf_model, "it is an encoder-decoder model; verispec runs decoder-only "
                                "causal LMs")
    layer_types = set(getattr(text, "layer_types", None) or [])
    if getattr(text, "attention_chunk_size", None) or "chunked_attention" in layer_types:
        raise _refuse(hf_model, "chunked attention (attention_chunk_size) is applied by "
                                "transformers' mask, not passed to the attention function")
    other = sorted(t for t in layer_types if t not in _ATTENTION_LAYER_TYPES)
    if other:
        raise _refuse(hf_model, f"a hybrid: its layer types {other} are not plain "
                                f"attention over the KV cache; they keep state of their own "
                                f"(recurrent, convolution, or a sparse-attention indexer's "
                                f"keys) outside verispec's pools, which would need its own "
                                f"cache and rollback on rejected drafts")
    return layer_types


def _refuse_probe(hf_model: Any, text: Any, layer_types: set, probe: _Probe,
                  logits: torch.Tensor, max_context: Any) -> None:
    """Refuse what the recording forward (``HFModel._probe``) shows HFModel cannot run: layers
    that never call the attention function or call it twice, fewer or more attention layers
    than the config counts, layers with their own mask, a config window no layer passes
    down, bidirectional attention, and a forward that ignores ``logits_to_keep``."""
    layers = probe.layers
    num_layers = getattr(text, "num_hidden_layers", None)
    if not layers:
        raise _refuse(hf_model, "its layers never called the attention function "
                                "(attention does not go through transformers' "
                                "AttentionInterface)")
    if len({id(r.module) for r in layers}) != len(layers):
        raise _refuse(hf_model, "one attention module is called more than once per "
                                "forward")
    if num_layers is not None and len(layers) < num_layers:
        raise _refuse(hf_model, f"only {len(layers)} of its {num_layers} layers call the "
                                f"attention function; the others (recurrent, convolution "
                                f"or custom attention) keep state verispec cannot roll "
                                f"back")
    if num_layers is not None and len(layers) > num_layers:
        raise _refuse(hf_model, f"{len(layers)} attention modules called the attention "
                                f"function, but its config has num_hidden_layers = "
                                f"{num_layers} (a decoder whose layers the config does "
                                f"not count, as an encoder-decoder family's causal LM)")
    if probe.mask is not None:
        raise _refuse(hf_model, f"its attention layers compute their own attention "
                                f"mask ({probe.mask}), which verispec's paged "
                                f"attention does not apply (it masks by position, "
                                f"sliding window and tree)")
    window = getattr(text, "sliding_window", None)
    limit = (max_context if isinstance(max_context, int)
             and not isinstance(max_context, bool)
             else getattr(text, "max_position_embeddings", None))
    if (isinstance(window, int) and not isinstance(window, bool) and window > 0
            and (not isinstance(limit, int) or window < limit)
            and "sliding_attention" in (layer_types or {"sliding_attention"})
            and not any(r.window for r in layers)):
        raise _refuse(hf_model, f"its config sets sliding_window = {window}, which "
                                f"transformers applies through its attention mask, but "
                                f"no layer passes a window to the attention function; "
                                f"pass max_context <= {window} to run it without one")
    if not all(r.causal for r in layers):
        raise _refuse(hf_model, "its attention is bidirectional (an encoder); verispec "
                                "runs causal LMs")
    if logits.dim() != 3 or logits.shape[:2] != (1, 1):
        raise _refuse(hf_model, f"its forward ignored logits_to_keep (logits "
                                f"{list(logits.shape)} for one kept row)")


def _make_batch_invariant(hf_model: Any, probe: Any) -> None:
    """Install the batch-invariant modules on ``hf_model``; refused (and uninstalled) where
    the recording forward ``probe`` shows it computing what torch may round by the pass's
    shape outside them."""
    _install_batch_invariant(hf_model)
    problems = _batch_invariant_problems(probe)
    if problems:
        _uninstall_cpu_kernels(hf_model)
        shown = ", ".join(problems[:6]) + (", ..." if len(problems) > 6 else "")
        raise _refuse(hf_model, f"batch_invariant=True: its forward computes {shown} outside "
                                f"its nn.Linear layers, row-wise norms and attention; torch "
                                f"may round such an op's result for a token by how many "
                                f"tokens share the pass (a float reduction or product whose "
                                f"kernel follows the shape, e.g. a mixture-of-experts "
                                f"router's softmax and top-k)")


class HFModel:
    """A transformers ``*ForCausalLM`` (any dtype, any device) as a verispec model.

    It writes the hidden states a drafter asks for (``KVPools.features``: the stream
    entering a decoder layer, the last layer's output, the final norm's output) on every
    path (eager, captured programs, the CPU kernels, the batch-invariant mode, tensor
    parallelism), from taps on the model's decoder layers and final norm
    (``verispec.models.hf.features``); ValueError naming the model type and the stream
    where the model shows no such layers or norm.

    ``max_context`` caps the context (default: the config's ``max_position_embeddings``).
    ``tokenizer`` (optional: a transformers tokenizer or verispec's Tokenizer) records the
    vocabulary, so SpecDecoder can refuse a draft with a different tokenizer.
    ``cpu_kernels`` (float32 models on an x86 CPU with AVX2 or AVX-512): run the model's
    ``nn.Linear`` layers of verify passes and its plain RMSNorm modules on verispec's CPU
    kernels, and store its weight matrices in the layout those read fastest
    (``verispec.models.layers.linear.matmul_layout``; same values). This sets
    instance-level ``forward`` methods on those modules of ``hf_model``, and gives its own
    module classes below the top level same-named subclasses called straight through
    ``forward`` while no hooks are registered (``_install_fast_calls``). Where the
    model's modeling module defines an ``apply_rotary_pos_emb`` that computes
    rotate-half RoPE bit for bit as verispec's kernel does (checked on random inputs),
    that name in the module's namespace is bound to a dispatcher running the kernel
    inside this model's forwards (``native_rope``) and the original function anywhere
    else, so unwrapped models of the same class compute exactly what they did.
    ``tp`` (a ``verispec.distributed.TensorParallel``): make this model one rank of a
    tensor-parallel group by cutting ``hf_model``'s modules in place along its config's
    ``base_model_tp_plan`` (``verispec.models.hf.tp``; every rank must pass the same model);
    ``geometry`` then reports this rank's KV heads. ``verispec.distributed.shard`` does it
    for a wrapped model.
    ``capture`` (default True): run decode and verify forwards as captured programs
    (``HFModel.capture``, ``verispec.models.hf.capture``); off for tensor parallelism and
    for a model compiled with ``torch.compile``.
    ``batch_invariant``: every forward gives a token's logits the same bits whatever the
    number of tokens in its pass and whatever shares it (docs/design.md, "Batch-invariant
    mode"), on any device: the model's ``nn.Linear`` layers and its row-wise norm modules
    run on fixed chunks of rows and every layer attends in
    ``verispec.models.layers.batch_invariant.attention`` (windows, softcaps, sinks and trees as
    the paged attention honours them); ``cpu_kernels`` and ``capture`` are then off.
    Refused (ValueError naming the ops and modules) where one recording forward shows
    the model computing anything else that torch may round by the pass's shape, e.g. a
    mixture-of-experts router's softmax and top-k or expert products outside
    ``nn.Linear``; and with ``tp``.
    """

    #: Writes KVPools.features (verispec.drafters.Feature) for drafters that read them.
    writes_features = True

    def __init__(self, hf_model: Any, *, max_context: Optional[int] = None,
                 tokenizer: Any = None, cpu_kernels: bool = True, tp: Any = None,
                 capture: bool = True, batch_invariant: bool = False) -> None:
        if not isinstance(hf_model, torch.nn.Module) or not hasattr(hf_model, "config"):
            raise TypeError(f"HFModel: hf_model must be a loaded transformers model "
                            f"(*ForCausalLM), got {type(hf_model).__name__}")
        _bi.refuse_tp("HFModel", batch_invariant, tp)
        #: See the class docstring (fixed at construction).
        self.batch_invariant = batch_invariant
        register_attention()
        _uninstall_cpu_kernels(hf_model)  # wrapped before: start from the modules' own code
        config = hf_model.config
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        layer_types = _refuse_config(hf_model, config, text)
        params = [p for p in hf_model.parameters() if p.is_floating_point()]
        if not params:
            raise TypeError(f"HFModel: {type(hf_model).__name__} has no floating-point weights")
        dtype, device = params[0].dtype, params[0].device
        previous = getattr(config, "_attn_implementation", None)
        was_training = hf_model.training
        hf_model.eval()
        try:
            try:
                hf_model.set_attn_implementation(ATTN_IMPLEMENTATION)
            except Exception as e:  # noqa: BLE001 - transformers raises several kinds
                raise _refuse(hf_model, f"transformers would not select the attention function "
                                        f"{ATTN_IMPLEMENTATION!r}: {e}") from e
            if getattr(config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
                raise _refuse(hf_model, "its attention does not go through transformers' "
                                        "AttentionInterface")
            self.model = hf_model
            self._captures = None
            try:
                probe, logits = self._probe(device)
            except Exception as e:  # noqa: BLE001 - whatever the model's own code raises
                # A forward that needs what transformers builds for its own attention (a
                # mask it adds a position bias to, as ALiBi Falcon's) fails here: refused
                # with its error, not raised from deep inside the model's code.
                raise _refuse(hf_model, f"its forward fails with the attention function "
                                        f"{ATTN_IMPLEMENTATION!r} selected (transformers "
                                        f"builds no attention mask for it): "
                                        f"{type(e).__name__}: {e}") from e
            layers = probe.layers
            _refuse_probe(hf_model, text, layer_types, probe, logits, max_context)
            if tp is not None:
                self._shard(tp, layers, int(logits.shape[-1]), device)
                probe, logits = self._probe(device)  # this rank's heads
                layers = probe.layers
            if batch_invariant:
                _make_batch_invariant(hf_model, lambda: self._probe(device))
        except BaseException:
            hf_model.train(was_training)
            if previous is not None and previous != ATTN_IMPLEMENTATION:
                try:
                    hf_model.set_attn_implementation(previous)
                except Exception:  # noqa: BLE001 - best effort: the refusal is what matters
                    pass
            raise
        if max_context is None:
            max_context = getattr(text, "max_position_embeddings", None)
            if not max_context:
                raise ValueError(f"HFModel: {type(hf_model).__name__}'s config has no "
                                 f"max_position_embeddings; pass max_context")
        if isinstance(max_context, bool) or not isinstance(max_context, int) or max_context < 1:
            raise ValueError(f"HFModel: max_context must be a positive int, got {max_context!r}")
        self.layers = layers
        self.tp = tp
        self._pool_of = {id(r.module): i for i, r in enumerate(layers)}
        shapes = tuple((r.num_kv_heads, r.k_head_dim, r.v_head_dim) for r in layers)
        uniform = len(set(shapes)) == 1 and shapes[0][1] == shapes[0][2]
        self.geometry = ModelGeometry(
            num_layers=len(layers), num_kv_heads=shapes[0][0], head_dim=shapes[0][1],
            vocab_size=int(logits.shape[-1]), max_context=int(max_context), dtype=dtype,
            device=device, layer_kv=None if uniform else shapes)
        self.model_type = getattr(text, "model_type", type(hf_model).__name__)
        from verispec import _C

        #: Layers without softcapping or sinks attend in verispec's paged CPU kernel unless
        #: a forward holds a chain row of more than KERNEL_MAX_QUERIES new tokens (float32
        #: CPU models): a token attends bit for bit the same whatever shares its pass and
        #: however its prompt was chunked. Set False to use the padded torch paths.
        self.native_attention = (device.type == "cpu" and dtype == torch.float32
                                 and not batch_invariant)
        self._kernels: Optional[_CpuKernels] = None
        self._attention_backend = "auto"
        if cpu_kernels and device.type == "cpu" and dtype == torch.float32 and (
                _C.linear_best_isa() != "scalar") and not batch_invariant:
            self._kernels = _install_cpu_kernels(hf_model, lambda: self._probe(device))
        # the hidden states a drafter may ask for (KVPools.features): the decoder layers
        # and the final norm their taps go on (hf.features), installed over the forwards
        # above by the first forward that asks for a stream
        self._streams = hf_features.find_streams(
            hf_model, [r.module for r in layers], lambda: self._probe(device),
            getattr(text, "hidden_size", None))
        self.geometry = replace(self.geometry, hidden_size=self._streams.hidden_size)
        #: Captured forwards of decode and verify passes (verispec.models.hf.capture);
        #: ``capture=False`` (or tensor parallelism, or the batch-invariant mode, whose
        #: attention steps follow the context lengths) runs every forward eagerly.
        self._captures = (hf_capture.Captures(hf_model) if capture and tp is None
                          and not batch_invariant
                          and getattr(hf_model, "_compiled_call_impl", None) is None else None)
        self.tokenizer_fingerprint: Optional[str] = None
        if tokenizer is not None:
            from verispec.models.tokenizer import vocabulary_fingerprint

            self.tokenizer_fingerprint = vocabulary_fingerprint(tokenizer)

    @property
    def num_layers(self) -> int:
        return self.geometry.num_layers

    @property
    def attention_backend(self) -> str:
        """How layers attend: "auto" (default: verispec's paged CPU kernel where
        ``native_attention`` runs it, else FlashInfer on a CUDA device where it imports,
        else SDPA), "native" (as "auto", on a float32 CPU model only), "sdpa" (the torch
        path, ``layers.attention.TorchAttention``) or "flashinfer" (a CUDA device with the
        flashinfer package); ValueError naming the backend where it cannot run
        (``layers.attention.select_backend``)."""
        return self._attention_backend

    @attention_backend.setter
    def attention_backend(self, name: str) -> None:
        select_backend(name, self.geometry.device, self.geometry.dtype,
                       who="HFModel.attention_backend")
        self._attention_backend = name

    def _backend(self, native: bool) -> AttentionBackend:
        """A new attention backend for one forward (``layers.attention.resolve_backend``;
        ``native``: whether this forward may run verispec's paged CPU kernel)."""
        g = self.geometry
        return make_backend(resolve_backend(self._attention_backend, g.device, g.dtype,
                                            native=native, who="HFModel.attention_backend"))

    @property
    def native_linear(self) -> bool:
        """Whether the model's linear layers run verify passes (2..16 tokens) on
        verispec's CPU kernel (float32 CPU models; set False to compare with torch's)."""
        return self._kernels is not None and self._kernels.linear

    @native_linear.setter
    def native_linear(self, on: bool) -> None:
        if self._kernels is not None:
            self._kernels.linear = bool(on)

    @property
    def native_norm(self) -> bool:
        """Whether the model's plain RMSNorm modules run as one pass of verispec's CPU
        kernel (float32 CPU models; set False to run the modules' own code)."""
        return self._kernels is not None and self._kernels.norm

    @native_norm.setter
    def native_norm(self, on: bool) -> None:
        if self._kernels is not None:
            self._kernels.norm = bool(on)

    @property
    def native_rope(self) -> bool:
        """Whether the model's rotate-half RoPE runs as one call of verispec's CPU kernel
        (float32 CPU models whose modeling module's apply_rotary_pos_emb computes the
        kernel's bits; set False to run the model's own function)."""
        return self._kernels is not None and self._kernels.rope

    @native_rope.setter
    def native_rope(self, on: bool) -> None:
        if self._kernels is not None:
            self._kernels.rope = bool(on) and self._kernels.rope_found

    @property
    def capture(self) -> bool:
        """Whether decode and verify forwards (up to ``hf_capture.MAX_TOKENS`` tokens) run
        as captured programs: each token count's forward recorded once as straight-line
        code over the same ops and checked bit for bit against the eager forward
        (``verispec.models.hf.capture``). Set False to run every forward eagerly."""
        return self._captures is not None and self._captures.enabled

    @capture.setter
    def capture(self, on: bool) -> None:
        if on and self.batch_invariant:
            raise ValueError("HFModel.capture: a batch-invariant model runs eagerly (its "
                             "attention's steps follow the rows' context lengths, which a "
                             "captured program would fix)")
        if on and self._captures is None:
            if self.tp is not None or self.model is None:
                raise ValueError("HFModel.capture: a tensor-parallel shard runs eagerly "
                                 "(its collectives are not torch ops a recording sees)")
            self._captures = hf_capture.Captures(self.model)
        if self._captures is not None:
            self._captures.enabled = bool(on)

    def early_exit(self, num_layers: int) -> "HFModel":
        """The first ``num_layers`` decoder layers + the model's final norm and LM head,
        sharing this model's modules (no copy of any weight): a self-speculation draft
        (``verispec.drafters.EarlyExit``), whose pools are the target's first layers.

        Works where the model keeps its decoder layers in one ``nn.ModuleList`` and runs
        any prefix of it; checked with a recording forward (ValueError otherwise).
        """
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not (
                1 <= num_layers <= self.num_layers):
            raise ValueError(f"early_exit: num_layers must be an int in [1, {self.num_layers}], "
                             f"got {num_layers!r}")
        path = self._layer_list_path()
        clone = _shallow_copy(self.model)
        parent = clone
        for name in path[:-1]:
            child = _shallow_copy(getattr(parent, name))
            setattr(parent, name, child)
            parent = child
        full = getattr(parent, path[-1])
        # in the mode of the list it cuts (a new module starts in train mode)
        setattr(parent, path[-1], torch.nn.ModuleList(list(full)[:num_layers]).train(full.training))
        draft = HFModel.__new__(HFModel)
        draft.model = clone
        draft.layers = self.layers[:num_layers]
        draft._pool_of = {id(r.module): i for i, r in enumerate(draft.layers)}
        layer_kv = self.geometry.layer_kv
        draft.geometry = replace(self.geometry, num_layers=num_layers,
                                 layer_kv=None if layer_kv is None else layer_kv[:num_layers])
        draft.model_type = self.model_type
        draft.tp = self.tp  # the draft runs the shared (cut) modules, collectives included
        draft._kernels = self._kernels
        draft.native_attention = self.native_attention
        draft._attention_backend = self._attention_backend
        draft.batch_invariant = self.batch_invariant
        draft.tokenizer_fingerprint = self.tokenizer_fingerprint
        draft._streams = self._streams  # the shared modules' taps
        draft._captures = None
        probe, _ = draft._probe(self.geometry.device)
        if [id(r.module) for r in probe.layers] != [id(r.module) for r in draft.layers]:
            raise ValueError(f"early_exit: {type(self.model).__name__} does not run a prefix of "
                             f"its layers (its forward called {len(probe.layers)} attention "
                             f"layers, expected the first {num_layers})")
        draft._captures = None if self._captures is None else hf_capture.Captures(clone)
        return draft

    def _layer_list_path(self) -> list[str]:
        """Attribute names from the model to the nn.ModuleList holding the decoder layers
        (element i contains layer i's attention module)."""
        attention = [r.module for r in self.layers]
        for name, module in self.model.named_modules():
            if (isinstance(module, torch.nn.ModuleList) and len(module) == len(attention)
                    and all(any(m is a for m in layer.modules())
                            for layer, a in zip(module, attention))):
                return name.split(".")
        raise ValueError(f"early_exit: {type(self.model).__name__} keeps no nn.ModuleList of "
                         f"its {len(attention)} decoder layers")

    def _shard(self, tp: Any, layers: list[_LayerRecord], vocab_size: int,
               device: torch.device) -> None:
        """Cuts the wrapped model to this rank's shard (``hf.tp``) and checks the cut: the
        logits of a few tokens in transformers' eager attention, before and after, must
        agree to rounding on every rank (the ranks decide together, so all refuse or
        none). A refusal here leaves the model cut: load it again."""
        plan = hf_tp.plan_shard(self.model, layers, tp.world_size, tp.rank)
        # every refusal that needs no collective is behind us; the check below and the
        # cut model's hooks call these
        missing = [n for n in ("all_reduce", "gather_vocab") if not callable(getattr(tp, n, None))]
        if missing:
            raise TypeError(f"HFModel: tp must be a verispec.distributed.TensorParallel (with "
                            f"all_reduce and gather_vocab), got {type(tp).__name__} without "
                            f"{' and '.join(missing)}")
        ids = (torch.arange(SHARD_CHECK_TOKENS, device=device) * 7 + 1) % vocab_size
        self.model.set_attn_implementation("eager")
        try:
            want = self._eager_logits(ids)
            hf_tp.apply_shard(plan, tp)  # outside inference_mode: the cut weights are
            try:                         # parameters, not inference tensors
                got = self._eager_logits(ids)
            except RuntimeError as e:
                raise _refuse(self.model, f"tensor parallelism: the cut model's forward "
                                          f"failed on rank {tp.rank} (a model that reshapes "
                                          f"by the config's head count cannot run a rank's "
                                          f"heads): {e}") from e
            scale = want.abs().max().double().clamp_min(1e-30)
            err = ((got - want).abs().max().double() / scale).reshape(1)
            tp.all_reduce(err)
        finally:
            self.model.set_attn_implementation(ATTN_IMPLEMENTATION)
        tol = SHARD_CHECK_RTOL.get(want.dtype, SHARD_CHECK_RTOL[None])
        if not float(err) <= tol:
            raise _refuse(self.model, f"tensor parallelism: its base_model_tp_plan does not "
                                      f"reproduce the model: the cut model's logits differ by "
                                      f"{float(err):.3g} of their largest (summed over the "
                                      f"ranks), expected <= {tol:g}")

    def _eager_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """All logits of ``ids`` as one sequence, in the model's own (eager) attention."""
        positions = torch.arange(ids.shape[0], device=ids.device)
        with torch.inference_mode():
            return self.model(input_ids=ids[None], position_ids=positions[None],
                              use_cache=False, return_dict=True).logits[0]

    def _probe(self, device: torch.device) -> tuple[_Probe, torch.Tensor]:
        """One recording forward of 2 tokens keeping the last one's logits: what each
        layer passed to the attention function, and the logits."""
        probe = _Probe()
        logits = self._call(torch.zeros(2, dtype=torch.long, device=device),
                            torch.arange(2, device=device), torch.tensor([1], device=device),
                            probe)
        return probe, logits

    def _call(self, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor,
              ctx: Any) -> torch.Tensor:
        if self.model is None:
            raise RuntimeError("HFModel: this wrapper's modules were cut by "
                               "verispec.distributed.shard; use the model shard returned")
        token = _CONTEXT.set(ctx)
        try:
            with torch.inference_mode():
                captures = self._captures
                if (captures is None or type(ctx) is not _Plan
                        or ids.shape[0] > hf_capture.MAX_TOKENS):
                    return self._eager_call(ids, positions, keep)
                k = self._kernels
                key = (ids.shape[0], keep.shape[0], ids.dtype, positions.dtype, keep.dtype,
                       ids.stride(), positions.stride(), keep.stride(), ids.device,
                       None if k is None else (k.linear, k.norm, k.rope),
                       getattr(self.model.config, "_attn_implementation", None),
                       # a program holds the taps of the features asked when recorded
                       getattr(getattr(ctx, "feature_taps", None), "keys", None))
                calls = ctx.calls

                def redo() -> None:
                    ctx.calls = calls

                return captures.forward(key, self._eager_call, ids, positions, keep, redo)
        finally:
            _CONTEXT.reset(token)

    def _eager_call(self, ids: torch.Tensor, positions: torch.Tensor,
                    keep: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids[None], position_ids=positions[None], use_cache=False,
                          logits_to_keep=keep, return_dict=True).logits

    def __call__(self, batch: PagedBatch) -> torch.Tensor:
        return self.forward(batch)

    def forward(self, batch: PagedBatch) -> torch.Tensor:
        """Logits [R, vocab] (model dtype) of the tokens ``batch.logits_indices``."""
        self._check(batch)
        g = self.geometry
        device = g.device
        plan = _Plan(batch, self._pool_of, device)
        plan.kernels = self._kernels  # read by the RoPE dispatcher (hf.patch._rope_dispatch)
        plan.backend = self._backend
        plan.feature_taps = self._feature_taps(batch, plan)
        if self.batch_invariant:
            plan.prepare_batch_invariant()
        else:
            plan.prepare(self.native_attention)
        if max(plan.ctx_lens) > g.max_context:
            raise ValueError(f"HFModel.forward: context_lens must be <= max_context = "
                             f"{g.max_context}, got {max(plan.ctx_lens)}")
        logits = self._call(batch.input_ids.to(device), batch.positions.to(
            device=device, dtype=torch.long), batch.logits_indices.to(
            device=device, dtype=torch.long), plan)
        if plan.calls != g.num_layers:
            raise RuntimeError(f"HFModel.forward: {plan.calls} of {g.num_layers} layers called "
                               f"verispec's attention function (was the model's attention "
                               f"implementation changed after wrapping?)")
        return logits[0]

    def _feature_taps(self, batch: PagedBatch, plan: _Plan
                      ) -> Optional[hf_features.FeatureTaps]:
        """The forward's feature writes (read by the taps, hf.features), None when no
        drafter asked for any; ValueError naming a stream this model cannot write."""
        if not batch.kv.features:
            return None
        self.check_features(sorted(batch.kv.features), who="HFModel.forward")
        hf_features.install(self._streams)  # once (a model wrapped again removes them)
        return hf_features.FeatureTaps(batch.kv, plan.write, self.geometry.num_layers)

    def check_features(self, keys, *, who: str = "HFModel") -> None:
        """ValueError naming a feature-pool key (verispec.drafters.Feature.key) this model
        cannot write (SpecDecoder asks before it builds anything)."""
        n = self.geometry.num_layers
        for key in keys:
            why = (f"its layers have streams 0..{n + 1}" if not 0 <= key <= n + 1
                   else self._streams.problem(key, n))
            if why is not None:
                raise ValueError(f"{who}: {self.model_type} ({type(self.model).__name__}) "
                                 f"cannot write the feature {feature_name(key, n)} "
                                 f"(KVPools.features key {key}): {why}")

    def _check(self, batch: PagedBatch) -> None:
        check_batch(batch, self.geometry, "HFModel.forward")
