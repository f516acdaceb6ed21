"""One prepacked-int4 GEMM, launched a few times, for a profiler (ncu / nsys) to look at.

    PYTHONPATH=src ncu --set full -k regex:_i4p_kernel -c 1 python3 scripts/int4p_profile.py \
        --n 34816 --k 5120 --m 1 [--config m64n16k512_w4_s2_swap]
    PYTHONPATH=src ncu --set full -k regex:_i4p_decode_kernel -c 1 python3 scripts/int4p_profile.py \
        --gluon-decode [--split 1] [--stages 2]
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
    p.add_argument("--gluon-decode", action="store_true", help="the Gluon decode kernel (int4p/decode_gluon.py)")
    p.add_argument("--split", type=int, default=1, help="--gluon-decode: split over K")
    p.add_argument("--stages", type=int, default=2, help="--gluon-decode: ring slots")
    args = p.parse_args()
    dev = torch.device("cuda")
    v = torch.randint(-8, 8, (args.n, args.k), dtype=torch.int8, device=dev)
    w = prepack_int4(v)
    s = torch.rand(args.k // 128, args.n, device=dev) + 0.5
    x = torch.randn(args.m, args.k, device=dev).to(torch.bfloat16)
    if args.gluon_decode:
        from tileq.int4p.decode_gluon import GluonDecodeLaunch

        launch = GluonDecodeLaunch(args.m, args.n, args.k, torch.bfloat16, torch.bfloat16, "group",
                                   (s.stride(0), s.stride(1)), 128, False, dev, None, split=args.split,
                                   stages=args.stages)
        print("kernel", launch.name)
        run = lambda: launch(x, w.data, None, s, None)  # noqa: E731
    else:
        cfg = Int4pConfig.parse_tag(args.config) if args.config else config_for(args.m, args.n, args.k)[0]
        print("config", cfg.tag)
        run = lambda: linear_prepacked(x, w, None, s, config=cfg)  # noqa: E731
    for _ in range(args.runs):
        run()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
