"""Stand-ins on the CPU for what only a GPU shows: a CUDA graph's replay and the
device -> host reads that make the host wait (issue 64). Each one behaves as the GPU
would where a CPU run cannot tell the difference by itself, and each test file that
uses one shows, with a control that does the forbidden thing on purpose, that it fires.

- :class:`ReplayGraph`: a captured body's aten ops recorded once and replayed on the
  captured tensors, the Python not run again (a CUDA graph replays kernels on fixed
  addresses). A forward that fills a buffer the capture did not read, or a graph
  replayed for pools it was not captured with, computes from what the capture saw and
  gives other logits. What cannot be captured fails the capture: an op that waits for
  the device (``item``, ``nonzero``, a boolean mask...) raises as CUDA does; verispec's
  CPU kernels (raw pointers, invisible to torch's dispatcher) are not replayed at all.
- :class:`DeviceReadAudit`: counts the reads a step would make on a GPU, whatever
  allocated the tensor read. "Device" is a taint: the models' weights and KV pools, the
  staging's uploads, tensors made with ``device=`` the model's device, what the models
  and verispec's CPU kernels return, and everything computed from those; every other
  tensor is the host's. A read of a device tensor (``.cpu()``, ``.to("cpu")``,
  ``item``, ``tolist``, ``numpy``, ``bool()``, a copy into a host tensor) or an op whose
  result size the device decides (``nonzero``, the one-argument ``where``, boolean
  indexing, ``unique``, ``repeat_interleave`` with a tensor count, ``masked_select``)
  or that answers the host (``equal``, ``allclose``) counts one. ``.cpu()`` of a device
  tensor returns a copy, as on a GPU (on a CPU it would alias). With a staging, the
  audit also stands in for the copy stream: an upload is pending until the step's
  blocking download, so ``host_rollovers`` counts a step that began with uploads in
  flight, as the CUDA event would.
"""

from __future__ import annotations

import sys
import traceback
from typing import Any, Callable, Optional

import torch
import torch.utils._pytree as pytree
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

__all__ = ["DeviceReadAudit", "ReplayGraph", "CAPTURE_ERROR"]

#: What CUDA says when a captured body waits for the device.
CAPTURE_ERROR = "operation not permitted when stream is capturing"

# ops that make the host wait for the device: the answer is a host value, or the
# result's size depends on device values (by overload packet: under inference_mode the
# composite ops, where(cond) or repeat_interleave(t, counts), reach the dispatcher whole)
_ANSWERS_HOST = {aten._local_scalar_dense, aten.item, aten.is_nonzero, aten.equal, aten.allclose}
_DATA_SIZED = {aten.nonzero, aten.nonzero_numpy, aten.argwhere, aten._unique, aten._unique2,
               aten.unique_dim, aten.unique_consecutive, aten.masked_select, aten.bincount}
_EMPTY = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
          aten.new_empty.default, aten.new_empty_strided.default}


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _is_mask(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)


def _waits(func, args, kwargs) -> Optional[list[torch.Tensor]]:
    """The tensors whose values an aten op waits for (None: it does not wait)."""
    packet = func.overloadpacket
    if packet in _ANSWERS_HOST or packet in _DATA_SIZED:
        return _tensors(args)
    if func is aten.where.default:  # where(condition): nonzero
        return _tensors(args)
    if packet is aten.repeat_interleave and kwargs.get("output_size") is None:
        counts = args[0] if func is aten.repeat_interleave.Tensor else (
            args[1] if len(args) > 1 else None)
        return [counts] if isinstance(counts, torch.Tensor) else None  # the output's size
    if func is aten.index.Tensor:
        masks = [i for i in args[1] if _is_mask(i)]
        return masks or None  # a boolean index: nonzero first
    if packet in (aten.index_put_, aten.index_put, aten._index_put_impl_):
        masks = [i for i in args[1] if _is_mask(i)]
        # a one-value write through one mask is a masked_fill (no wait)
        return masks if masks and args[2].numel() != 1 else None
    return None


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


# --- a CUDA graph ---------------------------------------------------------------------


class _Recorder(TorchDispatchMode):
    def __init__(self, ops: list):
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _waits(func, args, kwargs) is not None:
            raise RuntimeError(f"ReplayGraph: {func} waits for the device: {CAPTURE_ERROR}")
        out = func(*args, **kwargs)
        inputs = {_storage_key(t) for t in _tensors((args, kwargs))}
        outs = _tensors(out)
        # results written into a new buffer are copied into the captured one on replay;
        # views and in-place results are the captured buffers themselves
        fresh = [i for i, t in enumerate(outs)
                 if func not in _EMPTY and _storage_key(t) not in inputs]
        self.ops.append((func, args, kwargs, outs, fresh))
        return out


