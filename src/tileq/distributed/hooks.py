"""tileq.distributed's part of the calls below it: ``quantize_``, ``from_pretrained(tp_plan=...)``
and ``save_pretrained`` on a model sharded by transformers' tp_plan, registered with
``nn/quantize.py`` and ``formats/pretrained.py`` when this package is imported. ``tp`` and ``load``
are imported on a sharded model's first call: they import transformers, which an unsharded model
never needs.
"""

from __future__ import annotations

from ..formats import pretrained
from ..nn import quantize


def _sharded_quantizer(model, calibration):
    """The model's ``TensorParallel`` (None where the mesh shards nothing); GPTQ calibration refused."""
    from .tp import TensorParallel, refuse_calibration

    tp = TensorParallel.of(model)
    if tp is not None and calibration is not None:
        raise refuse_calibration()
    return tp


def _checkpoint_paths() -> pretrained.TensorParallelPaths:
    from . import load, tp

    return pretrained.TensorParallelPaths(
        start=load.start, prepare=load.prepare, load_layer=load.load_sharded_layer, read_dtensor=load.read_dtensor,
        of_model=tp.TensorParallel.of, gather_for_save=tp.gather_for_save, after_save=tp.after_save)


quantize.register_sharded_quantizer(_sharded_quantizer)
pretrained.register_tensor_parallel(_checkpoint_paths)
