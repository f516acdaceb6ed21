"""scripts/gpu_test_summary.py on a small JUnit XML written here in pytest's form (junit_family
xunit1, as scripts/gpu_run.sh writes it, and xunit2), run as the GPU machine runs it: a separate
python3 with the standard library alone (-S: no site-packages)."""

import csv
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_test_summary.py"

# Two parts of one run. Part 1: a pass, a parametrized pass whose id holds '.' and '|', a class's
# test, a failure (two-line message), a setup error, a skip, an xfail, a collection error. Part 2
# (xunit2: no file attribute): a pass and a skip in another file.
PART1 = """<?xml version="1.0" encoding="utf-8"?>
<testsuites name="pytest tests"><testsuite name="pytest" errors="2" failures="1" skipped="2" tests="8" time="61.5"
 timestamp="2026-12-08T09:15:02.5+00:00" hostname="gpu">
<properties><property name="gpu" value="NVIDIA H100 80GB HBM3"/><property name="torch" value="2.11.0+cu130"/>
<property name="triton" value="3.6.0"/><property name="transformers" value="5.17.0"/>
<property name="python" value="3.12.3"/><property name="commit" value="0123abcd"/>
<property name="part" value="tests-gpu-1"/></properties>
<testcase classname="" name="tests.test_broken" file="tests/test_broken.py" time="0.000">
<error message="collection failure">ImportError while importing test module</error></testcase>
<testcase classname="tests.test_a" name="test_pass" file="tests/test_a.py" line="1" time="1.250"/>
<testcase classname="tests.test_a" name="test_param[a.b-c|d]" file="tests/test_a.py" line="5" time="0.500"/>
<testcase classname="tests.test_a.TestGroup" name="test_in_class" file="tests/test_a.py" line="9" time="0.250"/>
<testcase classname="tests.test_a" name="test_fail" file="tests/test_a.py" line="12" time="2.000">
<failure message="AssertionError: outputs differ&#10;  max diff 3.5">traceback</failure></testcase>
<testcase classname="tests.test_a" name="test_error" file="tests/test_a.py" line="15" time="0.010">
<error message="failed on setup with &quot;RuntimeError: CUDA error: out of memory&quot;">tb</error></testcase>
<testcase classname="tests.test_a" name="test_skip" file="tests/test_a.py" line="18" time="0.001">
<skipped type="pytest.skip" message="needs an sm_90 GPU">tests/test_a.py:18: needs an sm_90 GPU</skipped></testcase>
<testcase classname="tests.test_a" name="test_xfail" file="tests/test_a.py" line="21" time="0.001">
<skipped type="pytest.xfail" message="known bug"/></testcase>
</testsuite></testsuites>
"""
PART2 = """<?xml version="1.0" encoding="utf-8"?>
<testsuites name="pytest tests"><testsuite name="pytest" errors="0" failures="0" skipped="1" tests="2" time="3.0"
 timestamp="2026-12-08T10:40:00+00:00" hostname="gpu">
<properties><property name="gpu" value="NVIDIA H100 80GB HBM3"/><property name="torch" value="2.11.0+cu130"/>
<property name="triton" value="3.6.0"/><property name="transformers" value="5.17.0"/>
<property name="python" value="3.12.3"/><property name="commit" value="0123abcd"/>
<property name="part" value="tests-perf"/></properties>
<testcase classname="tests.sub.test_b" name="test_timed[x]" time="2.500"/>
<testcase classname="tests.sub.test_b.TestT" name="test_skipped" time="0.000">
<skipped type="pytest.skip" message="compressed-tensors is not installed">x</skipped></testcase>
</testsuite></testsuites>
"""


