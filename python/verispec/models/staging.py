"""How a decode step's plan reaches the device: one staging object per step source.

Everything a step computes on the host and a forward needs on the device (the packed
step inputs, the attention plan's gather indices, KV write slots, padding maps, masks,
keyed-row indices) goes through :class:`PlanStaging`:

- the values are written into a **host arena**: one page-locked (pinned) buffer when the
  device is CUDA, a plain CPU buffer otherwise, reused across steps and grown
  geometrically (doubling) when a step needs more;
- each upload is one ``copy_(non_blocking=True)`` from the arena into a **device arena**,
  a preallocated device buffer carved linearly within a step and rewound at the next
  step: a step that uploads the same sizes in the same order (the same bucket: batch
  size, k, context blocks) gets the same device addresses every step, as a captured CUDA
  graph needs;
- the host never waits for an upload. The host arena is rewound at a step's start only
  when the event recorded after its last copy has completed (``Event.query()``, not a
  wait): after the step's result download, which waits for the stream, it has. If not
  (a step that failed before its download) a fresh buffer is taken instead and the old
  one is left to torch's caching host allocator, which keeps a pinned block until the
  copies recorded on it are done;
- the one blocking transfer of a step, the download of its results, is
  :meth:`PlanStaging.download`; it is counted, as the uploads are, so a test on any
  device can assert how many blocking transfers a step made (``stats()``).

A model forward finds the staging on its batch (``PagedBatch.staging``, set by
SpecDecoder) and uploads through :func:`upload`; a batch without one (a model called
directly) gets an ordinary synchronous copy, counted nowhere.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional, Sequence, Union

import torch

ALIGN = 64                 # bytes: every upload starts on a 64-byte boundary
MIN_BYTES = 1 << 14        # the first arena size (16 KiB); grown by doubling

Values = Union[torch.Tensor, Sequence[int], Sequence[float], Sequence[bool]]


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _grown(have: int, need: int) -> int:
    size = max(have, MIN_BYTES)
    while size < need:
        size *= 2
    return size


class PlanStaging:
    """Pinned host arena -> device arena uploads for one step at a time (module docstring).

    ``begin_step()`` rewinds both arenas; ``put(values, dtype)`` returns the values on
    the device (a view of the device arena, valid until the next ``begin_step``);
    ``download(tensor)`` brings a device tensor to the host (the step's one wait).
    Counters, since construction: ``steps``, ``uploads``, ``upload_bytes``,
    ``blocking_reads``, ``host_buffers`` and ``device_buffers`` (allocations, growth
    included), ``host_rollovers`` (a step began before the previous copies were done).
    """

    def __init__(self, device: Union[torch.device, str], *, pin: Optional[bool] = None):
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.cuda = self.device.type == "cuda"
        self.pin = self.cuda if pin is None else bool(pin)
        if self.pin and not torch.cuda.is_available():
            raise ValueError("PlanStaging: pin=True needs CUDA (page-locked memory), but "
                             "torch.cuda.is_available() is False")
        self._host: Optional[torch.Tensor] = None
        self._host_size = 0  # the host arena's size, kept across a rollover
        self._dev: Optional[torch.Tensor] = None
        self._host_at = 0
        self._dev_at = 0
        self._event: Any = None  # recorded after the latest copy (CUDA only)
        # storages of this step's host-side tensors (what was put, the host arena): what
        # a TransferAudit counts as the host on a CPU-only run
        self.host_storages: set[int] = set()
        self._held: list = []  # the tensors put this step: kept alive, so no address is reused
        self.steps = self.uploads = self.upload_bytes = self.blocking_reads = 0
        self.host_buffers = self.device_buffers = self.host_rollovers = 0

    # -- the step ------------------------------------------------------------------
    def begin_step(self) -> None:
        """Rewinds the arenas for a new step (no wait: see the module docstring)."""
        self.steps += 1
        self.host_storages.clear()
        self._held.clear()
        self._dev_at = 0
        if self._event is not None and not self._event.query():
            self.host_rollovers += 1
            self._host = None  # copies still read it: the caching allocator keeps it alive
        self._host_at = 0

    def put(self, values: Values, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """``values`` (a CPU tensor of any shape, or a flat sequence of numbers) as a
        ``dtype`` tensor of the same shape on the device, uploaded asynchronously."""
        if isinstance(values, torch.Tensor):
            if values.device.type != "cpu":
                raise ValueError(f"PlanStaging.put: values must be on the CPU (host), got a "
                                 f"tensor on {values.device}")
            src = values if dtype is None or values.dtype == dtype else values.to(dtype)
        else:
            if dtype is None:
                raise ValueError("PlanStaging.put: dtype is required for a sequence of values, "
                                 f"got dtype=None with a {type(values).__name__}")
            src = torch.tensor(values, dtype=dtype)
        shape, n = src.shape, src.numel() * src.element_size()
        host = self._carve_host(n)
        if isinstance(values, torch.Tensor):  # held until the next step
            self.host_storages.add(values.untyped_storage().data_ptr())
            self._held.append(values)
        self.host_storages.add(host.untyped_storage().data_ptr())
        dev = self._carve_device(n)
        if n:
            host.view(src.dtype).view(shape).copy_(src)
            dev.copy_(host, non_blocking=True)
            if self.cuda:
                if self._event is None:
                    self._event = torch.cuda.Event()
                self._event.record(torch.cuda.current_stream(self.device))
        self.uploads += 1
        self.upload_bytes += n
        return dev.view(src.dtype).view(shape)

    def download(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` on the host: the step's blocking device -> host transfer (counted)."""
        self.blocking_reads += 1
        return tensor.cpu()

    def stats(self) -> dict:
        return dict(steps=self.steps, uploads=self.uploads, upload_bytes=self.upload_bytes,
                    blocking_reads=self.blocking_reads, host_buffers=self.host_buffers,
                    device_buffers=self.device_buffers, host_rollovers=self.host_rollovers,
                    host_bytes=0 if self._host is None else self._host.numel(),
                    device_bytes=0 if self._dev is None else self._dev.numel(),
                    pinned=self.pin)

    # -- the arenas ----------------------------------------------------------------
    def _carve_host(self, n: int) -> torch.Tensor:
        end = self._host_at + n
        if self._host is None or end > self._host.numel():
            # a new buffer: what was carved from the old one stays valid (its own storage)
            size = self._host_size = _grown(self._host_size, _aligned(end))
            with torch.inference_mode(False):  # written in place by later steps, in or out
                self._host = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
            self.host_buffers += 1
            self._host_at, end = 0, n
        out = self._host[self._host_at:end]
        self._host_at = _aligned(end)
        return out

    def _carve_device(self, n: int) -> torch.Tensor:
        end = self._dev_at + n
        if self._dev is None or end > self._dev.numel():
            # big enough for the whole step so far: the next step fits in one buffer.
            # Views carved earlier keep the old buffer alive until they die.
            size = _grown(0 if self._dev is None else self._dev.numel(), _aligned(end))
            with torch.inference_mode(False):
                self._dev = torch.empty(size, dtype=torch.uint8, device=self.device)
            self.device_buffers += 1
            self._dev_at, end = 0, n
        out = self._dev[self._dev_at:end]
        self._dev_at = _aligned(end)
        return out


def upload(staging: Optional[PlanStaging], values: Values, dtype: torch.dtype,
           device: torch.device) -> torch.Tensor:
    """``values`` as a ``dtype`` tensor on ``device``: through ``staging`` when it serves
    that device (asynchronous, counted), else an ordinary (on CUDA, synchronous) copy."""
    if staging is not None and staging.device == _canonical(device):
        return staging.put(values, dtype)
    if isinstance(values, torch.Tensor):
        return values.to(device=device, dtype=dtype)
    return torch.tensor(values, dtype=dtype, device=device)


def _canonical(device: Union[torch.device, str]) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class TransferAudit(torch.overrides.TorchFunctionMode):
    """Counts, while active, the calls that on CUDA would block the host or upload
    outside the staging: ``unstaged_uploads`` (torch.tensor / as_tensor / asarray with an
    explicit non-CPU-host ``device``, i.e. a synchronous pageable copy on CUDA),
    ``reads`` (Tensor.cpu / item / tolist / numpy / bool() / int() / float() of a tensor
    that is not a host tensor, and nonzero, masked_select or boolean-mask indexing of
    one: a result sized by device values) and their call sites. On any device, so a CPU test can assert
    a step's transfers; on CUDA torch.cuda.set_sync_debug_mode sees the syncs themselves.

    Host tensors are not transfers when read: CPU tensors when the device is not the
    CPU; on a CPU-only run, tensors declared with ``host()``, the host side of
    ``staging``'s current step (what was put: the step's packed inputs and its views),
    tensors built from Python values without a device, and the outputs of torch
    functions whose tensor inputs are all host tensors.
    """

    _FACTORIES = {torch.tensor, torch.as_tensor, torch.asarray}
    _READS = {torch.Tensor.cpu, torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy,
              torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
              torch.Tensor.__index__}
    # results whose size depends on device values: the host waits to learn it
    _DATA_SIZED = {torch.Tensor.nonzero, torch.nonzero, torch.masked_select,
                   torch.Tensor.masked_select}

    def __init__(self, device: Union[torch.device, str], staging: Optional[PlanStaging] = None):
        super().__init__()
        self.device = _canonical(device)
        self.staging = staging
        self.unstaged_uploads = 0
        self.reads = 0
        self.sites: dict[str, int] = {}
        # host tensors by id, held weakly: a dead tensor's entry goes with it (an address
        # or an id reused by a device tensor is never taken for the host)
        self._host: dict[int, Any] = {}

    def host(self, *tensors: Optional[torch.Tensor]) -> None:
        """Declares host tensors (the step's packed inputs, the staging arena)."""
        for t in tensors:
            if t is not None and id(t) not in self._host:
                key = id(t)
                self._host[key] = weakref.ref(t, lambda _, key=key: self._host.pop(key, None))

    def _is_host(self, t: torch.Tensor) -> bool:
        if t.device.type == "cpu" and self.device.type != "cpu":
            return True
        if self.staging is not None and t.untyped_storage().data_ptr() in self.staging.host_storages:
            return True  # alive for the whole step: no stale address
        ref = self._host.get(id(t))
        return ref is not None and ref() is t

    def _site(self, kind: str) -> None:
        import traceback

        for frame in reversed(traceback.extract_stack(limit=12)[:-2]):
            if "staging.py" not in frame.filename and "torch" not in frame.filename:
                key = f"{kind} {frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}"
                self.sites[key] = self.sites.get(key, 0) + 1
                return

    def _moves_to_device(self, args, kwargs) -> bool:
        """Whether a Tensor.to call names the audited device (positionally or not)."""
        for a in (*args[1:], kwargs.get("device")):
            if isinstance(a, torch.device) or (isinstance(a, str) and a.split(":")[0] in
                                               ("cpu", "cuda", "mps", "xpu", "meta")):
                if _canonical(a) == self.device:
                    return True
        return False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tensors = [t for a in (*args, *kwargs.values())
                   for t in (a if isinstance(a, (list, tuple)) else (a,))
                   if isinstance(t, torch.Tensor)]
        on_device = kwargs.get("device") is not None and _canonical(kwargs["device"]) == self.device
        if func in self._FACTORIES and on_device:
            self.unstaged_uploads += 1  # Python values straight to the device
            self._site("upload")
            result_host = False
        elif func in self._READS:
            if tensors and not self._is_host(tensors[0]):
                self.reads += 1
                self._site("read")
            result_host = True  # on the host now
        elif (func in self._DATA_SIZED or (func is torch.Tensor.__getitem__ and any(
                t.dtype in (torch.bool, torch.uint8) for t in tensors[1:]))) and not all(
                self._is_host(t) for t in tensors):
            self.reads += 1  # a boolean mask or nonzero on the device
            self._site("read")
            result_host = False
        elif (func in (torch.Tensor.to, torch.Tensor.cuda) and tensors
              and self._is_host(tensors[0])
              and (func is torch.Tensor.cuda or self._moves_to_device(args, kwargs))):
            self.unstaged_uploads += 1  # a host tensor to the device, not staged
            self._site("upload")
            result_host = False
        else:
            # built on the host: from Python values or buffers (no tensor in, no device),
            # or from host tensors only
            result_host = not on_device and all(self._is_host(t) for t in tensors)
        if result_host and isinstance(out, torch.Tensor):
            self.host(out)
        return out
