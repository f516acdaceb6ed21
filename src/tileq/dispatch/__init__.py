"""The dispatch layer: every routing decision in one place.

From one problem description it returns one plan: executor, path, kernel instance, config,
split over K or stream-K, and the reason for each choice. The launchers under ``kernels/``
execute a plan and decide nothing; ``tileq explain`` prints the same plan object that runs.

- ``plan``: the one entry point (``make_plan``) and the one plan type (``Plan``) of every call:
  8-bit and pk_int4 GEMMs (``gemm``), calls on prepacked int4 weights (``prepacked``, from the
  rules of ``int4``: decode kernel, Gluon prefill kernel, fp8 GEMM on the values, dequantize +
  cuBLAS) and grouped GEMMs (``grouped``);
- ``heuristic``, ``gluon``, ``tuned``: the portable kernel's default config, the sm_90 Gluon
  kernel's choice and tiles, and the tuned tables (the int4 decode kernel's too);
- ``act_quant``, ``attention``: the activation-quantization and decode-attention launches;
- ``waves``: the one wave / split-K / stream-K cost model;
- ``thresholds``: every fitted number, one table per arch, each with what it decides and the
  results that back it.
"""
