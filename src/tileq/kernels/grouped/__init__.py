"""The grouped GEMM kernel (``kernel.py``), its spec and config (``spec.py``), its launcher (``launch.py``)."""
