"""Rebuild a scripts/gluon_bench.py CSV from its log's table, for a run whose CSV did not come back
from the device (the log holds every problem's row).

    python3 scripts/gluon_log_to_csv.py bench_gluon_int8.log int8.csv

Per problem: the planner's Gluon row (TFLOP/s and the ratio to the baseline as printed), the
Triton and baseline rows, torch._int_mm alone for int8 logs, and each --variants row (its ratio
as printed as 'gluonN=', its TFLOP/s from that ratio). Times are the flops over the printed
TFLOP/s (rounded as printed: three or four significant digits); max_rel_err is not in the log
(every output was checked before timing; the log's last line says how many failed). The note
column says 'rebuilt from the log'.
"""

from __future__ import annotations

import csv
import re
import sys

FIELDS = ["m", "n", "k", "impl", "config", "ms", "tflops", "vs_cublaslt", "vs_int_mm", "max_rel_err", "note"]
ROW = re.compile(r"\s*(\d+)\s+(\d+)\s+(\d+) \|\s+([\d.]+|-)\s+([\d.]+|-)\s+([\d.]+|-)\s+\|\s+([\d.]+|-)\s+([\d.]+|-)\s+\|(.*)")


def rows_of(line: str) -> list[dict]:
    m = ROW.match(line)
    if not m:
        return []
    mm, n, k = (int(v) for v in m.group(1, 2, 3))
    flops = 2.0 * mm * n * k
    rest = m.group(9)
    int_mm = None
    if rest.count("|") == 1:  # int8: "int_mm gluon/int_mm | configs"
        raw, rest = rest.split("|")
        int_mm = [float(v) for v in raw.split()]
    configs, *ratios = rest.split()
    configs = configs.split(",")
    variant = dict(re.findall(r"(gluon\d+)=([\d.]+)", " ".join(ratios)))
    base = None if m.group(6) == "-" else float(m.group(6))

    def row(impl, config, tflops, vs, vs_int_mm=""):
        ms = f"{flops / tflops / 1e9:.4f}" if tflops else ""
        return dict(m=mm, n=n, k=k, impl=impl, config=config, ms=ms, tflops=f"{tflops:.1f}" if tflops else "",
                    vs_cublaslt=vs, vs_int_mm=vs_int_mm, max_rel_err="", note="rebuilt from the log")

    out = []
    if m.group(4) != "-":
        out.append(row("gluon", configs[0], float(m.group(4)), m.group(7) if m.group(7) != "-" else "",
                       f"{int_mm[1]:.3f}" if int_mm else ""))
    for i, cfg in enumerate(configs[1:], 1):
        r = variant.get(f"gluon{i}")
        if r is not None and base:
            out.append(row("gluon", cfg, float(r) * base, r))
    if m.group(5) != "-":
        out.append(row("triton", "", float(m.group(5)), m.group(8) if m.group(8) != "-" else ""))
    if base:
        out.append(row("cublaslt", "", base, "1.000"))
    if int_mm:
        out.append(row("int_mm", "torch._int_mm alone", int_mm[0], ""))
    return out


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    rows = [r for line in open(sys.argv[1]) for r in rows_of(line)]
    with open(sys.argv[2], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)
    print(f"{len(rows)} rows -> {sys.argv[2]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
