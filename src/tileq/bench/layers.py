"""``tileq layerbench``: one quantized layer of a Qwen3-14B-shaped model, piece by piece, under
CUDA graphs with the L2 flushed (bench/timing.py): bf16 ``F.linear``, the activation
quantization alone, the GEMM alone, and the whole ``QuantLinear`` forward, per projection shape
and M. The activation quantization is also set against its byte floor: (bytes read + bytes
written) / the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import csv
import time
from pathlib import Path

import torch

from ..errors import UnsupportedError, expect
from .timing import Timer, TimingConfig

# (name, K, N) of Qwen3-14B's projections: q/o 5120x5120, k/v 5120->1024, gate/up 5120->17408,
# down 17408->5120.
SHAPES = (("qo", 5120, 5120), ("kv", 5120, 1024), ("gate_up", 5120, 17408), ("down", 17408, 5120))
CONFIGS = ("A8W8", "FP8Row", "FP8Block", "W4A16", "W4A8")


def _quant_bytes(m: int, k: int, act_granularity: str, group_k: int = 128) -> int:
    scales = m * 4 if act_granularity == "row" else m * -(-k // group_k) * 4
    return m * k * 2 + m * k + scales  # bf16 read + 8-bit write + fp32 scales


def copy_tbps(dev) -> float:
    """Device copy bandwidth (bytes read + written) over a 1 GiB buffer, measured now."""
    timer = Timer(dev, TimingConfig(warmup=3, runs=10, flush="none"))
    src = torch.randn(1 << 28, device=dev)
    dst = torch.empty_like(src)
    t = timer.measure(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / (t.median_ms * 1e-3) / 1e12


def measure(ms, configs, timer: Timer, copy_tbs: float) -> list[dict]:
    from .. import nn as tnn
    from ..activation import add_rmsnorm_quantize, quantize_activation
    from ..api import linear

    dev = torch.device("cuda")
    rows = []
    gen = torch.Generator(device=dev).manual_seed(0)
    for shape, k, n in SHAPES:
        lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
        with torch.no_grad():
            lin.weight.normal_(0, 0.02, generator=gen)
        layers = {c: tnn.QuantLinear.from_linear(lin, tnn.config_from_name(c)) for c in configs}
        for m in ms:
            x = torch.randn(m, k, generator=gen, device=dev, dtype=torch.bfloat16)
            t_bf16 = timer.measure(lambda: torch.nn.functional.linear(x, lin.weight)).median_ms * 1e3
            rows.append(dict(shape=shape, m=m, k=k, n=n, config="bf16", part="linear", us=t_bf16, vs_bf16=1.0))
            for c, layer in layers.items():
                cfg = layer.config
                parts = {"layer": lambda layer=layer: layer(x)}
                if cfg.act_dtype is not None:
                    q, s = quantize_activation(x, cfg.act_dtype, granularity=cfg.act_granularity,
                                               group_k=cfg.group_k)
                    parts["quantize"] = lambda cfg=cfg: quantize_activation(
                        x, cfg.act_dtype, granularity=cfg.act_granularity, group_k=cfg.group_k)
                    parts["gemm"] = lambda layer=layer, q=q, s=s: linear(
                        q, layer.weight_operand(), s, layer.weight_scale, scheme=cfg.scheme,
                        group_k=cfg.group_k, group_n=cfg.group_n)
                for part, fn in parts.items():
                    us = timer.measure(fn).median_ms * 1e3
                    row = dict(shape=shape, m=m, k=k, n=n, config=c, part=part, us=us, vs_bf16=us / t_bf16)
                    if part == "quantize":
                        floor = _quant_bytes(m, k, cfg.act_granularity) / (copy_tbs * 1e12) * 1e6
                        row["floor_us"], row["vs_floor"] = floor, us / floor
                    rows.append(row)
        # The fused residual add + RMSNorm + quantize of the Hugging Face integration, at K=5120.
        if shape == "qo":
            w = torch.ones(k, device=dev, dtype=torch.bfloat16)
            for m in ms:
                x = torch.randn(m, k, generator=gen, device=dev, dtype=torch.bfloat16)
                r = torch.randn(m, k, generator=gen, device=dev, dtype=torch.bfloat16)
                us = timer.measure(lambda: add_rmsnorm_quantize(x, r, w, 1e-6, "int8")).median_ms * 1e3
                floor = (_quant_bytes(m, k, "row") + 2 * m * k * 2) / (copy_tbs * 1e12) * 1e6
                rows.append(dict(shape="add_rmsnorm_quant", m=m, k=k, n=0, config="A8W8", part="fused_norm",
                                 us=us, floor_us=floor, vs_floor=us / floor))
    return rows


def act_quant_sweep(ks, ms, timer: Timer, hot: Timer, copy_tbps: float) -> list[dict]:
    """The row quantization's heuristic at large M, A/B in one run: LARGE_M off (16 warps per
    row) against elements-per-thread settings (ACT_QUANT_LARGE_M, thresholds.py); and, at small M, the in-model cost of one call:
    20 back-to-back calls on L2-resident activations (a layer's input was just written by the
    kernel before it), per call."""
    from .. import activation
    from ..device import facts
    from ..dispatch import thresholds

    dev = torch.device("cuda")
    rows = []
    table = thresholds.for_arch(facts(dev).arch.name)  # (patched in place for the A/B, restored after)
    saved = (table.ACT_QUANT_LARGE_M, table.ACT_QUANT_LARGE_M_ELEMS_PER_THREAD)
    try:
        for k in ks:
            for m in ms:
                x = torch.randn(m, k, device=dev).to(torch.bfloat16)
                floor = _quant_bytes(m, k, "row") / (copy_tbps * 1e12) * 1e6
                variants = [("16 warps/row", 1 << 30, 64)] + [(f"{e} elems/thread", 1, e) for e in (32, 64, 128)]
                if m < 256:
                    variants = [("default", *saved)]
                for label, large_m, ept in variants:
                    table.ACT_QUANT_LARGE_M, table.ACT_QUANT_LARGE_M_ELEMS_PER_THREAD = large_m, ept
                    activation._CACHE.clear()
                    fn = lambda: activation.quantize_activation(x, "int8")  # noqa: E731
                    cold = timer.measure(fn).median_ms * 1e3
                    row = dict(shape=f"act_quant K={k}", m=m, k=k, n=0, config="int8 row", part=label,
                               us=cold, floor_us=floor, vs_floor=cold / floor)
                    if m < 256:
                        calls = 20
                        burst = hot.measure(lambda: [fn() for _ in range(calls)]).median_ms * 1e3 / calls
                        row["part"] = f"{label}; in-model {burst:.2f} us/call (hot L2, back to back)"
                        row["us_hot"] = burst
                    rows.append(row)
    finally:
        table.ACT_QUANT_LARGE_M, table.ACT_QUANT_LARGE_M_ELEMS_PER_THREAD = saved
        activation._CACHE.clear()
    return rows


FIELDS = ["shape", "m", "k", "n", "config", "part", "us", "vs_bf16", "floor_us", "vs_floor", "us_hot"]


def run(args) -> int:
    if not torch.cuda.is_available():
        raise UnsupportedError(expect("tileq layerbench", "a CUDA GPU", "no CUDA device"))
    dev = torch.device("cuda")
    timer = Timer(dev, TimingConfig(warmup=10, runs=args.runs, flush="read", graphs=True))
    copy = copy_tbps(dev)
    hot = Timer(dev, TimingConfig(warmup=5, runs=args.runs, flush="none", graphs=True))
    rows = act_quant_sweep((5120, 17408), (1, 16, 4096), timer, hot, copy)
    if not args.act_only:
        rows += measure(args.m, args.configs, timer, copy)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "layers.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    lines = [f"# tileq layerbench ({time.strftime('%Y-%m-%d')}, {torch.cuda.get_device_name()}, "
             f"torch {torch.__version__})", "", timer.describe(), f"copy ceiling {copy:.2f} TB/s", "",
             "| shape | M | config | part | us | x bf16 | x byte floor |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['m']} | {r['config']} | {r['part']} | {r['us']:.1f} | "
                     f"{r.get('vs_bf16', float('nan')):.2f} | {r.get('vs_floor', float('nan')):.2f} |")
    md = "\n".join(lines) + "\n"
    (out / "layers.md").write_text(md)
    print(md)
    return 0


def register_cli(sub) -> None:
    """``tileq layerbench`` running ``run``; its options are tileq.bench.cli.add_layerbench's
    (importable without torch, for ``--help``)."""
    from .cli import add_layerbench

    add_layerbench(sub).set_defaults(func=run)
