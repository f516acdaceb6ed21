"""The ``tileq`` CLI's own commands (list, build, explain, selftest) and the options of ``tileq tune``.

Importing this module imports no torch, Triton or kernel module, so that ``tileq --help`` and
``tileq COMMAND --help`` answer at once: each command imports what it needs when it runs. The value
lists below are the library's own, spelled out for that reason (tests/test_cli.py checks them
against tileq.problem, tileq.device, tileq.catalog and tileq.tune).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from .argtypes import names_from, nonnegative_int, positive_float, positive_int, positive_ints, sizes_nk
from .errors import TileqError, UnsupportedError, expect

SCHEMES = ("tensor", "rowcol", "aquant", "bquant", "abquant")  # tileq.problem.Scheme
LAYOUTS = ("rcr", "rrr", "crr", "ccr")  # tileq.problem.LAYOUTS
ARCH_NAMES = ("sm_80", "sm_89", "sm_90", "sm_100", "sm_120")  # tileq.device.ARCHS
PIPELINES = ("prefill", "decode", "preshufflequant")  # tileq.catalog.names.PIPELINES
OUT_DTYPES = ("bf16", "fp16", "fp32")
TUNE_CASES = ("i8_rowcol", "fp8_tensor", "fp8_rowcol", "fp8_aquant", "fp8_abquant", "fp8_i4_bquant",
              "bf16_i4_bquant")  # tileq.tune.CASES


# ----------------------------------------------------------------------------- parsers


def register(sub) -> None:
    p = sub.add_parser("list", help="the kernel catalog, one family per line")
    p.add_argument("--scheme", choices=SCHEMES, help="only families of this scheme")
    p.add_argument("--pipeline", choices=PIPELINES, help="only families of this pipeline")
    p.add_argument("--arch", help=f"only families this arch can run: one of {', '.join(ARCH_NAMES)}")
    p.add_argument("--names", action="store_true",
                   help="names only (regenerates tests/golden_kernel_names.txt)")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("build", help="compile every catalog kernel ahead of time for an arch")
    p.add_argument("--arch", required=True, help=f"one of {', '.join(ARCH_NAMES)}")
    p.add_argument("--out", default="build/kernels", help="folder for binaries and manifest.json "
                   "(default: build/kernels)")
    p.add_argument("--jobs", type=positive_int, default=None, help="parallel compiler processes (default: all cores)")
    p.add_argument("--family", action="append",
                   help="build only this catalog family, e.g. rowcol_i8xi8_rcr_prefill (repeatable; "
                   "`tileq list --names` lists them)")
    p.set_defaults(func=cmd_build)

    p = sub.add_parser(
        "explain", help="print the plan for a problem described without tensors",
        description="The plan tileq.gemm would run for a problem of these types and sizes, checked as gemm "
        "checks its arguments. Says which executor runs it here (without a GPU: the torch reference on CPU "
        "tensors) and prints the plan for the target arch (--arch; default: the local GPU, else sm_90).")
    p.add_argument("--scheme", required=True, choices=SCHEMES, help="the scaling scheme (docs/schemes.md)")
    p.add_argument("--a", required=True, help="A's type: int8, fp8, bf8, int4, bf16, fp16")
    p.add_argument("--b", required=True, help="B's type (same names as --a)")
    p.add_argument("--layout", default="rcr", choices=LAYOUTS,
                   help="row- (r) or column-major (c) A, B and C: rcr is x @ W^T of an nn.Linear weight "
                   "(default: rcr)")
    p.add_argument("--m", type=positive_int, required=True, help="rows of A and C (tokens)")
    p.add_argument("--n", type=positive_int, required=True, help="columns of B and C (output features)")
    p.add_argument("--k", type=positive_int, required=True, help="the reduction size (input features)")
    p.add_argument("--group-k", type=positive_int, default=128,
                   help="length along K of a scale group (aquant, bquant, abquant; default: 128)")
    p.add_argument("--group-n", type=int, default=None,
                   help="width along N of a b_scale group, 1 or 128 (bquant, abquant; default: the scheme's "
                   "canonical one)")
    p.add_argument("--preshuffled", action="store_true", help="a_scale stored K-group-major")
    p.add_argument("--bias", action="store_true", help="with a bias [N]")
    p.add_argument("--acc", action="store_true", help="with an accumulator input [M, N] (acc=)")
    p.add_argument("--fast-accum", action="store_true", help="fp8/bf8: fast accumulation (gemm's fast_accum)")
    p.add_argument("--out-dtype", default="bf16", choices=OUT_DTYPES, help="the output's dtype (default: bf16)")
    p.add_argument("--arch", default=None,
                   help=f"plan for this arch, one of {', '.join(ARCH_NAMES)} (default: the local GPU, else sm_90)")
    p.add_argument("--backend", default=None, choices=("auto", "triton", "reference"),
                   help="the backend gemm is asked for (default: TILEQ_BACKEND, else auto: Triton kernels for "
                   "CUDA tensors, the torch reference for CPU tensors)")
    p.add_argument("--prepacked", action="store_true",
                   help="B is a prepacked int4 nn.Linear weight (tileq.PrepackedInt4): what linear runs for it")
    p.add_argument("--grouped", type=positive_int, default=None, metavar="E",
                   help="the plan of tileq.grouped_linear over E experts (--a: x's type, --b: w's, --m: T rows "
                   "in the contiguous form, C per expert in the masked one; docs/grouped.md)")
    p.add_argument("--form", default="contiguous", choices=("contiguous", "masked"),
                   help="with --grouped: x [T, K] with offsets (default) or x [E, C, K] with counts")
    p.set_defaults(func=cmd_explain)

    p = sub.add_parser("selftest", help="name parity, catalog build and a correctness pass")
    p.add_argument("--arch", default="sm_90",
                   help=f"the arch the build step compiles for, one of {', '.join(ARCH_NAMES)} (default: sm_90)")
    p.add_argument("--skip-build", action="store_true", help="skip the ahead-of-time build of the catalog")
    p.add_argument("--jobs", type=positive_int, default=None,
                   help="parallel compiler processes of the build step (default: all cores)")
    p.set_defaults(func=cmd_selftest)


def add_tune(sub) -> argparse.ArgumentParser:
    """``tileq tune``'s options (its code: tileq.tune, imported when it runs)."""
    p = sub.add_parser("tune", help="search tile configs on this GPU and write a tuned table")
    p.add_argument("--suite", default="llm", choices=["llm"], help="LLM projection shapes")
    p.add_argument("--out", required=True, help="table file (JSON); resumed if it exists")
    p.add_argument("--cases", default=None, type=names_from(TUNE_CASES, "cases"),
                   help=f"comma list from {', '.join(TUNE_CASES)} (default: all)")
    p.add_argument("--m", default=None, type=positive_ints, help="comma list of M (default 1..64 and 4096)")
    p.add_argument("--nk", default=None, type=sizes_nk, help="comma list of NxK (default: the LLM shapes)")
    p.add_argument("--reps", type=positive_int, default=30, help="timed runs per config (default: 30)")
    p.add_argument("--warmup", type=nonnegative_int, default=5, help="warm-up runs per config (default: 5)")
    p.add_argument("--max-seconds", type=positive_float, default=None,
                   help="stop starting new shapes after this many seconds (resumable; default: no limit)")
    p.add_argument("--jobs", type=positive_int, default=8,
                   help="parallel compile processes before timing (default: 8; 1 compiles while timing)")
    return p


