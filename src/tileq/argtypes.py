"""The argument types of the ``tileq`` subcommands' options (``commands.py``, ``bench/cli.py``,
``sass.py``). A refused value ends the command before any work, on one line: "tileq explain:
error: argument --m: expected a positive integer, got 0" (argparse's usage above it), exit status 2.

Only the standard library is imported here: every parser uses these, and ``tileq --help`` imports
no torch.
"""

from __future__ import annotations

import argparse
import math


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def positive_int(text: str) -> int:
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def nonnegative_int(text: str) -> int:
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {value}")
    return value


def positive_float(text: str) -> float:
    value = _number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def nonnegative_float(text: str) -> float:
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative number, got {text}")
    return value


def positive_ints(text: str) -> list[int]:
    """A comma-separated list of positive integers ('1,16,4096')."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def sizes_nk(text: str) -> list[tuple[int, int]]:
    """A comma-separated list of NxK sizes ('5120x5120,17408x5120')."""
    try:
        pairs = [tuple(int(v) for v in p.lower().split("x")) for p in text.split(",") if p.strip()]
    except ValueError:
        pairs = []
    if not pairs or any(len(p) != 2 or min(p) < 1 for p in pairs):
        raise argparse.ArgumentTypeError(f"expected comma-separated NxK sizes of positive integers "
                                         f"(e.g. 5120x5120,17408x5120), got {text!r}")
    return pairs


def names_from(valid, what: str = "names"):
    """The type of a comma-separated list of names out of ``valid`` (``--configs A8W8,W4A16``)."""

    def parse(text: str) -> list[str]:
        names = [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in names if v not in valid]
        if not names or bad:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what} from {', '.join(valid)}, "
                                             f"got {', '.join(bad) if bad else repr(text)}")
        return names

    parse.__name__ = what
    return parse
