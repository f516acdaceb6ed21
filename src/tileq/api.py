"""Public operations: ``gemm``, ``linear``, ``a8w8_matmul_dequant`` and ``explain``.

Each call validates once (``problem.build_problem``), makes a plan (``dispatch.plan.make_plan``: which
executor, pipeline, kernel and config) and runs it. Optional parameters are keyword-only.

Repeated calls are cheap: a call whose signature (below) has been validated and planned before
reuses that work and the kernel launch's fixed arguments (``kernels.launch.GemmLaunch``), and only
gathers its tensors. The signature holds everything validation and planning read: the type,
shape, strides, dtype and device of every tensor argument (a PackedInt4's logical shape and
packing too), the type of a Python-number scale, every option with its type, and the environment
variables planning reads. Tensor values and data pointers are never part of it: what depends on
them (a Python-number scale's tensor, bf16/fp16 scales and bias upcast to fp32, pointer alignment)
is redone on every call. Anything else (a new signature, an argument of another type, the
reference executor) takes the full path, so every error is raised exactly as before.
"""

from __future__ import annotations

import torch

from .dispatch import plan as _plan
from . import settings
from ._runtime import bounded_put, cache_get
from .dtypes import PackedInt4
from .prepacked import PrepackedInt4
from .errors import DTypeError, ShapeError, TileqError, expect
from .problem import GEMM_NAMES, LINEAR_NAMES, ArgNames, Problem, Scheme, build_problem

# Call signatures kept (oldest dropped first): enough for every layer shape of a model at every
# batch size a server sees, small in memory (no tensors are held).
CALL_CACHE_SIZE = 1024
_CALLS: dict[tuple, "_Call"] = {}

_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_NUMBER_TYPES = (float, int, bool)


class _Unkeyable(Exception):
    """An argument the call cache does not describe: the call takes the full path."""


def _arg_key(x):
    """The part of an argument that validation and planning read (never values or pointers)."""
    t = type(x)
    if t in _TENSOR_TYPES:
        return (t, x.shape, x.stride(), x.dtype, x.device)
    if x is None:
        return None
    if t is PackedInt4:
        d = x.data
        if type(d) not in _TENSOR_TYPES:
            raise _Unkeyable
        # (Whether the kernel may read int4 storage as 16-bit words also depends on its address:
        # GemmLaunch decides that on every call.)
        return (t, x.shape, x.packed_dim, d.shape, d.stride(), d.dtype, d.device)
    if t in _NUMBER_TYPES:
        return t  # a scale given as a Python number: validation reads only its type
    raise _Unkeyable


def _call_key(op, a, b, a_scale, b_scale, bias, acc, out, scheme, out_dtype, group_k, group_n,
              backend, pipeline, fast_accum):
    """The call signature, or None when an argument is not described by one."""
    try:
        return (
            op, _arg_key(a), _arg_key(b), _arg_key(a_scale), _arg_key(b_scale), _arg_key(bias),
            _arg_key(acc), _arg_key(out),
            type(scheme), scheme, type(out_dtype), out_dtype, type(group_k), group_k,
            type(group_n), group_n, type(backend), backend, type(pipeline), pipeline,
            type(fast_accum), fast_accum,
            # What the planners read from the environment.
            settings.key(),
        )
    except Exception:  # noqa: BLE001 - e.g. a sparse tensor has no strides: the full path decides
        return None


def _lookup(key):
    return cache_get(_CALLS, key)


def _remember(key, problem: Problem, plan: _plan.Plan, **extra) -> None:
    if key is None or plan.executor != "triton":
        return
    bounded_put(_CALLS, key, _Call(problem, plan, **extra), CALL_CACHE_SIZE)


def clear_call_cache() -> None:
    """Forget every remembered call signature (tests; memory)."""
    _CALLS.clear()


