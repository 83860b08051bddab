"""HFModel's attention function: how a transformers model's layers reach verispec's
paged attention.

transformers computes attention through a registry of attention functions
(``transformers.AttentionInterface``). ``register_attention`` registers one,
``_paged_attention``, under ``ATTN_IMPLEMENTATION``; HFModel selects it on the wrapped
model. Each layer's call reads the forward's context (a context variable, since some
models' layers do not pass keyword arguments down): the construction probe (``_Probe``:
what each layer passes, the cache geometry) or the forward's plan (``_Plan``: a
``layers.PagedPlan`` that writes the new tokens' K/V and attends through the forward's
attention backend, ``layers.attention``: verispec's paged CPU kernel, FlashInfer, torch or
the batch-invariant mode's, all called the same way).
"""

from __future__ import annotations

import contextvars
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from verispec.models.hf import capture as hf_capture
from verispec.models.layers.attention import (AttentionBackend, BatchInvariantAttention,
                                              TorchAttention)
from verispec.models.layers.attention.interface import flat
from verispec.models.layers.paged import PagedPlan


__all__ = ["ATTN_IMPLEMENTATION", "refuse", "register_attention"]

#: The name verispec's paged attention function is registered under in transformers'
#: AttentionInterface (``from_pretrained(..., attn_implementation=ATTN_IMPLEMENTATION)``).
ATTN_IMPLEMENTATION = "verispec_paged"
# The plan (or the construction probe) of the forward running in this thread, read by
# every layer's attention call: a context variable rather than a keyword argument, which
# some models' layers do not pass down to their attention.
_CONTEXT: contextvars.ContextVar[Any] = contextvars.ContextVar("verispec_hf_forward",
                                                                default=None)

_registered = False


