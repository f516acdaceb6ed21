"""Time the sm_90 Gluon prefill kernel against the portable Triton kernel and cuBLAS(Lt).

    OUT=/tmp/tileq-out PYTHONPATH=src python3 scripts/gluon_bench.py [--scheme rowcol|abquant|int8|fast|bquant] [--acc]

Default: fp8 e4m3 rowcol (per-token x per-channel scales), rcr, bf16 output, precise
accumulation, at M in {128, 256, 512, 1024, 4096, 8192} x (N, K) in {(5120, 5120),
(17408, 5120), (5120, 17408), (4096, 4096), (14336, 4096)}, against torch._scaled_mm (row-wise
scales, bf16 out, use_fast_accum=False: cuBLASLt). --scheme abquant: DeepSeek's 1x128 x 128x128
fp8 blocks against cuBLASLt block-wise (F.scaled_mm, the harness's baseline); --scheme int8:
int8 rowcol against torch._int_mm plus an unfused dequantization (torch has no fused one), and
torch._int_mm alone (int32 out, no scales: the `int_mm` rows and the vs_int_mm column, the
issue's target being >= 1.3x); --scheme fast: fp8 rowcol with fast_accum=True against
torch._scaled_mm(use_fast_accum=True); --scheme bquant: B scales in groups of one column x 128
of K (A per token), which torch cannot compute: the Gluon kernel against the Triton kernel, with
the row-wise torch._scaled_mm of the same operands as a speed reference only. --acc: tileq's calls add an acc_in [M, N] (int32 for
int8, fp32 otherwise; the Gluon kernel then runs 128 x 128 tiles) while the torch baselines stay
as they are (no fused accumulator input), so the ratios show what reading acc_in costs.

Per problem, shape by shape: every implementation's output is checked against tileq's reference
first (a failing one is reported and not timed), then the Gluon kernel, the Triton kernel (the
planner's config: tuned table or heuristic) and the torch baseline are timed as CUDA-graph
replays with the L2 flushed before every run (tileq.bench.timing), in turn over --rounds rounds. Prints a table (TFLOP/s,
ratios to the baseline) and writes $OUT/gluon.csv (gluon_<scheme>.csv for the other schemes,
gluon_<scheme>_acc.csv with --acc).
About 1-2 minutes on an H200 per scheme.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time
import traceback
from dataclasses import replace

import torch

M_DEFAULT = "128,256,512,1024,4096,8192"
NK_DEFAULT = "5120x5120,17408x5120,5120x17408,4096x4096,14336x4096"
FIELDS = ["m", "n", "k", "impl", "config", "ms", "tflops", "vs_cublaslt", "vs_int_mm", "max_rel_err", "note"]
# --scheme: (tileq family, baseline name, csv file)
SCHEMES = {
    "rowcol": ("rowcol_fp8xfp8_rcr_prefill", "torch._scaled_mm row-wise (cuBLASLt)", "gluon.csv"),
    "abquant": ("abquant_fp8xfp8_rcr_prefill", "F.scaled_mm block-wise 1x128 x 128x128 (cuBLASLt)",
                "gluon_abquant.csv"),
    "int8": ("rowcol_i8xi8_rcr_prefill", "torch._int_mm + dequantization (cuBLAS)", "gluon_int8.csv"),
    "fast": ("rowcol_fp8xfp8_rcr_prefill", "torch._scaled_mm row-wise, use_fast_accum=True (cuBLASLt)",
             "gluon_fast.csv"),
    # b_scale groups of one column (B 1 x 128 groups along K): torch has no such product; the
    # row-wise _scaled_mm of the same operands is the speed reference (not compared: other scales)
    "bquant": ("bquant_fp8xfp8_rcr_prefill", "torch._scaled_mm row-wise (cuBLASLt; a speed reference, "
               "other scales)", "gluon_bquant.csv"),
}
# The problem fields a scheme sets beyond its family's canonical ones.
SCHEME_SPEC = {"fast": dict(fast_accum=True), "bquant": dict(group_n=1)}
# Largest max |out - reference| / max |reference| accepted before timing: the bf16 tolerance, and
# for fast accumulation what its error reaches at K = 17408 (1.2-1.6e-2 on an H200, 2026-11-29,
# bench/results/h200/fast-accum-errors/; cuBLASLt's use_fast_accum is in the same range).
TOLERANCE = {"fast": 3e-2}


def _baseline(scheme: str, problem):
    """The torch baseline's callable for a validated problem (the harness's builders for the
    block-wise and int8 ones: the same padding and layouts the bench suites use)."""
    from types import SimpleNamespace

    from tileq.bench import baselines

    a, b, sa, sb = problem.a, problem.b, problem.a_scale, problem.b_scale
    if scheme == "bquant":
        m, n = problem.spec.m, problem.spec.n
        ra = torch.ones(m, 1, dtype=torch.float32, device=a.device)
        rb = torch.ones(1, n, dtype=torch.float32, device=a.device)
        return lambda: torch._scaled_mm(a, b, scale_a=ra, scale_b=rb, out_dtype=torch.bfloat16)
    if scheme in ("rowcol", "fast"):
        # Row-wise scales [M, 1] x [1, N] fp32, B column-major; precise or fast accumulation.
        fast = scheme == "fast"
        return lambda: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                        use_fast_accum=fast)
    spec = problem.spec
    ops = SimpleNamespace(m=spec.m, n=spec.n, k=spec.k, a=a, b=b, a_scale=sa, b_scale=sb, bytes=0,
                          case=SimpleNamespace(scheme=spec.scheme, fast_accum=False))
    build = baselines.build_blockwise if scheme == "abquant" else baselines.build_int_mm_dequant
    return build(ops, baselines.Context(a.device, "triton")).fn


def _int_mm_alone(problem):
    """torch._int_mm alone (int32 out, no dequantization): the issue's int8 baseline."""
    from types import SimpleNamespace

    from tileq.bench import baselines

    spec = problem.spec
    ops = SimpleNamespace(m=spec.m, n=spec.n, k=spec.k, a=problem.a, b=problem.b, a_scale=problem.a_scale,
                          b_scale=problem.b_scale, bytes=0, case=SimpleNamespace(scheme=spec.scheme))
    return baselines.build_int_mm(ops, baselines.Context(problem.a.device, "triton")).fn


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _nks(text: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in x.split("x")) for x in text.split(",") if x]


