"""What a check checks (:class:`ABFTConfig`) and what it reports (:class:`Counts`)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from sdcguard.fault_model import ATTENTION_SITES, NEAR_INF

IMPLEMENTATIONS = ("auto", "xla", "pallas")
REPAIRS = ("auto", "branch_free", "cond", "while")
# Fields of ABFTConfig that only sdcguard.checked reads.
_CHECKED_ONLY = ("include", "exclude", "recompute", "per_iteration", "allow_unmatched")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ABFTConfig:
    """What the protected attention checks and how.

    Attributes:
      sites: attention sites to protect (subset of ``query, key, value, scores, probs,
        context, out``).
      forward: check the forward GEMMs.
      backward: check the two gradient GEMMs of every protected forward GEMM.
      correct: correct errors in place (the flagged row of each matrix computed again); if
        False, only detect: every detection is counted uncorrectable (the error is passed on,
        for an update guard to refuse the step) and no repair is compiled, so nothing
        downstream waits on a check.
      repair: how the XLA path compiles the in-place repair: ``'branch_free'`` (computed on
        every call, no control flow), ``'cond'`` (a ``lax.cond``, per group of GEMMs with
        ``group_repairs``: the repair runs only when a check fired), ``'while'`` (a loop of
        zero or one trips per GEMM), or
        ``'auto'``: ``'cond'``, measured fastest on an H200 and on the CPU
        (docs/performance.md, "Repair strategies").
      group_repairs: with ``repair='cond'``, GEMMs whose outputs nothing reads in between (a
        layer's two gradient GEMMs, in :func:`sdcguard.checked` any run of such GEMMs) share
        one ``lax.cond``: when any of them flagged, each is repaired (a clean one comes back
        unchanged). On a GPU each cond is a conditional node of the step's CUDA graph, with a
        cost of its own on every step. False: one cond per GEMM.
      safety: multiplier on the round-off bound (1.0 is already a worst-case bound).
      near_inf: magnitude at and above which a value in a flagged line is located directly
        (the Pallas kernels, which locate single errors within a tile).
      implementation: ``'xla'`` (any backend), ``'pallas'`` (GPU kernels) or ``'auto'``.
      include, exclude: site patterns for :func:`sdcguard.checked` (the grammar of every
        ``--sites``, :func:`sdcguard.fault_model.site_matches`: ``*`` within a path component,
        ``**`` across): a GEMM is checked when its name matches some ``include`` pattern and no
        ``exclude`` pattern (e.g. ``include=("**attn**",)``, or ``exclude=("**head**",)``).
      recompute: for :func:`sdcguard.checked`: checks only detect (``correct`` is not read),
        and a call with any detection is computed again, once, from the same arguments; a
        detection on that second computation too is reported for the update guard to refuse.
        ``repair`` picks its control flow: ``'cond'`` (a ``lax.cond`` around a second copy of
        the step: a clean step costs detection and one predicate), otherwise a ``while`` loop
        of one or two trips around one copy; ``'auto'`` is ``'cond'`` on a GPU, the loop
        elsewhere.
      per_iteration: for :func:`sdcguard.checked`: one row of counters per ``scan`` iteration
        instead of their sum.
      allow_unmatched: for :func:`sdcguard.checked`: accept ``include``/``exclude`` patterns and
        fault-plan sites that match no GEMM of the function (by default each is an error that
        names it, with close matches).

    Which code reads which field: the drop-in attention layers read ``sites`` and the check's
    settings (``forward``, ``backward``, ``correct``, ``safety``, ``near_inf``,
    ``implementation``); :func:`sdcguard.checked` reads the check's settings and ``include``,
    ``exclude``, ``recompute``, ``per_iteration``, ``allow_unmatched``. Each refuses a config
    that sets a field it does not read (:meth:`validate_for_layers`,
    :meth:`validate_for_checked`), so no setting is silently ignored.

    Example:
      >>> cfg = ABFTConfig(sites=("scores", "context"), backward=False)
    """

    sites: tuple[str, ...] = ATTENTION_SITES
    forward: bool = True
    backward: bool = True
    correct: bool = True
    repair: str = "auto"
    group_repairs: bool = True
    safety: float = 1.0
    near_inf: float = NEAR_INF
    implementation: str = "auto"
    include: tuple[str, ...] = ("**",)
    exclude: tuple[str, ...] = ()
    recompute: bool = False
    per_iteration: bool = False
    allow_unmatched: bool = False

    def __post_init__(self):
        object.__setattr__(self, "sites", tuple(self.sites))
        for field in ("include", "exclude"):
            patterns = getattr(self, field)
            if isinstance(patterns, str):
                raise TypeError(
                    f"ABFTConfig.{field} takes a tuple of glob patterns, got the string "
                    f"{patterns!r}; write {field}=({patterns!r},)"
                )
            object.__setattr__(self, field, tuple(patterns))
        unknown = set(self.sites) - set(ATTENTION_SITES)
        if unknown:
            raise ValueError(
                f"unknown ABFT sites {sorted(unknown)}; valid sites: {list(ATTENTION_SITES)}"
            )
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(
                f"implementation must be one of {IMPLEMENTATIONS}, got {self.implementation!r}"
            )
        if self.repair not in REPAIRS:
            raise ValueError(f"repair must be one of {REPAIRS}, got {self.repair!r}")
        if not isinstance(self.group_repairs, bool):
            raise TypeError(f"group_repairs must be True or False, got {self.group_repairs!r}")
        if not self.safety >= 1.0:
            raise ValueError(
                f"safety={self.safety} would put the threshold below the round-off bound and "
                "raise false alarms; use safety >= 1"
            )
        if not self.near_inf > 0:
            raise ValueError(f"near_inf must be positive, got {self.near_inf}")

    def validate_for_layers(self) -> ABFTConfig:
        """``self``, or an error naming the fields only :func:`sdcguard.checked` reads."""
        defaults = ABFTConfig()
        ignored = [f for f in _CHECKED_ONLY if getattr(self, f) != getattr(defaults, f)]
        if ignored:
            raise ValueError(
                f"ABFTConfig fields {ignored} are read by sdcguard.checked only; the drop-in "
                "attention layers select their sites with sites=(...) and repair in place "
                "(training.TrainConfig(repair='recompute') recomputes a step with a detection)"
            )
        return self

    def validate_for_checked(self) -> ABFTConfig:
        """``self``, or an error naming the fields only the drop-in layers read."""
        if self.sites != ATTENTION_SITES:
            raise ValueError(
                f"ABFTConfig(sites={self.sites!r}) selects the sites of the drop-in attention "
                "layers; sdcguard.checked selects GEMMs by name with include=/exclude= glob "
                "patterns instead, e.g. include=('**attn:scores*',) (see sdcguard.list_sites)"
            )
        return self

    def checks(self, site: str, *, backward: bool = False) -> bool:
        """Whether ``site`` is checked in the given direction."""
        return site in self.sites and (self.backward if backward else self.forward)


class Counts(NamedTuple):
    """The four counters of a check, by name. A *check* is one matrix of a batched GEMM.

    Every detected check has exactly one outcome: ``detected == corrected + uncorrectable +
    nonfinite_input`` (see docs/abft.md, "Counters"). Reports hold them as int32 ``[..., 4]``
    arrays in this order; :meth:`of` reads such an array by name.

    Attributes:
      detected: checks whose checksums disagreed beyond the round-off bound.
      corrected: detected checks whose output passes its checksums again after repair.
      uncorrectable: detected checks left (partly) wrong, for the update guard to refuse.
      nonfinite_input: detected checks whose inputs define a non-finite output.

    Example:
      >>> Counts.of(report["mlp/up"]).detected
    """

    detected: jax.Array
    corrected: jax.Array
    uncorrectable: jax.Array
    nonfinite_input: jax.Array

    @classmethod
    def of(cls, counts) -> Counts:
        """A named view of counters ``[..., 4]``: each field ``[...]``."""
        return cls(*(counts[..., i] for i in range(len(cls._fields))))

    @classmethod
    def zeros(cls, *lead: int, dtype=jnp.int32) -> jax.Array:
        """Zero counters ``[*lead, 4]`` (int32 unless ``dtype`` says otherwise)."""
        return jnp.zeros((*lead, len(cls._fields)), dtype)

    @classmethod
    def rows(cls, counts, *inner: int):
        """``counts`` ``[..., *inner, 4]`` as ``[n, *inner, 4]`` (a NumPy or JAX array)."""
        return counts.reshape(-1, *inner, len(cls._fields))

    @staticmethod
    def all_corrected(counts: jax.Array) -> jax.Array:
        """Counters ``[..., 4]`` with every detection corrected: ``[d, d, 0, 0]``."""
        return counts[..., :1] * jnp.asarray([1, 1, 0, 0], counts.dtype)


def zero_counts() -> jax.Array:
    """int32 ``[4]`` zeros."""
    return Counts.zeros()


def zero_counts_like(flag: jax.Array) -> jax.Array:
    """int32 ``[4]`` zeros typed like ``flag``, a check's predicate: varying across devices
    inside ``shard_map``, as the counts a repair computes from the device's own data are (the
    two branches of a cond, and a loop's carry, keep one type)."""
    return zero_counts() + jnp.zeros_like(flag, jnp.int32)


def count_outcomes(detected: jax.Array, corrected: jax.Array, nonfinite_input=0) -> jax.Array:
    """int32 ``[detected, corrected, uncorrectable, nonfinite_input]`` of scalar counts.

    ``uncorrectable`` is what was detected and neither corrected nor a non-finite input.
    """
    uncorrectable = detected - corrected - nonfinite_input
    return jnp.stack(
        jnp.broadcast_arrays(detected, corrected, uncorrectable, nonfinite_input)
    ).astype(jnp.int32)


def unsafe_checks(counts: jax.Array) -> jax.Array:
    """Checks whose output the update guard must not accept: ``uncorrectable + nonfinite_input``.

    Args:
      counts: counters ``[..., 4]``.

    Returns:
      ``[...]``.

    Example:
      >>> tx.update(grads, opt_state, params, abft_uncorrectable=unsafe_checks(counts))
    """
    counts = Counts.of(jnp.asarray(counts))
    return counts.uncorrectable + counts.nonfinite_input


def zero_sink() -> jax.Array:
    """The backward-counter sink of one GEMM site: float32 ``[2, 4]`` zeros.

    Its gradient is ``[grad_lhs counts, grad_rhs counts]``: differentiate the loss with respect
    to the sink to read the backward counters with no host sync.
    """
    return Counts.zeros(2, dtype=jnp.float32)