# ----------------------------------------------------------------------------- list, build


def _arch_ok(fam, arch) -> bool:
    from .device import check_types

    try:
        check_types(arch, fam.a, fam.b)
        return True
    except TileqError:
        return False


def _supports(fam) -> str:
    from .catalog.families import canonical_scale_kinds
    from .device import ARCHS

    sa, sb, gn = canonical_scale_kinds(fam.scheme, fam.a, fam.b)
    scales = f"a_scale={sa.value} b_scale={sb.value}" + (f" group_n={gn}" if fam.scheme.b_grouped else "")
    archs = ",".join(n for n, a in ARCHS.items() if _arch_ok(fam, a))
    return f"{scales}  archs={archs}"


def cmd_list(args) -> int:
    from .catalog.families import catalog
    from .device import get_arch

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


class _BuildProgress:
    """``build_catalog``'s progress callback: a bar on a terminal, plain lines in a log, and each
    failure with its error as it comes."""

    def __init__(self, title: str):
        self.title = title
        self.bar = None

    def __call__(self, i: int, total: int, r) -> None:
        from .bench.progress import Progress

        if self.bar is None:
            self.bar = Progress(total, title=self.title)
        if not r.ok:
            self.bar.note(f"FAILED {r.name}: {r.error}")
        self.bar.advance(r.name)
        if i == total:
            self.bar.close()


