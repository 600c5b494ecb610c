"""The update guard's spike statistics: a window of recent accepted values and its order
statistics.

Two values are monitored, one per row: the log of the global gradient norm and the loss. Each
row keeps a ring of the last ``window`` *accepted* values (:class:`SpikeWindow`); a spike is a
value far above the ring's median, measured in robust deviations (:func:`spike_flags`). A refused
value never enters the ring, and one real outlier that does moves a median by one rank.

In the guard's state the window travels packed, as one float32 array ``[2, window + 4]``
(:meth:`SpikeWindow.pack`), the field ``GuardState.statistics`` (one buffer, not ten).

Example:
  >>> window = SpikeWindow.empty(32)
  >>> window = window.push(jnp.array([0.1, 2.3]), jnp.array([True, True]))
  >>> window.pack().shape
  (2, 36)
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from sdcguard.guard._config import GuardConfig

ROWS = ("grad_norm", "loss")  # the monitored values, one row each
# A normal distribution's upper quartile lies 0.6745 standard deviations above its median.
QUARTILE_TO_SIGMA = 1 / 0.6745
_TAIL = 4  # packed columns after the window: fill, position, last, expected


class RobustStats(NamedTuple):
    """A summary of the statistics of one monitored value (float32 scalars, int32 count).

    center: the median of the window (of log gradient norms, or of losses).
    spread: a robust standard deviation: (upper quartile - median) / 0.6745.
    count: values in the window (at most ``window``).
    """

    center: jax.Array
    spread: jax.Array
    count: jax.Array


class SpikeWindow(NamedTuple):
    """The spike statistics of both rows (log gradient norm, loss); float32, any leading axes.

    values: ``[..., 2, window]``, a ring of accepted values (log gradient norms, losses).
    fill: ``[..., 2]``, how many slots of the ring hold a value.
    position: ``[..., 2]``, the slot the next accepted value goes to.
    last: ``[..., 2]``, the last update's raw values (gradient norm, loss; 0 without a loss).
    expected: ``[..., 2]``, when the next update is a triage recomputation, the first pass's
      raw values it is compared with (see :func:`sdcguard.guard.with_triage`); else 0.
    """

    values: jax.Array
    fill: jax.Array
    position: jax.Array
    last: jax.Array
    expected: jax.Array

    @classmethod
    def empty(cls, window: int) -> SpikeWindow:
        zero = jnp.zeros((len(ROWS),), jnp.float32)
        return cls(jnp.zeros((len(ROWS), window), jnp.float32), zero, zero, zero, zero)

    @property
    def window(self) -> int:
        return self.values.shape[-1]

    def pack(self) -> jax.Array:
        """float32 ``[..., 2, window + 4]``: the values, then fill, position, last, expected."""
        tail = [self.fill, self.position, self.last, self.expected]
        return jnp.concatenate([self.values, *(x[..., None] for x in tail)], axis=-1)

    @classmethod
    def unpack(cls, packed) -> SpikeWindow:
        """The window of a packed array (a jax or numpy array, any leading axes)."""
        w = packed.shape[-1] - _TAIL
        return cls(packed[..., :w], *(packed[..., w + i] for i in range(_TAIL)))

    def push(self, x: jax.Array, take: jax.Array) -> SpikeWindow:
        """Writes ``x[r]`` into row ``r``'s ring where ``take[r]`` (and ``x[r]`` is finite)."""
        w = self.window
        take = take & jnp.isfinite(x)
        pos = self.position
        slot = (jnp.arange(w) == pos[:, None].astype(jnp.int32)) & take[:, None]
        return self._replace(
            values=jnp.where(slot, x[:, None], self.values),
            fill=jnp.where(take, jnp.minimum(self.fill + 1, w), self.fill),
            position=jnp.where(take, jnp.where(pos + 1 >= w, 0.0, pos + 1), pos),
        )

    def summary(self, row: int) -> RobustStats:
        """The :class:`RobustStats` of row ``row`` (0: log gradient norm, 1: loss)."""
        median, spread, _, fill = order_statistics(self)
        empty = fill[..., row] == 0
        return RobustStats(
            center=jnp.where(empty, 0.0, median[..., row]),
            spread=jnp.where(empty, 0.0, spread[..., row]),
            count=fill[..., row].astype(jnp.int32),
        )


def order_statistics(window: SpikeWindow):
    """Median, spread, maximum and fill of each row's window: four float32 ``[..., 2]``.

    The spread is the distance from the median to the upper quartile, scaled to a standard
    deviation: robust like the MAD, and it widens with a heavy upper tail (which is where
    spikes are looked for). Order statistics come from ranks (a ``window x window``
    comparison), not a sort: a few fused elementwise kernels where XLA:CPU's sort of a
    32-element row costs tens of microseconds. Unfilled slots rank last; no value outside
    the window, and at most one rank per outlier, moves them.
    """
    fill = window.fill
    valid = jnp.arange(window.window) < fill[..., None]
    v = jnp.where(valid, window.values, jnp.inf)
    below = v[..., None, :] < v[..., :, None]  # [..., 2, j, i]: v_i < v_j
    less = jnp.sum(below, axis=-1)
    tied = jnp.sum(v[..., None, :] == v[..., :, None], axis=-1)
    n = fill.astype(jnp.int32)

    def kth(k):  # the k-th smallest valid value (k from 0)
        k = jnp.clip(k, 0, jnp.maximum(n - 1, 0))[..., None]
        hit = (less <= k) & (k < less + tied) & valid
        return jnp.max(jnp.where(hit, v, -jnp.inf), axis=-1)

    median = 0.5 * (kth((n - 1) // 2) + kth(n // 2))
    upper = kth((3 * n) // 4)
    spread = QUARTILE_TO_SIGMA * jnp.maximum(upper - median, 0.0)
    largest = jnp.max(jnp.where(valid, window.values, -jnp.inf), axis=-1)
    return median, spread, largest, fill


def spike_flags(window: SpikeWindow, x: jax.Array, active, config: GuardConfig) -> jax.Array:
    """Whether each transformed value ``x`` ([2]: log gradient norm, loss) is a spike: bool [2].

    Only upward spikes count: a falling loss or gradient norm is what training is for.
    ``active`` ([2] bools) switches a row's check off (disabled, or no loss given).
    """
    median, spread, largest, fill = order_statistics(window)
    zscores = [config.grad_norm_zscore or 0.0, config.loss_zscore or 0.0]
    # Margins: the gradient norm's are in log space (ratios), the loss's absolute.
    floor = jnp.stack(
        [
            jnp.float32(math.log(config.grad_norm_min_ratio)),
            (config.loss_min_ratio - 1.0) * jnp.abs(median[1]),
        ]
    )
    steady = x - median > jnp.maximum(jnp.asarray(zscores) * spread, floor)
    absurd_floor = jnp.stack(
        [
            jnp.float32(math.log(config.warmup_max_ratio)),
            (config.warmup_max_ratio - 1.0) * jnp.abs(largest[1]),
        ]
    )
    # Far above every value in the window: refused in the warm-up, and after it too, where a
    # window that straddles a real change (two levels) has a wide spread.
    absurd = (fill >= 1) & (x - largest > absurd_floor)
    spike = absurd | ((fill >= config.warmup) & steady)
    return spike & jnp.isfinite(x) & jnp.asarray(active)
