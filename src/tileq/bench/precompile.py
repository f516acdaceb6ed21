"""Compile the sweep's tileq kernels in parallel processes before timing anything.

Triton compiles a kernel on its first call, about a second or two of one CPU core each, and a
sweep like ``llm`` needs hundreds of (config, split-K, size-divisibility) variants: compiled one
by one inside the sweep this took more than half of an llm-decode run on an H200 (2026-11-29).
Worker processes run each distinct kernel once on operands of its real shape, so Triton's on-disk
cache holds the binaries when the sweep (another process) asks for them. A kernel a worker could
not build is simply compiled (or reported) by the sweep itself; the count is printed.
"""

from __future__ import annotations

import os
import sys
import time


def _kernel_name(case, m, n, k, device) -> str:
    """The instance tileq's row of (case, m, n, k) runs (a prepacked case: its int4 plan's)."""
    from ..dispatch.plan import make_plan

    if case.prepacked:
        import torch

        from ..kernels.int4p.spec import PrepackedSpec
        from .cases import GROUP_K

        spec = PrepackedSpec(m, n, k, *case.prepacked_kinds, torch.bfloat16, GROUP_K)
        return make_plan(spec, device).route.kernel
    plan = make_plan(case.spec(m, n, k), device, backend="triton")
    return plan.instance.name if plan.instance is not None else plan.route.family.name


def kernel_jobs(items, device) -> list[tuple[str, int, int, int]]:
    """(case name, m, n, k) per distinct kernel the sweep will launch (planning only)."""
    seen, jobs = set(), []
    for shape, case in items:
        m, n, k = shape.m, shape.n, shape.k
        if case.unsupported_reason(m, n, k):
            continue
        try:
            name = _kernel_name(case, m, n, k, device)
        except Exception:  # the sweep reports the same error on its row
            continue
        # Triton specializes integer arguments on == 1 and on divisibility by 16.
        key = (case.name, name, m == 1, m % 16 == 0, n % 16 == 0, k % 16 == 0)
        if key not in seen:
            seen.add(key)
            jobs.append((case.name, m, n, k))
    return jobs


def _compile_job(job) -> str:
    case_name, m, n, k = job
    import torch

    from .cases import build_operands, draw_activation, draw_weight, parse_case, quantize_weight_side

    try:
        dev = torch.device("cuda")
        case = parse_case(case_name)
        weight = quantize_weight_side(case, draw_weight(n, k, 0, dev))
        ops = build_operands(case, draw_activation(m, k, 0, dev), weight)
        ops.tileq(backend="triton")
        torch.cuda.synchronize()
        return ""
    except Exception as e:  # reported as a count; the sweep shows the error on its row
        return f"{case_name} M={m} N={n} K={k}: {type(e).__name__}: {str(e)[:160]}"


def precompile(items, device, jobs: int | None = None, stream=None) -> str:
    """Compile every distinct kernel of ``items`` with ``jobs`` processes; returns a summary."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    stream = stream or sys.stderr
    work = kernel_jobs(items, device)
    if not work:
        return "no tileq kernels to precompile"
    jobs = max(1, min(jobs or (os.cpu_count() or 2) - 1, len(work)))
    t0 = time.monotonic()
    failed = []
    with ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as pool:
        for i, err in enumerate(pool.map(_compile_job, work), 1):
            if err:
                failed.append(err)
            if i % 25 == 0 or i == len(work):
                stream.write(f"precompiling tileq kernels: {i}/{len(work)} ({time.monotonic() - t0:.0f} s)\n")
                stream.flush()
    text = f"precompiled {len(work) - len(failed)}/{len(work)} tileq kernels with {jobs} processes in " \
           f"{time.monotonic() - t0:.0f} s"
    if failed:
        text += f"; {len(failed)} failed there (first: {failed[0]})"
    return text