def cmd_build(args) -> int:
    from .build import build_catalog

    t0 = time.time()
    results = build_catalog(args.arch, args.out, jobs=args.jobs, families=args.family,
                            progress=_BuildProgress(f"build {args.arch}"))
    failed = [r for r in results if not r.ok]
    spilled = [r for r in results if r.ok and r.spills]
    print(f"built {len(results) - len(failed)}/{len(results)} kernels for {args.arch} in "
          f"{time.time() - t0:.0f} s -> {args.out}/manifest.json")
    for r in spilled:
        print(f"  spills: {r.name}: {r.spills} B of local memory, {r.registers} registers")
    for r in failed:
        print(f"  FAILED: {r.name}: {r.error}")
    if failed:
        print(f"build: FAILED: {len(failed)} of {len(results)} kernels did not compile for {args.arch} "
              f"(listed above), first: {failed[0].name}: {failed[0].error}")
    return 1 if failed else 0


# ----------------------------------------------------------------------------- explain


def spec_from_args(args):
    """The ProblemSpec of ``tileq explain``'s options, refused exactly as ``tileq.gemm`` refuses the
    call: ``build_problem`` validates operands of its types, shapes, layouts and scales on the meta
    device (no memory, no data), so every refusal is the API's own."""
    import torch

    from .dtypes import PackedInt4
    from .problem import ScaleKind, ScaleLayout, build_problem
    from .warmup import describe

    out = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.out_dtype]
    spec = describe(  # the types, their pair and the scheme's canonical scale kinds
        scheme=args.scheme, a=args.a, b=args.b, m=args.m, n=args.n, k=args.k, layout=args.layout,
        out_dtype=out, group_k=args.group_k, group_n=args.group_n,
        preshuffled=args.preshuffled, bias=args.bias, acc=args.acc, fast_accum=args.fast_accum,
    )
    m, n, k = spec.m, spec.n, spec.k

    def empty(shape, dtype, row_major: bool = True):
        if row_major:
            return torch.empty(shape, dtype=dtype, device="meta")
        return torch.empty(shape[::-1], dtype=dtype, device="meta").t()

    def operand(t, rows: int, cols: int, layout: str):
        unit = 1 if layout == "r" else 0  # the unit-stride dimension
        if t.value != "i4":
            return empty((rows, cols), t.torch_dtype, layout == "r")
        packed = [rows, cols]
        packed[unit] //= 2  # two values a byte along it (an odd extent: PackedInt4's own refusal)
        return PackedInt4(empty(tuple(packed), torch.uint8, layout == "r"), (rows, cols), unit)

    def scale(kind, vector: tuple, group: tuple, preshuffled: bool = False):
        if kind is ScaleKind.SCALAR:
            return empty((), torch.float32)
        if kind is ScaleKind.VECTOR:
            return empty(vector, torch.float32)
        if kind is ScaleKind.GROUP:
            return empty(group, torch.float32, not preshuffled)
        return None

    problem = build_problem(
        operand(spec.a_type, m, k, spec.a_layout), operand(spec.b_type, k, n, spec.b_layout),
        scale(spec.a_scale_kind, (m,), (m, spec.gk), spec.a_scale_layout is ScaleLayout.PRESHUFFLED),
        scale(spec.b_scale_kind, (n,), (spec.gk, spec.gn)),
        scheme=spec.scheme, out_dtype=out, group_k=args.group_k, group_n=args.group_n,
        bias=empty((n,), torch.float32) if args.bias else None,
        acc=empty((m, n), spec.acc_dtype) if args.acc else None, fast_accum=args.fast_accum,
    )
    return problem.spec


def _here_on_cpu(backend) -> str:
    """What gemm runs for CPU tensors on this machine (no CUDA GPU), and why."""
    import torch

    from . import settings
    from .dispatch.plan import resolve_backend

    requested = backend or settings.current().backend
    try:
        executor, _ = resolve_backend(backend, torch.device("cpu"))
    except TileqError as e:
        return f"gemm refuses CPU tensors with backend '{requested}' ({e})"
    if executor == "reference":
        if requested == "reference":
            return "the torch reference (backend 'reference')"
        return (f"the torch reference (backend '{requested}' runs tileq's Triton kernels on CUDA tensors only; "
                "TRITON_INTERPRET=1 with backend 'triton' runs them in Triton's interpreter)")
    return (f"tileq's Triton kernels in Triton's interpreter (TRITON_INTERPRET=1, backend '{requested}'), "
            "planned for the default arch")


