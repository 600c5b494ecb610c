"""Recovery behind the update guard: the training loop that rolls back when refusing is not enough.

Three tiers, cheapest first:

1. The guard (:func:`sdcguard.guard.refuse_corrupted`) refuses a corrupted update: nothing to
   restore.
2. :class:`~sdcguard.recovery.SnapshotRing` keeps the last few *good* train states in host
   memory, copied asynchronously while training goes on.
3. :class:`~sdcguard.recovery.CheckpointTier` keeps train states on disk with Orbax, for
   crashes and for corruption older than every snapshot.

:func:`train_with_recovery` ties them together (a :class:`RecoveryLoop`): when the guard reports
``rollback_needed`` it restores the newest intact stored state taken before the refusals began (a
corrupt snapshot or checkpoint is reported in ``RunReport.corrupt`` and passed over for an older
one) and either skips the offending batches or replays them; if refusals keep coming without
progress it walks further back, and finally gives up with an error rather than training on a
state it cannot trust. Every stored state is verified against its bit fingerprints
before it is used.

Example:
  >>> report = train_with_recovery(jax.jit(step), state, data.batch, num_batches=1000,
  ...                              config=RecoveryConfig(snapshot_every=10))
  >>> report.rollbacks, report.skipped
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import optax

from sdcguard.guard import Triage, TriageEvent, find_guard_state, last_verdict, reason_names
from sdcguard.recovery._checkpoints import CheckpointTier
from sdcguard.recovery._integrity import CheckpointCorrupted, RecoveryError, SnapshotCorrupted
from sdcguard.recovery._snapshots import SnapshotRing

log = logging.getLogger(__name__)


class TrainState(NamedTuple):
    """The whole state of a training run, as :func:`train_with_recovery` expects it.

    step: int32 scalar, optimizer steps taken (refused ones included). params: the model parameters.
    opt_state: the optimizer state; contains exactly one
    :class:`sdcguard.guard.GuardState`. rng: a PRNG key (typed ``jax.random.key`` or
    raw uint32 key data).
    """

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array

    def apply_gradients(self, tx, grads, **extra) -> TrainState:
        """The state after one update of ``tx`` (refused or not: ``step`` counts it).

        Args:
          tx: the optimizer (``refuse_corrupted(...)`` reads ``loss=`` and
            ``abft_uncorrectable=`` from ``extra``).
          grads: gradients, shaped like ``params``.
          **extra: passed on to ``tx.update``.

        Example:
          >>> state = state.apply_gradients(tx, grads, loss=loss, abft_uncorrectable=unsafe)
        """
        updates, opt_state = tx.update(grads, self.opt_state, self.params, **extra)
        params = optax.apply_updates(self.params, updates)
        return self._replace(step=self.step + 1, params=params, opt_state=opt_state)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecoveryConfig:
    """How :func:`train_with_recovery` snapshots, checkpoints and rolls back.

    Attributes:
      snapshot_every: take an in-memory snapshot every this many steps (of accepted states);
        None: only the initial one.
      keep_snapshots: snapshots kept in memory.
      checkpoint_every: save an Orbax checkpoint every this many steps (needs ``checkpoints``);
        None: never.
      on_rollback: ``'skip'`` drops the batches whose updates were refused when replaying from
        the snapshot (bad data, or faults that follow the data); ``'replay'`` replays them
        (transient hardware faults).
      max_rollbacks: rollbacks in a row, without training getting past the step where the
        refusals began, before giving up; each one goes one stored state further back.
    """

    snapshot_every: int | None = 10
    keep_snapshots: int = 3
    checkpoint_every: int | None = None
    on_rollback: str = "skip"
    max_rollbacks: int = 3

    def __post_init__(self):
        for name in ("snapshot_every", "checkpoint_every"):
            every = getattr(self, name)
            if every is not None and every < 1:
                raise ValueError(f"{name} must be >= 1 or None (never), got {every}")
        if self.keep_snapshots < 1:
            raise ValueError(f"keep_snapshots must be >= 1, got {self.keep_snapshots}")
        if self.on_rollback not in ("skip", "replay"):
            raise ValueError(f"on_rollback must be 'skip' or 'replay', got {self.on_rollback!r}")
        if self.max_rollbacks < 1:
            raise ValueError(f"max_rollbacks must be >= 1, got {self.max_rollbacks}")


class Rollback(NamedTuple):
    """One rollback: at ``at_step`` the state went back to ``to_step`` from ``source``."""

    at_step: int
    to_step: int
    source: str  # 'snapshot' or 'checkpoint'
    reasons: tuple[str, ...]


@dataclasses.dataclass
class RunReport:
    """What :func:`train_with_recovery` did.

    Attributes:
      state: the final train state.
      refused: ``(step, data_index, reasons)`` of every refused update.
      rollbacks: every rollback, in order.
      skipped: data indices never trained on (``on_rollback='skip'``).
      triage: every spike recomputed by triage, with its outcome.
      corrupt: every stored state (snapshot or checkpoint) found corrupt during a rollback and
        passed over, with the reason.
      steps_run: step-function calls, discarded and replayed ones included (the cost).
    """

    state: Any
    refused: list[tuple[int, int, tuple[str, ...]]] = dataclasses.field(default_factory=list)
    rollbacks: list[Rollback] = dataclasses.field(default_factory=list)
    skipped: list[int] = dataclasses.field(default_factory=list)
    triage: list[TriageEvent] = dataclasses.field(default_factory=list)
    corrupt: list[str] = dataclasses.field(default_factory=list)
    steps_run: int = 0

    @property
    def sdc_events(self) -> int:
        """Spikes that recomputing showed to be corruption."""
        return sum(e.outcome in ("sdc_corrected", "refused") for e in self.triage)


class _Dispatched(NamedTuple):
    state: Any
    step: int  # the step number the update was computed at
    data_index: int


@dataclasses.dataclass(eq=False)
class RecoveryLoop:
    """One run of :func:`train_with_recovery`: its inputs, and the state that decides rollbacks.

    The guard's verdict on step ``t`` is read after step ``t + 1`` has been dispatched, so the
    device always has work queued; on a rollback the speculative step is discarded.

    Attributes:
      step_fn, batch_at, num_batches, config, ring, checkpoints: as
        :func:`train_with_recovery` takes them (``ring``: the snapshot tier).
      report: what the run did so far; ``report.state`` is the newest dispatched state.
      skip: data indices never to train on (``on_rollback='skip'``).
      streak: the refused updates since the last accepted one.
      failed_rollbacks: rollbacks since training last got past an incident.
      incident_step: the first refused step of the last incident rolled back, or None.
      restored_step: the step the last rollback went back to, or None.

    Example:
      >>> loop = RecoveryLoop(step_fn, data.batch, 1000, RecoveryConfig(), SnapshotRing(3))
      >>> report = loop.run(state)
    """

    step_fn: Callable
    batch_at: Callable[[int], Any]
    num_batches: int
    config: RecoveryConfig
    ring: SnapshotRing
    checkpoints: CheckpointTier | None = None
    report: RunReport | None = None
    skip: set[int] = dataclasses.field(default_factory=set)
    streak: list[_Dispatched] = dataclasses.field(default_factory=list)
    failed_rollbacks: int = 0
    incident_step: int | None = None
    restored_step: int | None = None

    def __post_init__(self):
        if self.config.checkpoint_every is not None and self.checkpoints is None:
            raise ValueError("RecoveryConfig.checkpoint_every is set but no checkpoints= was given")

    def run(self, state, start_index: int = 0) -> RunReport:
        """Trains on batches ``start_index .. num_batches - 1``; returns the report.

        However the run ends, the snapshots and checkpoints it started are completed first
        (an error still propagates: a :class:`RecoveryError` carries the report so far as
        ``report``).
        """
        self.report = RunReport(state=state)
        self._check_checkpoint_directory(int(state.step))
        try:
            self._train(state, start_index)
        except BaseException as error:
            if isinstance(error, RecoveryError):
                error.report = self.report
            self._finish_saving(quietly=True)
            raise
        self._finish_saving()
        self.report.skipped = sorted(self.skip)
        return self.report

    def _train(self, state, cursor: int) -> None:
        self.ring.take(state, step=int(state.step), meta={"data_index": cursor})
        pending: _Dispatched | None = None
        while True:
            cursor = self._next_index(cursor)
            dispatched = None
            if cursor < self.num_batches:
                step = int(state.step) if pending is None else pending.step + 1
                dispatched = _Dispatched(self.step_fn(state, self.batch_at(cursor)), step, cursor)
                if pending is None:
                    _refuse_donation(state)
                self.report.steps_run += 1
                cursor += 1
            if pending is not None:
                rolled_back = self._judge(pending)
                if rolled_back is not None:
                    state, cursor = rolled_back
                    self.report.state, pending = state, None
                    continue
            if dispatched is None:
                break
            pending = dispatched
            state = self.report.state = dispatched.state

    def _check_checkpoint_directory(self, start_step: int) -> None:
        """Refuses, before step 0, a checkpoint directory that holds steps after the start:
        Orbax would write none of this run's checkpoints, and a rollback would delete them."""
        if self.checkpoints is None:
            return
        later = [s for s in self.checkpoints.steps() if s > start_step]
        if later:
            raise ValueError(
                f"train_with_recovery: the checkpoint directory {self.checkpoints.directory} "
                f"already holds steps {later}, after this run's start at step {start_step} "
                "(another run's, or this one's future): Orbax would write none of this run's "
                "checkpoints, and a rollback would delete those. Resume from the newest "
                "(CheckpointTier.restore(like=state) and start_index=meta['data_index']), or "
                "give this run a directory of its own"
            )

    def _finish_saving(self, quietly: bool = False) -> None:
        """Waits for the snapshots and checkpoints in flight; ``quietly`` (the run is ending on
        an error, which must not be masked) logs a failure to finish instead of raising it."""
        tiers = [self.ring] + ([self.checkpoints] if self.checkpoints is not None else [])
        for tier in tiers:
            try:
                tier.wait()
            except Exception:
                if not quietly:
                    raise
                log.exception("sdcguard: a save in flight did not finish")

    def _next_index(self, i: int) -> int:
        while i < self.num_batches and i in self.skip:
            i += 1
        return i

    def _judge(self, pending: _Dispatched):
        """Reads the guard's verdict on ``pending``: accepts it, records a refusal, or rolls
        back. Returns ``(restored state, data cursor)`` after a rollback, else None."""
        verdict = last_verdict(find_guard_state(pending.state.opt_state))
        if verdict.triage:
            self.report.triage.append(
                TriageEvent(
                    pending.step,
                    pending.data_index,
                    reason_names(verdict.triage_reason),
                    Triage(verdict.triage).name.lower(),
                )
            )
        if not verdict.reason:
            self._accept(pending)
            return None
        names = reason_names(verdict.reason)
        self.report.refused.append((pending.step, pending.data_index, names))
        self.streak.append(pending)
        if verdict.rollback_needed:
            return self._roll_back(pending.step, names)
        return None

    def _accept(self, done: _Dispatched) -> None:
        self.streak.clear()
        # Replaying the steps before the incident is not progress; getting past it is.
        if self.incident_step is None or done.step >= self.incident_step:
            self.failed_rollbacks, self.incident_step = 0, None
        step = done.step + 1
        meta = {"data_index": done.data_index + 1}
        every = self.config.snapshot_every
        if every is not None and step % every == 0:
            self.ring.take(done.state, step=step, meta=meta)
        every = self.config.checkpoint_every
        if every is not None and step % every == 0:
            self.checkpoints.save(step, done.state, meta=meta)

    def _roll_back(self, at_step: int, reasons: tuple[str, ...]):
        self.failed_rollbacks += 1
        if self.failed_rollbacks > self.config.max_rollbacks:
            raise RecoveryError(
                f"updates are still refused after {self.config.max_rollbacks} rollbacks in a row "
                f"(last reasons: {', '.join(reasons)}); the stored states or this hardware "
                "cannot be trusted: run `sdcguard compare` against a healthy node"
            )
        # The state every refused update started from; walk further back if the last rollback
        # already went there and training did not get past the incident since.
        target = self.streak[0].step
        self.incident_step = target
        if self.failed_rollbacks > 1 and self.restored_step is not None:
            target = min(target, self.restored_step - 1)
        if self.config.on_rollback == "skip":
            self.skip.update(d.data_index for d in self.streak)
        self.ring.drop_newer_than(target)
        restored, meta, source, to_step = self._restore_newest_intact(at_step, target)
        if self.checkpoints is not None:
            self.checkpoints.delete_newer_than(to_step)
        self.restored_step = to_step
        self.report.rollbacks.append(Rollback(at_step, to_step, source, reasons))
        log.warning(
            "sdcguard: %d refused updates in a row at step %d (%s): rolled back to %s of step %d",
            len(self.streak),
            at_step,
            ", ".join(reasons),
            source,
            to_step,
        )
        self.streak.clear()
        if "data_index" not in meta:
            raise RecoveryError(
                f"rolled back to the {source} of step {to_step}, but it records no data index "
                "(a checkpoint that plain Orbax wrote): restore it yourself and call "
                "train_with_recovery(..., start_index=...) with the data index it belongs to"
            )
        return restored, int(meta["data_index"])

    def _restore_newest_intact(self, at_step: int, target: int):
        """The newest intact stored state at or before ``target``, from either tier (a snapshot
        before a checkpoint of the same step): ``(state, meta, source, step)``. A corrupt one is
        reported and passed over."""
        candidates = [("snapshot", s.step, s) for s in self.ring.snapshots() if s.step <= target]
        if self.checkpoints is not None:
            candidates += [("checkpoint", s, None) for s in self.checkpoints.steps() if s <= target]
        candidates.sort(key=lambda c: (-c[1], c[0] != "snapshot"))
        if not candidates:
            raise RecoveryError(
                f"rollback needed at step {at_step} but no snapshot or checkpoint exists at or "
                f"before step {target}; keep more snapshots (RecoveryConfig.keep_snapshots) or "
                "enable Orbax checkpoints"
            )
        tried = []
        for source, to_step, snapshot in candidates:
            try:
                if snapshot is not None:
                    return snapshot.restore(), snapshot.meta, source, to_step
                restored, meta = self.checkpoints.restore(like=self.report.state, step=to_step)
                return restored, meta, source, to_step
            except (SnapshotCorrupted, CheckpointCorrupted) as e:
                tried.append(f"{source} of step {to_step}: {e}")
                self.report.corrupt.append(tried[-1])
                log.warning("sdcguard: %s; trying an older stored state", tried[-1])
                if snapshot is not None:
                    self.ring.discard(snapshot)
        raise RecoveryError(
            f"rollback needed at step {at_step} but no stored state at or before step "
            f"{target} is intact; tried, newest first:\n  " + "\n  ".join(tried)
        )


