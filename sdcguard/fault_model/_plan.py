"""Faults as a person writes them (:class:`Fault`) and as jitted code reads them
(:class:`FaultPlan`).

Example:
  >>> plan = FaultPlan.from_faults([
  ...     Fault(site="decoder/block_0/attn:scores", kind="inf", index=17, step=3)])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sdcguard.fault_model._sites import FaultKind, site_id, split_site


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fault:
    """One fault, as a person writes it.

    Attributes:
      site: full site name, e.g. ``decoder/block_0/attn:scores`` or ``...:scores.grad_lhs``
        for the backward GEMM that produces the gradient of the left operand.
      kind: one of ``inf, -inf, nan, near_inf, bitflip, value, scale``.
      index: flat element index into the site's tensor (row-major), or None for an index drawn
        from ``seed``.
      seed: seed of the random index when ``index`` is None.
      step: the training step at which the fault fires, or -1 for every step.
      bit: the bit to flip (``bitflip``), counted from the least significant bit.
      value: the value to set (``value``) or the factor (``scale``).
    """

    site: str
    kind: str
    index: int | None = None
    seed: int = 0
    step: int = -1
    bit: int = 0
    value: float = 0.0

    def __post_init__(self):
        split_site(self.site)
        kind = FaultKind.parse(self.kind)
        if self.index is not None and self.index < 0:
            raise ValueError(f"fault index must be >= 0 or None (random), got {self.index}")
        if kind == FaultKind.BITFLIP and not 0 <= self.bit < 64:
            raise ValueError(f"bitflip needs 0 <= bit < 64, got bit={self.bit}")


class HostFaults:
    """The faults a plan was built from, kept on the host as the plan's static part.

    Any two compare equal: a plan's faults are data, and plans of one capacity share one
    compilation. What it holds lets a step check the plan against its sites when it is traced
    (:func:`sdcguard.fault_model.raise_if_unmatched`), before anything runs.
    """

    __slots__ = ("faults",)

    def __init__(self, faults: Sequence[Fault] | None = None):
        self.faults = None if faults is None else tuple(faults)

    def __eq__(self, other) -> bool:
        return isinstance(other, HostFaults)

    def __hash__(self) -> int:
        return hash(HostFaults)

    def __repr__(self) -> str:
        return f"HostFaults({self.faults!r})"


_UNKNOWN = HostFaults()


class FaultPlan(NamedTuple):
    """Faults as arrays: every field has shape ``[num_faults]`` except ``current_step``.

    A plan is a jit argument, so a campaign of thousands of faults compiles once. Build one
    with :meth:`from_faults` or :meth:`none`; set the step with :meth:`at_step`. ``host`` (not
    a leaf) keeps the faults :meth:`from_faults` was given, for the checks made when a step is
    traced.
    """

    site: jax.Array  # int32 site_id of the target site
    kind: jax.Array  # int32 FaultKind
    index: jax.Array  # int32 flat index, or -1 for random from `seed`
    seed: jax.Array  # int32
    step: jax.Array  # int32 step at which it fires, -1 = every step
    bit: jax.Array  # int32
    value: jax.Array  # float32
    current_step: jax.Array  # int32 scalar: the step being run now
    host: HostFaults = _UNKNOWN  # static: the faults as written, where known

    @classmethod
    def from_faults(cls, faults: Sequence[Fault], *, capacity: int | None = None) -> FaultPlan:
        """The plan of ``faults``, padded with inert entries to ``capacity`` if given.

        Plans of equal capacity have equal shapes, so a jitted step compiles once for all.
        """
        if capacity is not None and capacity < len(faults):
            raise ValueError(f"{len(faults)} faults do not fit in capacity={capacity}")
        pad = (capacity or len(faults)) - len(faults)

        def col(fn, dtype, inert=0):
            return np.asarray([fn(f) for f in faults] + [inert] * pad, dtype=dtype)

        return cls(
            site=col(lambda f: site_id(f.site), np.int32, inert=-1),  # no site has id -1
            kind=col(lambda f: int(FaultKind.parse(f.kind)), np.int32),
            index=col(lambda f: -1 if f.index is None else f.index, np.int32),
            seed=col(lambda f: f.seed, np.int32),
            step=col(lambda f: f.step, np.int32),
            bit=col(lambda f: f.bit, np.int32),
            value=col(lambda f: f.value, np.float32),
            current_step=np.zeros((), np.int32),
            host=HostFaults(faults),
        )

    @classmethod
    def none(cls) -> FaultPlan:
        """A plan with no faults (still a valid jit argument)."""
        return cls.from_faults([])

    @property
    def num_faults(self) -> int:
        return int(np.shape(self.site)[0])

    def at_step(self, step) -> FaultPlan:
        """The same plan, with ``current_step`` set (``step`` may be a traced int)."""
        return self._replace(current_step=jnp.asarray(step, jnp.int32))

    def fires_now(self) -> jax.Array:
        """bool ``[num_faults]``: which faults fire at ``current_step``."""
        return (self.step < 0) | (self.step == self.current_step)

    @property
    def faults(self) -> tuple[Fault, ...] | None:
        """The faults the plan was built from (:meth:`from_faults`), or None where unknown."""
        return self.host.faults


_LEAVES = FaultPlan._fields[:-1]


def _flatten_with_keys(plan: FaultPlan):
    return [(jax.tree_util.GetAttrKey(f), getattr(plan, f)) for f in _LEAVES], plan.host


jax.tree_util.register_pytree_with_keys(
    FaultPlan,
    _flatten_with_keys,
    lambda host, leaves: FaultPlan(*leaves, host=host),
    lambda plan: (plan[:-1], plan.host),
)
