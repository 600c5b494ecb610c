"""The fault model shared by every part: named sites and fault plans that are data.

:mod:`sdcguard.fault_model.sites` names the places a fault can strike (``path:site``) and the
kinds of fault; :mod:`sdcguard.fault_model.inject` applies a :class:`FaultPlan` at those sites
inside jitted code (``with sdcguard.faults(plan): ...``).
"""

from sdcguard.fault_model.inject import Fault, FaultPlan, faults, module_outputs
from sdcguard.fault_model.sites import ATTENTION_SITES, FaultKind, site_id, site_name

__all__ = [
    "ATTENTION_SITES",
    "Fault",
    "FaultKind",
    "FaultPlan",
    "faults",
    "module_outputs",
    "site_id",
    "site_name",
]