def register_attention() -> None:
    """Registers verispec's paged attention function in transformers' AttentionInterface
    under ATTN_IMPLEMENTATION (idempotent). Needed before
    ``from_pretrained(..., attn_implementation=ATTN_IMPLEMENTATION)``; HFModel calls it."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(ATTN_IMPLEMENTATION, _paged_attention)
        _registered = True


_NOT_PASSED = object()


@hf_capture.opaque
def _paged_attention(module, query, key, value, attention_mask, *, scaling=None, dropout=0.0,
                     sliding_window=_NOT_PASSED, softcap=None, s_aux=None, **kwargs):
    """transformers' attention-function signature: query [1, H, T, Dk], key [1, KvH, T, Dk],
    value [1, KvH, T, Dv] (the new tokens, after RoPE / q-k norms) -> ([1, T, H, Dv], None).
    ``attention_mask`` is None for every model HFModel accepts (it builds no mask); a layer
    that passes its own is refused at construction (_Probe) and never silently ignored."""
    ctx = _CONTEXT.get()
    if ctx is None:
        raise RuntimeError(
            f"{type(module).__name__}: the model's attention implementation is "
            f"{ATTN_IMPLEMENTATION!r}, which runs only inside verispec.models.HFModel.forward; "
            f"call model.set_attn_implementation('sdpa') to use the model on its own")
    if attention_mask is not None:
        ctx.masked(module, attention_mask)
    if sliding_window is _NOT_PASSED:
        # a layer that passes no window at all, whose window transformers applies through
        # its mask alone: the one it keeps on the module, if any (Qwen2-MoE's sliding
        # layers). A window passed as None is no window (EXAONE 4 keeps the config's
        # window on every module and passes it on its sliding layers only).
        sliding_window = getattr(module, "sliding_window", None)
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int):
            sliding_window = None
    return ctx.attend(module, query, key, value, scaling=scaling, window=sliding_window,
                      softcap=softcap, sinks=s_aux), None


def _describe(mask: Any) -> str:
    """An attention mask a layer passed, as errors name it: "dtype [shape]"."""
    return f"{getattr(mask, 'dtype', type(mask).__name__)} {list(getattr(mask, 'shape', []))}"


@dataclass
class _LayerRecord:
    module: Any
    num_heads: int
    q_head_dim: int
    num_kv_heads: int
    k_head_dim: int
    v_head_dim: int
    causal: bool
    window: Optional[int] = None  # the sliding window the layer attends with


class _Probe:
    """The recording context of the construction forward: what each layer passes."""

    def __init__(self) -> None:
        self.layers: list[_LayerRecord] = []
        self.mask: Optional[str] = None  # the first layer passing its own mask, described

    def masked(self, module, mask) -> None:
        if self.mask is None:
            self.mask = f"{type(module).__name__} passes {_describe(mask)}"

    def attend(self, module, query, key, value, *, scaling, window, softcap, sinks):
        self.layers.append(_LayerRecord(
            module=module, num_heads=query.shape[1], q_head_dim=query.shape[3],
            num_kv_heads=key.shape[1], k_head_dim=key.shape[3],
            v_head_dim=value.shape[3],
            causal=getattr(module, "is_causal", True) is not False,
            window=window if window is not None and window > 0 else None))
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[3])


class _Plan(PagedPlan):
    """The forward's plan, as every layer's attention call reads it: the paged plan of
    the batch (``layers.PagedPlan``), the pool each attention module writes, and the
    forward's attention backend (``layers.attention``), chosen and planned by ``prepare``
    / ``prepare_batch_invariant`` before the first layer writes the cache."""

    def __init__(self, batch: Any, pool_of: dict[int, int], device: torch.device):
        super().__init__(batch, device)
        self.pool_of = pool_of
        self.calls = 0
        #: native -> the forward's backend (HFModel.forward sets HFModel._backend)
        self.backend: Callable[[bool], AttentionBackend] = lambda native: TorchAttention()
        self.attention: AttentionBackend = TorchAttention()
        self.kernels = None  # read by the RoPE dispatcher (hf.patch._rope_dispatch)

    def masked(self, module, mask) -> None:
        raise RuntimeError(f"HFModel.forward: {type(module).__name__} passed its own attention "
                           f"mask ({_describe(mask)}), which verispec's paged attention cannot "
                           f"apply (the construction probe saw none)")

    def prepare_batch_invariant(self) -> None:
        """Every layer attends in ``batch_invariant.attention`` (HFModel's batch-invariant
        mode), over the key plan built now, before the first layer writes the cache."""
        self.attention = BatchInvariantAttention(batch_invariant=True)
        self.attention.plan(self)

    def prepare(self, native: bool) -> None:
        """Picks and plans the forward's backend before the first layer writes the cache
        (its checks of the batch run now): with ``native`` (HFModel.native_attention),
        layers without softcap or sinks attend in verispec's paged CPU kernel unless a
        chain row has more than KERNEL_MAX_QUERIES new tokens (a long prompt at once,
        which SDPA attends faster)."""
        self.attention = self.backend(native and not self.long_chain_rows)
        self.attention.plan(self)

    def _write_attend_native(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             pool: int, scaling: float, window: Optional[int],
                             softcap: Optional[float], sinks: Optional[torch.Tensor]
                             ) -> Optional[torch.Tensor]:
        """The backend's cache write and attention in one call (``write_attend``: the
        native kernel's, reading the strided [1, heads, T, D] tensors the module passes)
        -> [1, T, H, D]; None (nothing written) where the backend has none or it does
        not apply."""
        return self.attention.write_attend(self, query, key, value, self.kv.k[pool],
                                           self.kv.v[pool], scaling=scaling, window=window,
                                           softcap=softcap, sinks=sinks)

    def attend(self, module, query, key, value, *, scaling, window, softcap, sinks):
        pool = self.pool_of.get(id(module))
        if pool is None:
            raise RuntimeError(f"HFModel: attention module {type(module).__name__} "
                               f"(layer_idx {getattr(module, 'layer_idx', None)}) was not seen "
                               f"when the model was probed")
        self.calls += 1
        if scaling is None:
            scaling = 1.0 / math.sqrt(key.shape[3])
        out = self._write_attend_native(query, key, value, pool, scaling, window, softcap,
                                        sinks)
        if out is not None:
            return out
        k_pool, v_pool = self.kv.k[pool], self.kv.v[pool]
        self.write(flat(k_pool), key[0].transpose(0, 1))
        self.write(flat(v_pool), value[0].transpose(0, 1))
        q = query[0].transpose(0, 1)                                           # [T, H, Dk]
        return self.attention.attend(self, q, k_pool, v_pool, scaling=scaling, window=window,
                                     softcap=softcap, sinks=sinks)[None]       # [1, T, H, Dv]


def refuse(model: Any, why: str) -> ValueError:
    """The error of a model HFModel (or its tensor parallelism, ``hf.tp``) does not take."""
    return ValueError(f"HFModel: {type(model).__name__} is not supported: {why}")
