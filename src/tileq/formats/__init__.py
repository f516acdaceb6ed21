"""Quantized checkpoints: compressed-tensors (int-, float-, naive- and pack-quantized),
DeepSeek-style fp8 blocks and tileq's own format, read into and written from ``tileq.nn`` models.

    model = tileq.formats.from_pretrained("path/to/llm-compressor-output", device="cuda")
    tileq.formats.save_pretrained(model, "out/")   # compressed-tensors where it has an equivalent

This package imports ``tileq.nn``, ``tileq.quant``, ``tileq.dtypes`` and ``tileq.errors``, never
the reverse; transformers is imported only inside ``from_pretrained``; the ``compressed_tensors``
package is not needed (its config is parsed here).
"""

from .pretrained import from_pretrained, save_pretrained
from .safetensors_io import CheckpointError, CheckpointReader

__all__ = ["from_pretrained", "save_pretrained", "CheckpointError", "CheckpointReader"]
