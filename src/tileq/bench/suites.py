"""Suites: lists of GEMM shapes kept as CSV data files.

Format (one row per shape; '#' starts a comment line; blank lines are skipped)::

    name,m,n,k[,schemes][,cases]
    qwen3-14b.qkv,1;16;4096,7168,5120
    tiny.odd,37,72,200,rowcol;bquant,

- ``name``: a label (projection, model); ``m``, ``n``, ``k``: positive integers. ``m`` may list
  several values separated by ';' (one shape each): the LLM suites sweep M per projection.
- ``schemes`` (optional): ';'-separated schemes; only cases of these schemes run on the row.
- ``cases`` (optional): ';'-separated case names or sets (see ``cases.py``); replaces the
  command's case list for this row (the ck28 suite uses ``aquant28``).

Built-in suites ship inside the package (``tileq/bench/suites/*.csv``); any other argument is
read as a path. A malformed file raises ``SuiteError`` naming the file and the line.
"""

from __future__ import annotations

import csv
import io
import os
from dataclasses import dataclass
from importlib import resources

from ..errors import ShapeError, expect
from ..problem import Scheme, parse_scheme
from .cases import Case, parse_case_list

REQUIRED = ("name", "m", "n", "k")
OPTIONAL = ("schemes", "cases")

# Name -> what it is (the file is suites/<name>.csv). The whole llm suite does not fit one
# 10-minute GPU command at the default 50 + 100 runs: on an H200 (2026-11-29) it got through 60%
# of its 1512 (shape, case) items in 400 s, the kernels alone taking 277 s. llm-decode took 194 s;
# llm-prefill about 620 s over two commands, so it is split again into llm-prefill-a and -b
# (--time-budget stops a sweep cleanly regardless).
BUILTIN_SUITES = {
    "smoke": "tiny shapes for the CPU interpreter (correctness only there)",
    "llm": "Qwen3-14B, Llama-3-8B/-70B (= Mixtral-8x7B's shapes), DeepSeek-V3 projections x 12 M "
           "(use llm-decode, llm-prefill-a and llm-prefill-b for 10-minute commands)",
    "llm-decode": "the llm projections at M in 1..64",
    "llm-prefill": "the llm projections at M in 128..8192 (about 10.5 min on an H200: "
                   "llm-prefill-a + llm-prefill-b)",
    "llm-prefill-a": "llm-prefill's Qwen3-14B and Llama-3-8B projections",
    "llm-prefill-b": "llm-prefill's Llama-3-70B and DeepSeek-V3 projections",
    "square": "M = N = K from 512 to 16384",
    "ck28": "28 shapes crossed with the 28 AQuant families (CK's parity sweep)",
    "demo": "Qwen3-14B projections at M in {1, 16, 4096} (tileq demo on a GPU)",
    "demo-cpu": "the demo shapes divided by about 40, M in {1, 16, 64} (tileq demo on CPU)",
    "prefill-targets": "the prefill floor shapes: 8192^3 and M = 4096 at five LLM projections",
    "decode-targets": "the decode target shapes: six LLM projections x M in 1..64",
    "gluon-prefill": "the sm_90 Gluon prefill kernel's problem set: 11 LLM weights x M in 128..8192 "
                     "(with --cases gluon --impls gluon,triton --gluon-tilings)",
    "int4": "prepacked int4's weight sets (llm, untuned, fresh, tails: 22 weights, the set first in each "
            "name) x M in 1..4096 (with --cases int4 [--int4-variants]; --shapes '^llm\\.' keeps a set)",
}

# Short names used by scripts/gpu_run.sh.
SUITE_ALIASES = {"decode": "llm-decode", "prefill": "llm-prefill"}


class SuiteError(ShapeError):
    """A suite that cannot be read: unknown name, missing file, or a malformed line."""


