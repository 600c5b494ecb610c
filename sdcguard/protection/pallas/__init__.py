"""GPU kernels for ABFT (Pallas), each beside its pure-jnp reference; one module per kernel.

- :mod:`~sdcguard.protection.pallas.matmul`: :func:`checked_matmul` and
  :func:`checked_contraction`, the GEMM checked tile by tile inside one Hopper kernel
  (:mod:`~sdcguard.protection.pallas.matmul_mgpu`, Mosaic GPU), with the exact recomputation
  of located elements after it (:mod:`~sdcguard.protection.pallas.verify`).
- :mod:`~sdcguard.protection.pallas.flash`: :func:`flash_attention`, checksums verified
  inside the fused forward and backward kernels
  (:mod:`~sdcguard.protection.pallas.flash_mgpu` on Mosaic GPU,
  :mod:`~sdcguard.protection.pallas.flash_triton` on Triton).

Off a GPU every kernel runs in interpret mode (``interpret=None`` picks it): slow, for tests.
:func:`interpret_mode` overrides that choice; :func:`as_h100` lowers for sm_90a from a machine
without a GPU; :func:`kernel_unavailable` says whether a kernel lowers on the installed JAX.
"""

from sdcguard.protection.pallas._availability import (
    fails_on_gpu as fails_on_gpu,
    kernel_unavailable as kernel_unavailable,
)
from sdcguard.protection.pallas._platform import (
    as_h100 as as_h100,
    gpu_interpret_mode as gpu_interpret_mode,
    interpret_mode as interpret_mode,
    resolve_interpret as resolve_interpret,
)
from sdcguard.protection.pallas.flash import (
    FORWARD_SITES as FORWARD_SITES,
    KernelChoice as KernelChoice,
    attention_reference as attention_reference,
    flash_attention as flash_attention,
    flash_backward as flash_backward,
    flash_forward as flash_forward,
    kernel_choice as kernel_choice,
    kernel_for as kernel_for,
    zero_core_sink as zero_core_sink,
)
from sdcguard.protection.pallas.flash_mgpu import MosaicBlockSizes as MosaicBlockSizes
from sdcguard.protection.pallas.flash_triton import BlockSizes as FlashBlockSizes
from sdcguard.protection.pallas.matmul import (
    checked_contraction as checked_contraction,
    checked_matmul as checked_matmul,
    checked_matmul_reference as checked_matmul_reference,
    uses_kernel as uses_kernel,
)
from sdcguard.protection.pallas.matmul_mgpu import BlockSizes as BlockSizes

__all__ = [
    "FORWARD_SITES",
    "BlockSizes",
    "FlashBlockSizes",
    "KernelChoice",
    "MosaicBlockSizes",
    "as_h100",
    "attention_reference",
    "checked_contraction",
    "checked_matmul",
    "checked_matmul_reference",
    "fails_on_gpu",
    "flash_attention",
    "flash_backward",
    "flash_forward",
    "gpu_interpret_mode",
    "interpret_mode",
    "kernel_choice",
    "kernel_for",
    "kernel_unavailable",
    "resolve_interpret",
    "uses_kernel",
    "zero_core_sink",
]
