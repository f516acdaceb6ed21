"""Direct launches of compiled Triton kernels: the per-call host cost of every tileq kernel.

``KernelCall`` fixes a launch's grid, integer arguments, constexprs and pointer dtypes once; the
first launch goes through Triton's ``JITFunction.run`` and later ones call the compiled kernel's
launcher directly (tens of microseconds less per call). The GEMM launchers (``launch.py``, the
Gluon kernels' launchers, whose TMA descriptors the compiled launcher encodes) and the
activation-quantization launchers use it.

Traced into a torch.compile graph (``traced_launches``) a KernelCall becomes torch's triton-kernel
node instead. Whether that can carry a launcher's launches the launcher states when it is made,
from its plan: ``untraced`` (why torch's ``wrap_triton`` cannot carry them, or None; a
KernelCall's own, ``KernelCall.untraced``) and ``counters`` (the tile counters its split sums
with, which a traced launch takes from its caller: ``buffers.given_tile_counters``).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import threading

from .. import settings
from .._runtime import bounded_put, env_raw
from ..errors import UnsupportedError


def direct_launch_enabled() -> bool:
    """False when TILEQ_DIRECT_LAUNCH=0: every launch goes through ``JITFunction.run``."""
    return env_raw("TILEQ_DIRECT_LAUNCH") is None or settings.current().direct_launch


# Compiled-kernel handles for direct launches, keyed by (static id, JITFunction, device, pointer
# alignment, debug, instrumentation mode): what JITFunction.run's own cache key is made of, given
# that a static id fixes the pointer dtypes, integer arguments, constexprs and options. Bounded:
# an evicted handle only costs one JIT launch to find again.
_HANDLES: dict[tuple, tuple] = {}
_STATIC_IDS: dict[tuple, int] = {}
_NEXT_ID = itertools.count()
_TABLE_CAP = 4096
_TRITON: dict[str, object] = {}


def _bounded_put(table: dict, key, value) -> None:
    bounded_put(table, key, value, _TABLE_CAP)


def _triton():
    """Triton's runtime pieces the direct launch needs, looked up once."""
    if not _TRITON:
        from triton import knobs
        from triton.compiler.compiler import CompiledKernel
        from triton.knobs import HookChain
        from triton.runtime.driver import driver
        from triton.runtime.jit import JITFunction

        try:  # Gluon kernels launch the same way (their descriptors are converted by the launcher)
            from triton.experimental.gluon._runtime import GluonJITFunction
        except ImportError:  # a Triton without Gluon
            GluonJITFunction = JITFunction
        _TRITON.update(
            knobs=knobs, CompiledKernel=CompiledKernel, HookChain=HookChain, JITFunction=JITFunction,
            jit_types=(JITFunction, GluonJITFunction),
            # What JITFunction.run calls: torch.cuda.current_device and
            # torch._C._cuda_getCurrentRawStream (no torch.cuda.Stream object is made).
            device=driver.active.get_current_device, stream=driver.active.get_current_stream,
        )
    return _TRITON


def raw_stream():
    return _triton()["stream"]


# ----------------------------------------------------------------------------- traced launches

# Launch options torch's user-kernel path cannot pass (it moves num_warps and num_stages into the
# launch config; anything else would reach the kernel as an argument); launch_pdl is taken off
# (``without_pdl``).
_UNTRACED_OPTIONS = ("maxnreg",)


class _Mode(threading.local):
    tracing = False


_MODE = _Mode()


def tracing() -> bool:
    """Whether launches are being traced into a torch.compile graph (no data pointers may be read
    and nothing launches: workspaces are fresh tensors of the trace)."""
    return _MODE.tracing


@contextlib.contextmanager
def traced_launches():
    """Within: every KernelCall becomes torch's triton-kernel node (``wrap_triton``), which
    inductor launches from its generated code, instead of launching."""
    saved = _MODE.tracing
    _MODE.tracing = True
    try:
        yield
    finally:
        _MODE.tracing = saved


def without_pdl(kwargs: dict) -> dict:
    """The same launch's keywords without programmatic dependent launch, as a traced launch runs:
    torch cannot pass the launch attribute, and the kernels' PDL code (L2 prefetches,
    griddepcontrol; their ``PDL`` constexpr) is inline assembly that torch's analysis of which
    arguments a kernel writes cannot read (it would then copy every input, weights included,
    before each launch)."""
    if "launch_pdl" not in kwargs:
        return kwargs
    return {k: (False if k == "PDL" else v) for k, v in kwargs.items() if k != "launch_pdl"}


def untraceable_because(fn, kwargs: dict) -> str | None:
    """Why torch's ``wrap_triton`` cannot carry this launch, or None where it can: it takes a plain
    JITFunction (not Gluon, not the interpreter's) without pre-run hooks, and no launch option
    beyond the warps and stages."""
    from triton.runtime.jit import JITFunction  # (not _triton(): that needs a GPU driver)

    if type(fn) is not JITFunction:
        return f"{type(fn).__name__}, not a plain @triton.jit kernel"
    if fn.pre_run_hooks:
        return "pre-run hooks"
    options = [k for k in _UNTRACED_OPTIONS if k in kwargs]
    return f"launch option {', '.join(options)}" if options else None