def _variants(text: str) -> list:
    """--variants: [(BN, STAGES, EPI_BUFS, OVERLAP, SPLIT_K) or None for the planner's config];
    [None] when empty. SPLIT_K 'a': as many K ranges as the wave model gives the last wave
    (``split_k_for``; -1 here)."""
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        if item == "plan":
            out.append(None)
            continue
        if item in ("plan:nu", "plan:ep", "plan:ne", "plan:ns") or item.startswith("plan:g"):  # the planner's
            # config, group scales not unrolled (one step ahead) / the epilogue's vectors loaded at
            # the start of each tile / after the main loop / not swapped (one-column b_scale groups:
            # 128 x 64 tiles) / GROUP_M = N (the tile order's row groups)
            out.append(("plan", item[5:]))
            continue
        parts = [-1 if v == "a" else int(v) for v in item.split(":")]
        parts += [1, 0, 1][len(parts) - 2:]
        out.append((parts[0], parts[1], parts[2], bool(parts[3]), parts[4]))
    return out or [None]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", default=M_DEFAULT, help=f"comma-separated M values (default {M_DEFAULT})")
    p.add_argument("--nk", default=NK_DEFAULT, help=f"comma-separated NxK (default {NK_DEFAULT})")
    p.add_argument("--runs", type=int, default=30, help="timed graph replays per implementation")
    p.add_argument("--rounds", type=int, default=3,
                   help="the replays split into this many rounds, the implementations timed in turn in "
                        "each round (a clock drift during a problem then weighs on all of them alike); "
                        "the time is the median of the rounds' medians")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--variants", default="",
                   help="Gluon configs to time instead of the planner's, comma-separated "
                        "BN:STAGES[:EPI_BUFS[:OVERLAP[:SPLIT_K]]] (e.g. 128:6,256:4,256:3:2,128:6:1:1,"
                        "128:6:1:0:2, 128:6:1:0:a); 'plan' = the planner's, 'plan:nu' = the planner's with "
                        "group scales one K step ahead, the loop not unrolled, 'plan:ep' / 'plan:ne' = with "
                        "the epilogue's vectors loaded at the start of each tile / after the main loop, "
                        "'plan:g16' = with GROUP_M = 16")
    p.add_argument("--no-triton", action="store_true", help="skip the portable Triton kernel")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/tileq-out"), help="folder for gluon.csv")
    p.add_argument("--scheme", choices=tuple(SCHEMES), default="rowcol")
    p.add_argument("--acc", action="store_true",
                   help="tileq's calls add an acc_in [M, N] (the baselines do not: no fused input in torch)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("gluon_bench: needs a CUDA GPU", file=sys.stderr)
        return 2

    import triton

    import tileq
    from tileq.bench.timing import Timer, TimingConfig
    from tileq.catalog.families import family_spec
    from tileq.catalog.names import parse_family
    from tileq.kernels.gluon import launch as glaunch
    from tileq.kernels.gluon.config import instance_tag
    from tileq.kernels.gluon.launch import GluonLaunch
    from tileq.kernels.gluon.config import split_k_for
    from tileq.kernels.launch import make_launch
    from tileq.dispatch.plan import make_plan
    from tileq.problem import build_problem
    from tileq.testing import check_close, make_args

    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    print(f"{props.name} sm_{props.major}{props.minor}, torch {torch.__version__}, triton {triton.__version__}")
    rounds = max(1, args.rounds)
    timer = Timer(device, TimingConfig(warmup=args.warmup, runs=max(1, args.runs // rounds), flush="read",
                                       graphs=True))
    print(timer.describe())
    os.makedirs(args.out, exist_ok=True)
    family, base_name, csv_name = SCHEMES[args.scheme]
    if args.acc:
        csv_name = f"gluon_{args.scheme}_acc.csv"
    csv_path = os.path.join(args.out, csv_name)
    fam = parse_family(family)
    spec_kw = dict(SCHEME_SPEC.get(args.scheme, {}), has_acc=args.acc)
    tol = TOLERANCE.get(args.scheme)
    print(f"{family} {spec_kw}: Gluon vs the Triton kernel vs {base_name}"
          + (" (tileq with acc_in, the baseline without)" if args.acc else ""))

    # Count the Gluon kernel's launches: a call the launcher hands to the Triton fallback would
    # otherwise be timed as "gluon".
    real_kernel = glaunch._gl()["kernel"]
    gluon_launches = []

    class Counting:
        def __getitem__(self, grid):
            gluon_launches.append(grid)
            return real_kernel[grid]

    glaunch._gl()["kernel"] = Counting()

    def plan_with(spec, switch: str):
        os.environ["TILEQ_GLUON"] = switch
        try:
            return make_plan(spec, device)
        finally:
            os.environ.pop("TILEQ_GLUON", None)

    rows = []
    t_start = time.time()
    lib = "cuBLAS" if args.scheme == "int8" else "cuBLASLt"
    unit = "TOP/s" if args.scheme == "int8" else "TFLOP/s"
    int_mm = args.scheme == "int8"
    header = (f"{'M':>5} {'N':>6} {'K':>6} | {'gluon':>7} {'triton':>7} {lib:>8} {unit:<7} | "
              f"{'gluon/' + lib:>14} {'triton/' + lib:>15} | "
              + (f"{'int_mm':>7} {'gluon/int_mm':>12} | " if int_mm else "") + "gluon config")
    print(header)
    print("-" * len(header))
    for n, k in _nks(args.nk):
        for m in _ints(args.m):
            spec = replace(family_spec(fam, m, n, k), **spec_kw)
            data = make_args(spec, seed=m + n + k, device="cuda")
            problem = data.call(build_problem)
            a, b, sa, sb, acc = problem.a, problem.b, problem.a_scale, problem.b_scale, problem.acc
            ref = data.call(tileq.gemm, backend="reference")
            # (with --acc the torch baselines compute the product without acc_in)
            ref_base = data.call(tileq.gemm, backend="reference", acc=None) if args.acc else ref
            flops = 2.0 * m * n * k
            results = {}

            plan_g = plan_with(spec, "1")
            gluon_calls, gluon_configs = {}, {}
            for v, variant in enumerate(_variants(args.variants)):
                name = "gluon" if v == 0 else f"gluon{v}"
                if plan_g.impl != "gluon":
                    gluon_calls[name], gluon_configs[name] = None, f"not chosen: {plan_g.impl_reason}"
                    continue
                plan_v = plan_g
                if variant is not None and variant[0] == "plan":
                    change = ({"nu": dict(scale_unroll=False), "ep": dict(epi_preload=True),
                               "ne": dict(epi_preload=False), "ns": dict(swap_ab=False)}.get(variant[1])
                              or dict(group_m=int(variant[1][1:])))
                    plan_v = replace(plan_g, gluon=replace(plan_g.gluon, **change))
                elif variant is not None:
                    bn, stages, epi, overlap, split = variant
                    if split == -1:
                        tiles = -(-m // 128) * -(-n // bn)
                        split = split_k_for(tiles, -(-k // 128), torch.cuda.get_device_properties(device).multi_processor_count)
                    plan_v = replace(plan_g, gluon=replace(plan_g.gluon, block_n=bn, stages=stages,
                                                           epi_bufs=epi, overlap=overlap, split_k=split))
                launch_v = make_launch(problem, plan_v)
                out_v = torch.empty(m, n, dtype=torch.bfloat16, device=device)
                gluon_calls[name] = (lambda lv=launch_v, o=out_v: lv(a, b, sa, sb, None, acc, o))
                gluon_calls[name].launch = launch_v
                # the config the call runs (acc_in narrows wide tiles), '_fa' for fast accumulation
                gluon_configs[name] = (instance_tag(spec, launch_v.variant(True)[0])
                                       if isinstance(launch_v, GluonLaunch) else plan_v.gluon.tag)
            config_g = ",".join(gluon_configs.values())
            calls = dict(gluon_calls)
            configs = dict(gluon_configs)
            if not args.no_triton:
                plan_t = plan_with(spec, "0")
                launch_t = make_launch(problem, plan_t)
                out_t = torch.empty(m, n, dtype=torch.bfloat16, device=device)
                calls["triton"] = lambda: launch_t(a, b, sa, sb, None, acc, out_t)
                configs["triton"] = plan_t.instance.config.tag
            calls["cublaslt"] = _baseline(args.scheme, problem)
            configs["cublaslt"] = base_name
            if int_mm:
                calls["int_mm"] = _int_mm_alone(problem)
                configs["int_mm"] = "torch._int_mm alone (int32 out, no scales; not checked)"
            for impl, fn in calls.items():
                row = dict(m=m, n=n, k=k, impl=impl.rstrip("0123456789"), config=configs[impl], ms="",
                           tflops="", vs_cublaslt="", vs_int_mm="", max_rel_err="", note="")
                results[impl] = row
                if fn is None:
                    row["note"] = "Gluon kernel not chosen"
                    continue
                if impl.startswith("gluon") and not isinstance(fn.launch, GluonLaunch):
                    row["note"] = "TMA cannot read these operands: the Triton fallback would run"
                    continue
                try:
                    before = len(gluon_launches)
                    got = fn()
                    torch.cuda.synchronize()
                    if impl.startswith("gluon") and len(gluon_launches) == before:
                        row["note"] = "the call fell back to the Triton kernel"
                        continue
                    if impl == "int_mm" or (impl == "cublaslt" and args.scheme == "bquant"):
                        continue  # the raw int32 product / other scales: nothing to compare
                    stats = check_close(got, ref_base if impl == "cublaslt" else ref, torch.bfloat16, tol)
                    row["max_rel_err"] = f"{stats['max_rel']:.2e}"
                except Exception as e:  # noqa: BLE001 - report and go on: one failure must not hide the rest
                    row["note"] = f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
                    if os.environ.get("GLUON_BENCH_TRACE"):
                        traceback.print_exc()
                    continue
            timed = {impl: [] for impl, fn in calls.items() if fn is not None and not results[impl]["note"]}
            for _ in range(rounds):  # timed only after every output was checked, in turn per round
                for impl in list(timed):
                    try:
                        timed[impl].append(timer.measure(calls[impl]).median_ms)
                    except Exception as e:  # noqa: BLE001
                        results[impl]["note"] = f"FAILED timing: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
                        del timed[impl]
            for impl, times in timed.items():
                ms = statistics.median(times)
                results[impl]["ms"] = f"{ms:.4f}"
                results[impl]["tflops"] = f"{flops / ms / 1e9:.1f}"
            base = results["cublaslt"]["tflops"]
            raw = results["int_mm"]["tflops"] if int_mm else ""
            for row in results.values():
                if row["tflops"] and base:
                    row["vs_cublaslt"] = f"{float(row['tflops']) / float(base):.3f}"
                if row["tflops"] and raw:
                    row["vs_int_mm"] = f"{float(row['tflops']) / float(raw):.3f}"
                rows.append(row)

            def tf(impl):
                return results[impl]["tflops"] if impl in results and results[impl]["tflops"] else "-"

            def ratio(impl):
                return results[impl]["vs_cublaslt"] if impl in results and results[impl]["vs_cublaslt"] else "-"

            notes = "; ".join(f"{i}: {r['note']}" for i, r in results.items() if r["note"])
            extra = " ".join(f"{i}={ratio(i)}" for i in gluon_calls if i != "gluon")
            vs_raw = (results["gluon"]["vs_int_mm"] or "-") if int_mm else ""
            print(f"{m:>5} {n:>6} {k:>6} | {tf('gluon'):>7} {tf('triton'):>7} {tf('cublaslt'):>8} {'':<7} | "
                  f"{ratio('gluon'):>14} {ratio('triton'):>15} | "
                  + (f"{tf('int_mm'):>7} {vs_raw:>12} | " if int_mm else "") + f"{config_g} {extra}"
                  + (f"  [{notes}]" if notes else ""), flush=True)
            with open(csv_path, "w", newline="") as f:  # rewritten per problem: a cut run keeps its rows
                w = csv.DictWriter(f, fieldnames=FIELDS)
                w.writeheader()
                w.writerows(rows)
            del data, problem, a, b, acc, ref, ref_base, calls, gluon_calls
    glaunch._gl()["kernel"] = real_kernel
    by_config = {}
    for r in rows:
        if r["impl"] == "gluon" and r["vs_cublaslt"]:
            by_config.setdefault(r["config"], []).append(float(r["vs_cublaslt"]))
    for config, ratios in sorted(by_config.items()):
        ratios.sort()
        print(f"gluon {config} / {lib}: min {ratios[0]:.3f}, median {ratios[len(ratios) // 2]:.3f}, "
              f"max {ratios[-1]:.3f} over {len(ratios)} problems")
    raw_ratios = sorted(float(r["vs_int_mm"]) for r in rows if r["impl"] == "gluon" and r["vs_int_mm"])
    if raw_ratios:
        print(f"gluon / torch._int_mm alone: min {raw_ratios[0]:.3f}, median {raw_ratios[len(raw_ratios) // 2]:.3f}, "
              f"max {raw_ratios[-1]:.3f} over {len(raw_ratios)} rows (target >= 1.3)")
    failed = [r for r in rows if r["note"].startswith("FAILED")]
    print(f"{len(rows)} rows -> {csv_path} ({time.time() - t_start:.0f} s); {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
