"""Degraded mode's host side: :class:`DegradedTrainer` loses, quarantines and readmits replicas.

It drives the compiled step of :func:`~sdcguard.degraded.make_degraded_step` (the quarantine mask
is an argument) and keeps a :class:`DegradedReport`. The model is the user's
(:class:`~sdcguard.degraded.Workload`); the reference GPT's is
:class:`~sdcguard.degraded.GPTWorkload`.

Quarantine comes from the update guard's cross-replica check: a replica named twice in a row
is quarantined (see :class:`DegradedTrainer`); :meth:`DegradedTrainer.readmit` copies a healthy
replica's state into one (after ``sdcguard compare`` cleared it: docs/degraded.md).

Example:
  >>> workload = GPTWorkload(model=GPTConfig(), approximations=MeCeFO())
  >>> trainer = DegradedTrainer(DegradedConfig(micro_batch=2), workload)
  >>> data = ByteBatches(batch_size=trainer.global_batch, seq_len=64)
  >>> trainer.step(data.batch(0))
  >>> trainer.lose(3)                              # replica 3 is gone: 4 takes over, no recompile
  >>> trainer.step(data.batch(1))
  >>> trainer.readmit(3)                           # copies a healthy replica's state into 3
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sdcguard.degraded._step import (
    DegradedConfig,
    DegradedState,
    ReplicaFault,
    Workload,
    make_degraded_step,
)
from sdcguard.guard import GuardState, Reason, find_guard_state, reason_names


class ReplicaEvent(NamedTuple):
    """Something that happened to a replica.

    step: the step it happened at. replica: which. kind: ``lost``, ``quarantined``,
    ``readmitted`` or ``mismatch_not_repeated`` (the guard named it once, the recomputed step
    agreed). detail: a sentence for the log.
    """

    step: int
    replica: int
    kind: str
    detail: str


@dataclasses.dataclass
class DegradedReport:
    """What :class:`DegradedTrainer` did.

    Attributes:
      losses: full-batch loss of every step taken (the accepted computation of each).
      out_replicas: how many replicas were out at each step taken.
      events: every loss, quarantine and readmission, in order.
      refused: ``(step, reasons)`` of every update the guard refused and training kept.
      steps_run: step-function calls, recomputations included (the cost).
    """

    losses: list[float] = dataclasses.field(default_factory=list)
    out_replicas: list[int] = dataclasses.field(default_factory=list)
    events: list[ReplicaEvent] = dataclasses.field(default_factory=list)
    refused: list[tuple[int, tuple[str, ...]]] = dataclasses.field(default_factory=list)
    steps_run: int = 0

    def quarantined(self) -> list[int]:
        """Replicas quarantined during the run, in order."""
        return [e.replica for e in self.events if e.kind == "quarantined"]


def _rows(x: jax.Array) -> list:
    """The shards of a stacked array in replica order."""
    return sorted(x.addressable_shards, key=lambda s: s.index[0].start or 0)


def replica_row(tree, replica: int):
    """Replica ``replica``'s copy of a stacked tree (e.g. ``state.params``), on the host."""
    return jax.tree.map(lambda x: np.asarray(_rows(x)[replica].data)[0], tree)


def _guard_row(state: DegradedState, replica: int) -> GuardState | None:
    """Replica ``replica``'s copy of the guard state (host arrays), or None without a guard."""
    try:
        guard = find_guard_state(state.opt_state)
    except ValueError:  # no guard (or several): nothing quarantines replicas automatically
        return None
    return replica_row(guard._replace(inner_state=None), replica)


