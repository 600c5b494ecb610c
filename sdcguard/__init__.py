"""sdcguard: keep JAX/Flax training correct when hardware silently corrupts numbers.

Public API (submodules: ``abft``, ``attention``, ``inject``, ``linen``, ``nnx``, ``optim``,
``recovery``, ``replay``, ``pallas``, ``models``, ``sites``, ``training``).
"""

from sdcguard import abft, inject, linen, models, nnx, sites
from sdcguard.abft import ABFTConfig, Counts, checked_dot_general, checked_einsum
from sdcguard.attention import dot_product_attention, protected_attention
from sdcguard.inject import Fault, FaultPlan, faults
from sdcguard.sites import ATTENTION_SITES, FaultKind, site_id, site_name

__version__ = "0.1.0"

__all__ = [
    "ATTENTION_SITES",
    "ABFTConfig",
    "Counts",
    "Fault",
    "FaultKind",
    "FaultPlan",
    "abft",
    "checked_dot_general",
    "checked_einsum",
    "dot_product_attention",
    "faults",
    "inject",
    "linen",
    "models",
    "nnx",
    "protected_attention",
    "site_id",
    "site_name",
    "sites",
]
