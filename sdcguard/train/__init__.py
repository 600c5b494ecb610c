"""Protected training: one step that checks every GEMM and guards every update.

:func:`protected_step` wires :func:`sdcguard.checked` (ABFT on every GEMM of the loss and its
gradients) to :func:`sdcguard.refuse_corrupted` (the update guard) around your loss function
and Optax optimizer; :func:`sdcguard.train_with_recovery` rolls back when the guard asks. With
``every=k`` the GEMMs are checked on one step in ``k`` (:func:`checks_at`), the guard on all.
See docs/training.md.

Example:
  >>> protected = protected_step(loss_fn, optax.adamw(1e-3))
  >>> state = protected.init(params)
  >>> state, out = protected(state, batch)       # out.loss, out.counts, out.reasons
"""

from sdcguard.train._schedule import checks_at as checks_at
from sdcguard.train._step import (
    ProtectedStep as ProtectedStep,
    StepOutput as StepOutput,
    protected_step as protected_step,
)

__all__ = ["ProtectedStep", "StepOutput", "checks_at", "protected_step"]
