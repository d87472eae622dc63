"""The built-in op declarations, one file per op family. Importing this package declares them all.

Conventions shared by every op:
- tensors are PyTorch tensors; "fp8" means ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``;
- ``fp8_max`` is 448 for E4M3 and 57344 for E5M2; casts to FP8 saturate (clip, then cast);
- per-tensor ``scale`` / ``scale_inv`` / ``amax`` are float32 tensors with one element;
  ``amax`` is max|x| over the finite elements (NaN and +-inf never poison it);
- reductions and accumulations are float32 whatever the input dtype;
- ops return new tensors unless they are declared ``inplace``.
"""

from . import activation, attention, attention_fp8, gemm, misc, mxfp8, normalization, nvfp4, optimizer, quantization, rope, softmax

__all__ = ["activation", "attention", "attention_fp8", "gemm", "misc", "mxfp8", "normalization", "nvfp4", "optimizer", "quantization",
           "rope", "softmax"]
