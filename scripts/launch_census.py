"""What one decode step of a Qwen3-14B-shaped model costs on the host, config by config.

For each config (bf16 first) and each way of running the step -- eager, eager with programmatic
dependent launch off (TILEQ_PDL=0, quantized configs), torch.compile without a CUDA graph -- it
prints and writes (CSV) per step: wall ms over STEPS steps, GPU kernel ms of one step (torch
profiler), tileq launches made through ``KernelCall`` (all of them eager; compiled, only those of
ops left opaque), how many of those missed the direct-launch handle table (a JITFunction.run
launch) or were not direct at all, and CUDA synchronizations (torch's sync debug mode).
A step whose wall time is far above its kernel time is host-bound; the counts say where the host
time goes. Then, per config, the host microseconds of each call a fused decoder layer makes at one
token (layer 0's modules; bf16: F.linear at the same shapes), issued OP_CALLS times without a sync
(the launch queue does not fill, so this is host time even where the GPU is slower).
Runs on CPU tensors too (--small, Triton's interpreter: counts only, times mean nothing).

    PYTHONPATH=src python3 scripts/launch_census.py --layers 4 --configs A8W8:fused,FP8Block:fused
"""

from __future__ import annotations

import argparse
import collections
import csv
import os
import time
import warnings
from pathlib import Path

import torch

from tileq.bench import e2e
from tileq.kernels import direct

_CALLS, _MISSES, _NOT_DIRECT = collections.Counter(), collections.Counter(), collections.Counter()


class _CountingHandles(dict):
    """direct._HANDLES that counts lookups finding nothing, by kernel name."""

    def get(self, key, default=None):
        found = dict.get(self, key, default)
        if found is None:
            _MISSES[getattr(key[1], "__name__", str(key[1]))] += 1
        return found


def _install_counters() -> None:
    direct._HANDLES = _CountingHandles(direct._HANDLES)
    launch = direct.KernelCall.__call__

    def counted(self, ptrs, use_direct):
        if not direct.tracing():
            _CALLS[self.name] += 1
            if not use_direct:
                _NOT_DIRECT[self.name] += 1
        return launch(self, ptrs, use_direct)

    direct.KernelCall.__call__ = counted


_sync = e2e._sync


def _kernel_ms(forward, cache, tok, device) -> float:
    """Summed GPU kernel time of one step (nan on a CPU)."""
    if device.type != "cuda":
        return float("nan")
    parts = e2e.profiled_kernels(lambda: e2e._step(forward, cache, tok))
    parts.pop("launches")
    return sum(parts.values())


def census(config: str, mode: str, forward, cache, tok, steps: int, device) -> tuple[dict, torch.Tensor]:
    for counter in (_CALLS, _MISSES, _NOT_DIRECT):
        counter.clear()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        for _ in range(steps):
            tok = e2e._step(forward, cache, tok)
        _sync(device)
        wall = (time.perf_counter() - t0) * 1e3 / steps
    if device.type == "cuda":
        torch.cuda.set_sync_debug_mode(0)
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    # Other warnings raised in the timed steps: recorded each time here ("always"), they cost host time
    # that a normal run (each warned once) does not pay, so the wall ms above is suspect where any.
    others = collections.Counter(f"{w.category.__name__}: {str(w.message)[:80]}" for w in caught
                                 if "synchroniz" not in str(w.message))
    row = dict(config=config, mode=mode, wall_ms=wall, kernel_ms=_kernel_ms(forward, cache, tok, device),
               launches=sum(_CALLS.values()) / steps, handle_misses=sum(_MISSES.values()) / steps,
               not_direct=sum(_NOT_DIRECT.values()) / steps, syncs=syncs / steps,
               other_warnings=sum(others.values()) / steps,
               warnings_by_text=" | ".join(f"{n / steps:g}x {t}" for t, n in others.most_common(3)),
               by_kernel=" ".join(f"{k}={v / steps:g}" for k, v in sorted(_CALLS.items())),
               misses_by_kernel=" ".join(f"{k}={v / steps:g}" for k, v in sorted(_MISSES.items())))
    return row, tok


OP_CALLS = 200


def _host_us(fn, device, calls: int | None = None) -> float:
    """Host microseconds per call of ``fn``, issued ``calls`` times without a sync (after 3 warm calls)."""
    calls = calls or OP_CALLS
    for _ in range(3):
        fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t0) * 1e6 / calls
    _sync(device)
    return us