def _refuse_donation(state) -> None:
    """Raises if the step deleted its input state's arrays (``jax.jit(step,
    donate_argnums=0)``): the loop reads each state again after the next step is dispatched."""
    if any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves(state)):
        raise ValueError(
            "train_with_recovery: step_fn donated its input state (jax.jit(..., "
            "donate_argnums=0)), so the state's arrays were deleted. The loop reads the guard's "
            "verdict on each state, and snapshots it, after the next step is dispatched: jit "
            "the step without donating the state (donating the batch is fine)"
        )


def train_with_recovery(
    step_fn: Callable,
    state,
    batch_at: Callable[[int], Any],
    *,
    num_batches: int,
    config: RecoveryConfig = RecoveryConfig(),
    snapshots: SnapshotRing | None = None,
    checkpoints: CheckpointTier | None = None,
    start_index: int = 0,
) -> RunReport:
    """Trains on batches ``start_index .. num_batches - 1``, rolling back when the guard asks.

    The guard's verdict on step ``t`` is read after step ``t + 1`` has been dispatched, so the
    device always has work queued and the clean path never waits on the host; on a rollback the
    speculative step is discarded. Snapshots and checkpoints are taken only of states whose
    update was accepted.

    Args:
      step_fn: ``step_fn(state, batch) -> state``, usually jitted; ``state.opt_state`` holds
        the guard (:func:`sdcguard.guard.refuse_corrupted`) and ``state.step`` counts
        steps.
      state: the initial train state (e.g. :class:`TrainState`).
      batch_at: ``batch_at(i)`` is data batch ``i``; called again for replayed batches.
      num_batches: the end of the data.
      config: snapshot, checkpoint and rollback policy.
      snapshots: the in-memory tier; default a new ``SnapshotRing(config.keep_snapshots)``.
      checkpoints: the Orbax tier, used when ``config.checkpoint_every`` is set and as the last
        resort of a rollback.
      start_index: the first data index (e.g. from a restored checkpoint's meta).

    Returns:
      A :class:`RunReport` with the final state.

    Raises:
      RecoveryError: refusals persist after ``config.max_rollbacks`` rollbacks in a row (the
        state or the hardware cannot be trusted; run ``sdcguard compare`` on this node), or a
        rollback found no intact stored state (the message names each one tried and why).
        Its ``report`` attribute is the :class:`RunReport` so far; the checkpoints started
        before it are on disk.
      ValueError: before the first step, ``checkpoints`` holds steps after ``state.step``
        (another run's); at the first step, ``step_fn`` donates its input state.

    Example:
      >>> report = train_with_recovery(jax.jit(step), state, data.batch, num_batches=1000,
      ...                              config=RecoveryConfig(snapshot_every=10))
      >>> report.rollbacks, report.skipped
    """
    ring = snapshots if snapshots is not None else SnapshotRing(config.keep_snapshots)
    loop = RecoveryLoop(step_fn, batch_at, num_batches, config, ring, checkpoints)
    return loop.run(state, start_index)
