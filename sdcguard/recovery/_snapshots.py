"""The in-memory tier of recovery: the last few good train states, in host memory.

:class:`SnapshotRing` keeps complete host copies of a train state (:class:`Snapshot`), copied
asynchronously while training goes on; restoring one is a host-to-device copy. Every snapshot
carries a bit fingerprint per leaf (the integrity module), and one whose bits changed
since it was copied is refused with an error naming the leaf (:class:`SnapshotCorrupted`).
With an :class:`sdcguard.recovery.ErasureCode`, each host keeps its own shards plus parity.

Example:
  >>> ring = SnapshotRing(keep=3)
  >>> ring.take(state, step=int(state.step))        # returns at once; copy runs in background
  >>> state, snap = ring.restore(at_most=120)        # newest complete snapshot with step <= 120
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
from typing import Any

import jax
import numpy as np

from sdcguard.recovery._integrity import (
    LeafRecipe,
    RecoveryError,
    SnapshotCorrupted,
    host_fingerprint,
    leaf_paths,
    rebuild_leaf,
    split_leaves,
)

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, eq=False)
class Snapshot:
    """A complete host copy of a train state.

    Attributes:
      step: the training step it was taken at.
      meta: small host data saved with it (e.g. ``{"data_index": 1200}``).
      leaves: read-only host arrays, one per leaf (key data for typed keys).
      fingerprints: uint32 ``[num_leaves, 2]``, taken from ``leaves`` when they were copied.
    """

    step: int
    meta: dict
    leaves: tuple[np.ndarray, ...]
    fingerprints: np.ndarray
    _recipes: tuple[LeafRecipe, ...]
    _treedef: Any

    @property
    def paths(self) -> list[str]:
        """The key path of every leaf (as ``jax.tree_util.keystr`` writes it)."""
        return leaf_paths(self._treedef)

    def verify(self) -> None:
        """Raises :class:`SnapshotCorrupted` naming the first leaf whose bits changed."""
        for i, x in enumerate(self.leaves):
            if not np.array_equal(host_fingerprint(x), self.fingerprints[i]):
                raise SnapshotCorrupted(
                    f"in-memory snapshot of step {self.step}: leaf {self.paths[i]} no longer "
                    "matches the fingerprint taken when it was copied (host memory corruption or "
                    "a write into the snapshot). Restore an older snapshot "
                    f"(SnapshotRing.restore(at_most={self.step - 1})) or an Orbax checkpoint."
                )

    def restore(self):
        """The train state, verified and placed on the shardings it had when taken."""
        self.verify()
        leaves = [rebuild_leaf(r, x) for r, x in zip(self._recipes, self.leaves, strict=True)]
        return jax.tree.unflatten(self._treedef, leaves)


class SnapshotRing:
    """The last ``keep`` complete snapshots of a train state, in host memory.

    :meth:`take` starts the device-to-host copies and returns; a background thread finishes
    them, fingerprints the host copies and only then adds the snapshot to the ring, so a
    snapshot whose copy is still running (or failed) is never restored.

    The step function must not donate the buffers of a state being snapshotted until
    :meth:`wait` returns (the copy reads them).

    Args:
      keep: how many complete snapshots to keep (oldest dropped first).
      max_in_flight: snapshots copying at once; :meth:`take` waits beyond this, so a slow host
        cannot let copies pile up in memory.
      erasure: an :class:`sdcguard.recovery.ErasureCode` for sharded state: each host (device)
        keeps its own shards plus parity, and the snapshot is rebuilt bit-exact after the loss
        of hosts' memory (:class:`sdcguard.recovery.CodedSnapshot`). None: whole copies here.

    Example:
      >>> ring = SnapshotRing(keep=2)
      >>> ring.take(state, step=100, meta={"data_index": 100})
      >>> state, snap = ring.restore()
    """

    def __init__(self, keep: int = 2, *, max_in_flight: int = 2, erasure=None):
        if keep < 1:
            raise ValueError(f"SnapshotRing keeps at least one snapshot, got keep={keep}")
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.keep = keep
        self.max_in_flight = max_in_flight
        self.erasure = erasure
        self.failures: list[str] = []
        self._done: collections.deque[Snapshot] = collections.deque(maxlen=keep)
        self._in_flight: collections.deque[concurrent.futures.Future] = collections.deque()
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sdcguard-snap")

    def take(self, state, *, step: int, meta: dict | None = None) -> None:
        """Starts an asynchronous snapshot of ``state``; returns without waiting for the copy."""
        leaves, recipes, treedef = split_leaves(state)
        for x in leaves:
            if isinstance(x, jax.Array):
                x.copy_to_host_async()
        while len(self._in_flight) >= self.max_in_flight:
            self._in_flight.popleft().result()
        job = (int(step), dict(meta or {}), leaves, tuple(recipes), treedef)
        self._in_flight.append(self._pool.submit(self._finish, *job))

    def _finish(self, step, meta, leaves, recipes, treedef) -> None:
        try:
            if self.erasure is not None:  # each host's shards and parity (ErasureCode)
                snapshot = self.erasure.snapshot(step, meta, leaves, recipes, treedef)
            else:
                host = []
                for x in leaves:
                    copy = np.array(x)  # owns its memory: later device writes cannot reach it
                    copy.setflags(write=False)
                    host.append(copy)
                fingerprints = np.stack([host_fingerprint(x) for x in host]).reshape(-1, 2)
                snapshot = Snapshot(step, meta, tuple(host), fingerprints, recipes, treedef)
        except Exception as e:  # a failed copy must not kill training, nor be restorable
            message = f"snapshot of step {step} failed and was dropped: {type(e).__name__}: {e}"
            log.warning(message)
            self.failures.append(message)
            return
        with self._lock:
            self._done.append(snapshot)

    def wait(self) -> None:
        """Blocks until every snapshot started so far is complete (or failed)."""
        while self._in_flight:
            self._in_flight.popleft().result()

    def snapshots(self) -> list[Snapshot]:
        """The complete snapshots, oldest first."""
        with self._lock:
            return list(self._done)

    def latest(self, *, at_most: int | None = None) -> Snapshot | None:
        """The newest complete snapshot (with ``step <= at_most`` if given), or None."""
        for snapshot in reversed(self.snapshots()):
            if at_most is None or snapshot.step <= at_most:
                return snapshot
        return None

    def restore(self, *, at_most: int | None = None):
        """Restores the newest complete snapshot with ``step <= at_most``.

        Returns:
          ``(state, snapshot)``.

        Raises:
          RecoveryError: no complete snapshot qualifies.
          SnapshotCorrupted: the chosen snapshot's bits changed since it was taken.
        """
        snapshot = self.latest(at_most=at_most)
        if snapshot is None:
            have = [s.step for s in self.snapshots()]
            raise RecoveryError(
                f"no complete in-memory snapshot at or before step {at_most} (have steps "
                f"{have}); restore from an Orbax checkpoint instead"
            )
        return snapshot.restore(), snapshot

    def drop_newer_than(self, step: int) -> None:
        """Forgets snapshots after ``step`` (they belong to a timeline that was rolled back)."""
        self.wait()
        with self._lock:
            kept = [s for s in self._done if s.step <= step]
            self._done.clear()
            self._done.extend(kept)

    def discard(self, snapshot: Snapshot) -> None:
        """Forgets one snapshot (found corrupt: it must not be tried again)."""
        with self._lock:
            kept = [s for s in self._done if s is not snapshot]
            self._done.clear()
            self._done.extend(kept)

    def close(self) -> None:
        self.wait()
        self._pool.shutdown()
