"""``tileq.warmup``: compile ahead of serving what a model will run, so no request pays JIT time.

Each problem is described without tensors (``tileq.describe``), planned exactly as a call would
be, and run once on random data of its shape; Triton compiles and caches the kernel (in memory and
on disk). Nothing is tuned here: configs come from the tuned tables or the heuristic.
"""

from __future__ import annotations

import torch

from .catalog.families import canonical_scale_kinds
from .dtypes import check_pair, parse_operand_type
from .errors import UnsupportedError, expect
from .problem import ProblemSpec, ScaleKind, ScaleLayout, parse_scheme


def describe(*, scheme, a, b, m: int, n: int, k: int, layout: str = "rcr",
             out_dtype: torch.dtype = torch.bfloat16, group_k: int = 128, group_n: int | None = None,
             a_scale: str | None = None, b_scale: str | None = None, preshuffled: bool = False,
             bias: bool = False, acc: bool = False, fast_accum: bool = False) -> ProblemSpec:
    """A problem without tensors. Scale kinds default to the scheme's canonical ones
    (rowcol: per-row x per-column; abquant: [M, Gk] x [Gk, ceil(N/128)]; ...). ``fast_accum``
    applies to fp8/bf8 pairs only, as in ``gemm``."""
    scheme = parse_scheme(scheme)
    at, bt = parse_operand_type(a), parse_operand_type(b)
    check_pair(at, bt)
    sa, sb, gn = canonical_scale_kinds(scheme, at, bt)
    return ProblemSpec(
        m=m, n=n, k=k, a_type=at, b_type=bt, layout=layout, scheme=scheme,
        a_scale_kind=ScaleKind(a_scale) if a_scale else sa,
        b_scale_kind=ScaleKind(b_scale) if b_scale else sb,
        out_dtype=out_dtype, group_k=group_k, group_n=group_n or gn,
        a_scale_layout=ScaleLayout.PRESHUFFLED if preshuffled else ScaleLayout.ROWMAJOR,
        has_bias=bias, has_acc=acc, fast_accum=bool(fast_accum) and at.is_float8 and bt.is_float8,
    )


def warmup(problems, *, device=None, progress: bool = False) -> list[str]:
    """Compile the kernels these problems need; returns the kernel instance names, in order.

    ``problems``: ProblemSpec objects (``tileq.describe(...)``) or dicts of describe()'s keywords.
    """
    from .dispatch.plan import execute, make_plan
    from .problem import build_problem
    from .testing import make_args

    dev = torch.device(device) if device is not None else torch.device("cuda")
    if dev.type != "cuda" or not torch.cuda.is_available():
        raise UnsupportedError(expect("device", "a CUDA device (warm-up compiles GPU kernels)", str(dev)))
    if torch.cuda.is_current_stream_capturing():
        raise UnsupportedError("warmup: cannot compile during a CUDA graph capture; warm up before capturing")
    names = []
    specs = [p if isinstance(p, ProblemSpec) else describe(**p) for p in problems]
    for i, spec in enumerate(specs, 1):
        plan = make_plan(spec, dev)
        args = make_args(spec, device=dev)
        execute(plan, args.call(build_problem))
        names.append(plan.instance.name if plan.instance else plan.route.family.name)
        if progress:
            print(f"[{i}/{len(specs)}] {names[-1]}", flush=True)
    torch.cuda.synchronize(dev)
    return names