def cmd_explain(args) -> int:
    import torch

    from .device import DEFAULT_ARCH, facts, get_arch
    from .dispatch.plan import make_plan

    target = get_arch(args.arch).name if args.arch is not None else None  # refused before any work
    if args.prepacked:
        if target not in (None, DEFAULT_ARCH):
            raise UnsupportedError(expect("--arch", f"{DEFAULT_ARCH} with --prepacked (the prepacked int4 kernels' "
                                          "plans are sm_90's)", target))
        return _explain_prepacked(args)
    if args.grouped is not None:
        return _explain_grouped(args, target or DEFAULT_ARCH)
    spec = spec_from_args(args)
    cuda = torch.device("cuda")
    lines = []
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        try:
            here = make_plan(spec, cuda, backend=args.backend)
        except TileqError as e:
            lines.append(f"here      : CUDA tensors on {name}: gemm refuses them ({e})")
        else:
            local = facts(cuda).arch.name
            if target in (None, local):
                print(f"here      : CUDA tensors on {name} ({local}): the plan below")
                print(here.describe())
                return 0
            runs = here.instance.name if here.instance is not None else f"the {here.executor} executor"
            lines.append(f"here      : CUDA tensors on {name} ({local}): {runs}")
        why = "--arch" if target else "the default"
    else:
        lines.append(f"here      : CPU tensors (no CUDA GPU): {_here_on_cpu(args.backend)}")
        why = "--arch" if target else f"the default; --arch picks one of {', '.join(ARCH_NAMES)}"
    target = target or DEFAULT_ARCH
    plan = make_plan(spec, cuda, backend=args.backend, arch=target)  # (a refusal: before any output)
    lines.append(f"target    : {target} ({why}), CUDA tensors: the plan below")
    print("\n".join(lines))
    print(plan.describe())
    return 0


_PREPACKED_X = ("bf16", "fp16", "fp8", "bf8")


def _explain_grouped(args, arch: str) -> int:
    """``tileq explain --grouped E``: tileq.explain_grouped on meta tensors of the described call
    (the API's own validation), planned for ``arch``."""
    import math

    import torch

    from .api_grouped import explain_grouped
    from .dtypes import OperandType, parse_operand_type

    extra = [o for o in ("bias", "acc", "prepacked", "preshuffled", "fast_accum") if getattr(args, o)]
    if extra or args.layout != "rcr":
        got = ", ".join(f"--{o.replace('_', '-')}" for o in extra) or f"--layout {args.layout}"
        raise UnsupportedError(expect("--grouped", "no --bias, --acc, --prepacked, --preshuffled, --fast-accum "
                                      "or --layout (grouped_linear takes none of them)", got))
    e, n, k, gk = args.grouped, args.n, args.k, math.ceil(args.k / args.group_k)
    x_t, w_t = parse_operand_type(args.a), parse_operand_type(args.b)

    def meta(shape, dtype=torch.float32):
        return torch.empty(shape, dtype=dtype, device="meta")

    lead = (e, args.m) if args.form == "masked" else (args.m,)
    w = meta((e, n, k // 2), torch.uint8) if w_t is OperandType.I4 else meta((e, n, k), w_t.torch_dtype)
    x_scale = None
    if args.scheme == "abquant":
        x_scale = meta((*lead, gk))
    elif not x_t.is_wide_float:
        x_scale = meta(lead)
    group_n = args.group_n or (128 if args.scheme == "abquant" else 1)
    w_scale = meta((e, n)) if args.scheme == "rowcol" else meta((e, n if group_n == 1 else math.ceil(n / 128), gk))
    index = ({"counts": meta((e,), torch.int32)} if args.form == "masked"
             else {"offsets": meta((e + 1,), torch.int32)})
    out = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.out_dtype]
    x_dtype = x_t.torch_dtype if x_t is not OperandType.I4 else torch.uint8  # (int4 x: the API refuses it)
    print(explain_grouped(meta((*lead, k), x_dtype), w, x_scale, w_scale, scheme=args.scheme, out_dtype=out,
                          group_k=args.group_k, group_n=args.group_n, backend=args.backend, arch=arch, **index))
    return 0


def _explain_prepacked(args) -> int:
    import torch

    from .api_prepacked import described_plan
    from .dispatch.int4 import traced_config
    from .kernels.int4p.config import W_SCALE_OF_SCHEME, kernel_name

    if args.b not in ("int4", "i4") or args.layout != "rcr" or args.a not in _PREPACKED_X:
        raise UnsupportedError(expect("--prepacked", "--b int4, --layout rcr and --a bf16, fp16, fp8 or bf8 "
                                      "(an nn.Linear int4 weight, x @ W^T)", f"--a {args.a} --b {args.b} "
                                      f"--layout {args.layout}"))
    kinds = W_SCALE_OF_SCHEME
    if args.scheme not in kinds:
        raise UnsupportedError(expect("--scheme", "bquant, rowcol or tensor for a prepacked weight", args.scheme))
    if args.scheme == "bquant" and args.group_k % 128:
        raise UnsupportedError(expect("--group-k", "a multiple of 128 for a prepacked weight", args.group_k))
    x_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn,
               "bf8": torch.float8_e5m2}[args.a]
    plan = described_plan(args.m, args.n, args.k, x_dtype, kinds[args.scheme])
    path = plan.describe()
    print(f"problem : M={args.m} N={args.n} K={args.k}, x {args.a} x prepacked int4 (layout i4p1), "
          f"scheme {args.scheme}" + (f", group_k {args.group_k}" if args.scheme == "bquant" else ""))
    route = plan.route
    decode = route.path == "decode"
    print(f"runs    : {route.kernel if decode else path}")
    if decode:  # the decode kernel: its config and where it came from (the prefill paths have theirs in the name)
        cfg, source = route.config, route.reason
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
        if cfg.maxnreg:  # a traced launch cannot carry the cap: compiled code runs the twin
            twin, how = traced_config(cfg)
            print(f"compiled: under torch.compile {kernel_name(route.compute_type, plan.spec.w_kind, twin)} (no register "
                  f"cap, which a traced launch cannot carry: {how})")
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


