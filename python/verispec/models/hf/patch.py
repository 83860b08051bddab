"""HFModel's native-kernel patching: a wrapped transformers model's modules, run on
verispec's CPU kernels (``verispec.models.layers.kernels``) or in the batch-invariant ops.

All of it is instance-level (``forward`` methods set on modules, a module's class swapped
for a same-named subclass, a modeling module's ``apply_rotary_pos_emb`` bound to a
dispatcher) and undone by ``_uninstall_cpu_kernels``; values and parameters are unchanged
(weight matrices only change layout, ``matmul_layout``).

- ``_install_cpu_kernels`` (float32 CPU models): ``nn.Linear`` layers of
  NATIVE_LINEAR_MIN_ROWS..NATIVE_LINEAR_MAX_ROWS rows on verispec's linear kernel, linear
  layers reading one input fused into one product (``_Siblings``), plain RMSNorm modules
  as one pass of the norm kernel, transformers' rotate-half RoPE as one kernel call where
  the modeling module's function computes the kernel's bits, and the model's own modules
  called straight through ``forward`` (``_install_fast_calls``).
- ``_install_batch_invariant``: ``nn.Linear`` and row-wise norms on fixed chunks of rows;
  ``_batch_invariant_problems`` lists the other ops of a forward that may round a token
  by what shares its pass (HFModel refuses such models in that mode).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.nn.modules import module as _nn_module  # its global hooks (_fast_call)

from verispec.models.hf import capture as hf_capture
from verispec.models.hf import features as hf_features
from verispec.models.hf.attention import _CONTEXT
from verispec.models.layers import batch_invariant as _bi
from verispec.models.layers.kernels import native_linear, native_rms_norm, rotate_half_rope
# Forwards of NATIVE_LINEAR_MIN_ROWS..NATIVE_LINEAR_MAX_ROWS tokens (decoding, verify passes) of a
# float32 CPU model run their linear layers on verispec's CPU kernel, as LlamaModel's do.
from verispec.models.layers.linear import NATIVE_LINEAR_MAX_ROWS, NATIVE_LINEAR_MIN_ROWS, matmul_layout


class _CpuKernels:
    """The switch HFModel's CPU kernels read at each call (one object per model, shared
    by its modules; ``HFModel.native_linear`` / ``native_norm`` / ``native_rope`` flip
    it). ``rope`` can be True only where ``rope_found``: some attention module's RoPE
    function was checked and a dispatcher bound in its place (_install_rope)."""

    def __init__(self) -> None:
        self.linear = True
        self.norm = True
        self.rope = self.rope_found = False


def _product(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor],
             kernels: _CpuKernels) -> torch.Tensor:
    """x @ w^T + bias for HFModel's float32 CPU linear layers: products of
    NATIVE_LINEAR_MIN_ROWS..NATIVE_LINEAR_MAX_ROWS rows (decoding, verify passes) on
    verispec's kernel (``verispec.ops.linear``: it streams the weight once for up to 8
    rows; see verispec.models.llama), anything else through F.linear."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if (kernels.linear and NATIVE_LINEAR_MIN_ROWS <= rows <= NATIVE_LINEAR_MAX_ROWS
            and x.dtype is torch.float32 and w.dtype is torch.float32 and x.is_cpu
            and w.is_cpu and w.dim() == 2 and w.shape[1] == k):
        if not x.is_contiguous():
            x = x.contiguous()
        if w.stride(1) != 1 and w.stride(0) != 1:  # neither of matmul_layout's layouts
            w = w.contiguous()
        out = native_linear(x, w, torch.get_num_threads())
        if bias is not None:
            out += bias
        return out
    return F.linear(x, w, bias)


@hf_capture.opaque
def _linear_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear.forward of a float32 CPU model wrapped by HFModel (see _product)."""
    params = self._parameters
    if "weight" in params and "bias" in params:  # as nn.Linear keeps them
        return _product(x, params["weight"], params["bias"], self._verispec_kernels)
    return _product(x, self.weight, self.bias, self._verispec_kernels)


class _Siblings:
    """Linear layers that read the same input one after another (q/k/v projections,
    gate/up): one product over their weights stacked in one matrix, each layer's output
    its slice of it. Seven products per Llama layer become four, as in LlamaModel's fused
    layout; each layer's weight becomes a view of the stacked matrix (no copy kept)."""

    def __init__(self, modules: list[torch.nn.Module], kernels: _CpuKernels) -> None:
        self.kernels = kernels
        self.weight = matmul_layout(torch.cat([m.weight.data for m in modules]))
        self.bias = (None if modules[0].bias is None
                     else torch.cat([m.bias.data for m in modules]))
        self.sizes = []
        start = 0
        for m in modules:
            stop = start + m.weight.shape[0]
            m.weight.data = self.weight[start:stop]
            if self.bias is not None:
                m.bias.data = self.bias[start:stop]
            self.sizes.append(stop - start)
            start = stop
        self.input: Optional[torch.Tensor] = None   # the leader's input, until the last reads
        self.outputs: Optional[tuple[torch.Tensor, ...]] = None  # each sibling's slice


