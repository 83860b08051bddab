"""HFModel's feature taps: the target's hidden states a drafter reads
(``verispec.drafters.Feature``, ``KVPools.features``), from a transformers model's own
forward.

Stream r of a model of N decoder layers (``Feature.key``): r < N the hidden state a
decoder layer receives (r = 0: the embedding, scaled as the model scales it, e.g.
Gemma's), N the last layer's output, N + 1 the final norm's output (what the LM head
reads). transformers' ``output_hidden_states`` lists the same tensors (its last entry
is the normed one).

How: ``find_streams`` names, once per wrapped model, the decoder layers (the
``nn.ModuleList`` whose element i holds attention module i) and the final norm (the
module, named ``*Norm*``, that receives the last layer's output tensor itself), with
one recording forward that also checks what flows: each layer receives one
[1, tokens, hidden] tensor, layer i + 1 exactly the tensor layer i returned.
``install`` (at the first forward asking for a stream: a model never asked runs as it
did) sets an instance-level ``forward`` on each of those modules that calls the
module's own (or the one verispec installed before: the CPU kernels', the
batch-invariant mode's) and, when the running forward's plan asks for features
(``plan.feature_taps``, set by HFModel.forward only when ``batch.kv.features`` is not
empty), writes the stream through ``_tap``: the plan's cache write (``KVWrite``) at the
tokens' slots. With no feature asked a tap is one context-variable read.

``_tap`` is ``hf_capture.opaque``: a captured program logs it as one call and replays
it with that forward's plan; a program is keyed by the feature keys asked (HFModel._call),
so a program recorded without features holds no tap at all, and stays right when the
taps are installed after it was recorded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from verispec.models.hf import capture as hf_capture
from verispec.models.hf.attention import _CONTEXT

__all__ = ["FeatureTaps", "Streams", "find_streams", "install", "uninstall"]


@dataclass
class Streams:
    """What a wrapped model's streams are tapped from: its decoder layers in order (None
    where not found), its final norm (None where not found), the stream's width, and why
    a kind of stream cannot be tapped ("layers", "final_normed": the reason)."""

    layers: Optional[list[torch.nn.Module]] = None
    final_norm: Optional[torch.nn.Module] = None
    hidden_size: Optional[int] = None
    missing: dict[str, str] = field(default_factory=dict)

    def problem(self, key: int, num_layers: int) -> Optional[str]:
        """Why stream ``key`` of a model of ``num_layers`` layers cannot be written, or None."""
        if key == num_layers + 1 and "final_normed" in self.missing:
            return self.missing["final_normed"]
        if "layers" in self.missing:
            return self.missing["layers"]
        return None


class FeatureTaps:
    """One forward's feature writes (``plan.feature_taps``): stream ``key``'s states of
    the forward's tokens into ``kv.features[key]`` through the plan's cache write."""

    __slots__ = ("kv", "write", "num_layers", "keys")

    def __init__(self, kv: Any, write: Callable, num_layers: int) -> None:
        self.kv = kv
        self.write = write
        self.num_layers = num_layers
        self.keys = tuple(sorted(kv.features))

    def __call__(self, key: int, x: torch.Tensor) -> None:
        if key in self.kv.features:  # [1, T, hidden] as the layers pass it -> [T, hidden]
            self.kv.write_features(self.write, key, x.reshape(-1, x.shape[-1]))


@hf_capture.opaque
def _tap(key: int, x: torch.Tensor) -> None:
    """Writes stream ``key`` (x: [1, T, hidden]) for the running forward's plan."""
    _CONTEXT.get().feature_taps(key, x)


def _layer_forward(self: torch.nn.Module, *args, **kwargs):
    """A decoder layer's forward with its taps: the stream entering it (key = its index)
    and, for the forward's last layer, the stream leaving it (key N)."""
    taps = getattr(_CONTEXT.get(), "feature_taps", None)
    inner = self._verispec_tap_inner
    if taps is None:
        return inner(*args, **kwargs) if inner is not None else type(self).forward(
            self, *args, **kwargs)
    i = self._verispec_tap_layer
    _tap(i, args[0] if args else kwargs["hidden_states"])
    out = inner(*args, **kwargs) if inner is not None else type(self).forward(
        self, *args, **kwargs)
    if i + 1 == taps.num_layers:
        _tap(i + 1, out[0] if isinstance(out, (tuple, list)) else out)
    return out


def _norm_forward(self: torch.nn.Module, *args, **kwargs):
    """The final norm's forward with its tap: its output (key N + 1)."""
    inner = self._verispec_tap_inner
    out = inner(*args, **kwargs) if inner is not None else type(self).forward(
        self, *args, **kwargs)
    taps = getattr(_CONTEXT.get(), "feature_taps", None)
    if taps is not None:
        _tap(taps.num_layers + 1, out)
    return out


def _layer_list(model: torch.nn.Module, attention: list[torch.nn.Module]
                ) -> Optional[torch.nn.ModuleList]:
    """The nn.ModuleList whose element i holds attention module i (as
    HFModel._layer_list_path finds it)."""
    for module in model.modules():
        if (isinstance(module, torch.nn.ModuleList) and len(module) == len(attention)
                and all(any(m is a for m in layer.modules())
                        for layer, a in zip(module, attention))):
            return module
    return None


