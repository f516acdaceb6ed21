"""CPU runs use Triton's interpreter, which must be chosen before Triton is imported.

On the GPU machine scripts/gpu_run.sh sets TILEQ_TEST_GPU=1 and the kernels compile for real.
Without a GPU, the tests that need one are deselected at collection (reported as "deselected",
not as skips): a skipped GPU test is not a passing one, and the GPU script runs them.

A GPU test is one marked ``gpu`` or skipped with a GPU reason (``_needs_gpu``); every such test
gets the ``gpu`` marker at collection, so ``-m gpu`` on the GPU selects exactly the tests deselected
here. ``perf`` marks the GPU tests that time themselves: scripts/gpu_run.sh runs them alone.
``transformers`` marks the model-layer test files, run on both transformers releases (dev/test).
"""

import os

import pytest

if os.environ.get("TILEQ_TEST_GPU") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.pop("TILEQ_BACKEND", None)  # tests choose backends explicitly

_GPU_WORDS = ("GPU", "CUDA", "sm_90 device")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "transformers: drives transformers' models or internals (the model layer): ./dev/test runs these "
        "a second time with the newest transformers pyproject.toml allows (TILEQ_ENV=latest)")
    config.addinivalue_line(
        "markers", "one_release: a transformers-marked test whose subject does not change with the transformers "
        "release (kernels through the interpreter, quantization math; the same path runs on the reference backend "
        "in tests that do run on both): the newest-release run leaves it out (dev/test)")
    config.addinivalue_line(
        "markers", "perf: a GPU test that times kernels or host calls (scripts/gpu_run.sh tests-perf runs "
        "these with one worker; the parallel GPU steps leave them out)")


def _needs_gpu(item) -> bool:
    """Marked gpu, or a skipif with a GPU reason. The skipif's condition is not read: it is true on a
    CPU and false on the GPU, and the answer must be the same on both."""
    if item.get_closest_marker("gpu") is not None:
        return True
    for mark in item.iter_markers("skipif"):
        reason = str(mark.kwargs.get("reason", ""))
        if mark.args and isinstance(mark.args[0], bool) and any(w in reason for w in _GPU_WORDS):
            return True
    return False


@pytest.hookimpl(tryfirst=True)  # before -m filters: the added gpu markers must count there
def pytest_collection_modifyitems(config, items):
    import torch

    gpu = [item for item in items if _needs_gpu(item)]
    for item in gpu:
        if item.get_closest_marker("gpu") is None:
            item.add_marker(pytest.mark.gpu)
    if torch.cuda.is_available() or not gpu:
        return
    config.hook.pytest_deselected(items=gpu)
    items[:] = [item for item in items if not _needs_gpu(item)]


@pytest.fixture
def tested_triton(monkeypatch):
    """Plans made as on a Triton the Gluon kernels were tested with (on any other, dispatch.gluon's
    version gate alone refuses them: tests/test_gluon.py::test_gate_on_the_installed_triton and
    tests/test_int4p.py::test_prefill_gate_on_the_installed_triton check that). Plans are cached
    without the version: cleared around the pin."""
    from tileq.dispatch import gluon
    from tileq.dispatch.plan import _gemm_cached

    monkeypatch.setattr(gluon, "triton_version", lambda: gluon.GLUON_TRITON_VERSIONS[0])
    _gemm_cached.cache_clear()
    yield
    _gemm_cached.cache_clear()
