"""Catalog commands of the ``tileq`` CLI: list, build, explain, selftest."""

from __future__ import annotations

import os
import sys
import time

import torch

from .device import ARCHS, check_types, get_arch
from .catalog.families import catalog, family_spec
from .catalog.names import KernelFamily
from .errors import TileqError
from .problem import LAYOUTS, ProblemSpec, Scheme

_OUT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def register(sub) -> None:
    p = sub.add_parser("list", help="the kernel catalog, one family per line")
    p.add_argument("--scheme", choices=[s.value for s in Scheme])
    p.add_argument("--pipeline", choices=["prefill", "decode", "preshufflequant"])
    p.add_argument("--arch", help="only families this arch can run, e.g. sm_90")
    p.add_argument("--names", action="store_true",
                   help="names only (regenerates tests/golden_kernel_names.txt)")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("build", help="compile every catalog kernel ahead of time for an arch")
    p.add_argument("--arch", required=True, help=f"one of {', '.join(ARCHS)}")
    p.add_argument("--out", default="build/kernels", help="folder for binaries and manifest.json")
    p.add_argument("--jobs", type=int, default=None, help="parallel compiler processes (default: all cores)")
    p.add_argument("--family", action="append", help="build only this family (repeatable)")
    p.set_defaults(func=cmd_build)

    p = sub.add_parser("explain", help="print the plan for a problem described without tensors")
    p.add_argument("--scheme", required=True, choices=[s.value for s in Scheme])
    p.add_argument("--a", required=True, help="A's type: int8, fp8, bf8, int4, bf16, fp16")
    p.add_argument("--b", required=True, help="B's type")
    p.add_argument("--layout", default="rcr", choices=LAYOUTS)
    p.add_argument("--m", type=int, required=True)
    p.add_argument("--n", type=int, required=True)
    p.add_argument("--k", type=int, required=True)
    p.add_argument("--group-k", type=int, default=128)
    p.add_argument("--group-n", type=int, default=None, help="1 or 128 (bquant/abquant)")
    p.add_argument("--preshuffled", action="store_true", help="a_scale stored K-group-major")
    p.add_argument("--bias", action="store_true")
    p.add_argument("--acc", action="store_true")
    p.add_argument("--fast-accum", action="store_true", help="fp8/bf8: fast accumulation (gemm's fast_accum)")
    p.add_argument("--out-dtype", default="bf16", choices=list(_OUT))
    p.add_argument("--arch", default=None, help="plan for this arch (default: the local GPU, else sm_90)")
    p.add_argument("--backend", default="triton", choices=["triton", "reference"])
    p.add_argument("--prepacked", action="store_true",
                   help="B is a prepacked int4 nn.Linear weight (tileq.PrepackedInt4): what linear runs for it")
    p.set_defaults(func=cmd_explain)

    p = sub.add_parser("selftest", help="name parity, catalog build and a correctness pass")
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--skip-build", action="store_true")
    p.add_argument("--jobs", type=int, default=None)
    p.set_defaults(func=cmd_selftest)


def _arch_ok(fam: KernelFamily, arch) -> bool:
    try:
        check_types(arch, fam.a, fam.b)
        return True
    except TileqError:
        return False


def _supports(fam: KernelFamily) -> str:
    from .catalog.families import canonical_scale_kinds

    sa, sb, gn = canonical_scale_kinds(fam.scheme, fam.a, fam.b)
    scales = f"a_scale={sa.value} b_scale={sb.value}" + (f" group_n={gn}" if fam.scheme.b_grouped else "")
    archs = ",".join(n for n, a in ARCHS.items() if _arch_ok(fam, a))
    return f"{scales}  archs={archs}"


def cmd_list(args) -> int:
    arch = get_arch(args.arch) if args.arch else None
    shown = 0
    for fam in catalog():
        if args.scheme and fam.scheme.value != args.scheme:
            continue
        if args.pipeline and fam.pipeline != args.pipeline:
            continue
        if arch is not None and not _arch_ok(fam, arch):
            continue
        print(fam.name if args.names else f"{fam.name:<44} {_supports(fam)}")
        shown += 1
    print(f"{shown} families", file=sys.stderr)
    return 0


def _progress(i: int, total: int, r) -> None:
    width = 30
    done = int(width * i / total)
    state = "ok" if r.ok else "FAILED"
    line = f"\r[{'#' * done}{'.' * (width - done)}] {i}/{total} {state:<6} {r.name[:70]:<70}"
    sys.stderr.write(line)
    if not r.ok:
        sys.stderr.write(f"\n  {r.error}\n")
    if i == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def cmd_build(args) -> int:
    from .build import build_catalog

    t0 = time.time()
    results = build_catalog(args.arch, args.out, jobs=args.jobs, families=args.family, progress=_progress)
    failed = [r for r in results if not r.ok]
    spilled = [r for r in results if r.ok and r.spills]
    print(f"built {len(results) - len(failed)}/{len(results)} kernels for {args.arch} in "
          f"{time.time() - t0:.0f} s -> {args.out}/manifest.json")
    for r in spilled:
        print(f"  spills: {r.name}: {r.spills} B of local memory, {r.registers} registers")
    for r in failed:
        print(f"  FAILED: {r.name}: {r.error}")
    return 1 if failed else 0


