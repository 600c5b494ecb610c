"""Why the update guard refused an update, and what triage made of a spike.

A refusal's reasons are an int32 bit mask, one bit per check (:class:`Reason`); every check of
the checks returns such a mask and the guard ORs them.
:func:`reason_names` decodes a mask for people, :func:`combined_reason` joins the masks of
replicas that took one decision.

Example:
  >>> reason_names(Reason.NONFINITE | Reason.LOSS_SPIKE)
  ('nonfinite', 'loss_spike')
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp
import numpy as np


class Reason(enum.IntFlag):
    """Why an update was refused; one bit per check, combined into an int32 mask."""

    NONFINITE = 1  # a gradient, a proposed update or the loss is NaN or +-Inf
    GRAD_NORM_SPIKE = 2  # gradient norm far above its recent values
    LOSS_SPIKE = 4  # loss far above its recent values
    ABFT_UNCORRECTABLE = 8  # the protected layers left an error they could not correct
    REPLICA_MISMATCH = 16  # this step's gradients differ between data-parallel replicas


# The checks whose verdict triage may overturn: a spike can be real; the others cannot.
SPIKES = Reason.GRAD_NORM_SPIKE | Reason.LOSS_SPIKE


class Triage(enum.IntEnum):
    """The outcome of triaging a spike by recomputing its step (:func:`with_triage`)."""

    NONE = 0  # the update was not a recomputation
    REAL_ACCEPTED = 1  # bit-identical again: a real spike; the update was applied
    REAL_SKIPPED = 2  # bit-identical again: a real spike; the batch was skipped (policy)
    SDC_CORRECTED = 3  # different: the first pass was corrupted; the recomputation was used
    REFUSED = 4  # the recomputation failed a check too: refused (an SDC event if it differed)


def flag(condition: jax.Array, reason: int) -> jax.Array:
    """``reason`` where ``condition`` holds, else 0: an int32 mask of one check."""
    return jnp.where(condition, jnp.int32(reason), jnp.int32(0))


def combined_reason(mask) -> int:
    """The OR of a concrete reason mask over all its elements (a leading replica axis from
    ``pmap``: replicas take one decision, so in a healthy run they agree).

    Raises:
      ValueError: ``mask`` is empty or not an integer array.

    Example:
      >>> combined_reason(np.array([1, 16], np.int32))
      17
    """
    values = np.asarray(mask).reshape(-1)
    if values.size == 0 or not np.issubdtype(values.dtype, np.integer):
        raise ValueError(f"a guard reason mask is an integer scalar or array, got {mask!r}")
    return int(np.bitwise_or.reduce(values.astype(np.int64)))


def reason_names(mask) -> tuple[str, ...]:
    """Decodes a reason mask (an int or a concrete array) into check names.

    An array with more than one element (a guard state with a leading replica axis, from
    ``pmap``) gives the names of the bits set in any element (:func:`combined_reason`).

    Example:
      >>> reason_names(Reason.NONFINITE | Reason.LOSS_SPIKE)
      ('nonfinite', 'loss_spike')
    """
    value = combined_reason(mask)
    known = sum(int(r) for r in Reason)
    if np.min(mask) < 0 or value & ~known:
        raise ValueError(
            f"{np.asarray(mask).reshape(-1).tolist()} is not a guard reason mask: valid bits are "
            f"{', '.join(f'{r.name}={int(r)}' for r in Reason)}"
        )
    return tuple(r.name.lower() for r in Reason if value & r)
