"""The int4 report from scripts/int4_bench.py's CSV: markdown tables and a plot.

    python scripts/int4_report.py bench/results/h200/int4/int4.csv --out bench/results/h200/int4
    python scripts/int4_report.py bench/results/h200/int4/prefill-gluon/int4.csv --prefill \
        --out bench/results/h200/int4/prefill-gluon

Writes int4_tables.md (per problem: microseconds and the ratios the issue's targets name) and
int4.png (W4A16 time relative to tileq int8 and to bf16 cuBLAS, by M). Every ratio compares
implementations timed in the same run; 'best' is the fastest prepacked config of the run's
sweep, 'default' the one tileq picks (int4p.launch.default_config).
"""

from __future__ import annotations

import argparse
import collections
import csv
import os
import statistics


def load(path):
    t = collections.defaultdict(dict)
    meta = {}
    for r in csv.DictReader(open(path)):
        if not r["ms"]:
            continue
        key = (r["shape"], int(r["m"]))
        meta[r["shape"]] = (r["set"], int(r["n"]), int(r["k"]))
        us = float(r["ms"]) * 1000
        impl = r["impl"]
        if impl == "w4a16_prepacked_sweep":
            t[key]["best"] = min(t[key].get("best", 1e18), us)
        else:
            t[key][impl] = us
            if impl == "w4a16_prepacked":
                t[key]["best"] = min(t[key].get("best", 1e18), us)
    return t, meta


def prefill_report(path: str, out: str) -> None:
    """prefill_tables.md and prefill.png: per weight and prefill M (>= 256), bf16 cuBLAS, the path
    tileq takes for W4A16 with group scales (its name in the CSV's config column), and the other
    prefill path and the Gluon kernel with per-channel scales where the run timed them; as speed
    relative to bf16 cuBLAS."""
    rows = [r for r in csv.DictReader(open(path)) if r["ms"] and int(r["m"]) >= 256]
    t, cfg = {}, {}
    for r in rows:
        key = (r["set"], r["shape"], int(r["m"]))
        t.setdefault(key, {})[r["impl"]] = float(r["ms"]) * 1000
        if r["impl"] == "w4a16_prepacked":
            cfg[key] = r["config"]
    lines = ["| weight | set | M | bf16 cuBLAS us | default path | its time us | x bf16 speed "
             "| dequant+cuBLAS x bf16 | Gluon, per-channel scales x bf16 |", "|" + "---|" * 9]
    ratio = lambda d, impl: f"{d['bf16_cublas'] / d[impl]:.2f}" if impl in d else "-"  # noqa: E731
    for key in sorted(t):
        d = t[key]
        if "bf16_cublas" not in d or "w4a16_prepacked" not in d:
            continue
        lines.append(f"| {key[1]} | {key[0]} | {key[2]} | {d['bf16_cublas']:.1f} | {cfg[key]} | "
                     f"{d['w4a16_prepacked']:.1f} | {ratio(d, 'w4a16_prepacked')} | {ratio(d, 'w4a16_dequant')} | "
                     f"{ratio(d, 'w4a16_prepacked_channel')} |")
    with open(os.path.join(out, "prefill_tables.md"), "w") as fh:
        fh.write("W4A16 prefill, group-128 scales; times in microseconds, ratios from the same run.\n\n"
                 + "\n".join(lines) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    ms = sorted({k[2] for k in t})
    for impl, label, style in (("w4a16_prepacked", "default path (group scales)", "-o"),
                               ("w4a16_dequant", "dequantize + cuBLAS", "--s"),
                               ("w4a16_prepacked_channel", "Gluon kernel, per-channel scales", "-^")):
        ys = []
        for m in ms:
            vals = [d["bf16_cublas"] / d[impl] for k, d in t.items() if k[2] == m and impl in d and "bf16_cublas" in d]
            ys.append(statistics.median(vals) if vals else float("nan"))
        ax.plot(ms, ys, style, label=label)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("M (tokens)")
    ax.set_ylabel("speed relative to bf16 cuBLAS (median over weights)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "prefill.png"), dpi=110)
    print("wrote", os.path.join(out, "prefill_tables.md"), os.path.join(out, "prefill.png"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv")
    p.add_argument("--out", default=".")
    p.add_argument("--prefill", action="store_true",
                   help="the W4A16 prefill paths instead (prefill_tables.md, prefill.png)")
    args = p.parse_args()
    if args.prefill:
        prefill_report(args.csv, args.out)
        return
    t, meta = load(args.csv)
    lines = ["| set | shape | N x K | M | bf16 cuBLAS | int8 | fp8 | W4A16 pk_int4 | W4A16 prepacked | best swept "
             "| prepacked / int8 | bf16 / prepacked | pk / prepacked | W4A8 pk | W4A8 prepacked | W4A8 pp / int8 |",
             "|" + "---|" * 16]
    f = lambda v: f"{v:.1f}" if v else "-"  # noqa: E731
    r = lambda a, b: f"{a / b:.2f}" if a and b else "-"  # noqa: E731
    for (shape, m) in sorted(t, key=lambda x: (meta[x[0]][0], x[0], x[1])):
        d = t[(shape, m)]
        s, n, k = meta[shape]
        g = d.get
        lines.append(f"| {s} | {shape} | {n} x {k} | {m} | {f(g('bf16_cublas'))} | {f(g('int8_rowcol'))} | "
                     f"{f(g('fp8_rowcol'))} | {f(g('w4a16_pk'))} | {f(g('w4a16_prepacked'))} | "
                     f"{f(g('best')) if m in (1, 16, 32, 64) else '-'} | {r(g('w4a16_prepacked'), g('int8_rowcol'))} | "
                     f"{r(g('bf16_cublas'), g('w4a16_prepacked'))} | {r(g('w4a16_pk'), g('w4a16_prepacked'))} | "
                     f"{f(g('w4a8_pk'))} | {f(g('w4a8_prepacked'))} | {r(g('w4a8_prepacked'), g('int8_rowcol'))} |")
    with open(os.path.join(args.out, "int4_tables.md"), "w") as fh:
        fh.write("Times in microseconds (median of CUDA-graph replays, L2 flushed); ratios from the same "
                 "run.\n\n" + "\n".join(lines) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    ms = sorted({m for _, m in t})
    for impl, label, style in (("w4a16_prepacked", "W4A16 prepacked", "-o"), ("w4a16_pk", "W4A16 pk_int4", "--s"),
                               ("w4a8_prepacked", "W4A8 prepacked", "-^")):
        for ax, base, title in ((axes[0], "int8_rowcol", "time / tileq int8 rowcol (lower is better)"),
                                (axes[1], "bf16_cublas", "time / bf16 cuBLAS (lower is better)")):
            ys = []
            for m in ms:
                vals = [d[impl] / d[base] for (sh, mm), d in t.items() if mm == m and impl in d and base in d]
                ys.append(statistics.median(vals) if vals else float("nan"))
            ax.plot(ms, ys, style, label=label)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log", base=2)
            ax.set_xlabel("M (tokens)")
            ax.set_title(title)
            ax.axhline(1.0, color="gray", lw=0.8)
            ax.grid(True, which="both", alpha=0.3)
    axes[0].axhline(0.6, color="red", lw=0.8, ls=":", label="decode target 0.6")
    axes[0].legend()
    fig.suptitle("int4 weights on an H200: median over 11 LLM weights per M")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "int4.png"), dpi=110)
    print("wrote", os.path.join(args.out, "int4_tables.md"), os.path.join(args.out, "int4.png"))


if __name__ == "__main__":
    main()