# torch reads which arguments a traced user kernel writes from its Triton IR, generated anew for
# every launch it traces and again when inductor lowers it (a Triton front-end compilation each):
# a 40-layer model's hundreds of identical launches made its compilation take minutes. For tileq's
# kernels the answer depends only on the kernel, the constexpr and integer arguments and which arguments are
# tensors (of which dtype), so it is kept per such key (the torch function, renamed between torch
# versions, is wrapped where found; a torch without either keeps its own behaviour). Only answers
# made with a GPU driver present are kept (without one torch assumes every argument written).
_ANALYSIS_FUNCTIONS = ("identify_accessed_tensors", "identify_mutated_tensors")
_ANALYSES: dict = {}
_ANALYSIS_WRAPPED = [False]


def _cache_kernel_analysis() -> None:
    if _ANALYSIS_WRAPPED[0]:
        return
    from torch._higher_order_ops import triton_kernel_wrap as wrap

    for attr in _ANALYSIS_FUNCTIONS:
        original = getattr(wrap, attr, None)
        if original is None or getattr(original, "_tileq_cached", False):
            continue

        def cached(kernel, kwargs, *rest, _original=original, **more):
            key = _analysis_key(kernel, kwargs, rest, more)
            hit = None if key is None else _ANALYSES.get(key)
            if hit is None:
                answer = _original(kernel, kwargs, *rest, **more)
                if key is not None and _has_driver():
                    _ANALYSES[key] = answer
                return answer
            return copy.deepcopy(hit)  # callers own their result

        cached._tileq_cached = True
        setattr(wrap, attr, cached)
    _ANALYSIS_WRAPPED[0] = True


def _has_driver() -> bool:
    """Whether Triton has a GPU driver: without one torch's analysis fails and assumes every
    argument written, an answer not to keep."""
    try:
        from triton.runtime.driver import driver

        driver.active.get_current_target()
        return True
    except Exception:  # noqa: BLE001 - no active driver
        return False


def _analysis_key(kernel, kwargs: dict, rest: tuple, more: dict):
    """The key of a tileq kernel's write analysis, or None (not tileq's, or an argument whose
    value the key cannot hold: a symbolic size)."""
    import torch

    # torch wraps a launch's kernel in a fresh one-config Autotuner (its warps and stages): the key
    # is the JITFunction and the config's text
    jit = getattr(kernel, "fn", None) if hasattr(kernel, "configs") else kernel
    if not getattr(getattr(jit, "fn", None), "__module__", "").startswith("tileq."):
        return None
    parts = [str(c) for c in getattr(kernel, "configs", ())]
    for name, value in kwargs.items():
        if value is None or type(value) in (int, float, bool, str):
            parts.append((name, type(value).__name__, value))
        elif isinstance(value, torch.Tensor):
            parts.append((name, "tensor", str(value.dtype)))
        elif callable(getattr(value, "get_dtype", None)):  # an inductor buffer
            parts.append((name, "tensor", str(value.get_dtype())))
        else:
            return None
    try:
        extra = repr((rest, sorted(more.items())))
    except Exception:  # noqa: BLE001 - an argument without a stable text: no caching
        return None
    return (jit, tuple(sorted(map(repr, parts))), extra)


