"""GPU kernels for ABFT (Pallas, lowered through Triton), each beside its pure-jnp reference.

- :mod:`~sdcguard.protection.pallas.verify`: :func:`verify_and_correct` checks a GEMM computed
  elsewhere.
- :mod:`~sdcguard.protection.pallas.matmul`: :func:`checked_matmul` computes, encodes, verifies and
  corrects
  in one tiled pass.
- :mod:`sdcguard.protection.pallas.flash`: :func:`flash_attention` with checksums verified
  inside the fused forward and backward kernels.

On a backend without a GPU every kernel runs in interpret mode (``interpret=None`` picks it):
slow, for testing. :func:`interpret_mode` overrides that choice for the code traced inside it
(e.g. ``interpret_mode(False)`` to lower for CUDA from a machine without a GPU).
"""

from sdcguard.protection.pallas._common import interpret_mode
from sdcguard.protection.pallas.flash import attention_reference, flash_attention
from sdcguard.protection.pallas.matmul import (
    checked_contraction,
    checked_matmul,
    checked_matmul_reference,
)
from sdcguard.protection.pallas.verify import (
    check_contraction,
    encode,
    verify_and_correct,
    verify_and_correct_reference,
)

__all__ = [
    "attention_reference",
    "check_contraction",
    "checked_contraction",
    "checked_matmul",
    "checked_matmul_reference",
    "encode",
    "flash_attention",
    "interpret_mode",
    "verify_and_correct",
    "verify_and_correct_reference",
]
