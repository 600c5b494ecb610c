"""Injection points: where injection code is compiled, which sites have it, and faults aimed
at none of them.

Example:
  >>> with recording_injection_points({}) as points:
  ...     jax.make_jaxpr(step)(params, batch)
  >>> raise_if_unmatched(plan, points)  # a misspelt site: a ValueError while tracing
"""

from __future__ import annotations

import contextlib
import contextvars
import difflib
from collections.abc import Iterable, Iterator, Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp

from sdcguard.fault_model._check import SiteInfo, check_faults
from sdcguard.fault_model._context import scoped
from sdcguard.fault_model._plan import FaultPlan
from sdcguard.fault_model._sites import site_id, site_name_of


class Restriction(NamedTuple):
    """What :func:`restrict_sites` set: the armed sites (None: all), and where to record the
    size and dtype name of every site traced (None: nowhere)."""

    armed: frozenset[str] | None = None
    sizes: dict[str, int] | None = None
    dtypes: dict[str, str] | None = None


_RESTRICTION: contextvars.ContextVar[Restriction | None] = contextvars.ContextVar(
    "sdcguard_injection_restriction", default=None
)
_INJECTION_POINTS: contextvars.ContextVar[set[str] | dict | None] = contextvars.ContextVar(
    "sdcguard_injection_points", default=None
)


@contextlib.contextmanager
def restrict_sites(
    armed: Iterable[str] | None = None,
    *,
    sizes: dict[str, int] | None = None,
    dtypes: dict[str, str] | None = None,
) -> Iterator[None]:
    """While tracing inside the block, compile injection code only at the ``armed`` sites.

    Sites not armed compile to nothing, so two programs traced with the same armed set are the
    same program whatever their plans. Cover the whole trace, ``value_and_grad`` included:
    backward sites are traced after the forward pass has returned.

    Args:
      armed: the site names to arm; None arms all.
      sizes: receives the element count of every site traced, armed or not.
      dtypes: receives their dtype names (a bit flip's ``bit`` must be below that width).
    """
    armed = None if armed is None else frozenset(armed)
    with scoped(_RESTRICTION, Restriction(armed, sizes, dtypes)):
        yield


def note_site(site: str, size: int, dtype) -> bool:
    """Records an injection point at ``site`` (size, dtype) for the blocks above; returns
    whether injection code is to be compiled there (its site is armed)."""
    note_injection_point(site, SiteInfo(int(size), str(dtype)))
    armed, sizes, dtypes = _RESTRICTION.get() or Restriction()
    if sizes is not None:
        sizes.setdefault(site, int(size))
    if dtypes is not None:
        dtypes.setdefault(site, str(dtype))
    return armed is None or site in armed


@contextlib.contextmanager
def recording_injection_points(points: set[str] | dict[str, SiteInfo]) -> Iterator:
    """While tracing inside the block, adds every site that gets an injection point to
    ``points`` (armed or not, with or without a plan): its name to a set, or its name ->
    :class:`SiteInfo` (element count and dtype, where known) to a dict.

    Example:
      >>> with recording_injection_points({}) as points:
      ...     jax.make_jaxpr(step)(params, batch)
    """
    with scoped(_INJECTION_POINTS, points):
        yield points


def note_injection_point(site: str, info: SiteInfo | None = None) -> None:
    """Tells :func:`recording_injection_points` that ``site`` has an injection point: what
    every injector calls (``apply_in_block``, and the Pallas kernels, which inject inside the
    kernel), with its element count and dtype where it knows them."""
    points = _INJECTION_POINTS.get()
    if isinstance(points, dict):
        if points.get(site, SiteInfo()).size is None:
            points[site] = info or SiteInfo()
    elif points is not None:
        points.add(site)


def raise_if_unmatched(
    plan: FaultPlan | None,
    sites: Iterable[str] | Mapping[str, SiteInfo],
    *,
    not_injected: Mapping[str, str] | None = None,
    allow_unmatched: bool = False,
) -> None:
    """Refuses the faults of ``plan`` that the step, whose injection points are ``sites``,
    cannot take: a misspelt site, an index beyond the site's tensor, a bit beyond its dtype's
    width, a site that no fault strikes (``not_injected``: name -> why).

    Checked when the step is traced, with a ``ValueError`` in the command line's words, for the
    faults the plan was built from (:attr:`FaultPlan.faults`: the plan traced, concrete or a jit
    argument). A plan that reaches a compiled step without being traced (another plan of the same
    compilation) is checked when it runs: a fault firing at a site not in ``sites`` makes a host
    callback raise. Without a plan, the step is unchanged.

    Args:
      plan: the active plan, or None.
      sites: the step's injection points: names, or name -> :class:`SiteInfo` (sizes and dtypes
        are then checked too).
      not_injected: sites of the step without an injection point, and why.
      allow_unmatched: faults at sites in neither ``sites`` nor ``not_injected`` are aimed
        elsewhere (``ABFTConfig(allow_unmatched=True)``): not refused.
    """
    if plan is None or plan.num_faults == 0:
        return
    infos = sites if isinstance(sites, Mapping) else dict.fromkeys(sites, SiteInfo())
    check_faults(plan.faults, infos, not_injected, allow_unknown=allow_unmatched)
    if allow_unmatched:
        return
    sites = sorted(set(infos))
    known = jnp.asarray([site_id(s) for s in sites] or [-2], jnp.int32)
    unmatched = (plan.site >= 0) & plan.fires_now() & ~jnp.isin(plan.site, known)

    def report(unmatched, ids):
        if not unmatched.any():
            return
        names = sorted({site_name_of(i) for i in ids[unmatched]})
        close = {n: difflib.get_close_matches(n, sites, n=3, cutoff=0.4) for n in names}
        raise ValueError(
            f"fault plan targets {names}, which match no injection point of this step; close "
            f"matches: {close}. sdcguard.list_sites(step, ...) lists the GEMM sites; "
            "ABFTConfig(allow_unmatched=True) accepts faults aimed elsewhere."
        )

    jax.debug.callback(report, unmatched, plan.site)
