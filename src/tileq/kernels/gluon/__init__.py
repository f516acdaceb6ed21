"""sm_90 kernels written in Gluon (Triton 3.6's ``triton.experimental.gluon``): warp-specialized,
TMA-fed, persistent. ``config`` imports no Triton; ``ws_gemm`` holds the kernel and ``launch`` its
launcher and AOT compile. Chosen per plan by ``kernels/select.py`` (opt-in: TILEQ_GLUON=1)."""
