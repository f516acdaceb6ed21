"""``tileq sass``: compile one kernel instance for sm_90 on any machine (no GPU) and count the
instructions of its K loop.

    tileq sass bquant_fp8xi4_rcr_decode 1 28672 8192 m64n16k128_w4_s4_sk4_swap

    tileq sass --prepacked bf16 16 group                          # the prepacked int4 decode kernel, BM = 16
    tileq sass --prepacked bf16 16 group --split-k 4 --maxnreg 128   # register-capped

Prints registers, shared memory, and the instruction mix between the main loop's first wait on
the async copies (DEPBAR.LE SB0) and its backward branch, the part that runs once per K tile
(``--json``: the same as one JSON line, with the TTGIR). Writes the PTX, TTGIR, cubin and SASS
under ``--out``. Triton's own ptxas, cuobjdump and nvdisasm do the work.
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess


def _prepacked_source(ct: str, bm: int, w_scale: str, warps: int = 4, stages: int = 2, split_k: int = 1,
                      maxnreg: int | None = None, scale_ahead: bool = False, fp16: bool = False,
                      fixup: bool = False, streamk: bool = False):
    from .kernels.int4p.config import Int4pConfig
    from .kernels.int4p.launch import compile_options, compile_source

    cfg = Int4pConfig(bm, split_k, stages, warps, maxnreg, scale_ahead, fp16, fixup, streamk)
    x_type = {"fp8e4nv": "fp8", "fp8e5": "bf8"}.get(ct, ct)
    return compile_source(x_type, w_scale, cfg), compile_options(cfg)


def _family_source(family: str, m: int, n: int, k: int, config: str):
    import triton

    from .build import catalog_family
    from .catalog.families import family_spec
    from .errors import ShapeError, expect
    from .kernels.config import TileConfig
    from .kernels.gemm_kernel import _gemm_kernel
    from .dispatch.gemm import sums_in_kernel
    from .kernels.launch import signature

    fam = catalog_family(family, "family")
    try:
        cfg = TileConfig.parse_tag(config)
    except ValueError as e:
        raise ShapeError(expect("config", "a config tag m<BM>n<BN>k<BK>_w<W>_s<S>[_sk<SK>][_swap], e.g. "
                                "m64n16k256_w4_s4_swap", repr(config))) from e
    spec = family_spec(fam, m, n, k)
    sig, consts, attrs = signature(spec, cfg, fixup=sums_in_kernel(fam.pipeline, cfg))
    src = triton.compiler.ASTSource(fn=_gemm_kernel, signature=sig, constexprs=consts, attrs=attrs)
    return src, {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


def _op(line: str) -> str:
    body = re.sub(r"^@!?U?P\w+\s+", "", line.split("*/", 1)[1].strip())  # (the predicate dropped)
    return body.split()[0].split(".")[0].rstrip(";")


def loop_counts(sass: str) -> tuple[int, collections.Counter, collections.Counter]:
    """(instructions of the K loop, its opcode counts, the whole kernel's opcode counts): the loop
    runs from the first DEPBAR.LE SB0 to the last predicated backward branch."""
    lines = [ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", ln)]
    start = next((i for i, ln in enumerate(lines) if "DEPBAR.LE SB0" in ln), 0)
    end = max((i for i, ln in enumerate(lines) if re.search(r"@!?P\d BRA", ln)), default=len(lines) - 1)
    return (end - start + 1, collections.Counter(_op(ln) for ln in lines[start:end + 1]),
            collections.Counter(_op(ln) for ln in lines))


def run(args) -> int:
    import triton
    from triton.backends.compiler import GPUTarget

    from .errors import ShapeError, expect

    if args.prepacked:
        src, options = _prepacked_source(args.family, args.m, args.n or "group", args.warps, args.stages,
                                         args.split_k, args.maxnreg, args.scale_ahead, args.fp16, args.fixup,
                                         args.streamk)
        label = (f"int4p_{args.family}_bm{args.m}_{args.n or 'group'}_w{args.warps}_s{args.stages}"
                 f"{f'_sk{args.split_k}' if args.split_k > 1 else ''}{f'_r{args.maxnreg}' if args.maxnreg else ''}"
                 f"{'_pf' if args.scale_ahead else ''}{'_h16' if args.fp16 else ''}{'_fx' if args.fixup else ''}"
                 f"{'_stk' if args.streamk else ''}")
    else:
        if args.n is None or args.k is None or args.config is None:
            raise ShapeError(expect("arguments", "FAMILY M N K CONFIG (or --prepacked CT BM [W_SCALE])",
                                    " ".join(str(x) for x in (args.family, args.m, args.n, args.k, args.config)
                                             if x is not None)))
        if not args.n.isdigit() or int(args.n) < 1:
            raise ShapeError(expect("n", "a positive integer (N) for a catalog family", repr(args.n)))
        src, options = _family_source(args.family, args.m, int(args.n), args.k, args.config)
        label = f"{args.family}__{args.config}"
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, label)
    for ext in ("ptx", "ttgir"):
        with open(f"{stem}.{ext}", "w") as f:
            f.write(compiled.asm[ext])
    with open(stem + ".cubin", "wb") as f:
        f.write(compiled.asm["cubin"])
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    sass = subprocess.run([os.path.join(tools, "nvdisasm"), "-c", stem + ".cubin"],
                          capture_output=True, text=True, check=True).stdout
    with open(stem + ".sass", "w") as f:
        f.write(sass)
    usage = subprocess.run([os.path.join(tools, "cuobjdump"), "-res-usage", stem + ".cubin"],
                           capture_output=True, text=True, check=False).stdout  # (no usage: registers '?')
    regs = re.search(r"REG:(\d+)", usage)
    loop, ops, whole = loop_counts(sass)
    if args.json:
        asm_line = next((ln for ln in compiled.asm["ttgir"].splitlines() if "elementwise_inline_asm" in ln), "")
        print(json.dumps({"label": label, "registers": int(regs.group(1)) if regs else None,
                          "shared": compiled.metadata.shared, "loop": loop, "loop_ops": ops,
                          "kernel_ops": whole, "inline_asm": asm_line.rpartition(" : ")[2],
                          "ttgir": compiled.asm["ttgir"]}))
        return 0
    print(f"{label}: registers {regs.group(1) if regs else '?'}, shared {compiled.metadata.shared} B, "
          f"K loop {loop} instructions")
    print("  " + ", ".join(f"{op} {n}" for op, n in ops.most_common(16)))
    print(f"  sources: {stem}.{{ptx,ttgir,sass}}")
    return 0


def register_cli(sub) -> None:
    from .argtypes import positive_int

    p = sub.add_parser(
        "sass", help="compile one kernel for sm_90 (no GPU) and count the instructions of its K loop",
        description="Compile one catalog kernel instance (FAMILY M N K CONFIG) or the prepacked int4 decode "
        "kernel (--prepacked CT BM [W_SCALE]) for sm_90 with Triton's own toolchain, on any machine, and print "
        "its registers, shared memory and the opcode mix of its K loop (the part that runs once per K tile).")
    p.add_argument("family", help="a family name (e.g. bquant_fp8xi4_rcr_decode), or with --prepacked the "
                   "activation type (bf16, fp16, fp8e4nv, fp8e5)")
    p.add_argument("m", type=positive_int, help="M, or with --prepacked the token tile BM (16 or 32)")
    p.add_argument("n", nargs="?", default=None,
                   help="N, or with --prepacked the weight scale kind (group, vector, scalar; default group)")
    p.add_argument("k", nargs="?", type=positive_int, default=None, help="K (a catalog family)")
    p.add_argument("config", nargs="?", default=None,
                   help="a config tag (a catalog family), e.g. m64n16k256_w4_s4_swap")
    p.add_argument("--prepacked", action="store_true",
                   help="the prepacked int4 decode kernel (kernels/int4p/kernel.py) instead of a catalog family")
    p.add_argument("--stages", type=positive_int, default=2, help="--prepacked: pipeline stages (default: 2)")
    p.add_argument("--warps", type=int, choices=(4, 8), default=4,
                   help="--prepacked: warps, 4 or 8 (64 weight rows per 4; default: 4)")
    p.add_argument("--split-k", type=positive_int, default=1, help="--prepacked: K ranges per tile (default: 1)")
    p.add_argument("--maxnreg", type=positive_int, default=None, help="--prepacked: a register cap, e.g. 128 or 168")
    p.add_argument("--scale-ahead", action="store_true", help="--prepacked: group scales loaded one K tile ahead")
    p.add_argument("--streamk", action="store_true",
                   help="--prepacked: stream-K (contiguous (tile, K block) ranges per program, shared tiles summed "
                   "in the kernel)")
    p.add_argument("--fixup", action="store_true",
                   help="--prepacked: the split-K partials summed in the kernel (with --split-k > 1)")
    p.add_argument("--fp16", action="store_true",
                   help="--prepacked: fp8 activations converted to fp16 inside the kernel (Int4pConfig.fp16)")
    p.add_argument("--out", default="/tmp/tileq-sass", help="folder for the PTX, TTGIR, cubin and SASS "
                   "(default: /tmp/tileq-sass)")
    p.add_argument("--json", action="store_true", help="print one JSON line (counts, registers, shared memory, "
                   "the TTGIR) instead of the summary")
    p.set_defaults(func=run)

