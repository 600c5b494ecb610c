"""What the update guard checks: :class:`GuardConfig`.

Example:
  >>> GuardConfig(grad_norm_zscore=8.0, loss_zscore=None, axis_name="data")
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable


@dataclasses.dataclass(frozen=True, kw_only=True)
class GuardConfig:
    """What the update guard checks.

    Attributes:
      check_nonfinite: refuse when a gradient, a proposed update or the loss is NaN or Inf.
      grad_norm_zscore: a spike is a log gradient norm more than this many robust standard
        deviations (the median-to-upper-quartile distance / 0.6745) above the median of the last
        ``window`` accepted ones; None
        disables the gradient-norm check.
      grad_norm_min_ratio: ...and more than this many times that median. Gradient norms of
        clean training are heavy-tailed (the reference GPT reaches 3.6x its recent values), so
        a z-score alone would flag healthy steps.
      loss_zscore: the same for the ``loss`` extra argument (on the loss itself, which may be
        negative); None disables.
      loss_min_ratio: the loss's counterpart of ``grad_norm_min_ratio`` (a margin of
        ``(ratio - 1) * |median|``); it also keeps an almost constant loss from turning tiny
        wiggles into huge z-scores.
      window: how many recent accepted values the statistics hold (a ring in the state); the
        order statistics compare every pair, so the cost grows as ``window**2``.
      warmup: accepted values needed before the median check; before that, only the
        absurd is refused (``warmup_max_ratio``).
      warmup_max_ratio: a gradient norm more than this many times every one in the window (a
        loss more than ``(ratio - 1) * |max|`` above the largest) is a spike, in the warm-up
        and after it (where a window that straddles a real change has a wide spread).
      check_abft: refuse when the ``abft_uncorrectable`` extra argument is positive (pass
        :func:`sdcguard.unsafe_checks` of the counters: uncorrectable and non-finite
        inputs).
      max_consecutive: refusals in a row after which ``rollback_needed`` is set.
      axis_name: a data-parallel axis (``shard_map``/``pmap``) over which the replicas must
        agree; None disables the cross-replica check.
      gradients: how the gradients lie over ``axis_name``: ``"replicated"`` (all-reduced:
        every replica holds every gradient, and their fingerprints must agree), ``"sharded"``
        (ZeRO/FSDP: ``psum_scatter`` left each replica a different shard; the norm is summed
        over the axis and the replicas compare what they share: the global norm and the
        fingerprints of replicated leaves), or ``"auto"`` (per leaf, from the type that
        ``shard_map`` gives it: a leaf that varies over the axis is a shard; under ``pmap`` or
        ``check_vma=False`` no type says so, and every leaf counts as replicated).
      real_spike: what a spike that triage reproduced bit for bit does: ``"accept"`` (apply
        the update) or ``"skip"`` (leave parameters and optimizer state unchanged, like a
        refusal, but without counting towards a rollback). Either way the statistics take it.
      triage_rtol: how close a recomputation's gradient norm and loss must be to the first
        pass's to count as the same: 0 means bit-identical (XLA recomputes a step bit for bit
        on the same device and program); a backend with nondeterministic reductions needs a
        small tolerance (e.g. 1e-4: a spike that corruption caused disappears by far more).

    Example:
      >>> GuardConfig(grad_norm_zscore=8.0, loss_zscore=None, axis_name="data")
    """

    check_nonfinite: bool = True
    grad_norm_zscore: float | None = 6.0
    grad_norm_min_ratio: float = 8.0
    loss_zscore: float | None = 6.0
    loss_min_ratio: float = 1.5
    window: int = 32
    warmup: int = 8
    warmup_max_ratio: float = 20.0
    check_abft: bool = True
    max_consecutive: int = 3
    axis_name: Hashable | None = None
    gradients: str = "auto"
    real_spike: str = "accept"
    triage_rtol: float = 0.0

    def __post_init__(self):
        for name in ("grad_norm_zscore", "loss_zscore"):
            z = getattr(self, name)
            if z is not None and not z > 0:
                raise ValueError(f"{name} must be positive or None (disabled), got {z}")
        if self.window < 4:
            raise ValueError(f"window must be >= 4 to estimate a spread, got {self.window}")
        if not 2 <= self.warmup <= self.window:
            raise ValueError(
                f"warmup must be between 2 and window={self.window}, got {self.warmup}"
            )
        for name in ("grad_norm_min_ratio", "loss_min_ratio", "warmup_max_ratio"):
            ratio = getattr(self, name)
            if not ratio >= 1:
                raise ValueError(f"{name} must be >= 1 (1: no floor), got {ratio}")
        if self.max_consecutive < 1:
            raise ValueError(f"max_consecutive must be >= 1, got {self.max_consecutive}")
        if self.gradients not in ("auto", "replicated", "sharded"):
            raise ValueError(
                f"gradients must be 'auto', 'replicated' or 'sharded', got {self.gradients!r}"
            )
        if self.real_spike not in ("accept", "skip"):
            raise ValueError(f"real_spike must be 'accept' or 'skip', got {self.real_spike!r}")
        if not self.triage_rtol >= 0:
            raise ValueError(f"triage_rtol must be >= 0 (0: bit-identical), got {self.triage_rtol}")