class _Call:
    """A validated, planned call signature of the Triton executor: what a repeated call reuses."""

    __slots__ = ("launch", "m", "n", "out_dtype", "device", "scalars_to_device", "lead",
                 "flatten_k", "x_scale_rows")

    def __init__(self, problem: Problem, plan: _plan.Plan, lead=None, flatten_k=None,
                 x_scale_rows=None):
        spec = problem.spec
        self.m, self.n, self.out_dtype, self.device = spec.m, spec.n, spec.out_dtype, problem.device
        self.scalars_to_device = problem.device.type != "cpu"
        self.launch = None
        if spec.m and spec.n:  # an empty result launches nothing (plan.execute)
            from .kernels.launch import make_launch

            self.launch = make_launch(problem, plan)
        # linear only: the output's leading dims, x's K when x is flattened, x_scale's rows.
        self.lead, self.flatten_k, self.x_scale_rows = lead, flatten_k, x_scale_rows

    @property
    def untraced(self) -> str | None:
        """Why its launch cannot be traced into a torch.compile graph, or None (the launcher's
        statement; an empty result launches nothing)."""
        return "no launch" if self.launch is None else self.launch.untraced

    @property
    def counters(self) -> int:
        """The tile counters its launch's split sums with (0: none)."""
        return 0 if self.launch is None else self.launch.counters

    def run(self, a, b, a_scale, b_scale, bias, acc, out) -> torch.Tensor:
        """a, b: storage tensors; the rest as the caller passed them (build_problem's
        normalization is views of them, or the conversions redone here)."""
        if self.launch is None:
            if out is not None:
                return out
            return torch.empty(self.m, self.n, dtype=self.out_dtype, device=self.device)
        if a_scale is not None:
            a_scale = self._fp32(a_scale)
        if b_scale is not None:
            b_scale = self._fp32(b_scale)
        if bias is not None and bias.dtype is not torch.float32:
            bias = bias.float()
        return self.launch(a, b, a_scale, b_scale, bias, acc, out)

    def _fp32(self, s) -> torch.Tensor:
        # build_problem's _as_fp32_scale, and its move of a Python-number scale to the device
        # (a traced call's tensors are the tracer's subclasses).
        if isinstance(s, torch.Tensor):
            return s if s.dtype is torch.float32 else s.float()
        t = torch.tensor(float(s), dtype=torch.float32)
        return t.to(self.device) if self.scalars_to_device else t


def _storage(x):
    return x.data if type(x) is PackedInt4 else x


def _run(problem: Problem, backend, pipeline, key=None, **extra) -> torch.Tensor:
    p = _plan.make_plan(problem.spec, problem.device, backend=backend, pipeline=pipeline)
    _remember(key, problem, p, **extra)
    return _plan.execute(p, problem)


def _renamed(e: TileqError) -> TileqError | None:
    """A planning or execution error of ``linear``, speaking of gemm's a and b: in x's and w's
    words (None: it names neither)."""
    renamed = _with_head(e, _LINEAR_HEADS)
    return None if renamed is e else renamed


def _gemm(op: str, names: ArgNames, a, b, a_scale, b_scale, scheme, out_dtype, bias, acc, group_k, group_n, out,
          backend, pipeline, fast_accum) -> torch.Tensor:
    """``gemm`` for a caller whose arguments are named ``names`` in its messages."""
    key = _call_key(op, a, b, a_scale, b_scale, bias, acc, out, scheme, out_dtype, group_k, group_n, backend,
                    pipeline, fast_accum)
    hit = _lookup(key)
    if hit is not None:
        return hit.run(_storage(a), _storage(b), a_scale, b_scale, bias, acc, out)
    problem = build_problem(
        a, b, a_scale, b_scale, scheme=scheme, out_dtype=out_dtype, bias=bias, acc=acc,
        group_k=group_k, group_n=group_n, out=out, fast_accum=fast_accum, names=names,
    )
    return _run(problem, backend, pipeline, key)