def selftest_shape(fam) -> tuple[int, int, int]:
    m, n, k = SELFTEST_SHAPES[fam.pipeline]
    if fam.a.value == "i4" and fam.layout[0] == "c":
        m += 1  # int4 packed along M needs an even M
    return m, n, k


def selftest_family(fam, device: str, seed: int = 0) -> dict:
    """Run one family on a small odd shape with backend='triton' and compare with the reference."""
    import torch

    from .api import gemm
    from .catalog.families import family_spec
    from .testing import check_close, make_args

    m, n, k = selftest_shape(fam)
    spec = family_spec(fam, m, n, k, out_dtype=torch.float32)
    args = make_args(spec, seed=seed, device=device, bias=True)
    out = torch.full((m, n), float("nan"), dtype=torch.float32, device=device)
    got = args.call(gemm, backend="triton", out=out)
    want = args.call(gemm, backend="reference")
    return check_close(got, want, torch.float32)


def cmd_selftest(args) -> int:
    import subprocess

    import torch

    from .catalog.families import catalog
    from .catalog.names import format_family, parse_family
    from .device import get_arch

    arch = get_arch(args.arch).name  # an unknown arch is refused before any work
    problems = []
    fams = catalog()
    bad_names = [f.name for f in fams if parse_family(format_family(f)) != f]
    print(f"name parity: {len(fams) - len(bad_names)}/{len(fams)} families round-trip", flush=True)
    if bad_names:
        problems.append(f"{len(bad_names)} family names do not round-trip (first: {bad_names[0]})")
    if not args.skip_build:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        cmd = [sys.executable, "-m", "tileq", "build", "--arch", arch, "--out", "build/selftest"]
        if args.jobs:
            cmd += ["--jobs", str(args.jobs)]
        rc = subprocess.call(cmd, env=env)
        print(f"build: {'ok' if rc == 0 else 'FAILED'}", flush=True)
        if rc:
            problems.append(f"the build for {arch} failed (exit status {rc}; its FAILED lines above)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        # The interpreter must be chosen before Triton is imported: rerun this pass in a child.
        env = dict(os.environ, TRITON_INTERPRET="1")
        code = "import sys, tileq.commands as c; sys.exit(c.correctness_pass('cpu'))"
        rc = subprocess.call([sys.executable, "-c", code], env=env)
    else:
        rc = correctness_pass(device)
    if rc:
        problems.append("the correctness pass found results that differ from the reference (its FAILED "
                        "lines above)")
    if problems:
        print(f"selftest: FAILED ({len(problems)} problem{'s' if len(problems) > 1 else ''}): "
              + "; ".join(problems))
        return 1
    print("selftest: PASSED")
    return 0


def correctness_pass(device: str) -> int:
    from .catalog.families import catalog

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
    import torch

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
