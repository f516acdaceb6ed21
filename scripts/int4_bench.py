"""int4 weights against bf16 cuBLAS and tileq's int8 in one run: the prepacked kernel
(tileq.prepacked), the pk_int4 kernel it replaces, W4A16 and W4A8.

    OUT=/tmp/tileq-out PYTHONPATH=src python3 scripts/int4_bench.py [--quick]

Per (N, K) weight and M, in the same process and with the same timer (CUDA-graph replays, L2
flushed by a 2x-L2 read before every run, tileq.bench.timing): bf16 F.linear (cuBLAS), tileq int8
rowcol, tileq fp8 rowcol, W4A16 on pk_int4 (tileq.linear on a PackedInt4: the old kernel), W4A16
on the prepacked layout (the config tileq picks, labelled with it; at every M <= 16, and with
--sweep-m32 at 32 and 64, the best of a small config sweep), W4A8 (fp8 activations, per-token
scales) on both. Every output is checked against a float32 torch reference of the same
dequantized operands before it is timed (a failing one is reported, not timed). Writes
$OUT/int4.csv and prints the table and the issue's target ratios.
Shapes: 'llm' (Qwen3-14B merged qkv / o / gate_up / down, Llama-70B MLP) are what tileq's
tables and heuristics were made on; 'untuned' (Llama-3-8B and Llama-2-7B projections) were left
out of the tuned table but are in the sweeps the decode rule was fitted on (2026-12-01);
'fresh' (Qwen2.5-7B, Mistral-Small-24B, DeepSeek-V3's dense MLP) are in neither: the check that
the rule generalizes (``--sets fresh``); 'tails' (Phi-3-medium, Yi-34B, Qwen2.5-14B, Gemma-2-9B)
checks the decode rule's stream-K step (2026-12-02) on weights it was not fitted on.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import os
import re
import statistics
import sys
import time
from dataclasses import replace

import torch

SHAPES = [  # (set, name, N, K)
    ("llm", "qwen3-14b.qkv", 7168, 5120),
    ("llm", "qwen3-14b.o", 5120, 5120),
    ("llm", "qwen3-14b.gate_up", 34816, 5120),
    ("llm", "qwen3-14b.down", 5120, 17408),
    ("llm", "llama-70b.up", 28672, 8192),
    ("llm", "llama-70b.down", 8192, 28672),
    ("untuned", "llama3-8b.qkv", 6144, 4096),
    ("untuned", "llama3-8b.gate_up", 28672, 4096),
    ("untuned", "llama3-8b.down", 4096, 14336),
    ("untuned", "llama2-7b.up", 11008, 4096),
    ("untuned", "llama2-7b.down", 4096, 11008),
    ("fresh", "qwen2.5-7b.qkv", 4608, 3584),
    ("fresh", "qwen2.5-7b.gate_up", 37888, 3584),
    ("fresh", "qwen2.5-7b.down", 3584, 18944),
    ("fresh", "mistral-24b.gate_up", 65536, 5120),
    ("fresh", "mistral-24b.down", 5120, 32768),
    ("fresh", "deepseek-v3.gate_up", 36864, 7168),
    ("fresh", "deepseek-v3.down", 7168, 18432),
    # 'tails': weights in no other set whose 64-row tiles leave the decode kernel's last wave a
    # quarter full or less at some decode M (560 tiles: 1.06 waves of four per SM, 2.12 of two;
    # 640: 1.21 of four), and two that do not (the decode rule's stream-K step, out of sample)
    ("tails", "phi3-medium.gate_up", 35840, 5120),
    ("tails", "yi-34b.gate_up", 40960, 7168),
    ("tails", "qwen2.5-14b.gate_up", 27648, 5120),
    ("tails", "gemma2-9b.down", 3584, 14336),
]
M_DECODE = (1, 4, 16, 32, 64)
M_PREFILL = (128, 256, 512, 1024, 2048, 4096)
FIELDS = ["set", "shape", "m", "n", "k", "impl", "config", "ms", "tbps_weight", "max_rel_err", "note"]


def fp8_decode_kernel(m: int, n: int, k: int, dev) -> bool:
    """Whether W4A8 with e4m3 activations runs the decode kernel on them (not cast to bf16 first)."""
    from tileq.prepacked.launch import describe_prepacked

    path = describe_prepacked(m, n, k, torch.float8_e4m3fn, device=dev)
    return "_decode__" in path and "cast to" not in path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="three shapes, M in {1, 16, 256, 1024, 4096}")
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--sweep-m32", action="store_true", help="also sweep token tiles at M = 32 and 64")
    p.add_argument("--scale-ahead", action="store_true",
                   help="at M <= 16 also sweep each config with group scales loaded one K tile ahead")
    p.add_argument("--heuristic", action="store_true",
                   help="the default row runs the heuristic's config (int4p.launch.decode_rule), not the "
                        "tuned table's")
    p.add_argument("--m", default="", help="comma-separated M values instead of the default set")
    p.add_argument("--shapes", default="", help="comma-separated shape names (e.g. qwen3-14b.o) to keep")
    p.add_argument("--small-m-prefill", action="store_true",
                   help="at 16 < M < 256 also time the Gluon prefill kernel with 64- and 128-token tiles "
                        "(w4a16_gluon_t64 / _t128), next to the decode kernel")
    p.add_argument("--gluon-decode", action="store_true",
                   help="at M <= 16 also time the Gluon prefill kernel with 16-token tiles, split over K 1, 2, 4 "
                        "ways and as prefill.split_for picks ('w4a16_gluon_t16', the config in its name)")
    p.add_argument("--sweep-w4a8", action="store_true",
                   help="at M <= 16 also sweep the W4A8 (fp8 activations) decode configs, with and without "
                        "group scales one K tile ahead ('w4a8_prepacked_sweep')")
    p.add_argument("--prefill-split", action="store_true",
                   help="where the Gluon prefill kernel is timed (forced at 16 < M < 256, or the default path "
                        "from 256 where the plan does not split) and its grid has fewer tiles than SMs, also "
                        "time it split over K (prefill.split_for)")
    p.add_argument("--split-sweep", action="store_true",
                   help="where the plan's Gluon tiling has fewer tiles than SMs (M > 16), also time it split "
                        "over K every legal way, 2-8 ('w4a16_gluon_split_sweep'): data for split_for's cost")
    p.add_argument("--w4a8-via-bf16", action="store_true",
                   help="on the decode kernel (M < 256) time both routes of W4A8: fp8 -> bf16 activations "
                        "(a torch cast) and the W4A16 kernel with the per-token scale in its epilogue "
                        "('w4a8_via_bf16'), and the fp8 activations converted inside the kernel ('w4a8_fp8_kernel')")
    p.add_argument("--t256", action="store_true",
                   help="from 256 tokens also time W4A16 on the Gluon kernel with 256-token tiles, group "
                        "('w4a16_gluon_t256') and per-channel scales ('w4a16_gluon_t256_channel'), and "
                        "the 128-token tiling unsplit, group ('w4a16_gluon_t128')")
    p.add_argument("--w4a8-gluon", action="store_true",
                   help="from 33 tokens also time W4A8 on the Gluon prefill kernel (activations cast to bf16), "
                        "forced at the plan's tiling: group scales ('w4a8_gluon'), per-channel from 256 "
                        "('w4a8_gluon_channel')")
    p.add_argument("--w4a8-fused", action="store_true",
                   help="from 33 tokens also time W4A8 with group scales on the fused fp8 build of the Gluon "
                        "prefill kernel (TILEQ_W4A8_PREFILL=fused's kernel, e4m3 weights in registers), forced at "
                        "the plan's tiling ('w4a8_fused')")
    p.add_argument("--w4a8-fp16", action="store_true",
                   help="below 256 tokens also time W4A8 on the decode kernel with the fp8 activations "
                        "converted inside to bf16 ('w4a8_fp8_kernel_bf16') and to fp16 (Int4pConfig.fp16, "
                        "'w4a8_fp8_kernel_h16'), the decode rule's config")
    p.add_argument("--streamk", action="store_true",
                   help="from 128 tokens also time the Gluon prefill kernel with stream-K (int4p/streamk.py), "
                        "128- and (above 128) 256-token tiles: W4A16 group ('w4a16_streamk_t128' / '_t256'), "
                        "per-channel from 256 ('w4a16_streamk_channel_t128' / '_t256'), W4A8 group on the fused "
                        "fp8 build ('w4a8_fused_streamk_t128'); where the default takes stream-K, the plan's "
                        "tiling without it ('w4a16_plan', 'w4a16_plan_channel')")
    p.add_argument("--streamk-decode", action="store_true",
                   help="where the default runs the decode kernel: its stream-K variant (Int4pConfig.streamk) at "
                        "each occupancy band, W4A16 and W4A8 on its fp8 kernel ('w4a16_stk_r128', '_stk_s2', "
                        "'_stk_s3'; 'w4a8_stk_*'); the summary adds the fastest per call ('_stk_best')")
    p.add_argument("--fixup", action="store_true",
                   help="where the decode kernel runs a split over K (W4A16, and W4A8 on its fp8 kernel): the "
                        "same config with the partials summed in the kernel (Int4pConfig.fixup: 'w4a16_fixup', "
                        "'w4a8_fixup'), and with twice the split ('w4a16_fixup_x2', 'w4a8_fixup_x2'; a split of 2 "
                        "where the rule does not split); where the Gluon prefill kernel's plan splits 64- or "
                        "16-token tiles (33-127 tokens), that split with fixup ('w4a16_fixup', W4A8 on its fp8 "
                        "build 'w4a8_fixup')")
    p.add_argument("--overlap", action="store_true",
                   help="where the default runs the Gluon prefill kernel's 16-bit build with token tiles of at most "
                        "128 (W4A16, and W4A8 cast to bf16), which overlaps each consumer's conversion of its next "
                        "slice with this slice's wgmmas: the same call with prefill.OVERLAP cleared "
                        "('w4a16_no_overlap', 'w4a8_no_overlap')")
    p.add_argument("--decode-gluon", action="store_true",
                   help="up to 16 tokens also time the Gluon decode kernel (int4p/decode_gluon.py, not routed: "
                        "conversion overlapped with the wgmmas) with two and three stages at the decode rule's split "
                        "over K ('w4a16_decode_gluon_s2', '_s3') and at the other splits of 1, 2 and 4 that leave "
                        "each range two K blocks ('_s2_k4', ...); the summary adds the fastest per call ('_best')")
    p.add_argument("--sets", default="llm,untuned",
                   help="comma-separated shape sets to run (llm, untuned, fresh, tails; default llm,untuned)")
    args = p.parse_args()
    out_dir = os.environ.get("OUT", "/tmp/tileq-out")
    os.makedirs(out_dir, exist_ok=True)

    import tileq
    from tileq.bench.timing import Timer, TimingConfig
    from tileq.prepacked import prefill, prepack_int4
    from tileq.prepacked.dequant import DEQUANT_MIN_M, DequantLaunch, dequantize_prepacked
    from tileq.prepacked.fp8_prefill import Fp8PrefillLaunch
    from tileq.prepacked.launch import (Int4pConfig, Int4pLaunch, config_for, decode_rule, default_config,
                                    describe_prepacked,
                                    linear_prepacked)
    from tileq.quant import pack_int4

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    timer = Timer(dev, TimingConfig(warmup=5, runs=args.runs, flush="read", graphs=True))
    torch.backends.cuda.matmul.allow_tf32 = False
    sets = set(args.sets.split(","))
    shapes = [sh for sh in SHAPES if sh[0] in sets] if not args.quick else [SHAPES[0], SHAPES[3], SHAPES[8]]
    ms = (M_DECODE + M_PREFILL) if not args.quick else (1, 16, 256, 1024, 4096)
    if args.m:
        ms = tuple(int(v) for v in args.m.split(","))
    if args.shapes:
        keep = set(args.shapes.split(","))
        shapes = [sh for sh in SHAPES if sh[1] in keep]
    t_start = time.time()
    path = os.path.join(out_dir, "int4.csv")
    csv_file = open(path, "w", newline="")
    writer = csv.DictWriter(csv_file, fieldnames=FIELDS)
    writer.writeheader()

    rows = []

    def add(row):  # every row reaches the CSV at once: a run cut short keeps what it measured
        rows.append(row)
        writer.writerow(row)
        csv_file.flush()

    def record(s, name, m, n, k, impl, cfg, fn, want, wbytes, note=""):
        try:
            y = fn()
            err = float((y.float() - want).abs().max() / want.abs().max().clamp_min(1e-30))
            if not err < 2e-2:
                add(dict(set=s, shape=name, m=m, n=n, k=k, impl=impl, config=cfg, ms="",
                                 tbps_weight="", max_rel_err=f"{err:.3g}", note="WRONG: not timed"))
                print(f"  {impl} WRONG max_rel_err {err:.3g}", flush=True)
                return None
            t = timer.measure(fn).median_ms
        except Exception as e:  # reported, the run goes on
            add(dict(set=s, shape=name, m=m, n=n, k=k, impl=impl, config=cfg, ms="", tbps_weight="",
                             max_rel_err="", note=f"error: {type(e).__name__}: {str(e)[:200]}"))
            print(f"  {impl} error {type(e).__name__}: {str(e)[:300]}", flush=True)
            return None
        add(dict(set=s, shape=name, m=m, n=n, k=k, impl=impl, config=cfg, ms=f"{t:.5f}",
                         tbps_weight=f"{wbytes / t / 1e9:.3f}", max_rel_err=f"{err:.2e}", note=note))
        return t

    def lazy(build):
        """A callable that builds its launch on the first call (inside record, so that an error
        there is a row of the CSV, not the end of the run)."""
        box = []

        def run(*args):
            if not box:
                box.append(build())
            return box[0](*args)
        return run

    for s, name, n, k in shapes:
        g = torch.Generator(device=dev).manual_seed(n + k)
        v = torch.randint(-8, 8, (n, k), dtype=torch.int8, device=dev, generator=g)
        sw4 = torch.rand(k // 128, n, device=dev, generator=g) * 0.01 + 0.005
        w_deq = (v.float() * sw4.repeat_interleave(128, 0).t())  # [N, K] fp32
        w_pk = pack_int4(v, dim=1)
        w_pp = prepack_int4(w_pk)
        w_bf16 = w_deq.to(torch.bfloat16)
        sw_ch = sw4[0].contiguous()  # per-channel scales [N] (the prefill kernel's other scale kind)
        # its reference weight (N x K fp32), only when a prefill M is timed
        w_ch = v.float() * sw_ch[:, None] if max(ms) >= DEQUANT_MIN_M else None
        w8 = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=dev, generator=g)
        sw8 = torch.rand(n, device=dev, generator=g) * 0.01 + 0.005
        wf8 = (torch.randn(n, k, device=dev, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        for m in ms:
            x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16)
            sx = torch.rand(m, device=dev, generator=g) * 0.02 + 0.01
            xq8 = torch.randint(-127, 128, (m, k), dtype=torch.int8, device=dev, generator=g)
            xf8 = (torch.randn(m, k, device=dev, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
            ref16 = x.float() @ w_deq.t()
            ref8 = (xf8.float() * sx[:, None]) @ w_deq.t()
            print(f"{name} M={m} N={n} K={k} ({time.time() - t_start:.0f} s)", flush=True)
            b16 = w_bf16.numel() * 2
            b4 = n * k // 2
            record(s, name, m, n, k, "bf16_cublas", "", lambda: torch.nn.functional.linear(x, w_bf16),
                   x.float() @ w_bf16.float().t(), b16)
            record(s, name, m, n, k, "int8_rowcol", "", lambda: tileq.linear(xq8, w8, sx, sw8, scheme="rowcol"),
                   (xq8.float() * sx[:, None]) @ (w8.float() * sw8[:, None]).t(), n * k)
            record(s, name, m, n, k, "fp8_rowcol", "", lambda: tileq.linear(xf8, wf8, sx, sw8, scheme="rowcol"),
                   (xf8.float() * sx[:, None]) @ (wf8.float() * sw8[:, None]).t(), n * k)
            record(s, name, m, n, k, "w4a16_pk", "", lambda: tileq.linear(x, w_pk, None, sw4, scheme="bquant"),
                   ref16, b4)
            # the config that runs (tuned table or heuristic; with --heuristic the heuristic's), as labelled
            cfg = default_config(m, n, k) if args.heuristic else config_for(m, n, k)[0]
            given = cfg if args.heuristic and m < DEQUANT_MIN_M else None
            prefill_path = describe_prepacked(m, n, k, device=dev).split()[0]
            decode_path = m < DEQUANT_MIN_M and (given is not None or "_decode__" in prefill_path)
            record(s, name, m, n, k, "w4a16_prepacked", cfg.tag if decode_path else prefill_path,
                   lambda: linear_prepacked(x, w_pp, None, sw4, config=given), ref16, b4)
            if decode_path and cfg.streamk:  # the decode rule's stream-K step: its config without the step
                c_plain = decode_rule(m, n, k, streamk=False)[0]
                record(s, name, m, n, k, "w4a16_no_stk", c_plain.tag,
                       lambda c=c_plain: linear_prepacked(x, w_pp, None, sw4, config=c), ref16, b4)
            if args.overlap:
                # the same routed calls without prefill.OVERLAP (new launches: the cache is cleared)
                import tileq.prepacked.launch as ilaunch
                for kind, xin, sxin, want, xdt in (("w4a16", x, None, ref16, torch.bfloat16),
                                                   ("w4a8", xf8, sx, ref8, torch.float8_e4m3fn)):
                    path = describe_prepacked(m, n, k, xdt, device=dev).split()[0]
                    tok = re.search(r"_gluon_w128t(\d+)k512", path)
                    if not tok or int(tok.group(1)) > prefill.OVERLAP_MAX_TOKENS or "_fp8xi4p_" in path:
                        continue
                    ilaunch._LAUNCHES.clear()
                    prefill.OVERLAP = False
                    try:
                        record(s, name, m, n, k, f"{kind}_no_overlap", path + " (no overlap)",
                               lambda xin=xin, sxin=sxin: linear_prepacked(xin, w_pp, sxin, sw4), want, b4)
                    finally:
                        prefill.OVERLAP = True
                        ilaunch._LAUNCHES.clear()
            if args.small_m_prefill and 16 < m < DEQUANT_MIN_M and not decode_path:
                # the decode kernel, which the routing (int4p.prefill.plan) passed over here
                record(s, name, m, n, k, "w4a16_decode", cfg.tag,
                       lambda: linear_prepacked(x, w_pp, None, sw4, config=cfg), ref16, b4)
            if (args.prefill_split and m >= DEQUANT_MIN_M and "__gluon_" in prefill_path
                    and prefill.plan(m, n, k, sms)[1] == 1
                    and prefill.split_for(m, n, k, prefill.tokens_for(m, n, sms), sms) > 1):
                # the default kernel split over K where the plan does not split (prefill.split_for)
                t_ = prefill.tokens_for(m, n, sms)
                gp = prefill.GluonPrefillLaunch(m, n, k, torch.bfloat16, torch.bfloat16, "group",
                                                (sw4.stride(0), sw4.stride(1)), 128, False, dev, None, tokens=t_,
                                                split=prefill.split_for(m, n, k, t_, sms))
                record(s, name, m, n, k, "w4a16_gluon_split", gp.name,
                       lambda gp=gp: gp(x, w_pp.data, None, sw4, None), ref16, b4)
            if args.t256 and m >= DEQUANT_MIN_M:
                for impl, wk, sw_, want in (("w4a16_gluon_t256", "group", sw4, ref16),
                                            ("w4a16_gluon_t256_channel", "vector", sw_ch, x.float() @ w_ch.t())):
                    st = (sw_.stride(0), sw_.stride(1)) if wk == "group" else (0, 1)
                    g256 = lazy(lambda m=m, n=n, k=k, wk=wk, st=st: prefill.GluonPrefillLaunch(
                        m, n, k, torch.bfloat16, torch.bfloat16, wk, st, 128, False, dev, None, tokens=256))
                    record(s, name, m, n, k, impl, prefill.kernel_name("bf16", wk, 256),
                           lambda g256=g256, sw_=sw_: g256(x, w_pp.data, None, sw_, None), want, b4)
                # ... and the 128-token tiling unsplit (group scales), the other side of tokens_for
                g128 = lazy(lambda m=m, n=n, k=k: prefill.GluonPrefillLaunch(
                    m, n, k, torch.bfloat16, torch.bfloat16, "group", (sw4.stride(0), sw4.stride(1)), 128, False,
                    dev, None, tokens=128))
                record(s, name, m, n, k, "w4a16_gluon_t128", prefill.kernel_name("bf16", "group", 128),
                       lambda g128=g128: g128(x, w_pp.data, None, sw4, None), ref16, b4)
            if m >= DEQUANT_MIN_M:  # per-channel scales, the path they take
                record(s, name, m, n, k, "w4a16_prepacked_channel",
                       describe_prepacked(m, n, k, w_scale="vector", device=dev).split()[0],
                       lambda: linear_prepacked(x, w_pp, None, sw_ch), x.float() @ w_ch.t(), b4)
            if args.small_m_prefill and 16 < m < DEQUANT_MIN_M and "__gluon_" in describe_prepacked(
                    DEQUANT_MIN_M, n, k, device=dev):  # the Gluon prefill kernel below its range
                for tokens in prefill.TOKEN_TILES:
                    splits = [1]
                    if args.prefill_split and prefill.split_for(m, n, k, tokens, sms) > 1:
                        splits.append(prefill.split_for(m, n, k, tokens, sms))
                    for split in splits:
                        gp = prefill.GluonPrefillLaunch(m, n, k, torch.bfloat16, torch.bfloat16, "group",
                                                        (sw4.stride(0), sw4.stride(1)), 128, False, dev, None,
                                                        tokens=tokens, split=split)
                        record(s, name, m, n, k, f"w4a16_gluon_t{tokens}" + ("_split" if split > 1 else ""),
                               gp.name, lambda gp=gp: gp(x, w_pp.data, None, sw4, None), ref16, b4)
            if m >= DEQUANT_MIN_M:  # the other prefill path, in the same run
                dq = DequantLaunch(n, k, "group", "none", (sw4.stride(0), sw4.stride(1)), 128,
                                   torch.bfloat16, torch.bfloat16)
                record(s, name, m, n, k, "w4a16_dequant", dq.name, lambda: dq(x, w_pp.data, None, sw4, None),
                       ref16, b4)
            if m == min([mm for mm in ms if mm >= DEQUANT_MIN_M], default=None):
                # the dequantization alone, once per weight (rows of M = 0); its tbps_weight is its
                # whole traffic: the int4 read and the 16-bit or fp8 weight written
                st = (sw4.stride(0), sw4.stride(1))
                record(s, name, 0, n, k, "dequant_bf16_group", "",
                       lambda: dequantize_prepacked(w_pp.data, n, k, sw4, "group", st, 128, torch.bfloat16),
                       w_deq, b4 + n * k * 2)
                record(s, name, 0, n, k, "dequant_fp8_values", "",
                       lambda: dequantize_prepacked(w_pp.data, n, k, None, "none", (0, 0), 128, torch.float8_e4m3fn),
                       v.float(), b4 + n * k)
            record(s, name, m, n, k, "w4a8_pk", "", lambda: tileq.linear(xf8, w_pk, sx, sw4, scheme="bquant"),
                   ref8, b4)
            path8 = describe_prepacked(m, n, k, torch.float8_e4m3fn, device=dev)
            record(s, name, m, n, k, "w4a8_prepacked", path8.split()[0], lambda: linear_prepacked(xf8, w_pp, sx, sw4),
                   ref8, b4, note="cast to bf16" if "cast to bf16" in path8 else "")
            # (the launches below are built on their first call, inside record: an error is a row)
            if m >= DEQUANT_MIN_M:  # W4A8 on the fp8 GEMM path, forced (the default from W4A8_MAX_M)
                f8p = lazy(lambda n=n, k=k: Fp8PrefillLaunch(n, k, "group", "vector", 128, torch.bfloat16,
                                                             torch.float8_e4m3fn))
                record(s, name, m, n, k, "w4a8_fp8_prefill", Fp8PrefillLaunch.name,
                       lambda f8p=f8p: f8p(xf8, w_pp.data, sx, sw4, None), ref8, b4)
                f8c = lazy(lambda n=n, k=k: Fp8PrefillLaunch(n, k, "vector", "vector", 128, torch.bfloat16,
                                                             torch.float8_e4m3fn))
                record(s, name, m, n, k, "w4a8_fp8_prefill_channel", Fp8PrefillLaunch.name,
                       lambda f8c=f8c: f8c(xf8, w_pp.data, sx, sw_ch, None),
                       (xf8.float() * sx[:, None]) @ w_ch.t(), b4)
            if args.w4a8_gluon and m >= prefill.MIN_M:
                # the Gluon prefill kernel on W4A8 (activations cast to bf16, token scales in the
                # epilogue), forced at the plan's tiling (from DEQUANT_MIN_M also where it does not
                # serve group scales), group scales; per-channel from DEQUANT_MIN_M
                tiling = prefill.plan(m, n, k, sms, True) or (prefill.tokens_for(m, n, sms, True), 1)
                variants = [("w4a8_gluon", "group", sw4, ref8)]
                if m >= DEQUANT_MIN_M:
                    variants.append(("w4a8_gluon_channel", "vector", sw_ch, (xf8.float() * sx[:, None]) @ w_ch.t()))
                for impl, wk, sw_, want in variants:
                    st = (sw_.stride(0), sw_.stride(1)) if wk == "group" else (0, 1)
                    g8 = lazy(lambda m=m, n=n, k=k, wk=wk, st=st, tiling=tiling: prefill.GluonPrefillLaunch(
                        m, n, k, torch.float8_e4m3fn, torch.bfloat16, wk, st, 128, False, dev, None,
                        tokens=tiling[0], split=tiling[1], x_kind="vector", sx_stride=1))
                    record(s, name, m, n, k, impl, prefill.kernel_name("bf16", wk, *tiling, x_scale=True),
                           lambda g8=g8, sw_=sw_: g8(xf8, w_pp.data, sx, sw_, None), want, b4)
            if args.w4a8_fused and m >= prefill.MIN_M:
                tiling = prefill.plan(m, n, k, sms, True) or (prefill.tokens_for(m, n, sms, True), 1)
                gf = lazy(lambda m=m, n=n, k=k, tiling=tiling: prefill.GluonPrefillLaunch(
                    m, n, k, torch.float8_e4m3fn, torch.bfloat16, "group", (sw4.stride(0), sw4.stride(1)), 128,
                    False, dev, None, tokens=tiling[0], split=tiling[1], x_kind="vector", sx_stride=1, fused=True))
                record(s, name, m, n, k, "w4a8_fused", prefill.kernel_name("fp8", "group", *tiling),
                       lambda gf=gf: gf(xf8, w_pp.data, sx, sw4, None), ref8, b4)
            sk_plan = prefill.plan(m, n, k, sms) if args.streamk and m >= 128 else None
            if sk_plan is not None:
                # where the default takes stream-K (prefill.streamk_for): the plan's tiling without it
                tp, sp = sk_plan
                if prefill.streamk_for(m, n, k, tp, sp, sms)[1]:
                    for impl, wk, sw_, want in (("w4a16_plan", "group", sw4, ref16),
                                                ("w4a16_plan_channel", "vector", sw_ch, None)):
                        if wk == "vector" and (m < DEQUANT_MIN_M or w_ch is None):
                            continue
                        st = (sw_.stride(0), sw_.stride(1)) if wk == "group" else (0, 1)
                        gpl = lazy(lambda m=m, n=n, k=k, wk=wk, st=st, tp=tp, sp=sp: prefill.GluonPrefillLaunch(
                            m, n, k, torch.bfloat16, torch.bfloat16, wk, st, 128, False, dev, None, tokens=tp,
                            split=sp))
                        record(s, name, m, n, k, impl, prefill.kernel_name("bf16", wk, tp, sp),
                               lambda gpl=gpl, sw_=sw_: gpl(x, w_pp.data, None, sw_, None),
                               want if want is not None else x.float() @ w_ch.t(), b4)
            if args.streamk and m >= 128:
                variants = [("w4a16", "group", torch.bfloat16, sw4, ref16, x)]
                if m >= DEQUANT_MIN_M:
                    variants.append(("w4a16", "vector", torch.bfloat16, sw_ch, x.float() @ w_ch.t(), x))
                variants.append(("w4a8_fused", "group", torch.float8_e4m3fn, sw4, ref8, xf8))
                for kind, wk, xdt, sw_, want, xin in variants:
                    for tokens in ((128, 256) if m > 128 and kind == "w4a16" else (128,)):
                        st = (sw_.stride(0), sw_.stride(1)) if wk == "group" else (0, 1)
                        fp8 = xdt == torch.float8_e4m3fn
                        gs = lazy(lambda m=m, n=n, k=k, wk=wk, st=st, xdt=xdt, tokens=tokens, fp8=fp8:
                                  prefill.GluonPrefillLaunch(m, n, k, xdt, torch.bfloat16, wk, st, 128, False, dev,
                                                             None, tokens=tokens, x_kind="vector" if fp8 else "none",
                                                             sx_stride=1, fused=fp8, streamk=True))
                        impl = f"{kind}_streamk{'_channel' if wk == 'vector' else ''}_t{tokens}"
                        record(s, name, m, n, k, impl,
                               prefill.kernel_name("fp8" if fp8 else "bf16", wk, tokens, 1, True),
                               lambda gs=gs, sw_=sw_, xin=xin, fp8=fp8: gs(xin, w_pp.data, sx if fp8 else None, sw_,
                                                                           None), want, b4)
            if args.streamk_decode and decode_path:
                # stream-K in the decode kernel at each occupancy band of the rule (int4p.launch.PER_SM_*),
                # W4A16 and W4A8 on its fp8 kernel where the default runs that
                kinds = [("w4a16", "bf16", x, None, ref16)]
                if fp8_decode_kernel(m, n, k, dev):
                    kinds.append(("w4a8", "fp8", xf8, sx, ref8))
                bm = 16 if m <= 16 else 32
                bands = [("r128", Int4pConfig(bm, 1, 2, 4, 128)), ("s2", Int4pConfig(bm, 1, 2, 4, 168, True)),
                         ("s3", Int4pConfig(bm, 1, 3, 4, 168, True))] if bm == 16 else [("s2", Int4pConfig(bm, 1, 2))]
                for kind, xt, xin, sxin, want in kinds:
                    for band, c in bands:
                        c = replace(c, streamk=True, fp16=xt == "fp8")
                        record(s, name, m, n, k, f"{kind}_stk_{band}", c.tag,
                               lambda c=c, xin=xin, sxin=sxin: linear_prepacked(xin, w_pp, sxin, sw4, config=c),
                               want, b4)
            if args.fixup and decode_path:
                # the decode config's split-K partials summed by the kernel itself, and the split doubled
                ktiles = -(-k // 512)
                kinds = [("w4a16", cfg, x, None, ref16)]
                if fp8_decode_kernel(m, n, k, dev):
                    kinds.append(("w4a8", config_for(m, n, k, "fp8")[0], xf8, sx, ref8))
                for kind, c0, xin, sxin, want in kinds:
                    variants = [(f"{kind}_fixup", replace(c0, fixup=True))] if c0.split_k > 1 else []
                    if ktiles >= 2 * 2 * c0.split_k:
                        variants.append((f"{kind}_fixup_x2", replace(c0, split_k=2 * c0.split_k, fixup=True)))
                    for impl, c in variants:
                        record(s, name, m, n, k, impl, c.tag,
                               lambda c=c, xin=xin, sxin=sxin: linear_prepacked(xin, w_pp, sxin, sw4, config=c),
                               want, b4)
            gplan = prefill.plan(m, n, k, sms) if args.fixup and not decode_path and m < DEQUANT_MIN_M else None
            if gplan is not None and gplan[1] > 1 and gplan[0] <= prefill.FIXUP_MAX_TOKENS:
                # the Gluon prefill kernel's split (the plan's tiling) with its partials summed in the kernel
                tp, sp = gplan
                gfx = lazy(lambda m=m, n=n, k=k, tp=tp, sp=sp: prefill.GluonPrefillLaunch(
                    m, n, k, torch.bfloat16, torch.bfloat16, "group", (sw4.stride(0), sw4.stride(1)), 128, False, dev,
                    None, tokens=tp, split=sp, fixup=True))
                record(s, name, m, n, k, "w4a16_fixup", prefill.kernel_name("bf16", "group", tp, sp, fixup=True),
                       lambda gfx=gfx: gfx(x, w_pp.data, None, sw4, None), ref16, b4)
                p8 = prefill.plan(m, n, k, sms, True)
                if p8 is not None and p8[1] > 1 and p8[0] <= prefill.FIXUP_MAX_TOKENS and "its fp8 build" in \
                        describe_prepacked(m, n, k, torch.float8_e4m3fn, device=dev):
                    g8fx = lazy(lambda m=m, n=n, k=k, p8=p8: prefill.GluonPrefillLaunch(
                        m, n, k, torch.float8_e4m3fn, torch.bfloat16, "group", (sw4.stride(0), sw4.stride(1)), 128,
                        False, dev, None, tokens=p8[0], split=p8[1], x_kind="vector", sx_stride=1, fused=True,
                        fixup=True))
                    record(s, name, m, n, k, "w4a8_fixup", prefill.kernel_name("fp8", "group", *p8, fixup=True),
                           lambda g8fx=g8fx: g8fx(xf8, w_pp.data, sx, sw4, None), ref8, b4)
            if args.decode_gluon and m <= 16:
                from tileq.prepacked import decode_gluon
                # the decode config's split, and the others of 1 / 2 / 4 leaving each range two K blocks
                splits = sorted({cfg.split_k} | {sp for sp in (1, 2, 4) if 2 * sp <= -(-k // 512)})
                for stages, sk in itertools.product((2, 3), splits):
                    gd = lazy(lambda m=m, n=n, k=k, sk=sk, stages=stages: decode_gluon.GluonDecodeLaunch(
                        m, n, k, torch.bfloat16, torch.bfloat16, "group", (sw4.stride(0), sw4.stride(1)), 128, False,
                        dev, None, split=sk, stages=stages))
                    impl = f"w4a16_decode_gluon_s{stages}" + ("" if sk == cfg.split_k else f"_k{sk}")
                    record(s, name, m, n, k, impl, decode_gluon.kernel_name("bf16", "group", sk, stages, sk > 1),
                           lambda gd=gd: gd(x, w_pp.data, None, sw4, None), ref16, b4)
            if args.w4a8_via_bf16 and m < DEQUANT_MIN_M:
                # both decode-kernel routes of W4A8, whichever the default took: the fp8 activations
                # cast to bf16 before the W4A16 kernel (its config), and converted inside the kernel
                for impl, ct in (("w4a8_via_bf16", "bf16"), ("w4a8_fp8_kernel", "fp8")):
                    c = config_for(m, n, k, ct)[0]
                    lc = lazy(lambda m=m, n=n, k=k, c=c, ct=ct: Int4pLaunch(
                        m, n, k, ct, torch.bfloat16, "group", (sw4.stride(0), sw4.stride(1)), "vector", 1, 128,
                        False, dev, c, cast_x=ct == "bf16"))
                    record(s, name, m, n, k, impl, c.tag, lambda lc=lc: lc(xf8, w_pp.data, sx, sw4, None), ref8, b4)
            if args.w4a8_fp16 and m < DEQUANT_MIN_M:
                # the decode kernel on the fp8 activations themselves, converted to bf16 inside (the
                # default's kernel where compute_type keeps fp8) and to fp16 (Int4pConfig.fp16)
                for impl, h16 in (("w4a8_fp8_kernel_bf16", False), ("w4a8_fp8_kernel_h16", True)):
                    c = replace(config_for(m, n, k, "fp8")[0], fp16=h16)
                    lc = lazy(lambda m=m, n=n, k=k, c=c: Int4pLaunch(
                        m, n, k, "fp8", torch.bfloat16, "group", (sw4.stride(0), sw4.stride(1)), "vector", 1, 128,
                        False, dev, c))
                    record(s, name, m, n, k, impl, c.tag, lambda lc=lc: lc(xf8, w_pp.data, sx, sw4, None), ref8, b4)
            if args.split_sweep and m > 16:
                plan_ = prefill.plan(m, n, k, sms)
                tokens = plan_[0] if plan_ else (64 if m <= 64 else prefill.TOKENS)
                if prefill.tiles(m, n, tokens) < sms:
                    for split in range(2, prefill.MAX_SPLIT + 1):
                        if -(-k // 512) < prefill.min_split_blocks(m) * split:
                            break
                        gp = lazy(lambda m=m, n=n, k=k, tokens=tokens, split=split: prefill.GluonPrefillLaunch(
                            m, n, k, torch.bfloat16, torch.bfloat16, "group", (sw4.stride(0), sw4.stride(1)), 128,
                            False, dev, None, tokens=tokens, split=split))
                        record(s, name, m, n, k, "w4a16_gluon_split_sweep",
                               prefill.kernel_name("bf16", "group", tokens, split),
                               lambda gp=gp: gp(x, w_pp.data, None, sw4, None), ref16, b4)
            if (m <= 16 or m in (32, 64)) and not args.no_sweep:
                if m <= 16:
                    # (a split sums its partials in the kernel, as the rule's configs do)
                    sweep = [Int4pConfig(16, sk, st, 4, reg, fixup=sk > 1) for sk in (1, 2, 4, 8)
                             for st, reg in ((2, None), (3, None), (2, 128), (2, 168), (3, 168))]
                    if args.scale_ahead:
                        sweep += [replace(c, scale_ahead=True) for c in sweep] + [replace(cfg, scale_ahead=True)]
                elif args.sweep_m32:
                    sweep = [Int4pConfig(bm, sk, 2, fixup=sk > 1) for bm in (16, 32) for sk in (1, 2, 4, 8)]
                else:
                    sweep = []
                for c in sweep:
                    if c == cfg or -(-k // 512) < 2 * c.split_k:
                        continue
                    record(s, name, m, n, k, "w4a16_prepacked_sweep", c.tag,
                           lambda c=c: linear_prepacked(x, w_pp, None, sw4, config=c), ref16, b4)
            if m <= 16 and args.gluon_decode and "__gluon_" in describe_prepacked(DEQUANT_MIN_M, n, k, device=dev):
                # the Gluon prefill kernel with 16-token tiles (warp-specialized: a TMA producer, two
                # consumer warpgroups converting in turn), split over K 1, 2, 4 ways and as split_for
                # picks: built and not routed; a decode candidate against the Triton kernel
                splits = sorted({sp for sp in (1, 2, 4, prefill.split_for(m, n, k, 16, sms)) if -(-k // 512) >= 2 * sp})
                for split in splits:
                    gp = prefill.GluonPrefillLaunch(m, n, k, torch.bfloat16, torch.bfloat16, "group",
                                                    (sw4.stride(0), sw4.stride(1)), 128, False, dev, None,
                                                    tokens=16, split=split)
                    record(s, name, m, n, k, "w4a16_gluon_t16", gp.name,
                           lambda gp=gp: gp(x, w_pp.data, None, sw4, None), ref16, b4)
            if m <= 16 and args.sweep_w4a8:
                # W4A8 (fp8 activations) over the same 16-token configs, with and without group
                # scales one K tile ahead: its rule keeps three stages, never swept
                cfg8 = config_for(m, n, k, "fp8")[0]
                sweep8 = [Int4pConfig(16, sk, st, 4, reg, fp16=True, fixup=sk > 1) for sk in (1, 2, 4, 8)
                          for st, reg in ((2, None), (3, None), (2, 128), (2, 168), (3, 168))]
                sweep8 += [replace(c, scale_ahead=True) for c in sweep8 if c.maxnreg != 128]
                for c in sweep8:
                    if c == cfg8 or -(-k // 512) < 2 * c.split_k:
                        continue
                    record(s, name, m, n, k, "w4a8_prepacked_sweep", c.tag,
                           lambda c=c: linear_prepacked(xf8, w_pp, sx, sw4, config=c), ref8, b4)
        del v, w_deq, w_pk, w_pp, w_bf16, w8, wf8, w_ch
        torch.cuda.empty_cache()

    csv_file.close()
    summarize(rows)
    print(f"wrote {path} ({time.time() - t_start:.0f} s)")
    return 0


def summarize(rows) -> None:
    t = {}
    for r in rows:
        if r["ms"]:
            key = (r["shape"], int(r["m"]), r["impl"])
            t[key] = min(t.get(key, 1e9), float(r["ms"]))
    probs = sorted({(r["set"], r["shape"], int(r["m"]), int(r["n"]), int(r["k"])) for r in rows if int(r["m"])},
                   key=lambda p: (p[1], p[2]))
    print(f"{'shape':22} {'M':>5} {'bf16':>8} {'int8':>8} {'w4pk':>8} {'w4pp':>8} {'best':>8} {'pp/i8':>6} "
          f"{'bf16/pp':>7} {'pk/pp':>6} {'w4a8pp/i8':>9}")
    ratio = {}
    for s, shape, m, n, k in probs:
        g = lambda impl: t.get((shape, m, impl))  # noqa: E731
        best = min([x for x in (g("w4a16_prepacked"), g("w4a16_prepacked_sweep")) if x] or [None]) \
            if g("w4a16_prepacked") else None
        fmt = lambda x: f"{x * 1000:8.1f}" if x else "       -"  # noqa: E731
        div = lambda a, b: a / b if a and b else None  # noqa: E731
        r_pp_i8 = div(g("w4a16_prepacked"), g("int8_rowcol"))
        r_bf16 = div(g("bf16_cublas"), g("w4a16_prepacked"))
        r_pk = div(g("w4a16_pk"), g("w4a16_prepacked"))
        r_a8 = div(g("w4a8_prepacked"), g("int8_rowcol"))
        r_a8f = div(g("fp8_rowcol"), g("w4a8_prepacked"))
        best8 = min([x for x in (g("w4a8_prepacked"), g("w4a8_prepacked_sweep")) if x] or [None]) \
            if g("w4a8_prepacked") else None
        ratio[(s, shape, m, n, k)] = (r_pp_i8, r_bf16, r_a8, r_a8f, div(best, g("int8_rowcol")),
                                      div(g("bf16_cublas"), g("w4a16_dequant")), div(best8, g("int8_rowcol")),
                                      div(g("w4a16_gluon_t16"), g("int8_rowcol")),
                                      div(g("fp8_rowcol"), g("w4a8_fp8_prefill")),
                                      div(g("fp8_rowcol"), g("w4a8_fp8_prefill_channel")),
                                      div(g("w4a8_via_bf16"), g("int8_rowcol")),
                                      div(g("w4a8_fp8_kernel"), g("int8_rowcol")))
        f2 = lambda x: f"{x:6.2f}" if x else "     -"  # noqa: E731
        print(f"{shape:22} {m:5d} {fmt(g('bf16_cublas'))} {fmt(g('int8_rowcol'))} {fmt(g('w4a16_pk'))} "
              f"{fmt(g('w4a16_prepacked'))} {fmt(best)} {f2(r_pp_i8)} {f2(r_bf16)} {f2(r_pk)} {f2(r_a8)}   (us)")

    def med(sel, idx):
        vals = [v[idx] for key, v in ratio.items() if sel(*key) and v[idx]]
        return (statistics.median(vals), len(vals)) if vals else (None, 0)

    big = lambda s, sh, m, n, k: n * k // 2 >= 25e6  # noqa: E731
    lines = [
        ("W4A16 decode M<=16, int4 >= 25 MB: prepacked / int8 (target <= 0.6)",
         med(lambda *a: a[2] <= 16 and big(*a), 0)),
        ("  same, best swept config / int8", med(lambda *a: a[2] <= 16 and big(*a), 4)),
        ("  same, Gluon 16-token tiles (best split) / int8", med(lambda *a: a[2] <= 16 and big(*a), 7)),
        ("W4A16 M 32-64 (the routed path): prepacked / int8 (target <= 0.75)", med(lambda *a: 32 <= a[2] <= 64, 0)),
        ("W4A16 prefill M>=1024: bf16 time / prepacked time (target >= 0.95)", med(lambda *a: a[2] >= 1024, 1)),
        ("W4A16 prefill M 128-512: bf16 / prepacked (target >= 1.0)", med(lambda *a: 128 <= a[2] <= 512, 1)),
        ("  dequant+cublas instead, M>=1024: bf16 / dequant", med(lambda *a: a[2] >= 1024, 5)),
        ("  dequant+cublas instead, M 256-512: bf16 / dequant", med(lambda *a: 256 <= a[2] <= 512, 5)),
        ("W4A8 decode M<=16, >= 25 MB: prepacked / int8 (target <= 0.6)", med(lambda *a: a[2] <= 16 and big(*a), 2)),
        ("  same, best swept W4A8 config / int8", med(lambda *a: a[2] <= 16 and big(*a), 6)),
        ("W4A8 prefill M>=128: fp8 rowcol time / prepacked (target >= 0.8)", med(lambda *a: a[2] >= 128, 3)),
        ("  same, values as fp8 + tileq's fp8 GEMM (forced at every prefill M)", med(lambda *a: a[2] >= 128, 8)),
        ("  same with per-channel scales (fp8 rowcol GEMM)", med(lambda *a: a[2] >= 128, 9)),
        ("W4A8 decode via bf16 activations + the W4A16 kernel, >= 25 MB / int8",
         med(lambda *a: a[2] <= 16 and big(*a), 10)),
        ("W4A8 decode on the fp8 kernel (activations converted inside), >= 25 MB / int8",
         med(lambda *a: a[2] <= 16 and big(*a), 11)),
        ("  untuned shapes only, W4A16 decode M<=16 / int8", med(lambda *a: a[0] == "untuned" and a[2] <= 16, 0)),
        ("  fresh shapes only, W4A16 decode M<=16, >= 25 MB / int8",
         med(lambda *a: a[0] == "fresh" and a[2] <= 16 and big(*a), 0)),
        ("  fresh shapes only, W4A8 decode M<=16, >= 25 MB / int8",
         med(lambda *a: a[0] == "fresh" and a[2] <= 16 and big(*a), 2)),
    ]
    for impl in ("dequant_bf16_group", "dequant_fp8_values"):  # (rows of M = 0: the weight alone)
        tb = [float(r["tbps_weight"]) for r in rows if r["impl"] == impl and r["ms"]]
        if tb:
            lines.append((f"{impl}: TB/s of int4 read + weight written", (statistics.median(tb), len(tb))))
    print()
    for label, (v, n) in lines:
        print(f"{label}: {'-' if v is None else f'{v:.3f}'} (median of {n})")
    # The prefill targets per M (default paths): W4A16 bf16 cuBLAS time / int4 time with group and
    # per-channel scales, W4A8 fp8 rowcol time / int4 time with group scales (medians over weights)
    per_m = sorted({m for (_, m, impl) in t if impl == "w4a16_prepacked" and m >= 128})
    cols = (("W4A16 group", "bf16_cublas", "w4a16_prepacked"),
            ("W4A16 channel", "bf16_cublas", "w4a16_prepacked_channel"),
            ("W4A8 group", "fp8_rowcol", "w4a8_prepacked"),
            ("W4A8 fused (forced)", "fp8_rowcol", "w4a8_fused"),
            ("W4A16 stream-K t128", "bf16_cublas", "w4a16_streamk_t128"),
            ("W4A16 stream-K t256", "bf16_cublas", "w4a16_streamk_t256"),
            ("W4A16 channel stream-K t128", "bf16_cublas", "w4a16_streamk_channel_t128"),
            ("W4A16 channel stream-K t256", "bf16_cublas", "w4a16_streamk_channel_t256"),
            ("W4A8 fused stream-K", "fp8_rowcol", "w4a8_fused_streamk_t128"))
    # --w4a8-fp16: the decode kernel's fp8 activations converted to fp16 against bf16 (same config)
    h16 = [(m, t[(sh, m, "w4a8_fp8_kernel_bf16")] / t[(sh, m, "w4a8_fp8_kernel_h16")]) for (sh, m, i) in t
           if i == "w4a8_fp8_kernel_h16" and (sh, m, "w4a8_fp8_kernel_bf16") in t]
    for lo, hi in ((1, 16), (17, 255)):
        vals = [r for m, r in h16 if lo <= m <= hi]
        if vals:
            print(f"W4A8 decode kernel, M {lo}-{hi}: bf16-converting time / fp16-converting time "
                  f"{statistics.median(vals):.3f} ({min(vals):.3f}-{max(vals):.3f}, n={len(vals)})")
    if per_m:
        print("\nprefill per M (medians; baseline time / int4 time): " + ", ".join(c[0] for c in cols))
    for m in per_m:
        cells = []
        for label, base, impl in cols:
            vals = [t[(sh, m, base)] / t[(sh, m, impl)] for (sh, mm, i) in t
                    if mm == m and i == impl and (sh, m, base) in t]
            cells.append(f"{label} {statistics.median(vals):.3f} (n={len(vals)})" if vals else f"{label} -")
        print(f"  M = {m}: " + ", ".join(cells))
    # --fixup: the decode kernel's split-K sum in the kernel, against the default, per M; --overlap
    # --decode-gluon, --streamk-decode: the fastest variant per call
    for (sh, m, i) in list(t):
        for prefix in ("w4a16_decode_gluon_", "w4a16_stk_", "w4a8_stk_"):
            if i.startswith(prefix):
                best = (sh, m, f"{prefix}best")
                t[best] = min(t.get(best, float("inf")), t[(sh, m, i)])
    variants = lambda prefix: sorted({i for (_, _, i) in t if i.startswith(prefix)})  # noqa: E731
    sizes = {(sh, m): n * k // 2 for (_, sh, m, n, k) in ratio}
    for kind in ("w4a16", "w4a8"):  # --streamk-decode against int8 as the targets count it
        for impl in variants(f"{kind}_stk_"):
            for lo, hi in ((1, 16), (17, 32)):
                vals = [t[(sh, m, impl)] / t[(sh, m, "int8_rowcol")] for (sh, m, i) in t
                        if i == impl and lo <= m <= hi and sizes.get((sh, m), 0) >= 25e6 and (sh, m, "int8_rowcol") in t]
                if vals:
                    print(f"{impl} / int8 rowcol, M {lo}-{hi}, int4 >= 25 MB: {statistics.median(vals):.3f} "
                          f"(n={len(vals)})")
    for kind in ("w4a16", "w4a8"):
        for impl in (f"{kind}_fixup", f"{kind}_fixup_x2", f"{kind}_no_overlap", f"{kind}_no_stk",
                     *variants(f"{kind}_stk_"),
                     *(variants("w4a16_decode_gluon_") if kind == "w4a16" else ())):
            for m in sorted({m for (_, m, i) in t if i == impl}):
                vals = [t[(sh, m, f"{kind}_prepacked")] / t[(sh, m, impl)] for (sh, mm, i) in t
                        if mm == m and i == impl and (sh, m, f"{kind}_prepacked") in t]
                if vals:
                    print(f"{impl} M = {m}: {statistics.median(vals):.3f}x the default's speed "
                          f"({min(vals):.3f}-{max(vals):.3f}, n={len(vals)})")
    # --small-m-prefill / --prefill-split: the Gluon prefill kernel forced (token tiles, split over K)
    # and the decode kernel where the routing passed it over, against the path the call took,
    # medians over the weights timed with each
    forced = lambda impl: impl.startswith("w4a16_gluon_") or impl == "w4a16_decode"  # noqa: E731
    small = sorted({m for (_, m, impl) in t if forced(impl)})
    gluon_impls = sorted({impl for (_, _, impl) in t if forced(impl)})
    for m in small:
        parts = []
        for impl in gluon_impls:
            vals = [t[(sh, m, "w4a16_prepacked")] / t[(sh, m, impl)] for (sh, mm, i) in t
                    if mm == m and i == impl and (sh, m, "w4a16_prepacked") in t]
            vs_bf16 = [t[(sh, m, "bf16_cublas")] / t[(sh, m, impl)] for (sh, mm, i) in t
                       if mm == m and i == impl and (sh, m, "bf16_cublas") in t]
            if vals:
                parts.append(f"{impl[6:]}: {statistics.median(vals):.3f}x the default path's speed "
                             f"({min(vals):.3f}-{max(vals):.3f}), {statistics.median(vs_bf16):.3f}x bf16's")
        print(f"M = {m}: " + "; ".join(parts))


if __name__ == "__main__":
    sys.exit(main())
