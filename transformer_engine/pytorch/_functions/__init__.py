"""The autograd Functions shared by the modules (``module/``) and the fusible ops (``ops/``), with the GEMM,
cast and wgrad helpers they share. Nothing here is public; nothing is re-exported."""