@hf_capture.opaque
def _sibling_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A fused sibling's forward: the first computes every sibling's output for its input;
    the others take their slice when they are called with that same tensor (else, as in
    a code path the probe did not see, their own product)."""
    s: _Siblings = self._verispec_siblings
    i = self._verispec_sibling
    if i == 0:
        s.input, s.outputs = x, _product(x, s.weight, s.bias, s.kernels).split_with_sizes(
            s.sizes, -1)
    elif s.input is not x:
        return _product(x, self.weight, self.bias, s.kernels)
    out = s.outputs[i].contiguous()
    if i == len(s.sizes) - 1:
        s.input = s.outputs = None
    return out


def _record_linear_inputs(model: torch.nn.Module, run) -> list[tuple[torch.nn.Module, Any]]:
    """(module, input tensor) of every nn.Linear call in one forward ``run()``."""
    calls: list[tuple[torch.nn.Module, Any]] = []
    handles = [m.register_forward_pre_hook(lambda mod, args: calls.append((mod, args[0])))
               for m in model.modules() if type(m) is torch.nn.Linear]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return calls


def _sibling_groups(model: torch.nn.Module, calls) -> list[list[torch.nn.Module]]:
    """Runs of consecutive linear calls on the same input tensor whose layers can share
    one product: float32 CPU weights, the same input size, biases on all or none, each
    layer called once per forward, no hooks, no weight shared with another layer."""
    count: dict[int, int] = {}
    for m, _ in calls:
        count[id(m)] = count.get(id(m), 0) + 1
    owners: dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1

    def fusable(m: torch.nn.Module) -> bool:
        w = m.weight
        return (count[id(m)] == 1 and w.dtype == torch.float32 and w.device.type == "cpu"
                and owners.get(id(w), 0) == 1
                and (m.bias is None or owners.get(id(m.bias), 0) == 1)
                and not (m._forward_hooks or m._forward_pre_hooks))

    groups, run = [], []
    for m, x in calls:
        if run and x is run[-1][1]:
            run.append((m, x))
            continue
        groups.append(run)
        run = [(m, x)]
    groups.append(run)
    out = []
    for run in groups:
        mods = [m for m, _ in run]
        if (len(mods) >= 2 and all(fusable(m) for m in mods)
                and len({m.in_features for m in mods}) == 1
                and len({m.bias is None for m in mods}) == 1):
            out.append(mods)
    return out


@hf_capture.opaque
def _norm_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """An RMSNorm module's forward (checked at wrap time to compute plain RMSNorm) as one
    pass of verispec's CPU kernel for float32 CPU inputs; the module's own otherwise."""
    w = self._parameters.get("weight")
    if w is None:  # a buffer or plain attribute (_is_plain_rms_norm accepted the tensor)
        w = self.weight
    dim = w.shape[0]
    if (self._verispec_kernels.norm and x.dtype == torch.float32 and x.is_cpu
            and x.shape[-1] == dim):
        return native_rms_norm(x if x.is_contiguous() else x.contiguous(), w,
                               self._verispec_eps)
    return type(self).forward(self, x)


# --- transformers' rotate-half RoPE on verispec's kernel ----------------------------------
# Most modeling modules define their own copy of apply_rotary_pos_emb (q * cos +
# rotate_half(q) * sin, the same for k): about a dozen small torch ops per layer, ~10% of
# a SmolLM2 decode forward on a CPU. Where a module's function computes those very bits
# (checked on random strided inputs, _computes_rotate_half_rope), the name in the module's
# namespace is bound to a dispatcher that runs verispec's one-call kernel inside the
# forwards of HFModels with CPU kernels on, and the original function everywhere else.

_ROPE_NAME = "apply_rotary_pos_emb"
# (heads, KV heads, tokens, head size) of the random inputs a RoPE function is checked on
_ROPE_CHECK_SHAPES = ((4, 2, 3, 8), (3, 1, 1, 64), (2, 2, 5, 128))


def _rope_dispatch(original):
    """The dispatcher bound in place of a modeling module's checked apply_rotary_pos_emb:
    verispec's kernel inside an HFModel forward with native_rope on, for the call shape
    kernels.rotate_half_rope takes (q, k, cos, sin; unsqueeze_dim 1); ``original`` otherwise."""
    import functools

    @hf_capture.opaque
    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        kernels = getattr(_CONTEXT.get(), "kernels", None)
        if (kernels is not None and kernels.rope and not args
                and (not kwargs or (len(kwargs) == 1 and kwargs.get("unsqueeze_dim") == 1))):
            out = rotate_half_rope(q, k, cos, sin)
            if out is not None:
                return out
        return original(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb._verispec_original = original
    return apply_rotary_pos_emb


def _computes_rotate_half_rope(fn) -> bool:
    """Whether ``fn(q, k, cos, sin)`` returns exactly (bit for bit) what verispec's kernel
    computes, on random [1, heads, T, D] queries and keys laid out as a layer passes them
    (transposed views) and random [1, T, D] cos / sin, for several head counts, token
    counts and head sizes."""
    g = torch.Generator().manual_seed(0)
    for h, kvh, t, d in _ROPE_CHECK_SHAPES:
        q = torch.randn(1, t, h, d, generator=g).transpose(1, 2)
        k = torch.randn(1, t, kvh, d, generator=g).transpose(1, 2)
        cos, sin = torch.randn(1, t, d, generator=g), torch.randn(1, t, d, generator=g)
        with torch.inference_mode():
            try:
                want = fn(q, k, cos, sin)
            except Exception:  # noqa: BLE001 - any failure: not this function
                return False
            got = rotate_half_rope(q, k, cos, sin)
        if not (isinstance(want, tuple) and len(want) == 2 and got is not None
                and all(torch.is_tensor(w) and w.dtype == x.dtype and w.shape == x.shape
                        and torch.equal(w, x) for w, x in zip(want, got))):
            return False
    return True


def _install_rope(model: torch.nn.Module) -> bool:
    """Binds _rope_dispatch in place of apply_rotary_pos_emb in the namespace of each
    modeling module whose classes' forwards the model runs, where that function passes
    _computes_rotate_half_rope (once per module: a dispatcher already bound stays).
    Returns whether any of the model's modules reads a dispatcher."""
    import inspect

    seen: set[int] = set()
    found = False
    for module in model.modules():
        forward = getattr(type(module), "forward", None)
        space = getattr(inspect.unwrap(forward), "__globals__", None) if forward else None
        if not isinstance(space, dict) or id(space) in seen:
            continue
        seen.add(id(space))
        fn = space.get(_ROPE_NAME)
        if not callable(fn):
            continue
        if getattr(fn, "_verispec_original", None) is not None:
            found = True
        elif _computes_rotate_half_rope(fn):
            space[_ROPE_NAME] = _rope_dispatch(fn)
            found = True
    return found


