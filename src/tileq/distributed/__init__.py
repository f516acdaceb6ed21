"""Tensor parallelism for tileq-quantized models, riding transformers' ``tp_plan``.

``shard``: which slice of a quantized layer (weight, scales, bias) a rank holds and how slices
join; ``tp``: ``quantize_`` on a sharded model, the forward transforms, gathering for
``save_pretrained``; ``load``: a rank's slice of a quantized checkpoint; ``hooks``: those paths
registered with ``quantize_`` and ``from_pretrained`` / ``save_pretrained``, which sit below this
package. docs/tensor-parallel.md.
"""

from . import hooks  # noqa: F401 - registers the sharded-model paths with the floors below
from .shard import STYLES, ShardSpec, shard_quant_linear, unshard_quant_linear

__all__ = ["STYLES", "ShardSpec", "shard_quant_linear", "unshard_quant_linear"]
