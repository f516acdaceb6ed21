"""``tileq tune``: offline search of tile configs per shape, written as a tuned table.

Never runs implicitly: plans read tables, they never tune. Refuses to run during a CUDA graph
capture. Output is resumable: entries already in ``--out`` are skipped, and the file is
rewritten after every shape, so an interrupted run keeps what it measured.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from .bench.progress import end_status, status_line
from .kernels.config import TileConfig, config_problem
from .catalog.families import family_spec
from .device import facts as device_facts
from .dispatch import thresholds
from .dispatch.heuristic import choose_pipeline, decode_m_tile
from .catalog.names import KernelFamily, parse_family
from .dispatch.tuned import entry_key
from .errors import UnsupportedError, expect

# Headline cases (all rcr: activations row-major, nn.Linear weights).
CASES = {
    "i8_rowcol": "rowcol_i8xi8_rcr",
    "fp8_tensor": "tensor_fp8xfp8_rcr",
    "fp8_rowcol": "rowcol_fp8xfp8_rcr",
    "fp8_aquant": "aquant_fp8xfp8_rcr",
    "fp8_abquant": "abquant_fp8xfp8_rcr",
    "fp8_i4_bquant": "bquant_fp8xi4_rcr",
    "bf16_i4_bquant": "bquant_bf16xi4_rcr",
}

# (N, K) of LLM projections: Qwen3-14B q/o, gate/up, down; Llama-3-70B up/down; a DeepSeek-V3 one.
LLM_NK = [(5120, 5120), (17408, 5120), (5120, 17408), (28672, 8192), (8192, 28672), (7168, 2048)]
DECODE_MS = [1, 2, 4, 8, 16, 32, 64]
PREFILL_MS = [4096]


def candidates(pipeline: str, eight_bit: bool, m: int = 1) -> list[TileConfig]:
    """The search grid; the legality predicate prunes it per problem."""
    if pipeline == "decode":
        # One M tile covering M (re-reading the weight per M tile would double the bytes).
        bm = decode_m_tile(m)
        grid = [
            TileConfig(bm, bn, bk, 4, 4, sk)
            for bn in (16, 32, 64, 128)
            for bk in ((256, 512) if eight_bit else (128, 256))
            for sk in (1, 2, 4, 8)
        ]
        # Swapped (C^T = B^T A^T): N tiles of 64/128 on the wgmma M side, M on its N side.
        grid += [
            TileConfig(bn_w, bm, bk, 4, 4, sk, swap_ab=True)
            for bn_w in (64, 128)
            for bk in ((128, 256) if eight_bit else (64, 128))
            for sk in (1, 2, 4)
        ]
        return grid
    bk = 128 if eight_bit else 64
    return [
        TileConfig(128, 256, bk, 8, 3), TileConfig(128, 128, bk, 8, 4), TileConfig(128, 128, bk, 4, 4),
        TileConfig(256, 128, bk, 8, 3), TileConfig(128, 256, bk // 2, 8, 4), TileConfig(64, 256, bk, 4, 4),
        TileConfig(128, 128, bk, 8, 3),
        # Swapped: the weight is the mma's A operand (an int4 weight feeds it from registers).
        TileConfig(128, 128, bk, 8, 3, swap_ab=True), TileConfig(128, 128, bk, 8, 4, swap_ab=True),
        TileConfig(256, 128, bk, 8, 3, swap_ab=True),
    ]


def _eight_bit(fam: KernelFamily) -> bool:
    return not (fam.a.is_wide_float or fam.b.is_wide_float)


def _prepared(fam: KernelFamily, m: int, n: int, k: int):
    """(spec, the planner's plan, a validated problem on random CUDA operands) for one shape."""
    from .dispatch.plan import make_plan
    from .problem import build_problem
    from .testing import make_args

    spec = family_spec(fam, m, n, k)
    problem = make_args(spec, seed=0, device="cuda").call(build_problem)
    return spec, make_plan(spec, torch.device("cuda"), pipeline=fam.pipeline), problem


def _legal_candidates(fam: KernelFamily, spec, arch, m: int) -> list[TileConfig]:
    return [c for c in candidates(fam.pipeline, _eight_bit(fam), m) if config_problem(spec, c, arch) is None]


def tune_problem(fam: KernelFamily, m: int, n: int, k: int, *, reps: int,
                 warmup: int) -> list[tuple[TileConfig, float]]:
    """Time every legal candidate for one problem; returns [(config, median ms)] fastest first."""
    from .bench.timing import Timer, TimingConfig
    from .dispatch.plan import execute, with_config

    spec, base, problem = _prepared(fam, m, n, k)
    problem.out = torch.empty(m, n, dtype=spec.out_dtype, device="cuda")
    timer = Timer(torch.device("cuda"), TimingConfig(warmup=warmup, runs=reps))
    results = []
    cands = _legal_candidates(fam, spec, base.arch, m)
    if base.config not in cands:
        cands.insert(0, base.config)
    for cfg in cands:
        plan = with_config(base, cfg)
        try:
            t = timer.measure(lambda: execute(plan, problem))
        except Exception as e:  # a config that fails to compile or launch is skipped, said aloud
            print(f"\n  skipped {cfg.tag}: {type(e).__name__}: {str(e).splitlines()[0][:120]}", file=sys.stderr)
            continue
        results.append((cfg, t.median_ms))
    return sorted(results, key=lambda r: r[1])


def _compile_worker(job) -> str:
    """Run one (family, shape, config) once so Triton's on-disk cache holds its binary."""
    fam_name, m, n, k, tag = job
    from .dispatch.plan import execute, with_config

    _, base, problem = _prepared(parse_family(fam_name), m, n, k)
    try:
        execute(with_config(base, TileConfig.parse_tag(tag)), problem)
        torch.cuda.synchronize()
        return "ok"
    except Exception as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"


def precompile(problems, jobs: int) -> None:
    """Compile every candidate of every problem in parallel processes (compilation, not the GPU,
    bounds a sweep: about 2 s per kernel on one core)."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    from .dispatch.plan import make_plan

    work, seen = [], set()
    for fam, m, n, k in problems:
        spec = family_spec(fam, m, n, k)
        arch = make_plan(spec, torch.device("cuda"), pipeline=fam.pipeline).arch
        for cfg in _legal_candidates(fam, spec, arch, m):
            # One shape per kernel: binaries depend on the config and on sizes only through
            # their divisibility by 16 (Triton's specialization), the same across LLM shapes.
            key = (fam.name, cfg.tag, m % 16 == 0, m == 1)
            if key not in seen:
                seen.add(key)
                work.append((fam.name, m, n, k, cfg.tag))
    t0 = time.time()
    with ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as pool:
        for i, _ in enumerate(pool.map(_compile_worker, work, chunksize=2), 1):
            if i % 10 == 0 or i == len(work):
                status_line(f"precompiling {i}/{len(work)} ({time.time() - t0:.0f} s)")
    end_status()


def run(args) -> int:
    if not torch.cuda.is_available():
        raise UnsupportedError(expect("tileq tune", "a CUDA GPU (tuning times kernels)", "no CUDA device"))
    if torch.cuda.is_current_stream_capturing():
        raise UnsupportedError("tileq tune: refusing to tune during a CUDA graph capture")
    from .device import arch_of_capability

    dev = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(dev)
    arch = arch_of_capability(torch.cuda.get_device_capability(dev))
    out = Path(args.out)
    doc = json.loads(out.read_text()) if out.exists() else {}
    import triton

    doc.update({
        "gpu": props.name, "capability": list(arch.capability), "arch": arch.name,
        "date": time.strftime("%Y-%m-%d"), "triton": triton.__version__, "torch": torch.__version__,
        "command": "tileq " + " ".join(sys.argv[1:]),
    })
    entries = doc.setdefault("entries", {})
    cases = args.cases or list(CASES)  # (the options' types checked and split the lists)
    ms = args.m or DECODE_MS + PREFILL_MS
    nks = args.nk or LLM_NK
    decode_max_m = thresholds.for_arch(device_facts(torch.device("cuda")).arch.name).DECODE_MAX_M
    jobs = []
    for case in cases:
        if case not in CASES:
            raise UnsupportedError(expect("--cases", f"names from {', '.join(CASES)}", case))
        for n, k in nks:
            for m in ms:
                probe = family_spec(parse_family(CASES[case] + "_prefill"), m, n, k)
                fam = parse_family(f"{CASES[case]}_{choose_pipeline(probe, decode_max_m)}")
                jobs.append((case, fam, m, n, k))
    todo = [j for j in jobs if entry_key(j[1].name, family_spec(j[1], *j[2:])) not in entries]
    if args.jobs > 1 and todo:
        precompile([(fam, m, n, k) for _, fam, m, n, k in todo], args.jobs)
    t0 = time.time()
    done = 0
    for i, (case, fam, m, n, k) in enumerate(jobs, 1):
        key = entry_key(fam.name, family_spec(fam, m, n, k))
        if key in entries:
            continue
        if args.max_seconds and time.time() - t0 > args.max_seconds:
            print(f"\nstopping after {args.max_seconds} s (resumable: rerun with the same --out)")
            break
        res = tune_problem(fam, m, n, k, reps=args.reps, warmup=args.warmup)
        if not res:
            continue
        best, best_ms = res[0]
        _append_candidates(out, key, res)
        entries[key] = {"config": best.tag, "ms": round(best_ms, 5),
                        "candidates": len(res), "worst_ms": round(res[-1][1], 5)}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1, sort_keys=True))
        done += 1
        status_line(f"[{i}/{len(jobs)}] {key} -> {best.tag} {best_ms:.4f} ms "
                    f"({len(res)} configs, {time.time() - t0:.0f} s)")
    end_status()
    print(f"tuned {done} problems -> {out}")
    return 0


def _append_candidates(out: Path, key: str, res) -> None:
    """Every candidate's time, one CSV row each, beside the table (for studying the grid)."""
    side = out.with_suffix(".candidates.csv")
    new = not side.exists()
    with side.open("a") as f:
        if new:
            f.write("key,config,median_ms\n")
        for cfg, ms in res:
            f.write(f"{key},{cfg.tag},{ms:.5f}\n")


def register_cli(sub) -> None:
    """``tileq tune`` running ``run``; its options are tileq.commands.add_tune's (importable without
    torch, for ``--help``)."""
    from .commands import add_tune

    add_tune(sub).set_defaults(func=run)
