"""A GPU test run's summary from its pytest JUnit XML files (scripts/gpu_run.sh writes them).

    python3 scripts/gpu_test_summary.py JUNIT.xml [JUNIT.xml ...] --out DIR
    python3 scripts/gpu_test_summary.py JUNIT.xml [JUNIT.xml ...] --results bench/results
    python3 scripts/gpu_test_summary.py --stamp JUNIT.xml --part NAME
    python3 scripts/gpu_test_summary.py --print-env

The summary is DIR/summary.md (date, GPU, torch / Triton / transformers versions, commit; passed,
failed, skipped and errors per test file; every failure and error with the first line of its
message; every skip with its reason) and DIR/tests.csv (every test id: outcome, seconds, part,
message). ``--results ROOT`` writes them to ROOT/<gpu>/gpu-tests-<date>/, the place of a committed
summary: bench/results/<gpu>/gpu-tests-<date>/ for a run on that date (UTC), over every
part's XML of the run.

``--stamp`` runs on the GPU machine right after pytest: it writes the machine's facts (GPU, versions,
commit, date) and the part's name into the XML's testsuite properties, so that a summary made
later on another machine names them. The commit is TILEQ_COMMIT (gpu_run.sh sets it from the
caller or from git), else GIT_COMMIT, else a file GIT_COMMIT at the tree's root, else
``git rev-parse HEAD``: the GPU's copy of the tree has no .git. A part whose XML is missing (pytest
killed before it wrote one) gets one holding a single error, so that the summary shows the hole.

Standard library only: it runs on the GPU machine's python3 as well as on a CPU.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import importlib.metadata
import os
import platform
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV_KEYS = ("date", "gpu", "torch", "triton", "transformers", "python", "commit")
OUTCOMES = ("passed", "failed", "error", "skipped")
MESSAGE_CHARS = 300


# ---------------------------------------------------------------------------------- environment


def _gpu_name() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    names = [line.strip() for line in out.splitlines() if line.strip()]
    return names[0] if names else "unknown"


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _commit() -> str:
    for var in ("TILEQ_COMMIT", "GIT_COMMIT"):
        if os.environ.get(var, "").strip():
            return os.environ[var].strip()
    marker = ROOT / "GIT_COMMIT"
    if marker.is_file() and marker.read_text().strip():
        return marker.read_text().strip()
    try:
        proc = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return proc.stdout.strip() if proc.returncode == 0 and proc.stdout.strip() else "unknown"


def probe_environment() -> dict[str, str]:
    """This machine's facts, without importing torch (metadata and nvidia-smi only)."""
    return {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "gpu": _gpu_name(),
        "torch": _version("torch"),
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "python": platform.python_version(),
        "commit": _commit(),
    }


# ---------------------------------------------------------------------------------- stamping


def _missing_xml(part: str) -> ET.ElementTree:
    """A stand-in for a part whose pytest wrote no XML: one error, so the summary shows the hole."""
    root = ET.Element("testsuites")
    suite = ET.SubElement(root, "testsuite", name="pytest", errors="1", failures="0", skipped="0", tests="1",
                          time="0")
    case = ET.SubElement(suite, "testcase", classname="", name=f"{part} (no JUnit XML)", time="0")
    ET.SubElement(case, "error", message="pytest wrote no JUnit XML for this part (killed, or it never started)")
    return ET.ElementTree(root)


def stamp(path: Path, part: str, env: dict[str, str], status: int | None = None) -> None:
    """Write ``env``, ``part`` and pytest's exit ``status`` into every testsuite's properties of the
    XML at ``path``."""
    if path.is_file():
        tree = ET.parse(path)
    else:
        tree = _missing_xml(part)
    root = tree.getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    for suite in suites:
        props = suite.find("properties")
        if props is None:
            props = ET.Element("properties")
            suite.insert(0, props)
        extra = {"part": part} if status is None else {"part": part, "status": str(status)}
        for key, value in {**env, **extra}.items():
            for old in [p for p in props.findall("property") if p.get("name") == key]:
                props.remove(old)
            ET.SubElement(props, "property", name=key, value=value)
    path.parent.mkdir(parents=True, exist_ok=True)
    tree.write(path, encoding="utf-8", xml_declaration=True)


# ---------------------------------------------------------------------------------- reading


@dataclass
class Case:
    test_id: str
    file: str
    outcome: str  # one of OUTCOMES
    seconds: float
    message: str  # the first line of the failure / error message or the skip reason
    part: str


@dataclass
class Suite:
    source: str  # the XML file's name
    part: str
    status: str  # pytest's exit status where stamped, else ""
    env: dict[str, str]
    tests: int
    seconds: float


def first_line(text: str | None) -> str:
    for line in (text or "").splitlines():
        if line.strip():
            line = line.strip()
            return line if len(line) <= MESSAGE_CHARS else line[: MESSAGE_CHARS - 3] + "..."
    return ""


