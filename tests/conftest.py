"""CPU runs use Triton's interpreter, which must be chosen before Triton is imported.

On the GPU machine scripts/gpu_run.sh sets TILEQ_TEST_GPU=1 and the kernels compile for real.
"""

import os

if os.environ.get("TILEQ_TEST_GPU") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.pop("TILEQ_BACKEND", None)  # tests choose backends explicitly
os.environ.pop("TILEQ_DETERMINISTIC", None)
