"""CPU runs use Triton's interpreter, which must be chosen before Triton is imported.

On the GPU machine scripts/gpu_run.sh sets TILEQ_TEST_GPU=1 and the kernels compile for real.
Without a GPU, the tests that need one are deselected at collection (reported as "deselected",
not as skips): a skipped GPU test is not a passing one, and the GPU script runs them.
"""

import os

import pytest

if os.environ.get("TILEQ_TEST_GPU") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.pop("TILEQ_BACKEND", None)  # tests choose backends explicitly
os.environ.pop("TILEQ_DETERMINISTIC", None)

_GPU_WORDS = ("GPU", "CUDA", "sm_90 device")


def _needs_gpu(item) -> bool:
    if item.get_closest_marker("gpu") is not None:
        return True
    for mark in item.iter_markers("skipif"):
        reason = str(mark.kwargs.get("reason", ""))
        if mark.args and mark.args[0] is True and any(w in reason for w in _GPU_WORDS):
            return True
    return False


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    gpu = [item for item in items if _needs_gpu(item)]
    if gpu:
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if not _needs_gpu(item)]
