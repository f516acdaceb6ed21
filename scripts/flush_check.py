"""Which L2 flush gives HBM-cold timings without charging the kernel for someone else's writes?

Times a few decode problems (tileq and bf16 torch.matmul) four ways:
  write   the buffer.zero_() flush (leaves the L2 full of dirty lines)
  read    the harness default: a reduction over the buffer (leaves it clean)
  none    no flush: a weight smaller than the L2 is then read from the L2
  rotate  no flush, operands rotated over copies totalling >= 3x the L2: the ground truth for
          "weights come from HBM" (what a model's layer sequence does)
Prints one CSV line per (problem, impl, method) and writes flush_check.csv under $OUT.
"""

import csv
import math
import os
import sys

import torch

import tileq
from tileq.bench.timing import Timer, TimingConfig
from tileq.catalog.families import family_spec
from tileq.catalog.names import parse_family
from tileq.testing import make_args

PROBLEMS = [("rowcol_i8xi8_rcr_decode", 1, 5120, 5120), ("rowcol_i8xi8_rcr_decode", 16, 17408, 5120),
            ("rowcol_i8xi8_rcr_decode", 1, 28672, 8192), ("rowcol_fp8xfp8_rcr_decode", 1, 5120, 5120)]


def main() -> int:
    dev = torch.device("cuda")
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    rows = []
    for fam_name, m, n, k in PROBLEMS:
        spec = family_spec(parse_family(fam_name), m, n, k)
        weight_bytes = n * k  # 8-bit weights
        copies = max(2, math.ceil(3 * l2 / weight_bytes))
        sets = [make_args(spec, seed=i, device="cuda") for i in range(copies)]
        w16 = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(max(2, math.ceil(3 * l2 / (2 * n * k))))]
        x16 = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        impls = {
            "tileq": lambda i: sets[i % len(sets)].call(tileq.gemm),
            "torch_bf16_matmul": lambda i: torch.matmul(x16, w16[i % len(w16)].t()),
        }
        for impl, fn in impls.items():
            for method in ("write", "read", "none", "rotate"):
                timer = Timer(dev, TimingConfig(warmup=30, runs=100,
                                                flush="none" if method == "rotate" else method))
                counter = [0]

                def run():
                    # Only 'rotate' moves on to the next copy; the others reuse copy 0.
                    fn(counter[0])
                    if method == "rotate":
                        counter[0] += 1

                t = timer.measure(run)
                nbytes = weight_bytes * (2 if impl.startswith("torch_bf16") else 1)
                rows.append(dict(family=fam_name, m=m, n=n, k=k, impl=impl, method=method,
                                 median_us=round(t.median_ms * 1e3, 2),
                                 weight_tbps=round(nbytes / (t.median_ms * 1e-3) / 1e12, 3)))
                print(",".join(str(v) for v in rows[-1].values()), flush=True)
        del sets, w16
        torch.cuda.empty_cache()
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "flush_check.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