def _fast_call(self: torch.nn.Module, *args, **kwargs):
    """__call__ of a model's own module classes under HFModel's CPU kernels (_fast_class):
    straight to the module's forward, skipping nn.Module.__call__'s bookkeeping (the
    arguments packed twice, the hook checks: ~2-3% of a SmolLM2 decode step); with hooks
    registered (a profiler's, a user's), nn.Module.__call__ as usual."""
    if (self._forward_hooks or self._forward_pre_hooks or self._backward_hooks
            or self._backward_pre_hooks or _nn_module._global_forward_hooks
            or _nn_module._global_forward_pre_hooks or _nn_module._global_backward_hooks
            or _nn_module._global_backward_pre_hooks):
        return torch.nn.Module.__call__(self, *args, **kwargs)
    return self.forward(*args, **kwargs)


_FAST_CLASSES: dict[type, type] = {}


def _fast_class(cls: type) -> type:
    """A subclass of ``cls`` (same name and module) whose instances are called through
    _fast_call."""
    sub = _FAST_CLASSES.get(cls)
    if sub is None:
        sub = type(cls.__name__, (cls,), {"__call__": _fast_call, "__module__": cls.__module__,
                                          "__qualname__": cls.__qualname__})
        _FAST_CLASSES[cls] = sub
    return sub


def _install_fast_calls(model: torch.nn.Module) -> None:
    """The model's own module classes (its layers, attention, MLP, ...; not the model
    itself, not torch's modules such as nn.Linear, not modules with their own __call__ or
    compiled) become _fast_class subclasses; _uninstall_cpu_kernels puts them back."""
    for module in model.modules():
        cls = type(module)
        if (module is not model and cls.__call__ is torch.nn.Module.__call__
                and not cls.__module__.startswith("torch.")
                and getattr(module, "_compiled_call_impl", None) is None):
            module._verispec_class = cls
            module.__class__ = _fast_class(cls)