def _first_tensor(out: Any) -> Any:
    return out[0] if isinstance(out, (tuple, list)) and out else out


def find_streams(model: torch.nn.Module, attention: list[torch.nn.Module],
                 run: Callable[[], Any], hidden_size: Optional[int]) -> Streams:
    """The decoder layers and final norm of ``model`` (``attention``: its attention
    modules in the order the probe saw them), checked with one recording forward
    ``run()`` of 2 tokens (see the module docstring). ``hidden_size``: the config's,
    reported where no layer shows the width."""
    streams = Streams(hidden_size=hidden_size)
    layers = _layer_list(model, attention)
    if layers is None:
        streams.missing["layers"] = (f"it keeps no nn.ModuleList of its {len(attention)} "
                                     f"decoder layers")
        streams.missing["final_normed"] = streams.missing["layers"]
        return streams
    inside = {id(m) for layer in layers for m in layer.modules()}
    above = {id(m) for m in model.modules() if any(c is layers for c in m.modules())}
    inputs: list[Any] = [None] * len(layers)
    outputs: list[Any] = [None] * len(layers)
    after: list[tuple[torch.nn.Module, Any, Any]] = []  # (module, input, output) past the last

    def enter(i):
        def hook(module, args, kwargs):
            inputs[i] = args[0] if args else kwargs.get("hidden_states")
        return hook

    def leave(i):
        def hook(module, args, output):
            outputs[i] = _first_tensor(output)
        return hook

    def seen(module, args, output):
        if outputs[-1] is not None and args:
            after.append((module, args[0], output))

    handles = []
    try:
        for i, layer in enumerate(layers):
            handles.append(layer.register_forward_pre_hook(enter(i), with_kwargs=True))
            handles.append(layer.register_forward_hook(leave(i)))
        for m in model.modules():
            if id(m) not in inside and id(m) not in above:
                handles.append(m.register_forward_hook(seen))
        run()
    finally:
        for h in handles:
            h.remove()
    x0 = inputs[0]
    if not (isinstance(x0, torch.Tensor) and x0.dim() == 3 and x0.shape[:2] == (1, 2)):
        shape = list(x0.shape) if isinstance(x0, torch.Tensor) else type(x0).__name__
        streams.missing["layers"] = (f"its first decoder layer receives {shape}, not one "
                                     f"[1, tokens, hidden] residual stream")
    else:
        for i in range(1, len(layers)):
            if inputs[i] is not outputs[i - 1]:
                streams.missing["layers"] = (f"its decoder layer {i} does not receive the "
                                             f"tensor layer {i - 1} returns (the stream "
                                             f"changes between its layers)")
                break
        last = outputs[-1]
        if not (isinstance(last, torch.Tensor) and last.shape == x0.shape):
            streams.missing["layers"] = (f"its last decoder layer returns "
                                         f"{type(last).__name__}, not the stream it received")
    if "layers" in streams.missing:
        streams.missing["final_normed"] = streams.missing["layers"]
        return streams
    streams.layers = list(layers)
    streams.hidden_size = int(x0.shape[-1])
    # the final norm: the first module past the layers called on the last layer's output
    # itself, a norm by its class name, returning a tensor of the stream's shape
    for module, x, out in after:
        if x is outputs[-1]:
            if ("norm" in type(module).__name__.lower() and isinstance(out, torch.Tensor)
                    and out.shape == x.shape):
                streams.final_norm = module
            break
    if streams.final_norm is None:
        streams.missing["final_normed"] = ("no norm module receives its last decoder layer's "
                                           "output (no final norm verispec recognises)")
    return streams


def install(streams: Streams) -> None:
    """Sets the tapping forwards on the streams' modules (over whatever forward each has:
    its class's or one verispec set), where they are not set yet; ``uninstall`` (and
    hf.patch._uninstall_cpu_kernels) undoes it."""
    import types

    layers, norm = streams.layers or (), streams.final_norm
    if ((not layers or "_verispec_tap_inner" in vars(layers[-1]))
            and (norm is None or "_verispec_tap_inner" in vars(norm))):
        return  # installed (the common case: every forward of a drafter's target)
    for i, layer in enumerate(layers):
        if "_verispec_tap_inner" not in vars(layer):  # tapped already: its index only
            layer._verispec_tap_inner = vars(layer).get("forward")
            layer.forward = types.MethodType(_layer_forward, layer)
        layer._verispec_tap_layer = i
    if norm is not None and "_verispec_tap_inner" not in vars(norm):
        norm._verispec_tap_inner = vars(norm).get("forward")
        norm.forward = types.MethodType(_norm_forward, norm)


def uninstall(model: torch.nn.Module) -> None:
    """Every tap of ``model``'s modules removed: each one's previous forward back (captured
    programs invalidated: one recorded with features calls the taps)."""
    for m in model.modules():
        if "_verispec_tap_inner" in vars(m):
            inner = m._verispec_tap_inner
            if inner is not None:
                m.forward = inner
            else:
                vars(m).pop("forward", None)
            del m._verispec_tap_inner
            vars(m).pop("_verispec_tap_layer", None)
    hf_capture.invalidate()
