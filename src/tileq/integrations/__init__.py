"""Glue between tileq and model libraries. Imports ``tileq.nn``; no floor below this one imports it
(ARCHITECTURE.md, "Floors").

    from tileq.integrations.hf import fuse_decoder_
    tileq.nn.quantize_(model, tileq.nn.A8W8Config())
    print(fuse_decoder_(model))     # merged q/k/v and gate/up GEMMs, fused add + RMSNorm + quantize

``tileq.integrations.hf`` does not import transformers itself: it works on the modules of a model
that was built with it.
"""

from .hf import FuseSummary, fuse_decoder_, unfuse_decoder_

__all__ = ["fuse_decoder_", "unfuse_decoder_", "FuseSummary"]