def run(*args, env=None):
    proc = subprocess.run([sys.executable, "-I", "-S", str(SCRIPT), *map(str, args)], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def write_parts(tmp_path):
    (tmp_path / "junit-tests-gpu-1.xml").write_text(PART1)
    (tmp_path / "junit-tests-perf.xml").write_text(PART2)
    return [tmp_path / "junit-tests-gpu-1.xml", tmp_path / "junit-tests-perf.xml"]


def test_summary_counts_failures_and_skips(tmp_path):
    out = tmp_path / "sum"
    printed = run(*write_parts(tmp_path), "--out", out)
    md = (out / "summary.md").read_text()
    assert md.splitlines()[0] == "# GPU tests 2026-12-08: 10 tests, 4 passed, 1 failed, 3 skipped, 2 errors"
    assert md.splitlines()[0] in printed
    for row in ("| date | 2026-12-08 09:15 .. 2026-12-08 10:40 UTC |", "| GPU | NVIDIA H100 80GB HBM3 |",
                "| torch | 2.11.0+cu130 |", "| Triton | 3.6.0 |", "| transformers | 5.17.0 |",
                "| python | 3.12.3 |", "| commit | 0123abcd |",
                "| tests/test_a.py | 7 | 3 | 1 | 2 | 1 | 4 |",
                "| tests/test_broken.py | 1 | 0 | 0 | 0 | 1 | 0 |",
                "| tests/sub/test_b.py | 2 | 1 | 0 | 1 | 0 | 2 |",
                "| **total** | 10 | 4 | 1 | 3 | 2 | 7 |",
                "## Failures and errors (3)",
                "- `tests/test_a.py::test_fail` (failed, tests-gpu-1): AssertionError: outputs differ",
                '- `tests/test_a.py::test_error` (error, tests-gpu-1): failed on setup with "RuntimeError: CUDA '
                'error: out of memory"',
                "- `tests/test_broken.py` (error, tests-gpu-1): collection failure",
                "## Skips (3)",
                "- `tests/test_a.py::test_skip`: needs an sm_90 GPU",
                "- `tests/test_a.py::test_xfail`: xfail: known bug",
                "- `tests/sub/test_b.py::TestT::test_skipped`: compressed-tensors is not installed"):
        assert row in md.splitlines(), row
    assert "max diff" not in md  # the first line of a message only
    with open(out / "tests.csv", newline="") as f:
        rows = {r["test_id"]: r for r in csv.DictReader(f)}
    assert len(rows) == 10
    assert rows["tests/test_a.py::test_param[a.b-c|d]"]["outcome"] == "passed"
    assert rows["tests/test_a.py::TestGroup::test_in_class"] == {
        "test_id": "tests/test_a.py::TestGroup::test_in_class", "outcome": "passed", "seconds": "0.250",
        "part": "tests-gpu-1", "message": ""}
    assert rows["tests/sub/test_b.py::test_timed[x]"]["part"] == "tests-perf"
    assert rows["tests/test_a.py::test_error"]["outcome"] == "error"
    assert rows["tests/test_a.py::test_xfail"]["message"] == "xfail: known bug"


def test_results_folder_is_named_by_gpu_and_date(tmp_path):
    run(*write_parts(tmp_path), "--results", tmp_path / "results")
    made = sorted(p.relative_to(tmp_path).as_posix() for p in (tmp_path / "results").rglob("*") if p.is_file())
    assert made == ["results/h100/gpu-tests-2026-12-08/summary.md", "results/h100/gpu-tests-2026-12-08/tests.csv"]


def test_stamp_records_the_commit_part_and_status_and_fills_a_missing_part(tmp_path):
    """A part stopped at its timeout (status 124; pytest leaves the tests its workers were running
    nameless) and a part that wrote no XML both show as holes, never as passes."""
    xml = tmp_path / "junit-tests-gpu-2.xml"
    xml.write_text(PART1.replace('<property name="commit" value="0123abcd"/>', "")
                   .replace('<property name="part" value="tests-gpu-1"/>', "")
                   .replace("</testsuite>", '<testcase time="0.000" /></testsuite>'))
    env = {k: v for k, v in os.environ.items() if k not in ("TILEQ_COMMIT", "GIT_COMMIT")}
    run("--stamp", xml, "--part", "tests-gpu-2", "--status", 124, env={**env, "TILEQ_COMMIT": "feedbeef"})
    props = {p.get("name"): p.get("value") for p in ET.parse(xml).getroot().iter("property")}
    assert props["commit"] == "feedbeef" and props["part"] == "tests-gpu-2" and props["status"] == "124"
    assert props["python"] and props["gpu"] and props["torch"]  # this machine's, whatever they are
    missing = tmp_path / "junit-tests-gpu-3.xml"
    run("--stamp", missing, "--part", "tests-gpu-3", env={**env, "TILEQ_COMMIT": "feedbeef"})
    run(xml, missing, "--out", tmp_path / "sum")
    md = (tmp_path / "sum" / "summary.md").read_text()
    assert "| commit | feedbeef |" in md
    # (the stand-in's date is its stamp's: today's)
    assert md.splitlines()[0].endswith(": 10 tests, 3 passed, 1 failed, 2 skipped, 4 errors")
    assert "Not a complete run: tests-gpu-2 (stopped at its timeout, status 124)." in md
    assert "- `(interrupted)` (error, tests-gpu-2): a test running when the run was interrupted" in md
    assert ("- `tests-gpu-3 (no JUnit XML)` (error, tests-gpu-3): pytest wrote no JUnit XML for this part "
            "(killed, or it never started)") in md


def test_print_env_names_every_fact():
    env = {k: v for k, v in os.environ.items() if k != "GIT_COMMIT"}
    lines = run("--print-env", env={**env, "TILEQ_COMMIT": "feedbeef"}).splitlines()
    assert [line.split(":")[0] for line in lines] == ["date", "gpu", "torch", "triton", "transformers", "python",
                                                       "commit"]
    assert lines[-1] == "commit: feedbeef"