def op_costs(config: str, model, device) -> list[dict]:
    """Host us per call of each call a decoder layer makes at one token (module docstring)."""
    from torch.nn import functional as F

    layer = model.model.layers[0]
    dtype = layer.input_layernorm.weight.dtype
    hidden = model.config.hidden_size
    x = torch.randn(1, 1, hidden, dtype=dtype, device=device)
    ops = {}
    if config == "bf16":
        attn, mlp = layer.self_attn, layer.mlp
        for name, lin in (("q_proj", attn.q_proj), ("o_proj", attn.o_proj), ("gate_proj", mlp.gate_proj),
                          ("down_proj", mlp.down_proj)):
            xi = torch.randn(1, 1, lin.in_features, dtype=dtype, device=device)
            ops[f"F.linear {name}"] = lambda lin=lin, xi=xi: F.linear(xi, lin.weight)
        ops["add"] = lambda: x + x
    elif getattr(layer, "_tileq_fused", False) and layer.self_attn.qkv_proj.spec.act_dtype is None:
        # weight-only layers (W4A16, W8A16): transformers' norms, the four GEMMs on 16-bit inputs
        attn, mlp = layer.self_attn, layer.mlp
        for name, lin in (("qkv forward", attn.qkv_proj), ("o_proj forward", attn.o_proj),
                          ("gate_up forward", mlp.gate_up_proj), ("down forward", mlp.down_proj)):
            xi = torch.randn(1, 1, lin.in_features, dtype=dtype, device=device)
            ops[name] = lambda lin=lin, xi=xi: lin(xi)
        ops["input_layernorm"] = lambda: layer.input_layernorm(x)
    elif getattr(layer, "_tileq_fused", False):
        from tileq.integrations import hf

        attn, mlp = layer.self_attn, layer.mlp
        q, sc = hf.rmsnorm_quantize(x, layer.input_layernorm, attn.qkv_proj)
        q2, s2, _ = hf.add_rmsnorm_quantize_for(x, x, layer.post_attention_layernorm, mlp.gate_up_proj)
        gate_up = hf.linear_prequantized(mlp.gate_up_proj, q2, s2, dtype)
        qd, sd = hf.silu_mul_quantize_for(gate_up, mlp.down_proj)
        ops["rmsnorm_quantize"] = lambda: hf.rmsnorm_quantize(x, layer.input_layernorm, attn.qkv_proj)
        ops["qkv forward_quantized"] = lambda: hf.linear_prequantized(attn.qkv_proj, q, sc, dtype)
        ops["o_proj forward"] = lambda: attn.o_proj(x)
        ops["add_rmsnorm_quantize"] = lambda: hf.add_rmsnorm_quantize_for(
            x, x, layer.post_attention_layernorm, mlp.gate_up_proj)
        ops["gate_up forward_quantized"] = lambda: hf.linear_prequantized(mlp.gate_up_proj, q2, s2, dtype)
        ops["silu_mul_quantize"] = lambda: hf.silu_mul_quantize_for(gate_up, mlp.down_proj)
        ops["down forward_quantized"] = lambda: hf.linear_prequantized(mlp.down_proj, qd, sd, dtype)
    rows = []
    with torch.inference_mode():
        for name, fn in ops.items():
            us = _host_us(fn, device)
            print(f"{config:16s} {name:26s} {us:8.1f} us host per call", flush=True)
            rows.append(dict(config=config, mode=f"op: {name}", wall_ms=us / 1e3))
    return rows


def run_config(config: str, args, device) -> list[dict]:
    torch._dynamo.reset()
    model = e2e.build_model(args.layers, device, args.seed, small=args.small)
    e2e.quantize_model(model, config, False)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (1, args.prompt), device=device,
                           generator=torch.Generator(device=device).manual_seed(args.seed))
    modes = ["eager"] + (["eager-pdl0"] if config != "bf16" else []) + ["compile"]
    steps_needed = (len(modes) + 1) * (args.steps + e2e.WARM_STEPS + 2)
    rows = []
    if device.type == "cuda":
        e2e.warm_gpu()
    with torch.inference_mode():
        cache = e2e._cache(model, 1, args.prompt + steps_needed + 8)
        tok = e2e._prefill(model.forward, cache, prompt)
        for mode in modes:
            forward = e2e.compiled_forward(model) if mode == "compile" else model.forward
            saved = os.environ.get("TILEQ_PDL")
            if mode == "eager-pdl0":
                os.environ["TILEQ_PDL"] = "0"
            try:
                for _ in range(e2e.WARM_STEPS):  # new signatures learn their launches; compile compiles
                    tok = e2e._step(forward, cache, tok)
                row, tok = census(config, mode, forward, cache, tok, args.steps, device)
            finally:
                if mode == "eager-pdl0":
                    if saved is None:
                        os.environ.pop("TILEQ_PDL", None)
                    else:
                        os.environ["TILEQ_PDL"] = saved
            print(f"{config:16s} {mode:11s} wall {row['wall_ms']:8.2f} ms  kernels {row['kernel_ms']:7.2f} ms  "
                  f"launches {row['launches']:6.1f}  misses {row['handle_misses']:5.1f}  "
                  f"not direct {row['not_direct']:5.1f}  syncs {row['syncs']:4.1f}  "
                  f"other warnings {row['other_warnings']:5.1f}", flush=True)
            if row["warnings_by_text"]:
                print(f"{'':28s} warnings: {row['warnings_by_text']}", flush=True)
            if row["misses_by_kernel"]:
                print(f"{'':28s} misses: {row['misses_by_kernel']}", flush=True)
            rows.append(row)
    rows += op_costs(config, model, device)
    del model, cache
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--configs", default="A8W8:fused,FP8Block:fused",
                    help="comma list as tileq e2e takes it; bf16 always runs first")
    ap.add_argument("--steps", type=int, default=8, help="decode steps per timing")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--small", action="store_true", help="1/8-width model (a CPU check of the counting)")
    ap.add_argument("--csv", default=None, help="write the rows here")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    configs = [c for c in args.configs.split(",") if c and c != "bf16"]
    _install_counters()
    rows = []
    for config in ["bf16", *configs]:
        rows += run_config(config, args, device)
    if args.csv:
        Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]), restval="")
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