def _install_cpu_kernels(model: torch.nn.Module, run) -> _CpuKernels:
    """Puts verispec's CPU kernels under a float32 CPU model's linear layers and plain
    RMSNorm modules (instance-level forwards; values and parameters unchanged, weight
    matrices in matmul_layout: row-major where verispec's kernel runs them).
    Linear layers that one recording forward ``run()`` shows reading the same input one
    after another share one product (_Siblings). The model's own modules are then called
    straight through (_install_fast_calls)."""
    import types

    kernels = _CpuKernels()
    groups = _sibling_groups(model, _record_linear_inputs(model, run))
    with torch.no_grad():
        fused = set()
        for mods in groups:
            siblings = _Siblings(mods, kernels)
            for i, m in enumerate(mods):
                m._verispec_siblings, m._verispec_sibling = siblings, i
                m._verispec_kernels = kernels
                m.forward = types.MethodType(_sibling_forward, m)
                fused.add(id(m))
        for module in model.modules():
            if id(module) in fused:
                continue
            if type(module) is torch.nn.Linear and module.weight.dtype == torch.float32:
                module.weight.data = matmul_layout(module.weight.data)
                module._verispec_kernels = kernels
                module.forward = types.MethodType(_linear_forward, module)
            elif _is_plain_rms_norm(module):
                module._verispec_kernels = kernels
                module.forward = types.MethodType(_norm_forward, module)
    kernels.rope = kernels.rope_found = _install_rope(model)
    _install_fast_calls(model)
    return kernels


def _uninstall_cpu_kernels(model: torch.nn.Module) -> None:
    """Undoes _install_cpu_kernels (a model wrapped again, e.g. to be cut for tensor
    parallelism): the modules' own forwards back, and each fused sibling's weight its
    own tensor again (same values), so that cutting one does not leave a stale stack.
    Programs captured over those forwards (hf_capture) are invalidated. The feature taps
    (hf.features) go too, first: they wrap these forwards."""
    hf_features.uninstall(model)
    hf_capture.invalidate()
    with torch.no_grad():
        for m in model.modules():
            if "_verispec_class" in vars(m):
                m.__class__ = m._verispec_class
                del m._verispec_class
            if not hasattr(m, "_verispec_kernels"):
                continue
            if hasattr(m, "_verispec_siblings"):
                m.weight.data = m.weight.data.clone()
                if m.bias is not None:
                    m.bias.data = m.bias.data.clone()
                del m._verispec_siblings, m._verispec_sibling
            vars(m).pop("forward", None)
            vars(m).pop("_verispec_class_forward", None)
            del m._verispec_kernels


def _is_plain_rms_norm(module: torch.nn.Module) -> bool:
    """Whether a module computes weight * x / sqrt(mean(x^2) + eps) (checked on a random
    input against verispec's kernel), so that kernel may run it."""
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    w = getattr(module, "weight", None)
    if (not type(module).__name__.endswith("RMSNorm") or not isinstance(eps, float)
            or not isinstance(w, torch.Tensor) or w.dim() != 1 or w.dtype != torch.float32
            or w.device.type != "cpu" or not w.is_contiguous() or list(module.children())):
        return False
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, w.shape[0], generator=g) * 3
    with torch.no_grad():
        want = module(x)
    got = native_rms_norm(x, w, eps)
    if want.shape != got.shape or not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
        return False
    module._verispec_eps = eps
    return True


# --- the batch-invariant mode (verispec.models.layers.batch_invariant) ---------------------------


@hf_capture.opaque
def _bi_linear_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear.forward in the batch-invariant mode: fixed (ROWS, in) x (in, out) products."""
    return _bi.linear(x, self.weight, self.bias)


@hf_capture.opaque
def _bi_rows_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A norm module's own forward in the batch-invariant mode, on fixed chunks of ROWS rows."""
    forward = self._verispec_class_forward
    return _bi.rows(lambda c: forward(self, c), x)


