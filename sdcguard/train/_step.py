"""Protected training in one object: checked gradients, the update guard, sampled checking.

:func:`protected_step` takes a loss function and an Optax optimizer and returns a
:class:`ProtectedStep`: ``init(params)`` builds a :class:`sdcguard.TrainState` whose optimizer
is wrapped by :func:`sdcguard.refuse_corrupted`; ``step`` computes the loss and its gradients
with every GEMM checked by :func:`sdcguard.checked` and feeds the unsafe count to the guard;
calling the object runs ``step`` or the unchecked ``plain_step`` by the sampling schedule, each
compiled once. How to use it: docs/training.md.

Example:
  >>> protected = protected_step(loss_fn, optax.adamw(1e-3))
  >>> state = protected.init(params)
  >>> state, out = protected(state, batch)
  >>> out.loss, out.counts, out.reasons
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from sdcguard.fault_model import FaultPlan, faults
from sdcguard.guard import GuardConfig, reason_names, refuse_corrupted
from sdcguard.protection import ABFTConfig, GemmSite, checked, list_sites, total, unsafe_checks
from sdcguard.recovery import TrainState
from sdcguard.train import _inputs as inputs
from sdcguard.train._schedule import checks_at


class StepOutput(NamedTuple):
    """What one protected step reports, with no host sync (every field a device array).

    Attributes:
      loss: float32 ``[]``, the loss at the parameters before the update.
      aux: ``loss_fn``'s auxiliary output (``has_aux=True``), else None.
      report: ``{site: int32 [4]}`` ``[detected, corrected, uncorrectable, nonfinite_input]`` per
        checked GEMM site; ``{}`` on a step that was not checked.
      counts: int32 ``[4]``, ``report`` summed over its sites.
      checked: bool ``[]``, whether this step's GEMMs were checked.
      reason: int32 ``[]``, the guard's reason mask (:class:`sdcguard.Reason`); 0: accepted.
      rollback_needed: bool ``[]``, the guard asks for a rollback
        (:func:`sdcguard.train_with_recovery` answers it).
    """

    loss: jax.Array
    aux: Any
    report: dict[str, jax.Array]
    counts: jax.Array
    checked: jax.Array
    reason: jax.Array
    rollback_needed: jax.Array

    @property
    def accepted(self) -> jax.Array:
        """bool ``[]``: the guard accepted the update (works under ``jit``)."""
        return self.reason == 0

    @property
    def reasons(self) -> tuple[str, ...]:
        """The names of the checks that refused the update, on the host (``()``: accepted)."""
        return reason_names(jax.device_get(self.reason))


@dataclasses.dataclass(frozen=True, eq=False)
class ProtectedStep:
    """A training step whose GEMMs are checked and whose updates pass the guard.

    Build it with :func:`protected_step`. ``step`` and ``plain_step`` are pure functions of
    ``(state, batch, plan=None)`` returning ``(state, StepOutput)``, for your own ``jit``,
    ``shard_map`` or scan; calling the object runs the compiled one the schedule picks.

    Attributes:
      loss_fn, optimizer, abft, guard, has_aux, every, seed, with_rng: as given to
        :func:`protected_step`.
      tx: the guarded optimizer, ``refuse_corrupted(optimizer, config=guard)``.
      checked_program, plain_program: ``jax.jit`` of ``step`` and ``plain_step`` (what calling
        the object runs; each compiles once per argument structure).
    """

    loss_fn: Callable
    optimizer: Any
    abft: ABFTConfig
    guard: GuardConfig
    has_aux: bool
    every: int
    seed: int
    with_rng: bool = False
    tx: optax.GradientTransformationExtraArgs = dataclasses.field(init=False)
    checked_program: Callable = dataclasses.field(init=False)
    plain_program: Callable = dataclasses.field(init=False)
    _last: list = dataclasses.field(init=False, default_factory=list)

    def __post_init__(self):
        # Derived fields of a frozen dataclass.
        object.__setattr__(self, "tx", refuse_corrupted(self.optimizer, config=self.guard))
        object.__setattr__(self, "checked_program", jax.jit(self.step))
        object.__setattr__(self, "plain_program", jax.jit(self.plain_step))

    def init(self, params, rng: jax.Array | None = None) -> TrainState:
        """The train state at step 0: ``params``, the guarded optimizer's state, and ``rng``.

        Args:
          params: the parameters to train (floating-point arrays; fp32 with bf16/fp16 compute
            is the usual mixed precision).
          rng: a PRNG key carried in the state (default ``jax.random.key(seed)``). With
            ``with_rng``, each step draws its key from it (:meth:`rng_at`); otherwise the step
            does not use it.

        Raises:
          TypeError: a parameter is not a floating-point array.
          ValueError: the optimizer was already wrapped by ``refuse_corrupted``.
        """
        inputs.check_params(params, self.optimizer)
        rng = jax.random.key(self.seed) if rng is None else rng
        return TrainState(jnp.zeros((), jnp.int32), params, self.tx.init(params), rng)

    def rng_at(self, state: TrainState) -> jax.Array:
        """The key ``loss_fn`` gets at ``state``'s step with ``with_rng``:
        ``fold_in(state.rng, state.step)``, fresh on every step and the same whenever that step
        is computed again (checked or not, after a rollback, in a replay)."""
        return jax.random.fold_in(state.rng, state.step)

    def list_sites(self, state: TrainState, batch) -> list[GemmSite]:
        """The GEMM sites of :meth:`step`, the loss's and its gradients', by the names its
        report and fault plans use (:func:`sdcguard.list_sites` of ``loss_fn`` alone names a
        plain function's GEMMs ``fn:...`` and has no gradients).

        Example:
          >>> names = [s.name for s in protected.list_sites(state, batch) if s.checked]
        """
        rng = self.rng_at(state) if self.with_rng else None
        return list_sites(self._gradients(), state.params, batch, rng, config=self.abft)

    def checks_at(self, step: int) -> bool:
        """Whether calling the object at ``step`` runs the checked program (host ints only)."""
        return checks_at(step, every=self.every, seed=self.seed)

    def step(self, state: TrainState, batch, plan: FaultPlan | None = None):
        """One step with every GEMM of the loss and its gradients checked (jittable).

        Args:
          state: a :class:`sdcguard.TrainState` from :meth:`init` or a previous step.
          batch: ``loss_fn``'s second argument (any pytree).
          plan: faults to inject (:class:`sdcguard.FaultPlan`, at ``state.step``); None: none.

        Returns:
          ``(new state, StepOutput)``; a refused update leaves ``params`` and ``opt_state``'s
          inner state bit for bit (``state.step`` counts every step).
        """
        return self._run(state, batch, plan, self.abft)

    def plain_step(self, state: TrainState, batch, plan: FaultPlan | None = None):
        """The same step with no GEMM checked; the guard still runs (jittable).

        With a ``plan``, faults are injected at the same GEMM sites as in :meth:`step` and go
        unchecked (what a campaign of sampled checking measures).
        """
        if plan is None:
            return self._run(state, batch, None, None)
        return self._run(state, batch, plan, dataclasses.replace(self.abft, include=()))

    def __call__(self, state: TrainState, batch, plan: FaultPlan | None = None):
        """Runs :attr:`checked_program` or :attr:`plain_program`, as :meth:`checks_at` says.

        The step number is read from ``state.step`` only when ``state`` did not come from the
        previous call (a restored state): the loop does not wait for the device.
        """
        step = self._host_step(state)
        program = self.checked_program if self.checks_at(step) else self.plain_program
        new_state, out = program(state, batch, plan)
        self._last[:] = [new_state.step, step + 1]
        return new_state, out

    # --- internals -----------------------------------------------------------------------------

    def _host_step(self, state) -> int:
        if self._last and state.step is self._last[0]:
            return self._last[1]
        if isinstance(state.step, jax.core.Tracer):
            raise TypeError(
                "a ProtectedStep object picks its compiled program on the host, so it cannot "
                "run under jax.jit or another transformation; there, call protected.step (or "
                "protected.plain_step), the pure step function"
            )
        return int(state.step)

    def _loss(self, params, batch, rng):
        out = self.loss_fn(params, batch, rng) if self.with_rng else self.loss_fn(params, batch)
        loss, aux = inputs.split_loss(out, self.has_aux, self.loss_fn)
        return loss.astype(jnp.float32), aux

    def _gradients(self) -> Callable:
        # The function checked runs: site names start at loss_fn (its own frame is dropped).
        return jax.value_and_grad(self._loss, has_aux=True)

    def _run(self, state, batch, plan, abft: ABFTConfig | None):
        rng = self.rng_at(state) if self.with_rng else None
        if abft is None:
            ((loss, aux), grads), report = self._gradients()(state.params, batch, rng), {}
        else:
            with faults(None if plan is None else plan.at_step(state.step)):
                ((loss, aux), grads), report = checked(self._gradients(), abft)(
                    state.params, batch, rng
                )
        counts = total(report)

        def value_fn(params, loss=None, abft_uncorrectable=None):
            # The loss at other parameters (optax.lbfgs's line search). The line search passes
            # it the update's other extra arguments by name: the guard's, unused here.
            del loss, abft_uncorrectable
            return self._loss(params, batch, rng)[0]

        # Besides the guard's own arguments, those Optax's optimizers that need the loss take
        # (optax.contrib.reduce_on_plateau, polyak_sgd, lbfgs); the others ignore them.
        new_state = state.apply_gradients(
            self.tx, grads, loss=loss, abft_uncorrectable=unsafe_checks(counts),
            value=loss, grad=grads, value_fn=value_fn,
        )  # fmt: skip
        opt_state = new_state.opt_state
        out = StepOutput(
            loss=loss,
            aux=aux,
            report=report,
            counts=counts,
            checked=jnp.asarray(abft is not None and abft.include != ()),
            reason=opt_state.reason,
            rollback_needed=opt_state.rollback_needed,
        )
        return new_state, out


def protected_step(
    loss_fn: Callable,
    optimizer,
    *,
    abft: ABFTConfig | None = None,
    guard: GuardConfig | None = None,
    has_aux: bool = False,
    every: int = 1,
    seed: int = 0,
    with_rng: bool = False,
) -> ProtectedStep:
    """A protected training step for ``loss_fn`` and ``optimizer``.

    Args:
      loss_fn: ``loss_fn(params, batch) -> loss`` (a scalar), or ``-> (loss, aux)`` with
        ``has_aux=True``. Compute in bf16/fp16 inside it if you like; parameters keep their
        dtype, and the loss is reported as float32.
      optimizer: any Optax transformation, not yet wrapped by :func:`sdcguard.refuse_corrupted`
        (the step wraps it). Its ``update`` also receives ``value=loss``, ``grad=grads`` and
        ``value_fn`` (the loss at given parameters, on this batch), as Optax's optimizers that
        need the loss expect (``optax.contrib.reduce_on_plateau``, ``polyak_sgd``, ``lbfgs``).
      abft: which GEMMs :func:`sdcguard.checked` checks and how (default ``ABFTConfig()``:
        every one, errors corrected in place).
      guard: the update guard's checks (default ``GuardConfig()``).
      has_aux: ``loss_fn`` returns ``(loss, aux)``.
      every: check the GEMMs on one step in each window of ``every`` steps, at a random
        position drawn from ``seed`` (1: every step); the guard runs on every step.
      seed: the sampling schedule's seed, and the default ``rng`` of :meth:`ProtectedStep.init`.
      with_rng: call ``loss_fn(params, batch, rng)`` with a PRNG key for this step (dropout):
        ``fold_in(state.rng, state.step)`` (:meth:`ProtectedStep.rng_at`), fresh on every step,
        the same whenever a step is computed again.

    Returns:
      A :class:`ProtectedStep`: ``init(params)``, then ``state, out = protected(state, batch)``.

    Raises:
      TypeError: ``optimizer`` is not an Optax transformation, or ``loss_fn`` is not callable
        or does not take the arguments the step passes (two, or three with ``with_rng``).
      ValueError: ``every`` is not an int >= 1, or ``abft`` sets a field only the Flax drop-in
        layers read.

    Example:
      >>> protected = protected_step(loss_fn, optax.adamw(1e-3), every=4)
      >>> state = protected.init(params)
      >>> for batch in data:
      ...     state, out = protected(state, batch)
    """
    inputs.check_loss_fn(loss_fn, with_rng)
    inputs.check_optimizer(optimizer)
    inputs.check_schedule(every, seed)
    abft = (ABFTConfig() if abft is None else abft).validate_for_checked()
    guard = GuardConfig() if guard is None else guard
    return ProtectedStep(loss_fn, optimizer, abft, guard, has_aux, every, seed, with_rng)