def gemm(
    a,
    b,
    a_scale=None,
    b_scale=None,
    *,
    scheme,
    out_dtype: torch.dtype = torch.bfloat16,
    bias=None,
    acc=None,
    group_k: int = 128,
    group_n: int | None = None,
    out=None,
    backend: str | None = None,
    pipeline: str | None = None,
    fast_accum: bool = False,
) -> torch.Tensor:
    """C = dequant(A) @ dequant(B) with the dequantization fused, per docs/schemes.md section 1.

    a: logical [M, K] (tensor or PackedInt4); b: logical [K, N]. ``scheme`` is required
    ('tensor', 'rowcol', 'aquant', 'bquant', 'abquant'): it is never guessed from shapes.
    ``backend``: 'auto' (default, or $TILEQ_BACKEND): Triton kernels for CUDA tensors, the
    reference for CPU ones; 'triton' (the interpreter on CPU tensors); 'reference'.
    ``pipeline``: None lets the planner choose from the logical M (decode for M <= 64);
    'prefill' or 'decode' forces one (benchmarks, experiments).
    ``fast_accum``: fp8/bf8 pairs only; skip the fp32 promotion after every K tile (faster,
    error growing with K: up to 1.6% of max|C| at K = 17408 on an H200), like torch._scaled_mm's
    use_fast_accum. Default: precise.
    """
    if isinstance(b, PrepackedInt4) or isinstance(a, PrepackedInt4):
        raise DTypeError(expect("a, b", "tensors or tileq.PackedInt4 (gemm's B is the logical [K, N])",
                                "a tileq.PrepackedInt4 (an nn.Linear weight [N, K]: use tileq.linear(x, w, ...))"))
    return _gemm("gemm", GEMM_NAMES, a, b, a_scale, b_scale, scheme, out_dtype, bias, acc, group_k, group_n, out,
                 backend, pipeline, fast_accum)


def explain(
    a,
    b,
    a_scale=None,
    b_scale=None,
    *,
    scheme,
    out_dtype: torch.dtype = torch.bfloat16,
    bias=None,
    acc=None,
    group_k: int = 128,
    group_n: int | None = None,
    out=None,
    backend: str | None = None,
    pipeline: str | None = None,
    fast_accum: bool = False,
) -> str:
    """The plan ``gemm`` would run for these arguments, as text (nothing is launched)."""
    problem = build_problem(
        a, b, a_scale, b_scale, scheme=scheme, out_dtype=out_dtype, bias=bias, acc=acc,
        group_k=group_k, group_n=group_n, out=out, fast_accum=fast_accum,
    )
    return _plan.make_plan(problem.spec, problem.device, backend=backend, pipeline=pipeline).describe()


def linear(
    x,
    w,
    x_scale=None,
    w_scale=None,
    *,
    scheme,
    out_dtype: torch.dtype = torch.bfloat16,
    bias=None,
    group_k: int = 128,
    group_n: int | None = None,
    out=None,
    backend: str | None = None,
    pipeline: str | None = None,
    fast_accum: bool = False,
) -> torch.Tensor:
    """y = x @ w.t() (nn.Linear convention): x [..., K], w [N, K] (tensor, PackedInt4 or
    PrepackedInt4; the last runs the prepacked-int4 kernel, ``tileq.prepacked``).

    Leading dimensions of x are flattened into M and restored on the output. x_scale follows
    the flattened rows ([M], [M, 1], [M, Gk], or [..., 1] / [..., Gk] matching x's leading dims).
    """
    if isinstance(w, PrepackedInt4):
        return _linear_prepacked(x, w, x_scale, w_scale, scheme, out_dtype, bias, group_k, out, backend,
                                 pipeline, fast_accum)
    key = _call_key("linear", x, w, x_scale, w_scale, bias, None, out, scheme, out_dtype, group_k,
                    group_n, backend, pipeline, fast_accum)
    hit = _lookup(key)
    if hit is not None:
        if hit.flatten_k is not None:
            a = x.reshape(-1, hit.flatten_k)
        else:
            a = _storage(x)
        if hit.x_scale_rows is not None:
            x_scale = x_scale.reshape(hit.x_scale_rows, x_scale.shape[-1])
        # w's storage: the logical B = w.t() reads the same bytes through the strides kept.
        y = hit.run(a, _storage(w), x_scale, w_scale, bias, None, out)
        if out is not None:
            return out
        return _restore_lead(y, hit.lead)
    x2, x_scale, lead, x_scale_rows = linear_rows(x, x_scale)
    k, m = x2.shape[1], x2.shape[0]
    if not isinstance(w, (torch.Tensor, PackedInt4)) or len(tuple(w.shape)) != 2:
        got = tuple(w.shape) if hasattr(w, "shape") else type(w).__name__
        raise ShapeError(expect("w", "a 2-D [N, K] weight", got))
    if out is not None and isinstance(out, torch.Tensor) and out.dim() != 2:
        out2 = out.view(m, -1)
    else:
        out2 = out
    # linear's names in every message: w is passed as the nn.Linear weight, B = w.t().
    problem = build_problem(
        x2, w.t(), x_scale, w_scale, scheme=scheme, out_dtype=out_dtype, bias=bias,
        group_k=group_k, group_n=group_n, out=out2, fast_accum=fast_accum, names=LINEAR_NAMES,
    )
    flatten_k = k if x2 is not x and not isinstance(x, PackedInt4) else None
    try:
        y = _run(problem, backend, pipeline, key, lead=lead, flatten_k=flatten_k, x_scale_rows=x_scale_rows)
    except TileqError as e:
        renamed = _renamed(e)
        if renamed is None:
            raise
        raise renamed from None
    if out is not None:
        return out
    return _restore_lead(y, lead)


