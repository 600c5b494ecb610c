"""The record of what the faults did: every fault that fired, with its value before and after.

Example:
  >>> log = HitLog()
  >>> with recording_hits(log):
  ...     step = jax.jit(step_fn).lower(*args).compile()  # or the first (tracing) call
  >>> step(*args); log.take()
  [Hit(site='decoder/block_0/attn:scores', index=17, old=0.25, new=8.5e+37, step=3)]
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

import jax
import numpy as np

from sdcguard.fault_model._context import scoped


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hit:
    """One fault that fired: where, which element, and its value before and after."""

    site: str
    index: int
    old: float
    new: float
    step: int


class HitLog:
    """Receives every fault that fires in code traced inside :func:`recording_hits`.

    A diagnostic for campaigns: each site that could fire sends its faults to the host with
    ``jax.debug.callback`` at every run of the compiled code, so use it for measurements, not
    in production steps.
    """

    def __init__(self):
        self._hits: list[Hit] = []

    def record(self, site: str, fires, index, old, new, step) -> None:
        """Adds the faults that fired (``fires``, bool ``[num_faults]``) at ``site``."""
        for f, i, o, n in zip(
            np.asarray(fires), np.asarray(index), np.asarray(old), np.asarray(new), strict=True
        ):
            if f:
                self._hits.append(
                    Hit(site=site, index=int(i), old=float(o), new=float(n), step=int(step))
                )

    def take(self) -> list[Hit]:
        """The hits recorded so far (waiting for pending callbacks), and forgets them."""
        jax.effects_barrier()
        hits, self._hits = self._hits, []
        return hits


_HIT_LOG: contextvars.ContextVar[HitLog | None] = contextvars.ContextVar(
    "sdcguard_hit_log", default=None
)


@contextlib.contextmanager
def recording_hits(log: HitLog) -> Iterator[HitLog]:
    """While tracing inside the block, compiles a report of every firing fault into ``log``."""
    with scoped(_HIT_LOG, log):
        yield log


def active_log() -> HitLog | None:
    """The log of the enclosing :func:`recording_hits`, or None."""
    return _HIT_LOG.get()
