"""Protection: every GEMM of a step checked by checksums (ABFT), errors corrected in place.

Layers, bottom to top (each imports only those below it):

- :mod:`~sdcguard.protection.config`: :class:`ABFTConfig` (what to check) and
  :class:`Counts` (what a check reports).
- :mod:`~sdcguard.protection.checksums`: the checksum math and the tolerance model, in
  ``jnp`` (the XLA implementation, and the reference the kernels are tested against).
- :mod:`~sdcguard.protection.sharding`: a check on the block of a GEMM each device holds.
- :mod:`~sdcguard.protection.pallas`: the same checks as GPU kernels.
- :mod:`~sdcguard.protection.abft`: the checked einsum, dispatched to either implementation,
  with checked backward GEMMs.
- :mod:`~sdcguard.protection.attention`, :mod:`~sdcguard.protection.linen`,
  :mod:`~sdcguard.protection.nnx`: protected attention and the Flax drop-ins
  (``sdcguard.linen``, ``sdcguard.nnx``).
- :mod:`~sdcguard.protection.transform`: :func:`checked`, every GEMM of any JAX function.
"""

from sdcguard.protection.abft import checked_dot_general, checked_einsum
from sdcguard.protection.attention import protected_attention
from sdcguard.protection.config import ABFTConfig, Counts, unsafe_checks
from sdcguard.protection.transform import GemmSite, checked, list_sites

__all__ = [
    "ABFTConfig",
    "Counts",
    "GemmSite",
    "checked",
    "checked_dot_general",
    "checked_einsum",
    "list_sites",
    "protected_attention",
    "unsafe_checks",
]
