"""``tileq demo``: the main job. Every headline scheme on Qwen3-14B's projection GEMMs, then a
transformers model quantized with every config (demo_model.py).

With a GPU: the projections q/o (N = K = 5120), gate/up (N = 17408, K = 5120) and down
(N = 5120, K = 17408) at M in {1, 16, 4096}; each scheme is checked against tileq's reference
and the unquantized bf16 product, then timed against the best torch baseline; report.md, plots
and results.csv go to --out. Without a GPU: the same shapes with N and K divided by about 40, M in
{1, 16, 64}, through Triton's interpreter: correctness only (timings need a GPU).

Exit status 1 when any correctness check fails.
"""

from __future__ import annotations

import statistics
import sys

DEFAULT_OUT = "tileq-out/demo"


def register_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "demo",
        help="every scheme on Qwen3-14B's projections: correctness, SQNR and (GPU) speed",
        description=__doc__.split("\n\n")[1],
    )
    p.add_argument("--out", default=DEFAULT_OUT, help=f"folder for results.csv, report.md and plots (default: {DEFAULT_OUT})")
    p.add_argument("--quick", action="store_true",
                   help="fewer shapes: the q/o projection at M in {1, 16} (a fast check)")
    p.add_argument("--cases", default="headline", help="cases or case sets, see tileq bench --list (default: headline)")
    p.add_argument("--device", default="auto", help="auto (default), cuda, cuda:N or cpu")
    p.add_argument("--warmup", type=int, default=50, help="GPU: warm-up runs per measurement (default: 50)")
    p.add_argument("--runs", type=int, default=100, help="GPU: timed runs per measurement (default: 100)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random operands (default: 0)")
    p.add_argument("--no-plots", action="store_true", help="do not write PNG plots (GPU runs)")
    p.add_argument("--no-model", action="store_true",
                   help="skip the model part (a transformers model quantized with every config)")
    p.set_defaults(func=run_demo, demo_parser=p)


def _demo_shapes(gpu: bool, quick: bool):
    from .bench.suites import load_suite

    shapes = load_suite("demo" if gpu else "demo-cpu")
    if quick:
        first = shapes[0].name
        shapes = [s for s in shapes if s.name == first and s.m in (1, 16)]
    return shapes


def _table(rows) -> str:
    """One line per (shape, case): errors, SQNR, and times when measured."""
    from .bench.report import best_baseline

    timed = any(r.timed for r in rows)
    head = f"{'shape':<26} {'M':>5} {'case':<22} {'status':<8} {'rel err':>8} {'SQNR dB':>8}"
    if timed:
        head += f" {'tileq ms':>9} {'best torch baseline':>26} {'ms':>8} {'speedup':>8} {'vs bf16':>8}"
    lines = [head, "-" * len(head)]
    last = None
    by_shape: dict = {}
    for r in rows:
        by_shape.setdefault((r.shape, r.m, r.n, r.k), {}).setdefault(r.case, {})[r.impl] = r
    for (shape, m, n, k), cases in by_shape.items():
        if last is not None:
            lines.append("")
        last = shape
        for case, impls in cases.items():
            t = impls.get("tileq")
            if t is None:
                continue
            status = "ok" if t.passed else t.status
            err = f"{t.rel_err:.2e}" if t.rel_err is not None else "-"
            sq = f"{t.sqnr_db:.1f}" if t.sqnr_db is not None else "-"
            line = f"{shape[:26]:<26} {m:>5} {case.rsplit(':', 1)[0]:<22} {status:<8} {err:>8} {sq:>8}"
            if timed:
                b = best_baseline(impls)
                bf = impls.get("torch_bf16_matmul")
                tm = f"{t.time_ms:.4f}" if t.timed else "-"
                bname = b.impl if b else "none applies"
                bms = f"{b.time_ms:.4f}" if b else "-"
                sp = f"{b.time_ms / t.time_ms:.2f}x" if b and t.timed else "-"
                vs = f"{bf.time_ms / t.time_ms:.2f}x" if bf is not None and bf.timed and t.timed else "-"
                line += f" {tm:>9} {bname:>26} {bms:>8} {sp:>8} {vs:>8}"
            lines.append(line)
    return "\n".join(lines)


def run_demo(args) -> int:
    # Before anything imports tileq's kernels: without CUDA, Triton's interpreter must be chosen.
    from .bench.device import prepare_device
    from .errors import TileqError

    try:
        device = prepare_device(args.device)
        from .bench.baselines import select
        from .bench.cases import parse_case_list

        cases = parse_case_list(args.cases)
        gpu = device.type == "cuda"
        shapes = _demo_shapes(gpu, args.quick)
    except (TileqError, ValueError, TypeError) as e:
        print(f"tileq demo: error: {e}", file=sys.stderr)
        return 2

    from .bench.cli import command_line
    from .bench.harness import SweepConfig, run_sweep, tileq_failures
    from .bench.outputs import write_outputs
    from .bench.timing import TimingConfig

    sizes = ", ".join(sorted({f"{s.name} (N={s.n}, K={s.k})" for s in shapes}))
    ms = sorted({s.m for s in shapes})
    print(f"tileq demo on {'GPU ' + _gpu_name(device) if gpu else 'CPU'}: {len(cases)} schemes x "
          f"{len(shapes)} shapes\n  shapes: {sizes}\n  M: {ms}")
    if not gpu:
        print("  No CUDA GPU: tileq's Triton kernels run in Triton's interpreter at reduced sizes "
              "(Qwen3-14B's N and K / 40).\n  Correctness only: TIMINGS NEED A GPU.")
    print()
    cfg = SweepConfig(
        shapes=shapes, cases=cases, impls=select(None), device=device,
        timing=TimingConfig(args.warmup, args.runs), seed=args.seed, title="demo",
        ceilings=gpu,
    )
    sweep = run_sweep(cfg)
    print()
    print(_table(sweep.rows))
    paths = write_outputs(sweep, args.out, title="tileq demo: Qwen3-14B projections",
                          command=command_line(args, "demo"), plots=not args.no_plots)
    print(f"\nwritten: {paths['report']}, {paths['csv']}"
          + (f", {len(paths['plots'])} plots in {args.out}" if paths["plots"] else ""))
    if not gpu:
        print("Timings need a GPU: on a CUDA machine `tileq demo` also times every scheme against "
              "the best torch baseline.")
    failures = tileq_failures(sweep.rows)
    checked = [r for r in sweep.rows if r.impl == "tileq"]
    if failures:
        print(f"\nFAILED: {len(failures)} of {len(checked)} tileq checks:", file=sys.stderr)
        for r in failures:
            print(f"  {r.case} {r.shape} M={r.m}: {r.status}: {r.note}", file=sys.stderr)
        return 1
    passed = [r for r in checked if r.passed]
    sq = [r.sqnr_db for r in passed if r.sqnr_db is not None]
    print(f"\nall {len(passed)} tileq results match the reference (max rel err "
          f"{max(r.rel_err for r in passed):.2e}; median SQNR vs bf16 {statistics.median(sq):.1f} dB)"
          if passed and sq else f"\n{len(passed)} tileq results checked")
    if args.no_model:
        return 0
    from .demo_model import cpu_model_demo, gpu_model_demo

    return gpu_model_demo(args.out) if gpu else cpu_model_demo(args.seed)


def _gpu_name(device) -> str:
    import torch

    return torch.cuda.get_device_name(device)