def linear_rows(x, x_scale):
    """x [..., K] and its x_scale as ``linear`` takes them, as rows (linear's checks): (x [M, K],
    x_scale per row, x's leading dims, M where x_scale was reshaped to [M, G], else None)."""
    if isinstance(x, PackedInt4):  # always 2-D: [M, K]
        lead, k = (x.shape[0],), x.shape[1]
        x2 = x
    else:
        if not isinstance(x, torch.Tensor):
            raise DTypeError(expect("x", "a torch.Tensor or tileq.PackedInt4", type(x).__name__))
        if x.dim() < 1:
            raise ShapeError(expect("x", "a tensor of shape [..., K]", tuple(x.shape)))
        lead, k = tuple(x.shape[:-1]), x.shape[-1]
        x2 = x.reshape(-1, k) if x.dim() != 2 else x
    m = x2.shape[0]
    if isinstance(x_scale, torch.Tensor) and x_scale.dim() > 2 and len(lead) > 1:
        if tuple(x_scale.shape[:-1]) != lead:
            raise ShapeError(
                expect("x_scale", f"leading dimensions {lead} matching x", tuple(x_scale.shape))
            )
        return x2, x_scale.reshape(m, x_scale.shape[-1]), lead, m
    return x2, x_scale, lead, None


def linear_call(x, w, x_scale, w_scale, *, scheme, out_dtype, bias, group_k, group_n, traced: bool = False):
    """The validated, planned launch of ``linear`` for these arguments' signature (x 2-D [M, K]),
    made without running it, for callers that run the same signature many times and keep it
    (``QuantLinear``) or trace it into a torch.compile graph (``traced``: the plan a traced launch
    runs, ``dispatch.int4.traced_config``): its ``run(x, w_storage, x_scale, w_scale, bias, None,
    None)`` launches with no per-call checks; ``untraced`` and ``counters`` say whether a traced
    launch can carry it (``kernels/direct.py``). None when the call is not cached (the reference
    executor, an unkeyable argument): use ``linear``."""
    if x.dim() != 2:
        return None
    if isinstance(w, PrepackedInt4):
        from .api_prepacked import prepacked_call

        _prepacked_scheme(scheme)
        if _plan.resolve_backend(None, x.device)[0] == "reference":  # linear's path, as the docstring says
            return None
        return prepacked_call(x, w, x_scale, w_scale, out_dtype=out_dtype, bias=bias, group_k=group_k,
                              traced=traced)
    # (a traced call's tensors are the tracer's: its launch is made for it and not kept)
    key = None if traced else _call_key("linear", x, w, x_scale, w_scale, bias, None, None, scheme, out_dtype,
                                        group_k, group_n, None, None, False)
    if key is None and not traced:
        return None
    hit = _lookup(key) if key is not None else None
    if hit is None:
        if not isinstance(w, (torch.Tensor, PackedInt4)) or len(tuple(w.shape)) != 2:
            return None  # (linear's own message for it)
        problem = build_problem(x, w.t(), x_scale, w_scale, scheme=scheme, out_dtype=out_dtype, bias=bias,
                                group_k=group_k, group_n=group_n, names=LINEAR_NAMES)
        try:
            plan = _plan.make_plan(problem.spec, problem.device)
        except TileqError as e:
            renamed = _renamed(e)
            if renamed is None:
                raise
            raise renamed from None
        if plan.executor != "triton":
            return None
        hit = _Call(problem, plan, lead=(x.shape[0],))
        if key is not None:
            bounded_put(_CALLS, key, hit, CALL_CACHE_SIZE)
    return hit


def _restore_lead(y: torch.Tensor, lead: tuple) -> torch.Tensor:
    shape = (*lead, y.shape[-1])
    return y if y.shape == shape else y.reshape(shape)


