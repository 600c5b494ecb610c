"""GPU kernels for ABFT, each beside its pure-jnp reference.

- :mod:`~sdcguard.protection.pallas.matmul`: :func:`checked_matmul` and
  :func:`checked_contraction`, the GEMM checked tile by tile inside one Hopper kernel
  (:mod:`~sdcguard.protection.pallas.mgpu_matmul`, Pallas on Mosaic GPU), with the exact
  recomputation of located elements and the counters after it
  (:mod:`~sdcguard.protection.pallas.verify`).
- :mod:`sdcguard.protection.pallas.flash`: :func:`flash_attention` with checksums verified
  inside the fused forward and backward kernels.

On a backend without a GPU every kernel runs in interpret mode (``interpret=None`` picks it):
slow, for testing. :func:`interpret_mode` overrides that choice for the code traced inside it
(e.g. ``interpret_mode(False)`` to lower for CUDA from a machine without a GPU).
"""

from sdcguard.protection.pallas._common import interpret_mode, resolve_interpret
from sdcguard.protection.pallas.flash import attention_reference, flash_attention
from sdcguard.protection.pallas.matmul import (
    BlockSizes,
    checked_contraction,
    checked_matmul,
    checked_matmul_reference,
)

__all__ = [
    "BlockSizes",
    "attention_reference",
    "checked_contraction",
    "checked_matmul",
    "checked_matmul_reference",
    "flash_attention",
    "interpret_mode",
    "resolve_interpret",
]
