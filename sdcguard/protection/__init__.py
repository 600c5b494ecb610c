"""Protection: every GEMM of a step checked by checksums (ABFT), errors corrected in place.

The public face of the package. Bottom to top: what a check checks and reports
(:class:`ABFTConfig`, :class:`Counts`); the contraction, tolerance model and checks; one
checked-GEMM routine (XLA or the Pallas kernels in :mod:`~sdcguard.protection.pallas`); the
checked einsum with checked backward GEMMs; :func:`checked` (every GEMM of any JAX function:
selection, the jaxpr walk, naming, the interpreter, recompute, cuDNN attention); protected
attention and the Flax drop-ins :mod:`~sdcguard.protection.linen` and
:mod:`~sdcguard.protection.nnx` (also ``sdcguard.linen``, ``sdcguard.nnx``).
See docs/architecture.md for one line per module.
"""

from sdcguard.protection import (
    linen as linen,
    nnx as nnx,
)
from sdcguard.protection._abft import (
    checked_dot_general as checked_dot_general,
    checked_einsum as checked_einsum,
)
from sdcguard.protection._attention import (
    PallasFallbackWarning as PallasFallbackWarning,
    SiteRecorder as SiteRecorder,
    UncheckedAttentionWarning as UncheckedAttentionWarning,
    protected_attention as protected_attention,
)
from sdcguard.protection._backend import input_rounding as input_rounding
from sdcguard.protection._checked import (
    checked as checked,
    list_sites as list_sites,
    total as total,
)
from sdcguard.protection._checks import (
    CHECK_SCOPE as CHECK_SCOPE,
    check_contraction as check_contraction,
    check_scope as check_scope,
)
from sdcguard.protection._checksums import line_checksums as line_checksums
from sdcguard.protection._config import (
    ABFTConfig as ABFTConfig,
    Counts as Counts,
    unsafe_checks as unsafe_checks,
)
from sdcguard.protection._contraction import Contraction as Contraction
from sdcguard.protection._select import GemmSite as GemmSite
from sdcguard.protection._softmax import check_softmax_rows as check_softmax_rows
from sdcguard.protection._tolerance import roundoff_gamma as roundoff_gamma

__all__ = [
    "CHECK_SCOPE",
    "ABFTConfig",
    "Contraction",
    "Counts",
    "GemmSite",
    "PallasFallbackWarning",
    "SiteRecorder",
    "UncheckedAttentionWarning",
    "check_contraction",
    "check_scope",
    "check_softmax_rows",
    "checked",
    "checked_dot_general",
    "checked_einsum",
    "input_rounding",
    "line_checksums",
    "linen",
    "list_sites",
    "nnx",
    "protected_attention",
    "roundoff_gamma",
    "total",
    "unsafe_checks",
]