def spec_from_args(args) -> ProblemSpec:
    from .warmup import describe

    return describe(
        scheme=args.scheme, a=args.a, b=args.b, m=args.m, n=args.n, k=args.k, layout=args.layout,
        out_dtype=_OUT[args.out_dtype], group_k=args.group_k, group_n=args.group_n,
        preshuffled=args.preshuffled, bias=args.bias, acc=args.acc, fast_accum=args.fast_accum,
    )


def cmd_explain(args) -> int:
    from .dispatch.plan import make_plan

    if args.prepacked:
        return _explain_prepacked(args)
    spec = spec_from_args(args)
    arch = args.arch
    if arch is None and not torch.cuda.is_available():
        arch = "sm_90"
        print("(no GPU here: planning for sm_90; pass --arch to choose)")
    plan = make_plan(spec, torch.device("cuda"), backend=args.backend, arch=arch)
    print(plan.describe())
    return 0


_PREPACKED_X = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn, "bf8": torch.float8_e5m2}


def _explain_prepacked(args) -> int:
    from .errors import UnsupportedError, expect
    from .dispatch.int4 import described_plan
    from .kernels.int4p.config import W_SCALE_OF_SCHEME

    if args.b not in ("int4", "i4") or args.layout != "rcr" or args.a not in _PREPACKED_X:
        raise UnsupportedError(expect("--prepacked", "--b int4, --layout rcr and --a bf16, fp16, fp8 or bf8 "
                                      "(an nn.Linear int4 weight, x @ W^T)", f"--a {args.a} --b {args.b} "
                                      f"--layout {args.layout}"))
    kinds = W_SCALE_OF_SCHEME
    if args.scheme not in kinds:
        raise UnsupportedError(expect("--scheme", "bquant, rowcol or tensor for a prepacked weight", args.scheme))
    if args.scheme == "bquant" and args.group_k % 128:
        raise UnsupportedError(expect("--group-k", "a multiple of 128 for a prepacked weight", args.group_k))
    plan = described_plan(args.m, args.n, args.k, _PREPACKED_X[args.a], kinds[args.scheme])
    path = plan.describe()
    print(f"problem : M={args.m} N={args.n} K={args.k}, x {args.a} x prepacked int4 (layout i4p1), "
          f"scheme {args.scheme}" + (f", group_k {args.group_k}" if args.scheme == "bquant" else ""))
    decode = plan.path == "decode"
    print(f"runs    : {plan.kernel if decode else path}")
    if decode:  # the decode kernel: its config and where it came from (the prefill paths have theirs in the name)
        cfg, source = plan.config, plan.reason
        cap = f", registers capped at {cfg.maxnreg}" if cfg.maxnreg else ""
        cap += ", group scales loaded one K tile ahead" if cfg.scale_ahead else ""
        cap += ", fp8 activations converted to fp16 (an fp16 wgmma)" if cfg.fp16 else ""
        split = f"split-K {cfg.split_k}"
        if cfg.streamk:
            split = (f"stream-K: {cfg.per_sm} programs per SM, each an equal contiguous share of the (tile, K step) "
                     f"units, shared tiles' partials summed in the kernel by their last program")
        elif cfg.split_k > 1:
            split += (" (partials summed in the kernel by each tile's last program)" if cfg.fixup
                      else " (partials summed by a second kernel)")
        print(f"config  : {cfg.bm} tokens x {cfg.rows} weight rows per program, 512 of K per step, "
              f"{cfg.stages} stages, {split}{cap} ({source})")
    print("executor: the kernels of tileq.prepacked on an sm_90 GPU (Triton decode kernel; from "
          "33 tokens the Gluon prefill kernel where dispatch.int4.prefill_tiling gives it the call: split over K "
          "on narrow weights, unsplit where its tiles fill the SMs, always from 256 tokens where it "
          "serves the call (W4A8 below 256 tokens, and a little above on wide or deep weights: its fp8 "
          "build for e4m3 with group scales, else on activations cast to bf16); else W4A8 the values as fp8 "
          "and tileq's fp8 GEMM, W4A16 dequantize + cuBLAS), "
          "or the reference executor on the unprepacked weight (backend='reference', CPU tensors)")
    return 0


# Small odd shapes for the correctness pass: M, N, K off every tile multiple, a K tail inside a
# group; even where int4 is packed along that dimension.
SELFTEST_SHAPES = {"prefill": (69, 38, 300), "preshufflequant": (69, 38, 300), "decode": (3, 38, 300)}