class ReplayGraph:
    """A CUDA graph's replay on the CPU (module docstring): ``capture`` runs the body
    once, recording its aten ops with the tensors they read and wrote (held: their
    storage stays the graph's); ``replay`` runs those ops again on those tensors, in the
    same order, with the same shapes and Python values, and leaves the body's result in
    ``out``. Nothing the body's Python would compute afresh is seen by a replay."""

    def __init__(self, pool: Any = None):
        self.ops: list = []
        self.out: Optional[torch.Tensor] = None
        self._inference = False

    def capture(self, body: Callable[[], torch.Tensor]) -> torch.Tensor:
        self._inference = torch.is_inference_mode_enabled()
        ops: list = []
        with _Recorder(ops):
            out = body()
        self.ops, self.out = ops, out
        return out

    def replay(self) -> None:
        with torch.inference_mode(self._inference):
            for func, args, kwargs, outs, fresh in self.ops:
                if not fresh:
                    func(*args, **kwargs)
                    continue
                got = _tensors(func(*args, **kwargs))
                for i in fresh:
                    outs[i].copy_(got[i])

    def storages(self) -> set[int]:
        """Every buffer the capture read or wrote (the graph's addresses)."""
        return {_storage_key(t) for op in self.ops for t in _tensors((op[1], op[2], op[3]))}


# --- device -> host reads ---------------------------------------------------------------


def _names_host(a: Any) -> bool:
    """Whether a Tensor.to argument names the host unambiguously: the string "cpu" (on
    a CPU run a torch.device("cpu") may be the model's device as well as the host)."""
    return isinstance(a, str) and a.split(":")[0] == "cpu"


class _Taint(TorchDispatchMode):
    def __init__(self, audit: "DeviceReadAudit"):
        super().__init__()
        self.audit = audit

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        audit = self.audit
        if audit._plain:
            return func(*args, **kwargs)
        waited = _waits(func, args, kwargs)
        if waited is not None and any(audit.is_device(t) for t in waited):
            audit._count("read", str(func.overloadpacket.__name__))
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            if audit.is_device(src) and not audit.is_device(dst):
                audit._count("read", "copy_ into a host tensor")  # device -> host
                return func(*args, **kwargs)
            if audit.is_device(dst) and not audit.is_device(src) and src.dim() > 0:
                audit._count("upload", "copy_ from a host tensor")
        out = func(*args, **kwargs)
        if any(audit.is_device(t) for t in _tensors((args, kwargs))):
            audit.mark(out)
        return out


