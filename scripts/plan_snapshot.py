"""Every plan `tileq explain` prints for a grid of problems, as one text: run it before and after a
change to the planner or the code around it and diff the two (a restructure must leave each
plan's text unchanged). No GPU needed: the plans are sm_90's (--arch sm_90).

    PYTHONPATH=src python3 scripts/plan_snapshot.py > before.txt
    ... change ...
    PYTHONPATH=src python3 scripts/plan_snapshot.py > after.txt && diff before.txt after.txt

The grid: every catalog family (its scheme, operand types, layout and scale layout) at decode and
prefill sizes over Qwen3-14B / Llama-3-8B projections and an odd shape, with and without a bias,
under each TILEQ_GLUON value; prepacked int4 weights (bf16, fp16, fp8 activations; group and
per-channel scales); grouped GEMMs over 8 and 128 experts in both forms.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys

_TYPES = {"i8": "int8", "fp8": "fp8", "bf8": "bf8", "i4": "int4", "bf16": "bf16", "fp16": "fp16"}
_MS = (1, 5, 16, 17, 64, 65, 300, 4096)
_NK = ((5120, 5120), (17408, 5120), (5120, 17408), (14336, 4096), (577, 859))


def explain(argv: list[str]) -> str:
    from tileq.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = main(["explain", "--arch", "sm_90", *argv])
    return f"$ tileq explain {' '.join(argv)}  (rc {rc})\n{out.getvalue()}"


def families() -> list[list[str]]:
    from tileq.catalog.families import catalog

    seen, out = set(), []
    for fam in catalog():
        key = (fam.scheme.value, fam.a.value, fam.b.value, fam.layout, fam.scale_layout)
        if key in seen:
            continue
        seen.add(key)
        args = ["--scheme", key[0], "--a", _TYPES[key[1]], "--b", _TYPES[key[2]], "--layout", key[3]]
        if key[4] == "preshufflequant":
            args.append("--preshuffled")
        out.append(args)
    return out


def problems():
    for fam in families():
        for m in _MS:
            for n, k in _NK:
                for bias in ((), ("--bias",)):
                    yield [*fam, "--m", str(m), "--n", str(n), "--k", str(k), *bias]


def prepacked():
    for a in ("bf16", "fp16", "fp8"):
        for scheme, group in (("bquant", ()), ("rowcol", ())):
            for m in _MS:
                for n, k in _NK:
                    if scheme == "rowcol" and a != "bf16":
                        continue
                    yield ["--scheme", scheme, "--a", a, "--b", "int4", "--m", str(m), "--n", str(n), "--k", str(k),
                           "--prepacked", *group]


def grouped():
    for e in (8, 128):
        for form in ("contiguous", "masked"):
            for a, b, scheme in (("fp8", "fp8", "abquant"), ("int8", "int8", "rowcol"), ("bf16", "int4", "bquant")):
                for m in (1, 16, 256, 4096):
                    yield ["--scheme", scheme, "--a", a, "--b", b, "--m", str(m), "--n", "1536", "--k", "2048",
                           "--grouped", str(e), "--form", form]


def main() -> int:
    for gluon in (None, "0", "1"):
        if gluon is None:
            os.environ.pop("TILEQ_GLUON", None)
        else:
            os.environ["TILEQ_GLUON"] = gluon
        print(f"#### TILEQ_GLUON={gluon}")
        for argv in problems():
            sys.stdout.write(explain(argv))
    os.environ.pop("TILEQ_GLUON", None)
    for argv in (*prepacked(), *grouped()):
        sys.stdout.write(explain(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
