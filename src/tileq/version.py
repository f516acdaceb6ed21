"""The package version and the tested versions of what it runs on (one place: the facade, the
``tileq --version`` line, checkpoints, the bench record and ``integrations/compat.py`` read it;
pyproject.toml's bounds say the same, checked by tests/test_cli.py)."""

from __future__ import annotations

__version__ = "0.1.0"

# (oldest, newest) release tested, as "major.minor". torch / Triton: the GPU runs (torch 2.11,
# Triton 3.6), CI (torch 2.13 CPU) and a CPU suite run on torch 2.14 / Triton 3.8; the Gluon kernels
# run on Triton 3.6 only. transformers: CI runs the model-layer tests on both ends.
TESTED = {
    "torch": ("2.11", "2.14"),
    "triton": ("3.6", "3.8"),
    "transformers": ("5.17", "5.25"),
}


def _minor(version: str) -> tuple[int, ...]:
    parts = []
    for p in version.split(".")[:2]:
        digits = "".join(c for c in p if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def in_tested_range(package: str, version: str) -> bool:
    oldest, newest = TESTED[package]
    return _minor(oldest) <= _minor(version) <= _minor(newest)


def report() -> str:
    """``tileq --version``: tileq's version, then each dependency's installed version against its
    tested range (read from the installed packages' metadata: nothing is imported)."""
    from importlib import metadata

    lines = [f"tileq {__version__}"]
    for package, (oldest, newest) in TESTED.items():
        try:
            version = metadata.version(package)
        except metadata.PackageNotFoundError:
            lines.append(f"  {package}: not installed (tested {oldest} - {newest})")
            continue
        verdict = "tested" if in_tested_range(package, version) else "NOT in the tested range"
        lines.append(f"  {package} {version}: {verdict} ({oldest} - {newest})")
    return "\n".join(lines)