def _test_id(case: ET.Element) -> tuple[str, str]:
    """(node id, file) of a testcase: pytest's classname is the dotted path of the file and the
    classes; junit_family xunit1 adds the file itself."""
    classname, name = case.get("classname", ""), case.get("name", "")
    if not classname and not name:  # a test a worker was running when the run was interrupted
        return "(interrupted)", "(interrupted)"
    file = case.get("file")
    segs = [s for s in classname.split(".") if s]
    if file:
        module = [s for s in re.sub(r"\.py$", "", file).split("/") if s]
        classes = segs[len(module):] if segs[: len(module)] == module else []
    else:
        # xunit2: the module's segments end where the classes (capitalized) begin
        n = next((i for i, s in enumerate(segs) if s[:1].isupper()), len(segs))
        module, classes = segs[:n], segs[n:]
        file = "/".join(module) + ".py" if module else ""
    if not classname:  # a collection error (name: the file's dotted path) or a missing part's stand-in
        if not file:
            file = name.replace(".", "/") + ".py" if re.fullmatch(r"[\w.]+", name) else name
        return file, file
    return "::".join([file, *classes, name]), file


def _outcome(case: ET.Element) -> tuple[str, str]:
    if not case.get("classname") and not case.get("name"):
        return "error", "a test running when the run was interrupted (pytest names none)"
    tags = {child.tag: child for child in case}
    for tag, outcome in (("error", "error"), ("failure", "failed"), ("skipped", "skipped")):
        if tag in tags:
            el = tags[tag]
            message = first_line(el.get("message")) or first_line(el.text)
            if tag == "skipped" and el.get("type") == "pytest.xfail":
                message = "xfail: " + message
            return outcome, message
    return "passed", ""


def read_junit(path: Path) -> tuple[list[Suite], list[Case]]:
    root = ET.parse(path).getroot()
    suites_el = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    suites, cases = [], []
    for suite in suites_el:
        props = {p.get("name", ""): p.get("value", "") for p in suite.findall("properties/property")}
        env = {k: props[k] for k in ENV_KEYS if props.get(k)}
        if suite.get("timestamp"):  # the run's start (the stamp's date is its end)
            env["date"] = suite.get("timestamp", "")
        part = props.get("part") or path.stem.removeprefix("junit-")
        found = suite.findall("testcase")
        suites.append(Suite(path.name, part, props.get("status", ""), env, len(found), float(suite.get("time") or 0)))
        for case in found:
            test_id, file = _test_id(case)
            outcome, message = _outcome(case)
            cases.append(Case(test_id, file, outcome, float(case.get("time") or 0), message, part))
    return suites, cases


# ---------------------------------------------------------------------------------- writing


def gpu_short_name(gpu: str) -> str:
    """The results folder's name of a GPU: 'NVIDIA H100 80GB HBM3' -> 'h100'."""
    m = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Za-z]?)\b", gpu)
    if m:
        return m.group(1).lower()
    return re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-") or "unknown"


def _values(suites: list[Suite], key: str) -> str:
    """One value of ``key`` over the runs, or each run's where they differ."""
    seen = {s.env.get(key, "unknown") for s in suites}
    if len(seen) == 1:
        return seen.pop()
    return ", ".join(f"{s.env.get(key, 'unknown')} ({s.part})" for s in suites)


def _when(stamp: str) -> dt.datetime | None:
    """A testsuite's timestamp (pytest: ISO, local or with an offset) or a stamped date, in UTC."""
    try:
        t = dt.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError:
        return None
    return (t if t.tzinfo else t.astimezone()).astimezone(dt.timezone.utc)


def run_date(suites: list[Suite]) -> str:
    times = sorted(t for t in (_when(s.env.get("date", "")) for s in suites) if t)
    return (times[0] if times else dt.datetime.now(dt.timezone.utc)).strftime("%Y-%m-%d")


# pytest's exit statuses other than 0 (all passed) and 1 (some failed), and timeout's
STATUS = {"2": "interrupted", "3": "pytest internal error", "4": "pytest usage error", "5": "no tests collected",
          "124": "stopped at its timeout", "137": "killed"}


def _part(s: Suite) -> str:
    text = f"{s.part} ({s.source}: {s.tests} tests, {s.seconds:.0f} s"
    if s.status not in ("", "0", "1"):
        text += f", status {s.status}: {STATUS.get(s.status, 'abnormal exit')}"
    return text + ")"


def _md(text: str) -> str:
    return text.replace("|", "\\|")


