"""sm_90 kernels written in Gluon (Triton 3.6's ``triton.experimental.gluon``): warp-specialized,
TMA-fed, persistent. ``config`` imports no Triton; ``ws_gemm`` holds the kernel and ``launch`` its
launcher and AOT compile. Chosen per plan by ``kernels/select.py`` (on by default for the
problems it was measured faster on; TILEQ_GLUON=0 / 1 switches it off / on for all it serves)."""
