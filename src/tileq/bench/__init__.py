"""The benchmark harness behind ``tileq bench`` and ``tileq demo``.

    suites     shape lists as CSV data files (built-in: smoke, llm, llm-decode, llm-prefill,
               square, ck28, gluon-prefill, ...; or a user's path)
    cases      what is measured per shape: (scheme, A dtype, B dtype, layout, A-scale storage),
               and the seeded operands each case is built from
    baselines  ONE registry of implementations (tileq, torch baselines, optional peers), each
               applicable or N/A with a reason
    variants   tileq forced onto one kernel (``--impls gluon,triton``) or one Gluon tiling
               (``--gluon-tilings``): rows that check a dispatch decision against the data
    gate       the correctness gate every implementation passes before it is timed
    timing     CUDA-event timing with L2 flushing and a host-lead sleep, optional CUDA graphs;
               environment and measured ceilings (copy bandwidth, bf16/fp8/int8 peaks)
    precompile tileq's kernels compiled in parallel processes before anything is timed
    harness    the sweep (shape by shape, implementations interleaved), with a progress bar
    results    the CSV row, writing / reading, ``--compare``
    report     the markdown report;  plots: the PNG plots (matplotlib, optional)
    outputs    the output folder and the console table;  device: CUDA or the CPU interpreter
    cli        ``tileq bench``  (``tileq demo`` lives in ``tileq/demo.py`` and uses this package)
    replay     ``tileq replay``: a dispatch rule replayed on a results.csv of timed variants
               (``--rule gluon-tiles``), with ``--threshold NAME=VALUE`` overrides

Nothing here imports Triton at import time: the CLI decides first whether Triton's interpreter
must be switched on (no CUDA), which has to happen before ``tileq.kernels`` is imported.
"""

import importlib

__all__ = ["BUILTIN_SUITES", "GateResult", "Shape", "SuiteError", "gate", "load_suite"]
_HOME = {"GateResult": "gate", "gate": "gate", "BUILTIN_SUITES": "suites", "Shape": "suites",
         "SuiteError": "suites", "load_suite": "suites"}


def __getattr__(name: str):
    # Imported on first use (PEP 562): the CLI's parsers live in this package and ``--help`` must
    # not import torch (gate does). (``gate`` is also a submodule's name: imported by path.)
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    globals()[name] = value
    return value