@dataclass(frozen=True)
class Shape:
    suite: str
    name: str
    m: int
    n: int
    k: int
    schemes: tuple[Scheme, ...] = ()  # empty: no filter
    cases: tuple[Case, ...] = ()  # empty: the command's cases
    line: int = 0  # where it came from, for messages

    @property
    def label(self) -> str:
        return f"{self.name} M={self.m} N={self.n} K={self.k}"

    def cases_to_run(self, default: tuple[Case, ...]) -> tuple[Case, ...]:
        chosen = self.cases or default
        if self.schemes:
            chosen = tuple(c for c in chosen if c.scheme in self.schemes)
        return chosen


def suite_source(name_or_path: str) -> tuple[str, str, str]:
    """(suite name, where, text) for a built-in name or a path."""
    key = SUITE_ALIASES.get(str(name_or_path), str(name_or_path))
    if key in BUILTIN_SUITES:
        res = resources.files("tileq.bench").joinpath("suites", f"{key}.csv")
        return key, f"<built-in suite {key}: {res}>", res.read_text()
    if os.path.isfile(key):
        with open(key, encoding="utf-8") as f:
            text = f.read()
        return os.path.splitext(os.path.basename(key))[0], key, text
    raise SuiteError(
        expect("suite", f"a built-in suite ({', '.join(BUILTIN_SUITES)}) or a path to a CSV file",
               repr(key) + " (no such file)")
    )


def load_suite(name_or_path: str) -> list[Shape]:
    suite, where, text = suite_source(name_or_path)
    return parse_suite(text, suite=suite, where=where)


def parse_suite(text: str, *, suite: str, where: str) -> list[Shape]:
    """Parse suite CSV text; every problem is reported as ``<where>, line N: ...``."""
    reader = csv.reader(io.StringIO(text))
    header: list[str] | None = None
    shapes: list[Shape] = []
    for row in reader:
        line = reader.line_num

        def fail(msg: str):
            raise SuiteError(f"{where}, line {line}: {msg}")

        if not row or not "".join(row).strip() or row[0].lstrip().startswith("#"):
            continue
        cells = [c.strip() for c in row]
        if header is None:
            header = [c.lower() for c in cells]
            missing = [c for c in REQUIRED if c not in header]
            unknown = [c for c in header if c not in REQUIRED + OPTIONAL]
            if missing or unknown or len(set(header)) != len(header):
                fail(expect("header", f"columns {', '.join(REQUIRED)} (optional: "
                            f"{', '.join(OPTIONAL)}), each once", ",".join(cells)))
            continue
        if len(cells) > len(header):
            fail(expect("row", f"at most {len(header)} cells ({','.join(header)})",
                        f"{len(cells)}: {','.join(cells)}"))
        cells += [""] * (len(header) - len(cells))
        rec = dict(zip(header, cells))
        shapes.extend(_parse_row(rec, suite, line, fail))
    if header is None:
        raise SuiteError(f"{where}: expected a header line '{','.join(REQUIRED)}', got an empty file")
    if not shapes:
        raise SuiteError(f"{where}: expected at least one shape after the header, got none")
    return shapes


def _positive(value: str, col: str, fail) -> int:
    try:
        v = int(value)
    except ValueError:
        fail(expect(col, "a positive integer", repr(value)))
    if v < 1:
        fail(expect(col, "a positive integer", repr(value)))
    return v


def _parse_row(rec: dict, suite: str, line: int, fail) -> list[Shape]:
    name = rec["name"]
    if not name:
        fail(expect("name", "a non-empty label", "''"))
    ms = [_positive(v.strip(), "m", fail) for v in rec["m"].split(";")] if rec["m"] else []
    if not ms:
        fail(expect("m", "a positive integer (or several separated by ';')", "''"))
    n = _positive(rec["n"], "n", fail)
    k = _positive(rec["k"], "k", fail)
    schemes: tuple[Scheme, ...] = ()
    if rec.get("schemes"):
        try:
            schemes = tuple(parse_scheme(s.strip()) for s in rec["schemes"].split(";") if s.strip())
        except ValueError as e:
            fail(str(e))
    cases: tuple[Case, ...] = ()
    if rec.get("cases"):
        try:
            cases = parse_case_list(rec["cases"], sep=";")
        except (ValueError, TypeError) as e:
            fail(str(e))
    return [Shape(suite, name, m, n, k, schemes, cases, line) for m in ms]