class DeviceReadAudit(TorchFunctionMode):
    """Counts device -> host reads and unstaged uploads while active (module docstring).

    ``device``: the device the models run on. ``staging``: the decoder's PlanStaging
    (its uploads are the device's; its download is the one read a step should make;
    its copy event stood in for off CUDA). ``device_objects``: models, KV pools, anything
    holding the device's tensors (walked for tensors; a model's ``forward`` results are
    the device's whatever allocated them). Counters: ``reads``, ``unstaged_uploads``,
    ``sites`` (where each was made: "read what file:line").

    On a CPU run ``Tensor.to`` moves a device tensor to the host when it names "cpu" as
    a string (a torch.device("cpu") is also the model's device there), ``.cpu()`` always;
    a factory makes a device tensor when given ``device=`` as a torch.device (the string
    "cpu" names the host).
    """

    _FACTORIES_FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray}
    _READS = {torch.Tensor.tolist, torch.Tensor.numpy}

    def __init__(self, device: Any, staging: Any = None, device_objects: tuple = ()):
        super().__init__()
        self.device = torch.device(device)
        self.staging = staging
        self.reads = 0
        self.unstaged_uploads = 0
        self.sites: dict[str, int] = {}
        self._device: dict[int, StorageWeakRef] = {}
        self._quiet = False   # inside the staging's own upload
        self._plain = False   # a host copy made here: not the device's
        self._undo: list[Callable[[], None]] = []
        self._pending = False
        self._taint = _Taint(self)
        self._models = [obj for obj in device_objects if callable(getattr(obj, "forward", None))]
        for obj in device_objects:
            self.mark(_walk(obj))

    # -- the taint ---------------------------------------------------------------------
    def mark(self, tree: Any) -> None:
        """Declares the tensors in ``tree`` (and every view of their storage) the device's."""
        for t in _tensors(tree):
            key = _storage_key(t)
            ref = self._device.get(key)
            if ref is None or ref.expired():
                self._device[key] = StorageWeakRef(t.untyped_storage())

    def is_device(self, t: Any) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        if self.device.type != "cpu":
            return t.device.type != "cpu"
        ref = self._device.get(_storage_key(t))
        return ref is not None and not ref.expired()

    def _count(self, kind: str, what: str) -> None:
        if self._quiet:
            return
        if kind == "read":
            self.reads += 1
        else:
            self.unstaged_uploads += 1
        for frame in reversed(traceback.extract_stack(limit=30)[:-2]):
            name = frame.filename
            if "/torch/" not in name and not name.endswith("standins.py"):
                key = f"{kind} {what} {name.rsplit('/', 1)[-1]}:{frame.lineno}"
                self.sites[key] = self.sites.get(key, 0) + 1
                return

    # -- what the audit wraps while active ----------------------------------------------
    def _patch(self, obj: Any, name: str, value: Any, instance: bool) -> None:
        if instance:  # an attribute of the instance, over its class's
            missing = object()
            old = obj.__dict__.get(name, missing)
            obj.__dict__[name] = value
            self._undo.append(lambda: obj.__dict__.pop(name, None) if old is missing
                              else obj.__dict__.__setitem__(name, old))
        else:
            old = getattr(obj, name)
            setattr(obj, name, value)
            self._undo.append(lambda: setattr(obj, name, old))

    def _wrap_forward(self, model: Any) -> None:
        forward = model.forward

        def marked(*args, **kwargs):
            out = forward(*args, **kwargs)
            self.mark(out)
            return out
        self._patch(model, "forward", marked, instance=True)

    def _wrap_staging(self, staging: Any) -> None:
        put, download = staging.put, staging.download

        def put_(*args, **kwargs):
            self._quiet, was = True, self._quiet
            try:
                out = put(*args, **kwargs)
            finally:
                self._quiet = was
            self.mark(out)
            self._pending = True  # an upload in flight until the step's download
            return out

        def download_(*args, **kwargs):
            out = download(*args, **kwargs)
            self._pending = False  # the blocking read waited for the stream
            return out
        self._patch(staging, "put", put_, instance=True)
        self._patch(staging, "download", download_, instance=True)
        if not staging.cuda and staging._event is None:
            audit = self

            class CopyEvent:  # the CUDA event recorded after the latest upload
                def query(self) -> bool:
                    return not audit._pending

            staging._event = CopyEvent()
            self._undo.append(lambda: setattr(staging, "_event", None))

    def _wrap_kernels(self) -> None:
        """verispec's CPU kernels write through raw pointers: what they return (and the
        float buffers they write) is the device's when they read the device's."""
        from verispec.models.layers import kernels

        originals = {n: getattr(kernels, n) for n in kernels.__all__}
        names = {id(f): n for n, f in originals.items()}
        wrapped = {}
        for n in kernels.__all__:
            def call(*args, __f=originals[n], **kwargs):
                out = __f(*args, **kwargs)
                given = _tensors((args, kwargs))
                held = [t for a in (*args, *kwargs.values()) if hasattr(a, "__dict__")
                        for t in _tensors(list(vars(a).values()))]
                if any(self.is_device(t) for t in given + held):
                    self.mark(out)
                    self.mark([t for t in given if t.is_floating_point()])
                return out
            wrapped[n] = call
        for mod in list(sys.modules.values()):
            if not getattr(mod, "__name__", "").startswith("verispec"):
                continue
            for attr, value in list(vars(mod).items()):
                if id(value) in names and value is originals[names[id(value)]]:
                    self._patch(mod, attr, wrapped[names[id(value)]], instance=False)

    def __enter__(self):
        for model in self._models:
            self._wrap_forward(model)
        if self.staging is not None:
            self._wrap_staging(self.staging)
        self._wrap_kernels()
        super().__enter__()
        self._taint.__enter__()
        return self

    def __exit__(self, *exc):
        try:
            self._taint.__exit__(*exc)
            return super().__exit__(*exc)
        finally:
            while self._undo:
                self._undo.pop()()

    # -- the Python-level calls a CPU tensor answers without the dispatcher ---------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        on_cpu = self.device.type == "cpu"
        if func is torch.Tensor.cpu or (func is torch.Tensor.to and on_cpu and any(
                _names_host(a) for a in (*args[1:], kwargs.get("device")))):
            if self.is_device(args[0]):
                self._count("read", f"Tensor.{func.__name__}")
                self._plain = True  # what comes back is the host's
                try:
                    out = func(*args, **kwargs)
                    # a GPU's .cpu() never aliases the device (here it would)
                    return out.clone() if _storage_key(out) == _storage_key(args[0]) else out
                finally:
                    self._plain = False
        elif func in self._READS and self.is_device(args[0]):
            self._count("read", f"Tensor.{func.__name__}")
        out = func(*args, **kwargs)
        device = kwargs.get("device")
        if func is torch.Tensor.cuda or (func is torch.Tensor.to and not on_cpu
                                         and out.device.type == self.device.type):
            if not self.is_device(args[0]):
                self._count("upload", f"Tensor.{func.__name__}")
        elif (func is not torch.Tensor.to and device is not None and not _names_host(device)
              and torch.device(device).type == self.device.type):
            if func in self._FACTORIES_FROM_DATA:
                self._count("upload", func.__name__)  # Python values straight to the device
            self.mark(out)
        elif func is torch.Tensor.new_tensor and self.is_device(args[0]):
            self._count("upload", "Tensor.new_tensor")
        return out


def _walk(obj: Any, depth: int = 10, seen: Optional[set] = None) -> list[torch.Tensor]:
    """The tensors an object holds (a module's parameters and buffers, attributes,
    containers), ``depth`` levels down."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth < 0:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, torch.nn.Module):
        return [*obj.parameters(), *obj.buffers()]
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        items = list(obj)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type) and not callable(obj):
        items = list(vars(obj).values())
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("verispec"):
        items = list(vars(obj).values())
    else:
        return []
    return [t for item in items for t in _walk(item, depth - 1, seen)]
