"""Compile one kernel instance for sm_90 on the CPU and count the instructions of its K loop.

    python scripts/sass_loop.py bquant_fp8xi4_rcr_decode 1 28672 8192 m64n16k128_w4_s4_sk4_swap

    python scripts/sass_loop.py --prepacked bf16 16 group     # tileq.prepacked's kernel, BM = 16
    python scripts/sass_loop.py --prepacked bf16 16 group --split-k 4 --maxnreg 128   # capped

Prints registers, shared memory, and the instruction mix between the main loop's first wait on
the async copies (DEPBAR.LE SB0) and its backward branch, the part that runs once per K tile
(``--json``: the same as one JSON line).
Writes the PTX and SASS next to the cubin under --out (default /tmp/tileq-sass). Needs no GPU:
Triton's own ptxas, cuobjdump and nvdisasm do the work.
"""

import argparse
import collections
import json
import os
import re
import subprocess
import sys

import triton
from triton.backends.compiler import GPUTarget

from tileq.kernels.config import TileConfig
from tileq.catalog.families import family_spec
from tileq.catalog.names import parse_family
from tileq.kernels.gemm_kernel import _gemm_kernel
from tileq.kernels.launch import signature

_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def _prepacked_source(ct: str, bm: int, w_scale: str, warps: int = 4, stages: int = 2, split_k: int = 1,
                      maxnreg: int | None = None, scale_ahead: bool = False, fp16: bool = False,
                      fixup: bool = False, streamk: bool = False):
    from tileq.kernels.int4p.config import Int4pConfig
    from tileq.kernels.int4p.launch import compile_options, compile_source

    cfg = Int4pConfig(bm, split_k, stages, warps, maxnreg, scale_ahead, fp16, fixup, streamk)
    x_type = {"fp8e4nv": "fp8", "fp8e5": "bf8"}.get(ct, ct)
    return compile_source(x_type, w_scale, cfg), compile_options(cfg)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("family", help="a family name, or with --prepacked the activation type (bf16, fp16, fp8e4nv)")
    p.add_argument("m", type=int, help="M, or with --prepacked the token tile BM")
    p.add_argument("n", nargs="?", help="N, or with --prepacked the weight scale kind (group, vector)")
    p.add_argument("k", nargs="?", type=int)
    p.add_argument("config", nargs="?", help="a config tag, e.g. m64n16k256_w4_s4_swap")
    p.add_argument("--prepacked", action="store_true", help="the prepacked-int4 kernel (tileq.prepacked)")
    p.add_argument("--stages", type=int, default=2, help="pipeline stages (--prepacked)")
    p.add_argument("--warps", type=int, default=4, help="warps: 4 or 8 (--prepacked; 64 weight rows each 4)")
    p.add_argument("--split-k", type=int, default=1, help="split-K (--prepacked)")
    p.add_argument("--maxnreg", type=int, default=None, help="a register cap (--prepacked), e.g. 128")
    p.add_argument("--scale-ahead", action="store_true",
                   help="group scales loaded one K tile ahead (--prepacked)")
    p.add_argument("--streamk", action="store_true",
                   help="stream-K: contiguous (tile, K block) ranges per program, shared tiles summed in the kernel "
                        "(--prepacked)")
    p.add_argument("--fixup", action="store_true",
                   help="the split-K partials summed in the kernel (--prepacked, with --split-k > 1)")
    p.add_argument("--fp16", action="store_true",
                   help="fp8 activations converted to fp16 inside the kernel (--prepacked, Int4pConfig.fp16)")
    p.add_argument("--out", default="/tmp/tileq-sass")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    if args.prepacked:
        src, options = _prepacked_source(args.family, args.m, args.n or "group", args.warps, args.stages,
                                         args.split_k, args.maxnreg, args.scale_ahead, args.fp16, args.fixup,
                                         args.streamk)
        label = (f"int4p_{args.family}_bm{args.m}_{args.n or 'group'}_w{args.warps}_s{args.stages}"
                 f"{f'_sk{args.split_k}' if args.split_k > 1 else ''}{f'_r{args.maxnreg}' if args.maxnreg else ''}"
                 f"{'_pf' if args.scale_ahead else ''}{'_h16' if args.fp16 else ''}{'_fx' if args.fixup else ''}"
                 f"{'_stk' if args.streamk else ''}")
    else:
        spec = family_spec(parse_family(args.family), args.m, int(args.n), args.k)
        cfg = TileConfig.parse_tag(args.config)
        sig, consts, attrs = signature(spec, cfg)
        src = triton.compiler.ASTSource(fn=_gemm_kernel, signature=sig, constexprs=consts, attrs=attrs)
        options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
        label = f"{args.family}__{args.config}"
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, label)
    with open(stem + ".ptx", "w") as f:
        f.write(compiled.asm["ptx"])
    with open(stem + ".ttgir", "w") as f:
        f.write(compiled.asm["ttgir"])
    with open(stem + ".cubin", "wb") as f:
        f.write(compiled.asm["cubin"])
    sass = subprocess.run([os.path.join(_BIN, "nvdisasm"), "-c", stem + ".cubin"],
                          capture_output=True, text=True, check=True).stdout
    with open(stem + ".sass", "w") as f:
        f.write(sass)
    usage = subprocess.run([os.path.join(_BIN, "cuobjdump"), "-res-usage", stem + ".cubin"],
                           capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", usage)

    lines = [ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", ln)]
    start = next((i for i, ln in enumerate(lines) if "DEPBAR.LE SB0" in ln), 0)
    end = max((i for i, ln in enumerate(lines) if re.search(r"@!?P\d BRA", ln)), default=len(lines) - 1)
    ops = collections.Counter()
    for ln in lines[start:end + 1]:
        body = ln.split("*/", 1)[1].strip()
        body = re.sub(r"^@!?U?P\w+\s+", "", body)  # drop the predicate
        ops[body.split()[0].split(".")[0].rstrip(";")] += 1
    whole = collections.Counter()
    for ln in lines:
        body = re.sub(r"^@!?U?P\w+\s+", "", ln.split("*/", 1)[1].strip())
        whole[body.split()[0].split(".")[0].rstrip(";")] += 1
    if args.json:
        asm_line = next((ln for ln in compiled.asm["ttgir"].splitlines() if "elementwise_inline_asm" in ln), "")
        print(json.dumps({"label": label, "registers": int(regs.group(1)) if regs else None,
                          "shared": compiled.metadata.shared, "loop": end - start + 1, "loop_ops": ops,
                          "kernel_ops": whole, "inline_asm": asm_line.rpartition(" : ")[2],
                          "ttgir": compiled.asm["ttgir"]}))
        return 0
    print(f"{label}: registers {regs.group(1) if regs else '?'}, "
          f"shared {compiled.metadata.shared} B, K loop {end - start + 1} instructions")
    print("  " + ", ".join(f"{op} {n}" for op, n in ops.most_common(16)))
    print(f"  sources: {stem}.{{ptx,ttgir,sass}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
