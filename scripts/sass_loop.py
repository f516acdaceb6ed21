"""Compile one kernel instance for sm_90 on the CPU and count the instructions of its K loop.

    python scripts/sass_loop.py bquant_fp8xi4_rcr_decode 1 28672 8192 m64n16k128_w4_s4_sk4_swap

Prints registers, shared memory, and the instruction mix between the main loop's first wait on
the async copies (DEPBAR.LE SB0) and its backward branch, the part that runs once per K tile.
Writes the PTX and SASS next to the cubin under --out (default /tmp/tileq-sass). Needs no GPU:
Triton's own ptxas, cuobjdump and nvdisasm do the work.
"""

import argparse
import collections
import os
import re
import subprocess
import sys

import triton
from triton.backends.compiler import GPUTarget

from tileq.catalog.config import TileConfig
from tileq.catalog.families import family_spec
from tileq.catalog.names import parse_family
from tileq.kernels.gemm_kernel import _gemm_kernel
from tileq.kernels.launch import signature

_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("family")
    p.add_argument("m", type=int)
    p.add_argument("n", type=int)
    p.add_argument("k", type=int)
    p.add_argument("config", help="a config tag, e.g. m64n16k256_w4_s4_swap")
    p.add_argument("--out", default="/tmp/tileq-sass")
    args = p.parse_args()

    spec = family_spec(parse_family(args.family), args.m, args.n, args.k)
    cfg = TileConfig.parse_tag(args.config)
    sig, consts, attrs = signature(spec, cfg)
    src = triton.compiler.ASTSource(fn=_gemm_kernel, signature=sig, constexprs=consts, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"{args.family}__{args.config}")
    with open(stem + ".ptx", "w") as f:
        f.write(compiled.asm["ptx"])
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
    print(f"{args.family} {args.config}: registers {regs.group(1) if regs else '?'}, "
          f"shared {compiled.metadata.shared} B, K loop {end - start + 1} instructions")
    print("  " + ", ".join(f"{op} {n}" for op, n in ops.most_common(16)))
    print(f"  sources: {stem}.{{ptx,sass}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