def a8w8_matmul_dequant(
    lhs: torch.Tensor,
    rhs: torch.Tensor,
    act_scale,
    weight_scale,
    *,
    out_dtype: torch.dtype,
    a_trans: bool = False,
    b_trans: bool = False,
    acc: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """The seed op: int8 x int8 rowcol with the dequantization fused.

    lhs is [M, K] ([K, M] when ``a_trans``), rhs is [K, N] ([N, K] when ``b_trans``).
    act_scale: [M], [M, 1] or scalar; weight_scale: [N], [1, N] or scalar; acc: int32 [M, N]
    added to the integer product before dequantization. GEMV versus GEMM is decided from the
    logical M (after ``a_trans``), by the planner.
    """
    for name, t in (("lhs", lhs), ("rhs", rhs)):
        if not isinstance(t, torch.Tensor):
            raise DTypeError(expect(name, "a torch.Tensor", type(t).__name__))
        if t.dtype != torch.int8:
            raise DTypeError(expect(name, "dtype torch.int8", t.dtype))
        if t.dim() != 2:
            raise ShapeError(expect(name, "a 2-D tensor", f"{t.dim()}-D"))
    a = lhs.t() if a_trans else lhs
    b = rhs.t() if b_trans else rhs
    try:
        return _gemm("a8w8_matmul_dequant", _SEED_NAMES, a, b, act_scale, weight_scale, Scheme.ROWCOL, out_dtype,
                     None, acc, 128, None, None, backend, None, False)
    except TileqError as e:
        head = str(e).partition(": ")[0]
        if (head == "lhs" and a_trans) or (head == "rhs" and b_trans):
            raise type(e)(f"{e} (shapes are logical: {head} is passed transposed)") from None
        raise


# The seed op's names in its messages; it transposes with a_trans / b_trans (its shapes are logical).
_SEED_NAMES = ArgNames("lhs", "rhs", "act_scale", "weight_scale", logical=True)
# linear's, for the errors raised after validation (planning, execution).
_LINEAR_HEADS = {"a": "x", "b": "w", "a, b": "x, w", "a_scale": "x_scale", "b_scale": "w_scale"}


def _with_head(e: TileqError, names: dict) -> TileqError:
    """``e`` with the argument name at the head of its message (``a: ...``) replaced by
    ``names[head]``; ``e`` itself when its head is not in ``names``."""
    head, sep, rest = str(e).partition(": ")
    if not sep or head not in names:
        return e
    return type(e)(f"{names[head]}: {rest}")


_PREPACKED_SCHEMES = ("bquant", "rowcol", "tensor")


def _linear_prepacked(x, w, x_scale, w_scale, scheme, out_dtype, bias, group_k, out, backend, pipeline,
                      fast_accum):
    """tileq.linear on a PrepackedInt4 weight: the prepacked-int4 kernel serves every M (its own
    launcher validates x, the scales and the bias); options it has no meaning for are refused."""
    from .prepacked import unprepack_int4
    from .api_prepacked import check_x_k, linear_prepacked

    _prepacked_scheme(scheme)
    check_x_k(x, w)  # one message on every path (the reference one below goes through linear)
    if pipeline is not None or fast_accum:
        raise DTypeError(expect("options", "no pipeline/fast_accum choice for a PrepackedInt4 weight "
                                "(it has one kernel)", f"pipeline={pipeline}, fast_accum={fast_accum}"))
    device = x.device if isinstance(x, torch.Tensor) else w.device
    if _plan.resolve_backend(backend, device)[0] == "reference":
        # The reference executor (what auto picks for CPU tensors) reads the interchange form:
        # the same values, unprepacked exactly.
        return linear(x, unprepack_int4(w), x_scale, w_scale, scheme=scheme, out_dtype=out_dtype, bias=bias,
                      group_k=group_k, out=out, backend=backend)
    return linear_prepacked(x, w, x_scale, w_scale, out_dtype=out_dtype, bias=bias, group_k=group_k, out=out)


def _prepacked_scheme(scheme) -> None:
    name = getattr(scheme, "value", scheme)
    if name not in _PREPACKED_SCHEMES:
        raise DTypeError(expect("scheme", f"one of {_PREPACKED_SCHEMES} for a PrepackedInt4 weight", name))
