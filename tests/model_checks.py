"""Checks shared by the tests that compare two tileq models (tests import it as a plain module,
like formats_artefacts.py)."""

from __future__ import annotations

import torch


def ids():
    """The token batch the comparisons run (2 x 5 tokens of a 256-token vocabulary)."""
    return torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(1))


def bits(t):
    """A 1-byte float tensor as its bytes (torch.equal on fp8 compares values, and NaN != NaN)."""
    return t.view(torch.uint8) if t.dtype.itemsize == 1 and t.dtype != torch.uint8 else t


def assert_same_model(a, b):
    """The same state dict, tensor for tensor and bit for bit, and the same logits."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys(), set(sa) ^ set(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(bits(sa[k]), bits(sb[k])), k
    with torch.no_grad():
        assert torch.equal(a(ids()).logits, b(ids()).logits)
