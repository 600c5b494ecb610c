"""The fault model shared by every part: named sites and fault plans that are data.

Sites are the places a fault can strike (``path:site``); a :class:`FaultPlan` is applied at
them inside jitted code (``with sdcguard.faults(plan): ...``). No Flax import: the linen
interceptor (:func:`module_outputs`) imports Flax when it is entered.
"""

from sdcguard.fault_model._apply import (
    apply as apply,
    apply_in_block as apply_in_block,
    corrupt as corrupt,
    fault_hits as fault_hits,
    random_index as random_index,
)
from sdcguard.fault_model._check import (
    SiteInfo as SiteInfo,
    check_faults as check_faults,
    fault_problem as fault_problem,
    unknown_site_message as unknown_site_message,
)
from sdcguard.fault_model._context import (
    active_plan as active_plan,
    faults as faults,
)
from sdcguard.fault_model._linen import (
    module_outputs as module_outputs,
    output_sites as output_sites,
)
from sdcguard.fault_model._plan import (
    Fault as Fault,
    FaultPlan as FaultPlan,
    HostFaults as HostFaults,
)
from sdcguard.fault_model._points import (
    note_injection_point as note_injection_point,
    raise_if_unmatched as raise_if_unmatched,
    recording_injection_points as recording_injection_points,
    restrict_sites as restrict_sites,
)
from sdcguard.fault_model._record import (
    Hit as Hit,
    HitLog as HitLog,
    recording_hits as recording_hits,
)
from sdcguard.fault_model._sites import (
    ATTENTION_SITES as ATTENTION_SITES,
    FAULT_KINDS as FAULT_KINDS,
    GEMM_SITES as GEMM_SITES,
    GRAD_SUFFIXES as GRAD_SUFFIXES,
    NEAR_INF as NEAR_INF,
    OUTPUT as OUTPUT,
    ROOT_MODULE as ROOT_MODULE,
    SITE_CLASSES as SITE_CLASSES,
    FaultKind as FaultKind,
    attention_site_names as attention_site_names,
    backward_site_names as backward_site_names,
    is_output_site as is_output_site,
    match_sites as match_sites,
    module_path_name as module_path_name,
    output_site_name as output_site_name,
    site_class as site_class,
    site_id as site_id,
    site_matches as site_matches,
    site_name as site_name,
    site_name_of as site_name_of,
    site_pattern as site_pattern,
    split_site as split_site,
)
from sdcguard.fault_model._spec import parse_spec as parse_spec

__all__ = [
    "ATTENTION_SITES",
    "FAULT_KINDS",
    "GEMM_SITES",
    "GRAD_SUFFIXES",
    "NEAR_INF",
    "OUTPUT",
    "ROOT_MODULE",
    "SITE_CLASSES",
    "Fault",
    "FaultKind",
    "FaultPlan",
    "Hit",
    "HitLog",
    "HostFaults",
    "SiteInfo",
    "active_plan",
    "apply",
    "apply_in_block",
    "attention_site_names",
    "backward_site_names",
    "check_faults",
    "corrupt",
    "fault_hits",
    "fault_problem",
    "faults",
    "is_output_site",
    "match_sites",
    "module_outputs",
    "module_path_name",
    "note_injection_point",
    "output_site_name",
    "output_sites",
    "parse_spec",
    "raise_if_unmatched",
    "random_index",
    "recording_hits",
    "recording_injection_points",
    "restrict_sites",
    "site_class",
    "site_id",
    "site_matches",
    "site_name",
    "site_name_of",
    "site_pattern",
    "split_site",
    "unknown_site_message",
]
