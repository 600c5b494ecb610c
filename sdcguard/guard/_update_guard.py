"""An Optax update guard that refuses updates corrupted by silent hardware faults.

:func:`refuse_corrupted` wraps any Optax transformation: it runs the inner update, then the
checks (:mod:`._checks`: non-finite values, ABFT's unsafe count, spikes against the statistics of
:mod:`._statistics`, replicas that disagree); if any fires, the update is all zeros and the inner
state stays bit for bit. Triage's decision is in :mod:`._triage`, the state and its readers in
:mod:`._state`. How the checks work and why: docs/guard.md.

Example:
  >>> tx = refuse_corrupted(optax.adamw(1e-3), max_consecutive=3)
  >>> opt_state = tx.init(params)
  >>> updates, opt_state = tx.update(grads, opt_state, params, loss=loss,
  ...                                abft_uncorrectable=sdcguard.unsafe_checks(counts))
  >>> reason_names(opt_state.reason)       # () when the step was accepted
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from sdcguard._in_place import apply_if
from sdcguard.guard import _triage as triage
from sdcguard.guard._checks import (
    abft_reasons,
    global_norm,
    held_updates,
    nonfinite_reasons,
    replica_reasons,
    sharded_leaves,
    spike_reasons,
    sum_of_squares,
)
from sdcguard.guard._config import GuardConfig
from sdcguard.guard._reasons import Reason
from sdcguard.guard._state import TRIAGE_LOG, Counters, GuardState
from sdcguard.guard._statistics import SpikeWindow


def _scalar_argument(name: str, value, hint: str) -> jax.Array:
    value = jnp.asarray(value)
    if value.ndim != 0:
        raise ValueError(
            f"refuse_corrupted: the extra argument {name} must be a scalar, got shape "
            f"{tuple(value.shape)} ({value.dtype}): {hint}"
        )
    return value


@jax.custom_jvp
def _unless(refuse: jax.Array, accepted, refused):
    """``refused`` when ``refuse``, else ``accepted``, without touching ``accepted``'s bytes.

    A select would read both trees and write a third, a pass over the optimizer state on every
    clean step, as costly as the rest of the guard; :func:`sdcguard._in_place.apply_if` returns
    the inner update's own output buffers as they are, and only a refused step pays for copying
    the old state. Its derivative is that of the select.
    """
    return apply_if(refuse, lambda _: refused, accepted)


@_unless.defjvp
def _unless_jvp(primals, tangents):
    refuse = primals[0]
    _, accepted_dot, refused_dot = tangents

    def select(a, r):
        if a.dtype == jax.dtypes.float0:  # integer leaves (step counts) have no tangent
            return a
        return jnp.where(refuse, r, a)

    return _unless(*primals), jax.tree.map(select, accepted_dot, refused_dot)


# --- The transformation -------------------------------------------------------------------------


def _with_extra_args(inner) -> optax.GradientTransformationExtraArgs:
    # MultiSteps is not itself a GradientTransformation, but its update takes extra args.
    if isinstance(inner, optax.MultiSteps):
        return optax.GradientTransformationExtraArgs(inner.init, inner.update)
    return optax.with_extra_args_support(inner)


def refuse_corrupted(
    inner, *, config: GuardConfig | None = None, **overrides
) -> optax.GradientTransformationExtraArgs:
    """Wraps ``inner`` so that updates touched by corruption are refused.

    ``update(grads, state, params=None, *, loss=None, abft_uncorrectable=None, **extra)``
    runs ``inner`` (which also receives every extra argument), then refuses the step if any
    enabled check fires. A refused step returns all-zero updates and keeps ``inner_state`` bit
    for bit; the reason is in ``state.reason``. A check whose input is absent is skipped.

    With ``axis_name`` set, call ``update`` inside ``shard_map``/``pmap`` with gradients already
    reduced over that axis (``pmean``, or ``psum_scatter`` for ZeRO/FSDP shards: see
    ``GuardConfig.gradients``) and a reduced loss, as in ordinary data-parallel training. The extra
    argument ``replicas`` (bool ``[axis size]``) names the replicas that take part in the
    cross-replica check; the others (out of training: :mod:`sdcguard.degraded`) are ignored.

    Args:
      inner: any Optax transformation, including ``optax.chain``, ``optax.MultiSteps`` and
        transformations with schedules.
      config: the checks; defaults to ``GuardConfig()``.
      **overrides: fields of :class:`GuardConfig` to change, e.g. ``max_consecutive=5``.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a :class:`GuardState`.

    Raises:
      ValueError: (when traced) ``loss`` or ``abft_uncorrectable`` is not a scalar.

    Example:
      >>> tx = refuse_corrupted(optax.adam(1e-3), loss_zscore=8.0)
      >>> state = tx.init(params)
      >>> updates, state = tx.update(grads, state, params, loss=loss)
    """
    config = config or GuardConfig()
    try:
        config = dataclasses.replace(config, **overrides)
    except TypeError:
        fields = [f.name for f in dataclasses.fields(GuardConfig)]
        raise TypeError(
            f"refuse_corrupted got unknown options {sorted(overrides)}; GuardConfig fields: "
            f"{fields}"
        ) from None
    inner = _with_extra_args(inner)

    def init_fn(params):
        zero = jnp.zeros((), jnp.int32)
        return GuardState(
            inner_state=inner.init(params),
            refused=zero,
            reason=zero,
            rollback_needed=jnp.zeros((), jnp.bool_),
            counters=Counters.initial().pack(),
            statistics=SpikeWindow.empty(config.window).pack(),
        )

    def update_fn(updates, state: GuardState, params=None, **extra):
        grads = updates
        loss, abft_uncorrectable = _extra_scalars(extra)
        if jnp.ndim(state.reason) != 0:
            raise ValueError(
                f"refuse_corrupted: the guard state's reason has shape "
                f"{tuple(jnp.shape(state.reason))}; a state with a leading replica axis is "
                "updated inside pmap/shard_map, one replica at a time"
            )
        proposed, new_inner_state = inner.update(grads, state.inner_state, params, **extra)
        # The one boundary where the packed state is read (and, below, written).
        counts, window = state.counts, state.spike_window

        leaves = jax.tree.leaves(grads)
        sharded = sharded_leaves(leaves, config)
        replicated = [x for x, s in zip(leaves, sharded, strict=True) if not s]
        grad_norm = _grad_norm(grads, leaves, sharded, config.axis_name)
        observed = jnp.stack([grad_norm, jnp.float32(0) if loss is None else loss])
        x = jnp.stack([jnp.log(grad_norm), observed[1]])  # what the statistics hold
        used = jnp.asarray([True, loss is not None])
        update_squares, unless_held = held_updates(proposed, checked=config.check_nonfinite)

        # Every check returns its reasons; the replicas then share theirs, and decide together.
        reason = jnp.int32(0)
        if config.check_nonfinite:
            reason |= nonfinite_reasons(grad_norm, update_squares, loss)
        active = (config.grad_norm_zscore is not None, config.loss_zscore is not None)
        reason |= spike_reasons(window, x, (active[0], active[1] and loss is not None), config)
        if config.check_abft and abft_uncorrectable is not None:
            reason |= abft_reasons(abft_uncorrectable)
        recheck = counts.recheck != 0
        reason |= triage.recomputation_reasons(
            observed, window.expected, used, recheck, config.triage_rtol
        )
        odd_replica = jnp.int32(-1)
        if config.axis_name is not None:
            # Under ZeRO/FSDP the replicas share the replicated leaves and the summed norm.
            shared = [*replicated, grad_norm] if any(sharded) else replicated
            reason, odd_replica = replica_reasons(
                shared, reason, config.axis_name, extra.get("replicas")
            )
        decision = triage.decide(reason, recheck, config.real_spike)

        # A select, not _unless: XLA fuses it into the caller's apply_updates, and the sums
        # stay bit-identical to the unguarded step's (through the loop they differed by an ulp).
        out_updates = unless_held(decision.hold)
        inner_state = _unless(decision.hold, new_inner_state, state.inner_state)
        # Statistics: what was accepted (a real spike too), never what was refused.
        window = window.push(x, used & ~decision.refuse)._replace(
            last=observed, expected=jnp.zeros_like(observed)
        )
        counts = _count(counts, decision, odd_replica)
        new_state = GuardState(
            inner_state=inner_state,
            refused=state.refused + decision.refuse.astype(jnp.int32),
            reason=decision.reason,
            rollback_needed=counts.consecutive >= config.max_consecutive,
            counters=counts.pack(),
            statistics=window.pack(),
        )
        return out_updates, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _extra_scalars(extra: dict):
    """The ``loss`` (float32) and ``abft_uncorrectable`` extra arguments, or None where absent."""
    loss = extra.get("loss")
    abft_uncorrectable = extra.get("abft_uncorrectable")
    if loss is not None:
        loss = _scalar_argument(
            "loss", loss, "pass the batch's mean loss (e.g. loss=jnp.mean(per_example))"
        ).astype(jnp.float32)
    if abft_uncorrectable is not None:
        abft_uncorrectable = _scalar_argument(
            "abft_uncorrectable",
            abft_uncorrectable,
            "pass sdcguard.unsafe_checks(counts), the count of checks left unsafe, "
            "not the counters themselves",
        )
    return loss, abft_uncorrectable


def _grad_norm(grads, leaves, sharded: list[bool], axis_name) -> jax.Array:
    """The global gradient norm, float32; shards' squares summed over ``axis_name``."""
    if not any(sharded):
        return global_norm(grads)
    mine = [x for x, s in zip(leaves, sharded, strict=True) if s]
    everyone = [x for x, s in zip(leaves, sharded, strict=True) if not s]
    return jnp.sqrt(sum_of_squares(everyone) + jax.lax.psum(sum_of_squares(mine), axis_name))


def _count(counts: Counters, decision: triage.TriageDecision, odd_replica) -> Counters:
    """The counters after an update decided as ``decision``."""
    recheck = counts.recheck != 0
    bits = jnp.array([int(r) for r in Reason], jnp.int32)
    entry = jnp.stack([counts.steps, counts.recheck, decision.outcome])
    slot = (jnp.arange(TRIAGE_LOG) == counts.triaged % TRIAGE_LOG) & recheck
    return Counters(
        steps=counts.steps + 1,
        consecutive=jnp.where(decision.refuse, counts.consecutive + 1, 0),
        odd_replica=odd_replica,
        skipped=counts.skipped + decision.skipped,
        triaged=counts.triaged + recheck,
        reproduced=counts.reproduced + decision.reproduced,
        sdc_events=counts.sdc_events + decision.differed,
        triage=decision.outcome,
        triage_reason=jnp.where(recheck, counts.recheck, 0),
        recheck=jnp.int32(0),
        reason_counts=counts.reason_counts + ((decision.reason & bits) != 0).astype(jnp.int32),
        triage_log=jnp.where(slot[:, None], entry[None, :], counts.triage_log),
    )