class DegradedTrainer:
    """Data-parallel training that goes on when replicas are out.

    Holds the state, the quarantine mask and a :class:`DegradedReport`. :meth:`step` trains on
    one global batch; when the guard refuses it and names an odd replica, the step is computed
    again from the same state, and if the same replica disagrees again it is quarantined and
    the step computed without it (three computations of that one step; the event is in the
    report). Nothing is recompiled by any of this. Each step reads the guard's verdict (two
    small integers) on the host, so the next step is dispatched after this one finished.

    Args:
      config: the run; default ``DegradedConfig()``.
      workload: the model (:class:`Workload`); unused with ``compiled``.
      optimizer: see :func:`make_degraded_step`; a guard (``refuse_corrupted`` with
        ``axis_name``) is what quarantines replicas automatically.
      mesh: see :func:`make_degraded_step`.
      compiled: ``(initial_state, step)`` from :func:`make_degraded_step` of this ``config``,
        to share one compilation between trainers (``workload``, ``optimizer`` and ``mesh`` are
        then unused).

    Raises:
      ValueError: neither ``workload`` nor ``compiled`` is given.

    Example:
      >>> trainer = DegradedTrainer(DegradedConfig(), GPTWorkload())
      >>> for i in range(100):
      ...     trainer.step(data.batch(i), fault=ReplicaFault.on(5) if i > 20 else None)
      >>> trainer.report.quarantined()
      [5]
    """

    def __init__(
        self,
        config: DegradedConfig | None = None,
        workload: Workload | None = None,
        optimizer: optax.GradientTransformation | None = None,
        *,
        mesh: jax.sharding.Mesh | None = None,
        compiled: tuple[DegradedState, Callable] | None = None,
    ):
        self.config = config = config or DegradedConfig()
        if compiled is None:
            if workload is None:
                raise ValueError(
                    "DegradedTrainer needs the model to train: workload=Workload(init=..., "
                    "loss=...) (the reference GPT: sdcguard.degraded.GPTWorkload()), "
                    "or compiled= from make_degraded_step"
                )
            compiled = make_degraded_step(config, workload, optimizer, mesh=mesh)
        self.state, self.step_fn = compiled
        self.out = np.zeros((config.replicas,), np.bool_)
        self.report = DegradedReport()

    @property
    def global_batch(self) -> int:
        return self.config.global_batch

    @property
    def steps(self) -> int:
        """Steps taken (read from a replica that is in)."""
        return int(replica_row(self.state.step, self.healthy()))

    def healthy(self) -> int:
        """The first replica that is in."""
        return int(np.argmin(self.out))

    def _set_out(self, replica: int, kind: str, detail: str) -> None:
        n = self.config.replicas
        if not 0 <= replica < n:
            raise ValueError(f"replica must be in [0, {n}), got {replica}")
        if self.out[replica]:
            return
        if 2 * (int(self.out.sum()) + 1) > n:
            raise ValueError(
                f"cannot take replica {replica} out: replicas {np.flatnonzero(self.out).tolist()} "
                f"are out already and each neighbour takes over one micro-batch, so at most "
                f"{n // 2} of {n} may be out. Readmit one (after `sdcguard compare`) or restore "
                "from a snapshot on healthy hardware."
            )
        self.out[replica] = True
        self.report.events.append(ReplicaEvent(self.steps, replica, kind, detail))

    def lose(self, replica: int) -> None:
        """Replica ``replica`` is gone (its node failed): its neighbour takes its micro-batch."""
        self._set_out(replica, "lost", f"replica {replica} lost; its neighbour takes over")

    def quarantine(self, replica: int, why: str = "by the user") -> None:
        """Takes ``replica`` out of training until :meth:`readmit`."""
        self._set_out(
            replica,
            "quarantined",
            f"replica {replica} quarantined {why}; before readmitting it, replay it against a "
            f"healthy replica: sdcguard compare --node-a local:{self.healthy()} "
            f"--node-b local:{replica}",
        )

    def readmit(self, replica: int, *, source: int | None = None) -> None:
        """Brings ``replica`` back, with a copy of replica ``source``'s state (default: the
        first replica that is in). Its own copy went stale or wrong while it was out."""
        if not self.out[replica]:
            raise ValueError(f"replica {replica} is not out (out: {np.flatnonzero(self.out)})")
        source = self.healthy() if source is None else source
        if self.out[source]:
            raise ValueError(f"source replica {source} is out itself; pick one that is in")

        def copy_row(x):
            shards = _rows(x)
            arrays = [s.data for s in shards]
            target = shards[replica].data.devices().pop()
            arrays[replica] = jax.device_put(shards[source].data, target)
            return jax.make_array_from_single_device_arrays(x.shape, x.sharding, arrays)

        self.state = jax.tree.map(copy_row, self.state)
        self.out[replica] = False
        self.report.events.append(
            ReplicaEvent(
                self.steps, replica, "readmitted", f"replica {replica} readmitted from {source}"
            )
        )

    def _run(self, batch, fault):
        self.report.steps_run += 1
        return self.step_fn(self.state, batch, self.out, fault)

    def _verdict(self, state) -> tuple[int, int]:
        guard = _guard_row(state, self.healthy())
        if guard is None:
            return 0, -1
        return int(guard.reason), int(guard.odd_replica)

    def step(self, batch, fault: ReplicaFault | None = None) -> float:
        """Trains on one global batch ``[global_batch, ...]``; returns its loss.

        Args:
          batch: the global batch; row ``r * micro_batch + i`` belongs to replica ``r``.
          fault: a simulated faulty replica (tests, benchmarks); default none.
        """
        fault = ReplicaFault.none() if fault is None else fault
        n, m = self.config.replicas, self.config.micro_batch
        batch = jnp.asarray(batch)
        if batch.shape[0] != n * m:
            raise ValueError(
                f"the global batch has {batch.shape[0]} sequences; {n} replicas x "
                f"micro_batch {m} need {n * m}"
            )
        batch = batch.reshape(n, m, -1)
        new, info = self._run(batch, fault)
        reason, odd = self._verdict(new)
        if reason & Reason.REPLICA_MISMATCH and odd >= 0:
            again, again_info = self._run(batch, fault)  # same state, same batch
            reason2, odd2 = self._verdict(again)
            if reason2 & Reason.REPLICA_MISMATCH and odd2 == odd:
                self.quarantine(
                    odd,
                    f"by the update guard: its all-reduced gradients disagreed with the "
                    f"majority twice at step {self.steps}",
                )
                new, info = self._run(batch, fault)
                reason, _ = self._verdict(new)
            else:
                self.report.events.append(
                    ReplicaEvent(
                        self.steps,
                        odd,
                        "mismatch_not_repeated",
                        f"replica {odd} disagreed once at step {self.steps}; the recomputed "
                        "step did not name it again",
                    )
                )
                new, info, reason = again, again_info, reason2
        if reason:
            self.report.refused.append((self.steps, reason_names(reason)))
        self.state = new
        loss = float(replica_row(info.loss, self.healthy()))
        self.report.losses.append(loss)
        self.report.out_replicas.append(int(self.out.sum()))
        return loss

    def params(self):
        """The parameters of the first replica that is in (host arrays)."""
        return replica_row(self.state.params, self.healthy())
