"""Triton kernels. Importing this package imports Triton but queries no device."""
