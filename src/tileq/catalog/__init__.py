"""Kernel catalog: families and their stable names, per-arch configs, the legality predicate."""