class KernelCall:
    """One launch of a Triton kernel with fixed grid, integer arguments and keyword arguments
    (launch options and constexprs) and fixed dtypes of its pointer arguments (None for an
    absent one); only the pointers vary from call to call.

    JITFunction.run binds every argument, computes a specialization key and looks the compiled
    kernel up on each launch (most of tens of microseconds). Here the first launch of each
    specialization goes through it and keeps the compiled kernel it returns; later launches call
    that kernel's launcher exactly as JITFunction.run does (same arguments in parameter order,
    the current device's raw stream, launch hooks and metadata). The key adds what JITFunction.run
    derives from the pointers: each one's 16-byte alignment. Taken only when ``direct`` (a GPU,
    not interpreted, TILEQ_DIRECT_LAUNCH not 0) and the kernel has no pre-run hooks.

    ``module`` holds the kernel as attribute ``name``, looked up at every call (profiling scripts
    and tests replace it there).
    """

    __slots__ = ("module", "name", "grid", "ints", "kwargs", "sid")

    @property
    def untraced(self) -> str | None:
        """Why torch's ``wrap_triton`` cannot carry this launch (``untraceable_because``), or None."""
        why = untraceable_because(getattr(self.module, self.name), self.kwargs)
        return None if why is None else f"{self.name}: {why}"

    def __init__(self, module, name: str, grid: tuple, ints: tuple, kwargs: dict, ptr_dtypes: tuple):
        self.module, self.name, self.grid, self.ints, self.kwargs = module, name, grid, ints, kwargs
        # Everything JITFunction.run specializes on except pointer alignment: pointer dtypes (the
        # output's is no constexpr), integer values, constexprs and options.
        static = (module.__name__, name, grid, ints, tuple(sorted(kwargs.items())), ptr_dtypes)
        sid = _STATIC_IDS.get(static)
        if sid is None:
            sid = next(_NEXT_ID)  # never reused, so an evicted id cannot alias another launch
            _bounded_put(_STATIC_IDS, static, sid)
        self.sid = sid

    def __call__(self, ptrs: tuple, direct: bool) -> None:
        fn = getattr(self.module, self.name)
        if _MODE.tracing:
            self._traced(fn, ptrs)
            return
        if direct:
            t = _triton()
            if type(fn) in t["jit_types"] and not fn.pre_run_hooks:
                self._direct(fn, ptrs, t)
                return
        fn[self.grid](*ptrs, *self.ints, **self.kwargs)

    def _traced(self, fn, ptrs: tuple) -> None:
        why = untraceable_because(fn, self.kwargs)
        if why is not None:  # (its launcher said so: ``untraced``; the caller did not ask)
            raise UnsupportedError(f"{self.name}: this launch cannot be traced into a torch.compile graph ({why})")
        from torch.library import wrap_triton

        _cache_kernel_analysis()
        wrap_triton(fn)[self.grid](*ptrs, *self.ints, **without_pdl(self.kwargs))

    def _direct(self, fn, ptrs: tuple, t: dict) -> None:
        knobs = t["knobs"]
        device = t["device"]()
        align = 0
        for i, p in enumerate(ptrs):
            if p is not None and _address(p) & 15:
                align |= 1 << i
        key = (self.sid, fn, device, align, knobs.runtime.debug, knobs.compilation.instrumentation_mode)
        handle = _HANDLES.get(key)
        if handle is None:
            kernel = fn[self.grid](*ptrs, *self.ints, **self.kwargs)
            if isinstance(kernel, t["CompiledKernel"]) and kernel.function is not None:
                rest = _constexpr_tail(fn, len(ptrs) + len(self.ints), self.kwargs)
                if rest is not None:
                    _bounded_put(_HANDLES, key, (kernel, self.ints + rest))
            return
        kernel, rest = handle
        args = ptrs + rest
        # JITFunction.run refuses a launch when a global the kernel read at compile time changed.
        for (name, _), (val, globals_dict) in fn.used_global_vals.items():
            if (new := globals_dict.get(name, _MISSING)) != val:
                raise RuntimeError(
                    f"Global variable {name} has changed since we compiled this kernel, from {val} to {new}"
                )
        stream = t["stream"](device)
        enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        if _idle(enter, t) and _idle(leave, t):
            # No hook would see the metadata: skip building it (empty chains do nothing).
            meta = enter = leave = None
        else:
            meta = kernel.launch_metadata(self.grid, stream, *args)
        grid = self.grid
        kernel.run(grid[0], grid[1] if len(grid) > 1 else 1, 1, stream, kernel.function,
                   kernel.packed_metadata, meta, enter, leave, *args)


_MISSING = object()


def _address(arg) -> int:
    """A tensor's data pointer, or a TMA descriptor's base tensor's."""
    data_ptr = getattr(arg, "data_ptr", None)
    if data_ptr is not None:
        return data_ptr()
    return arg.base.data_ptr()


class TableKernel:
    """A kernel held in a launcher's lazily filled table (``table[key]``), seen as a module
    attribute by ``KernelCall`` (which looks its kernel up at every call, so that tests and
    profiling scripts can replace it in the table)."""

    def __init__(self, table: dict, key: str, name: str):
        self._table, self._key, self.__name__ = table, key, name

    def __getattr__(self, attr):
        return self._table[self._key]


def _idle(hook, t: dict) -> bool:
    return hook is None or (type(hook) is t["HookChain"] and not hook.calls)


_OPTIONS = ("num_warps", "num_stages", "maxnreg", "launch_pdl")  # launch options, not parameters


def _constexpr_tail(fn, n_runtime: int, kwargs: dict) -> tuple | None:
    """The values of ``fn``'s parameters after the first ``n_runtime``, in parameter order, as
    JITFunction.run binds them (keywords, else defaults); None when the keywords do not match the
    parameters (the JIT launch then reports it, and no direct launch is made)."""
    params = fn.params[n_runtime:]
    names = {p.name for p in params}
    if any(name not in names for name in kwargs if name not in _OPTIONS):
        return None
    tail = []
    for p in params:
        if p.name in kwargs:
            tail.append(kwargs[p.name])
        elif p.has_default:
            tail.append(p.default)
        else:
            return None
    return tuple(tail)
