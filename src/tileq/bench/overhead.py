"""``tileq overhead``: per-call host cost of tileq against torch, and the kernel time alone under
CUDA-graph replay.

Two groups of rows: the GEMM functions (``tileq.linear`` on fp8 rowcol operands against
``torch._scaled_mm``), and a whole layer as a model calls it (``QuantLinear`` of each ``--configs``
config against ``nn.Linear`` in bf16): eagerly, through the ``tileq::quant_linear`` custom op as
a compiled graph calls it, and ``torch.compile``d (default mode, no CUDA graph).

Host: ``calls`` back-to-back calls with no synchronization inside the loop; host microseconds per
call is the loop's wall time divided by ``calls`` (what a serving loop pays on the CPU). The
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


def layer_rows(m: int, n: int, k: int, calls: int, configs) -> list[dict]:
    """Host and device cost per call of one layer: nn.Linear (bf16) and QuantLinear per config,
    eager, through the custom op, compiled (``torch.compile``, no CUDA graph)."""
    from .. import ops  # noqa: F401 - registers torch.ops.tileq.*
    from ..nn import QuantLinear, config_from_name

    dev = torch.device("cuda")
    torch.manual_seed(0)
    dense = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    impls = {"nn.Linear bf16 (F.linear)": dense}
    ops = {}
    for name in configs:
        layer = QuantLinear.from_linear(dense, config_from_name(name))
        impls[f"QuantLinear {name}"] = layer
        ops[f"torch.ops.tileq.quant_linear {name}"] = layer
    rows = []
    with torch.inference_mode():
        for label, mod in impls.items():
            fn = (lambda mod=mod: mod(x))
            rows.append(_row(label, "eager", fn, calls))
        for label, layer in ops.items():
            fn = (lambda L=layer: torch.ops.tileq.quant_linear(x, L.weight, L.weight_scale, L.bias, L.input_scale,
                                                               L.spec.key))
            rows.append(_row(label, "custom op", fn, calls))
        for label, mod in impls.items():
            compiled = torch.compile(mod, fullgraph=True, dynamic=False)
            rows.append(_row(label, "compiled", (lambda c=compiled: c(x)), calls))
    return rows


def _row(impl: str, how: str, fn, calls: int) -> dict:
    host = host_us_per_call(fn, calls)
    return {"impl": impl, "how": how, "host_us": host, "eager_device_us": _device_us_per_call(fn, calls),
            "graph_us": _graph_us_per_call(fn, calls)}


def run(args) -> int:
    if not torch.cuda.is_available():
        raise UnsupportedError(expect("tileq overhead", "a CUDA GPU", "no CUDA device"))
    rows = [dict(r, how="eager") for r in measure(args.m, args.n, args.k, args.calls)]
    rows += layer_rows(args.m, args.n, args.k, args.calls, args.configs)
    print(f"M={args.m} N={args.n} K={args.k}, {args.calls} calls each ({torch.cuda.get_device_name()})")
    print(f"{'impl':<44} {'how':<10} {'host us/call':>13} {'eager us/call':>14} {'graph us/call':>14}")
    for r in rows:
        print(f"{r['impl']:<44} {r['how']:<10} {r['host_us']:>13.1f} {r['eager_device_us']:>14.1f} "
              f"{r['graph_us']:>14.1f}")
    if args.csv:
        import csv

        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    return 0


def register_cli(sub) -> None:
    """``tileq overhead`` running ``run``; its options are tileq.bench.cli.add_overhead's
    (importable without torch, for ``--help``)."""
    from .cli import add_overhead

    add_overhead(sub).set_defaults(func=run)
