"""A fault plan checked against the sites of a step, when the step is traced.

The same mistakes the command line refuses (``sdcguard record --inject``), in the same words:
a site the step does not have, an element index beyond the site's tensor, a bit at or beyond the
width of its dtype, a site no fault strikes (an integer or fp8 GEMM).

Example:
  >>> check_faults(plan.faults, {"m:x": SiteInfo(8, "float32")})
  Traceback (most recent call last):
  ValueError: Fault(site='m:x', kind='bitflip', ...): bit 40 is beyond site 'm:x', a float32
  tensor (bit 0 to 31)
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import numpy as np

from sdcguard.fault_model._plan import Fault
from sdcguard.fault_model._sites import FaultKind


class SiteInfo(NamedTuple):
    """What a fault at a site may address: its element count and dtype name (None: unknown)."""

    size: int | None = None
    dtype: str | None = None


LIST_SITES = (
    "sdcguard.list_sites(step, *args) lists every GEMM site of the step "
    "(of a protected_step: protected.list_sites(state, batch))"
)


def unknown_site_message(name: str, sites: Iterable[str], hint: str = LIST_SITES) -> str:
    """``unknown site 'm:x' (close: m:y); <hint>``: the wording of every front end."""
    close = difflib.get_close_matches(name, list(sites), n=3, cutoff=0.6)
    close_text = f" (close: {', '.join(close)})" if close else ""
    return f"unknown site {name!r}{close_text}; {hint}"


def fault_problem(
    fault: Fault,
    sites: Mapping[str, SiteInfo],
    not_injected: Mapping[str, str] | None = None,
    *,
    allow_unknown: bool = False,
) -> str | None:
    """What is wrong with ``fault`` at a step whose injection points are ``sites``, or None.

    Args:
      fault: the fault.
      sites: site name -> :class:`SiteInfo` of every injection point of the step.
      not_injected: site name -> why no fault strikes it (a site of the step without an
        injection point: ``'int8 operands'``).
      allow_unknown: a site in neither mapping is aimed elsewhere, not a mistake.
    """
    not_injected = not_injected or {}
    if fault.site not in sites:
        if fault.site in not_injected:
            return (
                f"site {fault.site!r} has no injection point: {not_injected[fault.site]}; "
                "faults strike the floating-point GEMMs (16 bits or more) that the step runs"
            )
        return None if allow_unknown else unknown_site_message(fault.site, sites)
    size, dtype = sites[fault.site]
    if size is not None and fault.index is not None and fault.index >= size:
        return (
            f"index {fault.index} is beyond site {fault.site!r}, which has {size} elements "
            f"(index 0 to {size - 1})"
        )
    if dtype is not None and FaultKind.parse(fault.kind) == FaultKind.BITFLIP:
        dt = np.dtype(dtype)
        width = dt.itemsize * 8
        if fault.bit >= width:
            return (
                f"bit {fault.bit} is beyond site {fault.site!r}, a {dt.name} tensor "
                f"(bit 0 to {width - 1})"
            )
    return None


def check_faults(
    faults: Iterable[Fault] | None,
    sites: Mapping[str, SiteInfo],
    not_injected: Mapping[str, str] | None = None,
    *,
    allow_unknown: bool = False,
) -> None:
    """Raises ValueError on the first of ``faults`` that :func:`fault_problem` refuses.

    Raises:
      ValueError: ``Fault(...): <what is wrong>``, in the command line's words.
    """
    for fault in faults or ():
        problem = fault_problem(fault, sites, not_injected, allow_unknown=allow_unknown)
        if problem is not None:
            raise ValueError(f"{fault!r}: {problem}")
