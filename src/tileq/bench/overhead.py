"""``tileq overhead``: per-call host cost of tileq's eager path against torch._scaled_mm, and the
kernel time alone under CUDA-graph replay (decode issue: "host overhead ... reported").

Eager: ``calls`` back-to-back calls with no synchronization inside the loop; host microseconds
per call is the loop's wall time divided by ``calls`` (what a serving loop pays on the CPU). The
device time per call comes from CUDA events around the same loop. Graph: the call captured once
and replayed ``calls`` times (launch cost removed), timed with events.
"""

from __future__ import annotations

import time

import torch

from ..errors import UnsupportedError, expect


def host_us_per_call(fn, calls: int = 500, warmup: int = 50) -> float:
    """Wall-clock microseconds per call of ``fn`` over ``calls`` back-to-back calls."""
    for _ in range(warmup):
        fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def _device_us_per_call(fn, calls: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def _graph_us_per_call(fn, calls: int) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return _device_us_per_call(graph.replay, calls)


def measure(m: int, n: int, k: int, calls: int) -> list[dict]:
    import tileq
    from tileq.quant import quantize_a, quantize_weight

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(m, k, generator=gen, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, generator=gen, device=dev, dtype=torch.bfloat16)
    qx, sx = quantize_a(x, "fp8", granularity="row")
    qw, sw = quantize_weight(w, "fp8", granularity="col")
    out = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
    sa, sb = sx.reshape(m, 1).contiguous(), sw.reshape(1, n).contiguous()
    impls = {
        "tileq.linear (fp8 rowcol)": lambda: tileq.linear(qx, qw, sx, sw, scheme="rowcol", out=out),
        "torch._scaled_mm (row-wise)": lambda: torch._scaled_mm(qx, qw.t(), scale_a=sa, scale_b=sb,
                                                                out_dtype=torch.bfloat16),
    }
    rows = []
    for name, fn in impls.items():
        host = host_us_per_call(fn, calls)
        rows.append({"impl": name, "host_us": host, "eager_device_us": _device_us_per_call(fn, calls),
                     "graph_us": _graph_us_per_call(fn, calls)})
    return rows


def run(args) -> int:
    if not torch.cuda.is_available():
        raise UnsupportedError(expect("tileq overhead", "a CUDA GPU", "no CUDA device"))
    rows = measure(args.m, args.n, args.k, args.calls)
    print(f"M={args.m} N={args.n} K={args.k}, {args.calls} calls each ({torch.cuda.get_device_name()})")
    print(f"{'impl':<30} {'host us/call':>13} {'eager us/call':>14} {'graph us/call':>14}")
    for r in rows:
        print(f"{r['impl']:<30} {r['host_us']:>13.1f} {r['eager_device_us']:>14.1f} {r['graph_us']:>14.1f}")
    return 0


def register_cli(sub) -> None:
    """``tileq overhead`` running ``run``; its options are tileq.bench.cli.add_overhead's
    (importable without torch, for ``--help``)."""
    from .cli import add_overhead

    add_overhead(sub).set_defaults(func=run)