def selftest_shape(fam: KernelFamily) -> tuple[int, int, int]:
    m, n, k = SELFTEST_SHAPES[fam.pipeline]
    if fam.a.value == "i4" and fam.layout[0] == "c":
        m += 1  # int4 packed along M needs an even M
    return m, n, k


def selftest_family(fam: KernelFamily, device: str, seed: int = 0) -> dict:
    """Run one family on a small odd shape with backend='triton' and compare with the reference."""
    import tileq
    from .testing import check_close, make_args

    m, n, k = selftest_shape(fam)
    spec = family_spec(fam, m, n, k, out_dtype=torch.float32)
    args = make_args(spec, seed=seed, device=device, bias=True)
    out = torch.full((m, n), float("nan"), dtype=torch.float32, device=device)
    got = args.call(tileq.gemm, backend="triton", out=out)
    want = args.call(tileq.gemm, backend="reference")
    return check_close(got, want, torch.float32)


def cmd_selftest(args) -> int:
    from .catalog.names import format_family, parse_family

    failures = 0
    fams = catalog()
    bad_names = [f.name for f in fams if parse_family(format_family(f)) != f]
    print(f"name parity: {len(fams) - len(bad_names)}/{len(fams)} families round-trip")
    failures += len(bad_names)
    if not args.skip_build:
        import subprocess

        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        cmd = [sys.executable, "-m", "tileq", "build", "--arch", args.arch, "--out", "build/selftest"]
        if args.jobs:
            cmd += ["--jobs", str(args.jobs)]
        rc = subprocess.call(cmd, env=env)
        print(f"build: {'ok' if rc == 0 else 'FAILED'}")
        failures += rc != 0
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        # The interpreter must be chosen before Triton is imported: rerun this pass in a child.
        import subprocess

        env = dict(os.environ, TRITON_INTERPRET="1")
        code = "import sys, tileq.commands as c; sys.exit(c.correctness_pass('cpu'))"
        rc = subprocess.call([sys.executable, "-c", code], env=env)
    else:
        rc = correctness_pass(device)
    failures += rc != 0
    print("selftest:", "PASSED" if failures == 0 else f"FAILED ({failures} problems)")
    return 1 if failures else 0


def correctness_pass(device: str) -> int:
    fams = catalog()
    failed = 0
    t0 = time.time()
    for i, fam in enumerate(fams, 1):
        try:
            selftest_family(fam, device, seed=i)
            state = "ok"
        except (AssertionError, TileqError, RuntimeError) as e:
            failed += 1
            state = f"FAILED: {str(e).splitlines()[0][:200]}"
        if state != "ok" or i == len(fams) or i % 20 == 0:
            print(f"[{i}/{len(fams)}] {fam.name}: {state}", flush=True)
    where = "GPU" if device == "cuda" else "CPU (Triton interpreter)"
    print(f"correctness on {where}: {len(fams) - failed}/{len(fams)} families match the reference "
          f"({time.time() - t0:.0f} s)")
    bad = prepacked_pass(device)
    return 1 if failed or bad else 0


def prepacked_pass(device: str, seed: int = 0) -> int:
    """The prepacked-int4 kernel (decode and split-K configs, the prefill path) against the
    reference executor on the same weight unprepacked, on small odd shapes."""
    import tileq
    from .api_prepacked import linear_prepacked
    from .kernels.int4p.config import Int4pConfig
    from .testing import check_close

    g = torch.Generator().manual_seed(seed)
    n, k = 70, 1100
    v = torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=g)
    w = tileq.prepack_int4(v).to(device)
    ws = (torch.rand(-(-k // 128), n, generator=g) + 0.5).to(device)
    pk = tileq.unprepack_int4(w)
    failed = 0
    for x_dtype, m, cfg in ((torch.bfloat16, 3, Int4pConfig(16, 1, 2)), (torch.float16, 19, Int4pConfig(32, 2, 2)),
                            (torch.float8_e4m3fn, 5, Int4pConfig(16, 2, 2)), (torch.bfloat16, 260, None)):
        x = torch.randn(m, k, generator=g).to(x_dtype).to(device)
        xs = (torch.rand(m, generator=g) + 0.5).to(device) if x_dtype == torch.float8_e4m3fn else None
        got = linear_prepacked(x, w, xs, ws, out_dtype=torch.float32, config=cfg)
        want = tileq.linear(x, pk, xs, ws, scheme="bquant", out_dtype=torch.float32, backend="reference")
        label = f"int4p {x_dtype} M={m} {cfg.tag if cfg else 'dequant+cublas'}"
        try:
            # The prefill path rounds the dequantized weight and the product to 16 bits.
            check_close(got, want, torch.float32 if cfg else torch.bfloat16)
        except AssertionError as e:
            failed += 1
            print(f"{label}: FAILED: {str(e).splitlines()[0][:200]}", flush=True)
    print(f"prepacked int4: {4 - failed}/4 checks match the reference")
    return failed
