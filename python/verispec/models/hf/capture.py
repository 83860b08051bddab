"""Captured forwards for HFModel: a transformers model's forward at one token count,
recorded once as straight-line Python and replayed without the module code around it.

Why: on a CPU, a small model's decode forward through transformers spends more time in
Python module code (``nn.Module.__call__``, attribute lookups, config reads, deprecation
and checkpointing wrappers) than in its products: SmolLM2-135M's one-token forward costs
~12 ms besides its products in the adapter against ~4 ms in the native Llama
(``bench/bench_hf_adapter.py --profile``). The ops themselves are the same every time
the shapes are.

How: one eager forward runs under a ``TorchFunctionMode`` that logs every torch call
(functions, tensor methods, properties) with its arguments, and verispec's own functions
called inside the forward (the CPU kernels' forwards, the RoPE dispatcher, the paged
attention function: ``opaque``) log themselves as one call each and run unlogged. The log
becomes a generated Python function, one line a call, its tensors as locals
(``del``-ed after their last use); tensors that no logged call produced (weights, buffers)
are held by reference. verispec's functions read the forward's context (the batch's
plan) when they run, so a program serves every batch with its token count.

What keeps it exact:
- A forward whose Python reads tensor values (``.item()``, ``bool(t)``, ``.tolist()``,
  any non-tensor result besides shape and metadata queries) is never captured: its
  control flow could depend on the values.
- A program is replayed only for the same key (token count, kept logits rows, inputs'
  dtypes and strides, the CPU kernels' switches, the attention implementation), with no
  forward hooks anywhere (global or on any of the model's modules), every module in eval
  mode, no autocast, no torch function mode of the caller's active (``with
  torch.device(...)``), and no parameter, buffer or submodule (re)assigned since it was
  recorded (torch's registration hooks count those).
- A tensor the logged calls read but did not make is held by reference only if it is
  not an inference tensor (weights and buffers are not; anything an inference-mode
  forward made is), so no value of the recording's batch is baked in.
- It is checked once before use, on the key's next forward (another batch): the program
  runs, then the eager forward (which rewrites the same cache slots, so whatever the
  program wrote is overwritten), and their logits must be equal bit for bit; the eager
  logits are returned. Otherwise that key stays eager.
"""
from __future__ import annotations

import contextvars
import functools
import math
import operator
from typing import Any, Callable, Optional

import torch
from torch.overrides import TorchFunctionMode

#: Forwards of at most this many tokens are captured (decode and verify passes); longer
#: ones (prefill chunks) run eagerly, where the module code is a small part of the time.
MAX_TOKENS = 64
#: A key is recorded at its third forward. Recording costs about two eager forwards and
#: the check another two, and a replay saves a fraction of one, so shapes seen once or
#: twice (a batch's odd token count) stay eager.
RECORD_AFTER = 2
#: Programs kept per model (the least recently used dropped first).
MAX_PROGRAMS = 32
#: After this many invalidations (weights or modules reassigned) a model stops capturing.
MAX_INVALIDATIONS = 4

_RECORDER: contextvars.ContextVar[Optional["_Recorder"]] = contextvars.ContextVar(
    "verispec_hf_capture", default=None)

# torch's module registration hooks bump this when a parameter, buffer or submodule of a
# watched module (one of a wrapped model's) is assigned: a program records the value it saw
_generation = 0
_hooks_installed = False
_watched: dict[int, int] = {}  # id(module) -> how many Captures watch it


def _bump(*_args) -> None:
    global _generation
    _generation += 1


def _registered(module, *_args) -> None:
    if id(module) in _watched:
        _bump()


def _install_registration_hooks() -> None:
    global _hooks_installed
    if not _hooks_installed:
        from torch.nn.modules import module as nn_module

        nn_module.register_module_parameter_registration_hook(_registered)
        nn_module.register_module_buffer_registration_hook(_registered)
        nn_module.register_module_module_registration_hook(_registered)
        _hooks_installed = True


def invalidate() -> None:
    """Every captured program is stale (verispec changed modules' forwards)."""
    _bump()


