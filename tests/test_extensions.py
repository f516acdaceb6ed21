"""The parts of ``quantize_`` and ``from_pretrained`` / ``save_pretrained`` that the floors above
them register (``tileq.extensions``): there whichever tileq module a program imports first, and a
clear refusal where one that a call needs is missing."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
import torch

from tileq import extensions
from tileq.errors import UnsupportedError
from tileq.formats import pretrained
from tileq.nn import A8W8Config, quantize_
from tileq.nn import quantize as nn_quantize


def test_registered_whichever_module_is_imported_first():
    """``from tileq.nn import quantize_`` as a program's first import: Python runs tileq/__init__.py
    first, which schedules the imports; quantize_'s first call runs them. An unsharded model
    imports neither transformers nor the tensor-parallel code."""
    code = (
        "import sys, torch\n"
        "from tileq.nn import A8W8Config, quantize_\n"
        "from tileq.nn import quantize as q\n"
        "quantize_(torch.nn.Sequential(torch.nn.Linear(128, 128)), A8W8Config())\n"
        "hf_moe, p = sys.modules['tileq.integrations.hf_moe'], sys.modules['tileq.formats.pretrained']\n"
        "print([k.convert is hf_moe.quantize_experts_ for k in q._module_kinds], q._sharded_quantizer is not None,\n"
        "      p._tensor_parallel is not None,\n"
        "      [m for m in ('transformers', 'tileq.distributed.tp') if m in sys.modules])\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[True] True True []", proc.stdout


class _Sharded(torch.nn.Sequential):
    _device_mesh = object()  # what transformers sets on a model it shards by a tp_plan


def test_a_sharded_model_without_the_distributed_hooks_is_refused(monkeypatch):
    extensions.load()  # the real hooks first, so that they do not replace the empty registry below
    monkeypatch.setattr(nn_quantize, "_sharded_quantizer", None)
    model = _Sharded(torch.nn.Linear(128, 128))
    with pytest.raises(UnsupportedError, match=r"sharded by transformers' tp_plan needs tileq.distributed"):
        quantize_(model, A8W8Config())
    assert isinstance(model[0], torch.nn.Linear)  # refused before any layer was converted


def test_tp_plan_without_the_distributed_hooks_is_refused(monkeypatch, tmp_path):
    extensions.load()
    monkeypatch.setattr(pretrained, "_tensor_parallel", None)
    qc = {"quant_method": "tileq", "format_version": pretrained.tqf.FORMAT_VERSION, "layers": {}}
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": qc}))
    with pytest.raises(UnsupportedError, match=r"from_pretrained\(tp_plan=\.\.\.\) needs tileq.distributed"):
        pretrained.from_pretrained(tmp_path, tp_plan="auto")


def test_a_module_that_cannot_be_imported_is_logged_and_skipped(monkeypatch, caplog):
    ran = []

    def missing():
        raise ImportError("No module named 'torch.distributed.tensor'")

    monkeypatch.setattr(extensions, "_pending", [("tileq.distributed", missing), ("other", lambda: ran.append(1))])
    with caplog.at_level(logging.WARNING, logger="tileq"):
        extensions.load()
    assert ran == [1] and extensions._pending == []
    assert "tileq.distributed could not be imported (ImportError: No module named" in caplog.text
