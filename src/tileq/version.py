"""The package version (one place: the facade, checkpoints and the bench record read it)."""

__version__ = "0.1.0"