def summary_markdown(suites: list[Suite], cases: list[Case]) -> str:
    total = Counter(c.outcome for c in cases)
    head = (f"# GPU tests {run_date(suites)}: {len(cases)} tests, {total['passed']} passed, {total['failed']} failed, "
            f"{total['skipped']} skipped, {total['error']} errors")
    times = sorted(t for t in (_when(s.env.get("date", "")) for s in suites) if t)
    when = " .. ".join(sorted({t.strftime("%Y-%m-%d %H:%M") for t in (times[:1] + times[-1:])})) + " UTC"
    cut = [s for s in suites if s.status not in ("", "0", "1")]
    if cut:
        head += "\n\nNot a complete run: " + ", ".join(
            f"{s.part} ({STATUS.get(s.status, 'abnormal exit')}, status {s.status})" for s in cut) + "."
    lines = [head, "", "| | |", "|---|---|", f"| date | {when if times else 'unknown'} |",
             f"| GPU | {_md(_values(suites, 'gpu'))} |", f"| torch | {_values(suites, 'torch')} |",
             f"| Triton | {_values(suites, 'triton')} |", f"| transformers | {_values(suites, 'transformers')} |",
             f"| python | {_values(suites, 'python')} |", f"| commit | {_values(suites, 'commit')} |",
             "| parts | " + ", ".join(_part(s) for s in suites) + " |",
             "", "| file | tests | passed | failed | skipped | errors | seconds |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    per_file: dict[str, Counter] = defaultdict(Counter)
    seconds: dict[str, float] = defaultdict(float)
    for c in cases:
        per_file[c.file][c.outcome] += 1
        seconds[c.file] += c.seconds
    for file in sorted(per_file):
        n = per_file[file]
        lines.append(f"| {file} | {sum(n.values())} | {n['passed']} | {n['failed']} | {n['skipped']} | "
                     f"{n['error']} | {seconds[file]:.0f} |")
    lines.append(f"| **total** | {len(cases)} | {total['passed']} | {total['failed']} | {total['skipped']} | "
                 f"{total['error']} | {sum(seconds.values()):.0f} |")
    bad = sorted((c for c in cases if c.outcome in ("failed", "error")), key=lambda c: c.test_id)
    lines += ["", f"## Failures and errors ({len(bad)})", ""]
    lines += [f"- `{c.test_id}` ({c.outcome}, {c.part}): {c.message or '(no message)'}" for c in bad] or ["None."]
    skips = sorted((c for c in cases if c.outcome == "skipped"), key=lambda c: c.test_id)
    lines += ["", f"## Skips ({len(skips)})", ""]
    lines += [f"- `{c.test_id}`: {c.message or '(no reason)'}" for c in skips] or ["None."]
    dup = [t for t, n in Counter(c.test_id for c in cases).items() if n > 1 and t != "(interrupted)"]
    if dup:
        lines += ["", f"{len(dup)} test ids ran more than once (each run counted): "
                  + ", ".join(f"`{t}`" for t in sorted(dup)[:10]) + (" ..." if len(dup) > 10 else "")]
    return "\n".join(lines) + "\n"


def write_summary(xml_paths: list[Path], out: Path | None, results: Path | None) -> Path:
    suites, cases = [], []
    for path in xml_paths:
        s, c = read_junit(path)
        suites += s
        cases += c
    if out is None:
        gpus = sorted({gpu_short_name(s.env.get("gpu", "unknown")) for s in suites})
        out = results / "+".join(gpus or ["unknown"]) / f"gpu-tests-{run_date(suites)}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.md").write_text(summary_markdown(suites, cases))
    with open(out / "tests.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["test_id", "outcome", "seconds", "part", "message"])
        for c in sorted(cases, key=lambda c: (c.test_id, c.part)):
            w.writerow([c.test_id, c.outcome, f"{c.seconds:.3f}", c.part, c.message])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("xml", nargs="*", type=Path, help="JUnit XML files (pytest --junitxml)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--out", type=Path, help="write summary.md and tests.csv here")
    where.add_argument("--results", type=Path, help="write them to RESULTS/<gpu>/gpu-tests-<date>/")
    p.add_argument("--stamp", type=Path, help="write this machine's facts and --part into this XML")
    p.add_argument("--part", help="the part's name (with --stamp)")
    p.add_argument("--status", type=int, help="pytest's exit status (with --stamp)")
    p.add_argument("--print-env", action="store_true", help="print this machine's facts as 'key: value' lines")
    args = p.parse_args(argv)
    if args.print_env:
        for key, value in probe_environment().items():
            print(f"{key}: {value}")
        return 0
    if args.stamp:
        stamp(args.stamp, args.part or args.stamp.stem.removeprefix("junit-"), probe_environment(), args.status)
        return 0
    if not args.xml or (args.out is None and args.results is None):
        p.error("expected JUnit XML files and --out or --results")
    missing = [str(x) for x in args.xml if not x.is_file()]
    if missing:
        p.error("no such file: " + ", ".join(missing))
    out = write_summary(args.xml, args.out, args.results)
    text = (out / "summary.md").read_text().splitlines()
    print("\n".join(text[:40]) + ("\n..." if len(text) > 40 else ""))
    print(f"written: {out / 'summary.md'}, {out / 'tests.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
