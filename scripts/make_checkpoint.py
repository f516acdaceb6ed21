"""Write Qwen3-shaped quantized checkpoints for ``tileq e2e --checkpoint`` (no download needed).

For each config: a transformers ``Qwen3ForCausalLM`` with Qwen3-14B's widths (by default) and
``--layers`` decoder layers, random bf16 weights made directly on ``--device`` (the GPU when there
is one: quantizing there takes seconds), ``tileq.quantize_`` with the config, then
``tileq.save_pretrained`` into ``OUT/<config>`` (compressed-tensors where it has an equivalent,
else tileq's format). Every config starts from the same weights (same seed). Prints each folder,
its format, files and sizes, and the time taken by each part.

    python3 scripts/make_checkpoint.py --out /tmp/tileq-ckpt                     # A8W8, W4A16
    python3 scripts/make_checkpoint.py --out /tmp/ck --configs W4A8 --layers 2 \\
        --hidden 256 --intermediate 512 --heads 4 --kv-heads 2 --head-dim 64 --vocab 1000   # tiny
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

import tileq
from tileq.bench.e2e import QWEN3_14B
from tileq.nn import config_from_name


def build(args, device):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    shape = dict(QWEN3_14B, num_hidden_layers=args.layers, hidden_size=args.hidden,
                 intermediate_size=args.intermediate, num_attention_heads=args.heads,
                 num_key_value_heads=args.kv_heads, head_dim=args.head_dim, vocab_size=args.vocab)
    cfg = Qwen3Config(**shape)
    torch.manual_seed(args.seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # bf16 parameters made on the device, no fp32 copy first
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.eval()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="parent folder: one checkpoint per config, OUT/<config>")
    p.add_argument("--configs", default="A8W8,W4A16", help="comma list of tileq config names")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (Qwen3-14B has 40)")
    p.add_argument("--hidden", type=int, default=QWEN3_14B["hidden_size"])
    p.add_argument("--intermediate", type=int, default=QWEN3_14B["intermediate_size"])
    p.add_argument("--heads", type=int, default=QWEN3_14B["num_attention_heads"])
    p.add_argument("--kv-heads", type=int, default=QWEN3_14B["num_key_value_heads"])
    p.add_argument("--head-dim", type=int, default=QWEN3_14B["head_dim"])
    p.add_argument("--vocab", type=int, default=QWEN3_14B["vocab_size"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the weights are made and quantized (default: cuda when available)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-shard-size", default="5GB")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    names = [c for c in args.configs.split(",") if c]
    configs = [config_from_name(c) for c in names]  # unknown names fail before any work
    out = Path(args.out)
    print(f"[make_checkpoint] Qwen3 layers={args.layers} hidden={args.hidden} intermediate={args.intermediate} "
          f"heads={args.heads}/{args.kv_heads} head_dim={args.head_dim} vocab={args.vocab} on {device}; "
          f"tileq {tileq.__version__}, torch {torch.__version__}", flush=True)
    total0 = time.time()
    for name, config in zip(names, configs):
        t0 = time.time()
        model = build(args, device)
        _sync(device)
        t1 = time.time()
        summary = tileq.quantize_(model, config)
        _sync(device)
        t2 = time.time()
        path = out / config.name
        fmt = tileq.save_pretrained(model, path, max_shard_size=args.max_shard_size)
        t3 = time.time()
        files = sorted(f for f in path.iterdir() if f.is_file())
        size = sum(f.stat().st_size for f in files)
        print(f"[make_checkpoint] {config.name}: {path} ({fmt}, {size / 1e9:.2f} GB; "
              f"{len(summary.converted)} layers quantized, {len(summary.skipped)} kept); "
              f"build {t1 - t0:.1f} s, quantize {t2 - t1:.1f} s, save {t3 - t2:.1f} s", flush=True)
        for f in files:
            print(f"    {f.name:40s} {f.stat().st_size / 1e6:12.1f} MB")
        del model, summary
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"[make_checkpoint] {len(names)} checkpoint(s) in {time.time() - total0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
