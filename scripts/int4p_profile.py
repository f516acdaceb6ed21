"""One prepacked-int4 GEMM, launched a few times, for a profiler (ncu / nsys) to look at.

    PYTHONPATH=src ncu --set full -k regex:_i4p_kernel -c 1 python3 scripts/int4p_profile.py \
        --n 34816 --k 5120 --m 1 [--config m64n16k512_w4_s2_swap]
"""

import argparse

import torch

from tileq.int4p import prepack_int4
from tileq.int4p.launch import Int4pConfig, config_for, linear_prepacked


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=34816)
    p.add_argument("--k", type=int, default=5120)
    p.add_argument("--m", type=int, default=1)
    p.add_argument("--config", default=None)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    dev = torch.device("cuda")
    v = torch.randint(-8, 8, (args.n, args.k), dtype=torch.int8, device=dev)
    w = prepack_int4(v)
    s = torch.rand(args.k // 128, args.n, device=dev) + 0.5
    x = torch.randn(args.m, args.k, device=dev).to(torch.bfloat16)
    cfg = Int4pConfig.parse_tag(args.config) if args.config else config_for(args.m, args.n, args.k)[0]
    print("config", cfg.tag)
    for _ in range(args.runs):
        linear_prepacked(x, w, None, s, config=cfg)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