def opaque(fn: Callable) -> Callable:
    """Marks one of verispec's functions called inside a wrapped model's forward: a
    recording logs it as one call (run with the recording off), so a replay runs it again
    with that forward's arguments and context."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        rec = _RECORDER.get()
        if rec is None:
            return fn(*args, **kwargs)
        return rec.opaque_call(fn, args, kwargs)

    return wrapper


class Refused(Exception):
    """A forward that cannot be captured (the reason is the message)."""


# non-tensor results that depend on shapes and metadata only (constants at fixed shapes)
_QUERIES = frozenset({
    "size", "dim", "numel", "__len__", "stride", "storage_offset", "is_contiguous",
    "element_size", "nelement", "ndimension", "is_floating_point", "is_complex",
    "get_device", "is_inference", "is_signed", "__hash__", "has_names", "is_set_to",
    "is_pinned", "__repr__", "__format__", "__str__", "is_shared", "type"})
_PROPERTIES = frozenset({
    "shape", "ndim", "dtype", "device", "is_cuda", "is_cpu", "requires_grad", "layout",
    "is_sparse", "is_quantized", "is_meta", "is_mkldnn", "is_nested", "names", "grad_fn",
    "is_leaf", "itemsize", "nbytes", "is_xpu", "is_mps", "output_nr", "_base"})
# calls whose result is their first argument when it is (no copy): not replayed
_IDENTITY_WHEN_SELF = frozenset({"to", "contiguous", "float", "type_as", "type", "cpu",
                                 "double", "half", "bfloat16", "cuda", "dropout",
                                 "alpha_dropout", "feature_alpha_dropout", "dropout1d",
                                 "dropout2d", "dropout3d"})


_FORWARD_HOOKS = operator.attrgetter("_forward_hooks")
_PRE_HOOKS = operator.attrgetter("_forward_pre_hooks")
_TRAINING = operator.attrgetter("training")


def _name(func: Any) -> str:
    name = getattr(func, "__name__", "")
    if name == "__get__":  # a tensor property: the descriptor's name
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return name


class _Recorder(TorchFunctionMode):
    """Logs one forward's torch calls (see the module docstring) as generated code."""

    def __init__(self, inputs: list[torch.Tensor]) -> None:
        super().__init__()
        self.var: dict[int, str] = {}
        self.held: list[Any] = []      # every tensor seen, alive: ids stay unique
        self.consts: list[Any] = []
        self.const_index: dict[int, int] = {}
        self.lines: list[tuple[str, list[str], list[str]]] = []  # (code, reads, writes)
        self.count = 0
        self.refused: Optional[str] = None
        for i, t in enumerate(inputs):
            self._bind(t, f"a{i}")

    # --- names ---
    def _bind(self, t: torch.Tensor, name: str) -> None:
        self.var[id(t)] = name
        self.held.append(t)

    def _new(self, t: torch.Tensor) -> str:
        name = f"v{self.count}"
        self.count += 1
        self._bind(t, name)
        return name

    def _const(self, obj: Any) -> str:
        i = self.const_index.get(id(obj))
        if i is None:
            i = self.const_index[id(obj)] = len(self.consts)
            self.consts.append(obj)
        return f"c{i}"

    def _src(self, obj: Any, reads: list[str]) -> str:
        """Source text of an argument; tensor locals it reads go to ``reads``."""
        if isinstance(obj, torch.Tensor):
            name = self.var.get(id(obj))
            if name is None:
                if obj.is_inference():
                    # made in an inference-mode forward (this one's or an earlier one's)
                    # by code no logged call covers: its values could be this batch's
                    raise Refused("the forward reads a tensor that no logged call made "
                                  "and that is not the model's own (an inference tensor)")
                self.held.append(obj)
                return self._const(obj)
            reads.append(name)
            return name
        # exact types: a subclass (numpy's float64 is a float) reprs as code that would
        # not run here, so it is held as a constant
        kind = type(obj)
        if obj is None or kind is bool or kind is int or kind is str:
            return repr(obj)
        if obj is Ellipsis:
            return "..."
        if kind is float:
            return repr(obj) if math.isfinite(obj) else self._const(obj)
        if type(obj) is tuple:
            inner = ", ".join(self._src(x, reads) for x in obj)
            return f"({inner},)" if obj else "()"
        if type(obj) is list:
            return "[" + ", ".join(self._src(x, reads) for x in obj) + "]"
        if type(obj) is slice:
            return (f"slice({self._src(obj.start, reads)}, {self._src(obj.stop, reads)}, "
                    f"{self._src(obj.step, reads)})")
        if type(obj) is dict and all(type(k) is str for k in obj):
            return "{" + ", ".join(f"{k!r}: {self._src(v, reads)}" for k, v in obj.items()) + "}"
        if isinstance(obj, (tuple, list, dict)) and _has_tensor(obj):
            raise Refused(f"an argument of type {type(obj).__name__} holding tensors")
        return self._const(obj)

    def _log(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        reads: list[str] = []
        parts = [self._src(a, reads) for a in args]
        parts += [f"{k}={self._src(v, reads)}" for k, v in kwargs.items()]
        call = f"{self._const(func)}({', '.join(parts)})"
        writes: list[str] = []
        if isinstance(out, torch.Tensor):
            if id(out) in self.var:  # in place, or returned its argument
                if (args and out is args[0] and _name(func) in _IDENTITY_WHEN_SELF
                        and not kwargs.get("copy", False) and not kwargs.get("inplace", False)):
                    return
                self.lines.append((call, reads, []))
                return
            name = self._new(out)
            self.lines.append((f"{name} = {call}", reads, [name]))
            return
        if isinstance(out, (tuple, list)) and any(isinstance(x, torch.Tensor) for x in out):
            tmp = f"t{self.count}"
            self.count += 1
            code = [f"{tmp} = {call}"]
            for i, x in enumerate(out):
                if isinstance(x, torch.Tensor):
                    if id(x) in self.var:
                        continue
                    name = self._new(x)
                    writes.append(name)
                    code.append(f"{name} = {tmp}[{i}]")
                elif _has_tensor(x):
                    raise Refused(f"{_name(func)} returned nested tensors")
            self.lines.append(("; ".join(code), reads, writes))
            return
        if _has_tensor(out):
            raise Refused(f"{_name(func)} returned tensors inside a {type(out).__name__}")
        self.lines.append((call, reads, []))

    # --- the mode ---
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.refused is not None:
            return out
        name = _name(func)
        try:
            if isinstance(out, torch.Tensor) or out is None or (
                    isinstance(out, (tuple, list)) and any(isinstance(x, torch.Tensor)
                                                           for x in out)):
                self._log(func, args, kwargs, out)
            elif not (name in _QUERIES or name in _PROPERTIES) and (
                    _has_tensor(args) or _has_tensor(kwargs)):
                raise Refused(f"the forward reads tensor values ({name} returned "
                              f"{type(out).__name__})")
        except Refused as e:
            self.refused = str(e)
        return out

    def opaque_call(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        token = _RECORDER.set(None)
        try:
            with torch.overrides._pop_mode_temporarily():
                out = fn(*args, **kwargs)
        finally:
            _RECORDER.reset(token)
        if self.refused is None:
            try:
                self._log(fn, args, kwargs, out)
            except Refused as e:
                self.refused = str(e)
        return out

    def program(self, output: torch.Tensor) -> "Program":
        if self.refused is not None:
            raise Refused(self.refused)
        result = self.var.get(id(output))
        if result is None or result.startswith("a"):
            raise Refused("the logits were not produced by a logged call")
        last: dict[str, int] = {}
        for i, (_, reads, _) in enumerate(self.lines):
            for r in reads:
                last[r] = i
        body = []
        for i, (code, reads, writes) in enumerate(self.lines):
            body.append(code)
            dead = sorted({r for r in reads if last.get(r) == i and r != result}
                          | {w for w in writes if w not in last and w != result})
            if dead:
                body.append("del " + ", ".join(dead))
        src = ("def program(a0, a1, a2):\n    "
               + "\n    ".join(body) + f"\n    return {result}\n")
        namespace = {f"c{i}": c for i, c in enumerate(self.consts)}
        exec(compile(src, "<verispec captured forward>", "exec"), namespace)
        return Program(namespace["program"], src, len(self.lines))


def _has_tensor(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, (tuple, list)):
        return any(_has_tensor(x) for x in obj)
    if isinstance(obj, dict):
        return any(_has_tensor(x) for x in obj.values())
    return False


class Program:
    """One captured forward: ``run(ids, positions, keep)`` -> the logits."""

    def __init__(self, run: Callable, source: str, calls: int) -> None:
        self.run = run
        self.source = source
        self.calls = calls
        self.generation = _generation
        self.checked = False


class Captures:
    """An HFModel's captured forwards, keyed by what fixes a forward's code path."""

    def __init__(self, model: torch.nn.Module) -> None:
        _install_registration_hooks()
        self.model = model
        first = next(model.parameters(), None)
        self.device_type = first.device.type if first is not None else "cpu"
        self.programs: dict[tuple, Program] = {}
        self.seen: dict[tuple, int] = {}
        self.refused: dict[tuple, str] = {}
        self.invalidations = 0
        self.replays = 0  # forwards served by a checked program
        self.enabled = True  # HFModel.capture
        self.gave_up = False  # MAX_INVALIDATIONS reached
        self.modules: list[torch.nn.Module] = []
        self.modules_generation = -1
        self._watch()

    def _watch(self) -> None:
        """Watches the model's modules (their registrations bump the generation)."""
        for m in self.modules:
            n = _watched.get(id(m), 0) - 1
            if n > 0:
                _watched[id(m)] = n
            else:
                _watched.pop(id(m), None)
        self.modules = list(self.model.modules())
        self.modules_generation = _generation
        for m in self.modules:
            _watched[id(m)] = _watched.get(id(m), 0) + 1

    def __del__(self) -> None:
        for m in getattr(self, "modules", ()):
            n = _watched.get(id(m), 0) - 1
            if n > 0:
                _watched[id(m)] = n
            else:
                _watched.pop(id(m), None)

    def clear(self) -> None:
        self.programs.clear()
        self.seen.clear()
        self.refused.clear()

    def _quiet(self) -> bool:
        """No forward hooks anywhere, every module in eval mode, no autocast, no torch
        function mode active (a caller's ``with torch.device(...)`` is one: it changes
        what factory calls make)."""
        from torch.nn.modules import module as nn_module

        if (nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks
                or torch._C._len_torch_function_stack()
                or torch.is_autocast_enabled("cpu")
                or torch.is_autocast_enabled(self.device_type)):
            return False
        if self.modules_generation != _generation:
            self._watch()
        mods = self.modules  # the loops run in C (map, attrgetter): ~10 us for 300 modules
        return not (any(map(_FORWARD_HOOKS, mods)) or any(map(_PRE_HOOKS, mods))
                    or any(map(_TRAINING, mods)))

    def forward(self, key: tuple, run_eager: Callable, ids: torch.Tensor,
                positions: torch.Tensor, keep: torch.Tensor, redo: Callable) -> Any:
        """The logits of one forward: a program's where one serves ``key``, else
        ``run_eager(ids, positions, keep)`` (recorded into a program at the key's
        RECORD_AFTER + 1-th forward, checked at the next). ``redo()`` resets the forward's context before the
        recorded program's check replays it."""
        if not self.enabled or self.gave_up or key in self.refused or not self._quiet():
            return run_eager(ids, positions, keep)
        program = self.programs.get(key)
        if program is not None:
            if program.generation != _generation:
                self.invalidations += 1
                self.clear()
                if self.invalidations >= MAX_INVALIDATIONS:
                    self.gave_up = True
                return run_eager(ids, positions, keep)
            if program.checked:
                self.replays += 1
                self.programs[key] = self.programs.pop(key)  # most recently used last
                return program.run(ids, positions, keep)
            return self._check(key, program, run_eager, ids, positions, keep, redo)
        seen = self.seen.get(key, 0)
        self.seen[key] = seen + 1
        if seen < RECORD_AFTER or _RECORDER.get() is not None:
            return run_eager(ids, positions, keep)
        rec = _Recorder([ids, positions, keep])
        generation = _generation
        token = _RECORDER.set(rec)
        try:
            with rec:
                want = run_eager(ids, positions, keep)
        finally:
            _RECORDER.reset(token)
        if _generation != generation:
            # e.g. a buffer registered in every forward: a program would be stale at once
            self.refused[key] = ("the forward assigns parameters, buffers or submodules of "
                                 "the model's modules")
            return want
        try:
            program = rec.program(want)
        except Refused as e:
            self.refused[key] = str(e)
            return want
        if len(self.programs) >= MAX_PROGRAMS:
            self.programs.pop(next(iter(self.programs)))
        self.programs[key] = program
        return want

    def _check(self, key: tuple, program: "Program", run_eager: Callable, ids: torch.Tensor,
               positions: torch.Tensor, keep: torch.Tensor, redo: Callable) -> Any:
        """The program's first use: it runs, then the eager forward; equal logits (bit for
        bit) let it serve the key from now on. The eager logits are returned."""
        try:
            got = program.run(ids, positions, keep)
        except Exception as e:  # noqa: BLE001 - any failure only keeps the key eager
            got = e
        redo()
        want = run_eager(ids, positions, keep)
        if (isinstance(got, torch.Tensor) and got.dtype == want.dtype
                and got.shape == want.shape and torch.equal(got, want)):
            program.checked = True
        else:
            del self.programs[key]
            self.refused[key] = (f"its first replay did not give the eager forward's logits "
                                 f"({type(got).__name__ if isinstance(got, Exception) else 'differ'})")
        return want