def _norm_is_row_wise(module: torch.nn.Module) -> bool:
    """Whether a norm module normalizes each row over its last dimension alone, so that
    running it on chunks of rows changes nothing but rounding: its output on a random
    [3, 5, d] input against the chunked one."""
    d = None
    for p in module.parameters(recurse=False):
        if p.dim() == 1:
            d = p.shape[0]
    d = d or getattr(module, "normalized_shape", (None,))[-1]
    if not isinstance(d, int) or d < 1:
        return False
    p0 = next(module.parameters(), None)
    dtype = p0.dtype if p0 is not None else torch.float32
    device = p0.device if p0 is not None else torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, d, generator=g) * 3).to(device=device, dtype=dtype)
    forward = type(module).forward
    try:
        with torch.no_grad():
            want = forward(module, x)
            got = _bi.rows(lambda c: forward(module, c), x, 4)
    except Exception:  # noqa: BLE001 - a norm that needs more than one input: not wrapped
        return False
    return (torch.is_tensor(want) and want.shape == got.shape
            and torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2))


def _install_batch_invariant(model: torch.nn.Module) -> None:
    """Puts the batch-invariant ops under a model's nn.Linear layers and row-wise norm
    modules (instance-level forwards, undone by _uninstall_cpu_kernels)."""
    import types

    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module._verispec_kernels = None
            module.forward = types.MethodType(_bi_linear_forward, module)
        elif (type(module).__name__.endswith("Norm") and not list(module.children())
              and _norm_is_row_wise(module)):
            module._verispec_kernels = None
            module._verispec_class_forward = type(module).forward
            module.forward = types.MethodType(_bi_rows_forward, module)


# aten ops that compute each output element from inputs without summing floats (data
# movement, allocation, masks), besides the pointwise-tagged ops and views
_ROW_LOCAL_OPS = frozenset((
    "embedding", "index_select", "index", "gather", "cat", "stack", "clone", "copy_", "copy",
    "_to_copy", "empty", "empty_like", "empty_strided", "zeros", "zeros_like", "ones",
    "ones_like", "full", "full_like", "arange", "new_zeros", "new_empty", "new_ones",
    "new_full", "new_empty_strided", "fill_", "fill", "index_copy_", "index_copy",
    "index_put_", "index_put", "scatter", "scatter_", "repeat", "repeat_interleave",
    "_unsafe_view", "split", "split_with_sizes", "unbind", "chunk", "flip", "roll",
    "lift_fresh", "lift_fresh_copy", "_local_scalar_dense", "scalar_tensor", "triu", "tril",
    "masked_fill", "masked_fill_", "where", "constant_pad_nd", "slice_scatter",
    "select_scatter", "detach", "alias", "contiguous", "resize_", "set_", "sym_size",
    "sym_stride", "sym_numel", "_assert_async", "is_nonzero"))
# products that are exact when they reduce over one term (RoPE's angle outer products)
_PRODUCT_OPS = {"mm": 0, "bmm": 0, "matmul": 0, "addmm": 1, "baddbmm": 1, "dot": 0, "mv": 0}


def _row_local(func: Any, args: tuple) -> bool:
    """Whether an aten op's result for one token cannot depend on the others in its pass."""
    name = func.overloadpacket.__name__
    if torch.Tag.pointwise in func.tags or func.is_view or name in _ROW_LOCAL_OPS:
        return True
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if tensors and not any(t.is_floating_point() or t.is_complex() for t in tensors):
        return True  # integer and boolean arithmetic is exact in any order
    if name in _PRODUCT_OPS:
        a = args[_PRODUCT_OPS[name]]
        return isinstance(a, torch.Tensor) and a.shape[-1] == 1
    if name in ("dropout", "feature_dropout", "alpha_dropout"):  # identity in eval mode
        return len(args) > 2 and args[2] is False
    return False


def _batch_invariant_problems(run) -> list[str]:
    """The ops of one forward ``run()`` outside the batch-invariant ops (linear layers,
    wrapped norms, attention) that may round a token by what shares its pass, as
    "aten.op (in Module)"; empty when there are none."""
    from torch.nn.modules import module as nn_module
    from torch.utils._python_dispatch import TorchDispatchMode

    stack: list[str] = []
    found: dict[str, None] = {}

    class Check(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if _bi._depth == 0 and not _row_local(func, args):
                where = stack[-1] if stack else "the model's forward"
                found.setdefault(f"aten.{func.overloadpacket.__name__} (in {where})")
            return func(*args, **(kwargs or {}))

    def enter(module, args) -> None:
        stack.append(type(module).__name__)

    def leave(module, args, output) -> None:  # returns None: the output stays
        if stack:
            stack.pop()

    pre = nn_module.register_module_forward_pre_hook(enter)
    post = nn_module.register_module_forward_hook(leave)
    try:
        with Check():
            run()
    finally:
        pre.remove()
        post.remove()
    return list(found)
