"""Which steps a sampled protected step checks: one step at a random position in each window.

With ``every=k``, steps ``[w*k, (w+1)*k)`` form window ``w``; exactly one of them is checked,
at an offset drawn from ``(seed, w)``. The cost is exactly ``1/k`` checked steps, and a fault
that recurs with a period cannot hide in the gaps of a fixed stride. Decided on the host from
integers alone: no device work, no sync.

Example:
  >>> [checks_at(s, every=4, seed=0) for s in range(8)]
  [False, False, False, True, False, False, True, False]
"""

from __future__ import annotations

_MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: a well-mixed 64-bit integer from ``x``."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def checked_offset(window: int, *, every: int, seed: int) -> int:
    """The position in window ``window`` (steps ``window*every ...``) of its checked step."""
    return _mix(_mix(seed & _MASK) ^ window) % every


def checks_at(step: int, *, every: int, seed: int) -> bool:
    """Whether ``step`` (an int, 0-based) is a checked step of the schedule ``(every, seed)``."""
    if every == 1:
        return True
    window, position = divmod(int(step), every)
    return position == checked_offset(window, every=every, seed=seed)
