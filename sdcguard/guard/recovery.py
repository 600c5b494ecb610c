"""Recovery behind the update guard: in-memory snapshots, an Orbax tier, and a training loop.

Three tiers, cheapest first:

1. The guard (:mod:`~sdcguard.guard.update_guard`) refuses a corrupted update: nothing to restore.
2. :class:`SnapshotRing` keeps the last few *good* train states in host memory, copied
   asynchronously while training goes on. Restoring one is a host-to-device copy.
3. :class:`CheckpointTier` keeps train states on disk with Orbax (async save), for crashes and
   for corruption older than every snapshot.

:func:`train_with_recovery` ties them together: when the guard reports ``rollback_needed`` it
restores the newest intact stored state taken before the refusals began (a corrupt snapshot or
checkpoint is reported in ``RunReport.corrupt`` and passed over for an older one) and either
skips the offending batches or replays them; if refusals keep coming without progress it walks
further back, and finally gives up with an error rather than training on a state it cannot
trust. Checkpoints are standard Orbax checkpoints of the user's own pytree.

Every stored state carries an exact bit fingerprint per leaf (see
:func:`sdcguard.guard.update_guard.tree_fingerprint`); a restore that does not reproduce it is
refused with an error that names the leaf, so a tampered or truncated snapshot/checkpoint is never
used.

Why one module: snapshots, checkpoints and the loop that falls back from one to the other share the
integrity format (per-leaf hashes, the tree fingerprint) and the errors that name a leaf; the loop's
fallback order is only readable beside both tiers.

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
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from sdcguard.guard.update_guard import (
    _COUNTERS,
    Triage,
    find_guard_state,
    reason_names,
    tree_fingerprint,
)

__all__ = [
    "CheckpointCorrupted",
    "CheckpointTier",
    "RecoveryConfig",
    "RecoveryError",
    "Rollback",
    "RunReport",
    "Snapshot",
    "SnapshotCorrupted",
    "SnapshotRing",
    "TrainState",
    "TriageEvent",
    "host_fingerprint",
    "train_with_recovery",
]

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = "sdcguard.train_state"
CHECKPOINT_VERSION = 2  # 2: the state item is the user's own pytree


class RecoveryError(RuntimeError):
    """Training cannot be brought back to a state that can be trusted."""


class SnapshotCorrupted(RecoveryError):
    """An in-memory snapshot no longer matches the fingerprint taken when it was copied."""


class CheckpointCorrupted(RecoveryError):
    """An Orbax checkpoint is truncated, tampered with, or does not fit the train state."""


class TrainState(NamedTuple):
    """The whole state of a training run, as :func:`train_with_recovery` expects it.

    step: int32 scalar, optimizer steps taken (refused ones included). params: the model parameters.
    opt_state: the optimizer state; contains exactly one
    :class:`sdcguard.guard.update_guard.GuardState`. rng: a PRNG key (typed ``jax.random.key`` or
    raw uint32 key data).
    """

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array


# --- Leaves: what is stored for each, and its fingerprint --------------------------------------


_WEIGHTS = np.ones((0,), np.uint32)  # 2j + 1, grown on demand and shared by all leaves


def _weights(n: int) -> np.ndarray:
    global _WEIGHTS
    weights = _WEIGHTS
    if weights.size < n:
        weights = 2 * np.arange(max(n, 2 * weights.size), dtype=np.uint32) + np.uint32(1)
        _WEIGHTS = weights  # a whole new array: a reader never sees it half-written
    return weights[:n]


def host_fingerprint(x: np.ndarray) -> np.ndarray:
    """The numpy twin of :func:`~sdcguard.guard.update_guard.tree_fingerprint` for one array:
    uint32 ``[2]``."""
    x = np.ascontiguousarray(x)
    if x.dtype == np.bool_:
        words = x.reshape(-1).astype(np.uint32)
    elif x.dtype.itemsize in (4, 8):
        words = x.reshape(-1).view(np.uint32)
    else:
        words = x.reshape(-1).view(np.dtype(f"uint{8 * x.dtype.itemsize}")).astype(np.uint32)
    # Integer sums and dot products wrap modulo 2**32, exactly like the device version.
    return np.array([np.sum(words, dtype=np.uint32), np.dot(words, _weights(words.size))])


@jax.jit
def _fingerprint_each(leaves: list) -> jax.Array:
    return jnp.stack([tree_fingerprint(x) for x in leaves])


def _device_fingerprints(leaves: list) -> np.ndarray:
    """uint32 ``[len(leaves), 2]``: one fingerprint per leaf, computed where the leaf lives.

    One compiled call per set of devices: a jitted function cannot mix arrays committed to
    different devices (a step counter on one device, parameters sharded over a mesh).
    """
    leaves = [jnp.asarray(x) for x in leaves]
    groups: dict[frozenset, list[int]] = {}
    for i, x in enumerate(leaves):
        groups.setdefault(frozenset(x.sharding.device_set), []).append(i)
    out = np.zeros((len(leaves), 2), np.uint32)
    for members in groups.values():
        out[members] = np.asarray(_fingerprint_each([leaves[i] for i in members]))
    return out


def _is_key(x) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


@dataclasses.dataclass(frozen=True)
class _Leaf:
    """How to rebuild one leaf: ``kind`` is 'array', 'key' (typed PRNG key) or 'host'."""

    kind: str
    sharding: Any = None
    key_impl: Any = None
    python_type: type | None = None  # for 'host' leaves that were Python scalars


def _split(state) -> tuple[list, list[_Leaf], Any]:
    """Flattens ``state`` into storable leaves (key data instead of typed keys) and recipes."""
    leaves, recipes = [], []
    flat, treedef = jax.tree.flatten(state)
    for x in flat:
        if _is_key(x):
            leaves.append(jax.random.key_data(x))
            recipes.append(_Leaf("key", x.sharding, jax.random.key_impl(x)))
        elif isinstance(x, jax.Array):
            leaves.append(x)
            recipes.append(_Leaf("array", x.sharding))
        else:
            scalar = type(x) if isinstance(x, int | float | bool | complex) else None
            leaves.append(np.asarray(x))
            recipes.append(_Leaf("host", python_type=scalar))
    return leaves, recipes, treedef


def _paths(treedef) -> list[str]:
    """The key path of every leaf of ``treedef``, as ``jax.tree_util.keystr`` writes it.

    Computed only when needed (errors, checkpoint records): formatting paths costs more than
    flattening, and a snapshot is taken every few steps.
    """
    placeholder = treedef.unflatten(range(treedef.num_leaves))
    return [
        jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(placeholder)[0]
    ]


def _rebuild(recipe: _Leaf, data):
    """The leaf for ``recipe`` from stored ``data``, placed on its original sharding."""
    if recipe.kind == "host":
        data = np.array(data)  # a private copy: the stored one must stay as fingerprinted
        return recipe.python_type(data.item()) if recipe.python_type else data
    on_device = jax.device_put(data, recipe.sharding)
    if recipe.kind == "key":
        return jax.random.wrap_key_data(on_device, impl=recipe.key_impl)
    return on_device


# --- Tier 2: in-memory snapshots ---------------------------------------------------------------


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
    _recipes: tuple[_Leaf, ...]
    _treedef: Any

    @property
    def paths(self) -> list[str]:
        """The key path of every leaf (as ``jax.tree_util.keystr`` writes it)."""
        return _paths(self._treedef)

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
        leaves = [_rebuild(r, x) for r, x in zip(self._recipes, self.leaves, strict=True)]
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
      erasure: an :class:`sdcguard.guard.erasure.ErasureCode` for sharded state: each host (device)
        keeps its own shards plus parity, and the snapshot is rebuilt bit-exact after the loss
        of hosts' memory (:class:`sdcguard.guard.erasure.CodedSnapshot`). None: whole copies here.

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
        leaves, recipes, treedef = _split(state)
        for x in leaves:
            if isinstance(x, jax.Array):
                x.copy_to_host_async()
        while len(self._in_flight) >= self.max_in_flight:
            self._in_flight.popleft().result()
        job = (int(step), dict(meta or {}), leaves, tuple(recipes), treedef)
        self._in_flight.append(self._pool.submit(self._finish, *job))

    def _finish(self, step, meta, leaves, recipes, treedef) -> None:
        try:
            if self.erasure is not None:  # each host's shards and parity (sdcguard.guard.erasure)
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


# --- Tier 3: Orbax checkpoints -----------------------------------------------------------------


def _abstract(like):
    """The restore target of ``like``: shapes, dtypes and shardings of its arrays (typed keys
    included), Python scalars and numpy arrays as they are."""

    def leaf(x):
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        return x

    return jax.tree.map(leaf, like)


def _described(tree) -> list[tuple[str, str, tuple]]:
    """(path, dtype, shape) of every leaf, as the integrity record stores them."""
    out = []
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if _is_key(x) or jax.dtypes.issubdtype(
            getattr(x, "dtype", np.float32), jax.dtypes.prng_key
        ):
            x = jax.eval_shape(jax.random.key_data, x)
        elif not hasattr(x, "dtype"):
            x = np.asarray(x)
        out.append((jax.tree_util.keystr(path), str(np.dtype(x.dtype)), tuple(x.shape)))
    return out


def _combined(fingerprints: np.ndarray, sizes: list[int]) -> list[int]:
    """The fingerprint of the whole tree (as
    :func:`~sdcguard.guard.update_guard.tree_fingerprint` of all
    leaves together) from the leaves' own: a leaf's weighted sum shifts by twice its offset."""
    total = weighted = 0
    offset = 0
    for (t, w), n in zip(fingerprints.tolist(), sizes, strict=True):
        total += t
        weighted += w + 2 * offset * t
        offset += n
    return [total % 2**32, weighted % 2**32]


def _words_of(x) -> int:
    """How many uint32 words :func:`~sdcguard.guard.update_guard.tree_fingerprint` reads from
    leaf ``x``."""
    if _is_key(x):
        x = jax.random.key_data(x)
    x = x if hasattr(x, "dtype") else np.asarray(x)
    return int(np.prod(x.shape)) * (2 if np.dtype(x.dtype).itemsize == 8 else 1)


class CheckpointTier:
    """Train states on disk as standard Orbax checkpoints (``CheckpointManager``, async save).

    Each checkpoint step holds two Orbax items: ``state``, the user's own pytree written with
    ``ocp.args.StandardSave`` (so plain Orbax restores it into the user's tree:
    ``ocp.CheckpointManager(dir).restore(step, args=ocp.args.Composite(
    state=ocp.args.StandardRestore(abstract_state)))``), and ``integrity``, a JSON record of
    every leaf's path, dtype, shape and bit fingerprint and of the whole tree's fingerprint.
    :meth:`restore` places every leaf on the sharding of the template and refuses a checkpoint
    that does not reproduce its fingerprints, naming the leaf. A checkpoint written by plain
    Orbax (no ``integrity`` item; the state in item ``state`` or ``default``) is restored too,
    unverified, with a warning. A save that crashed half-way leaves only an Orbax temporary
    directory, which is never listed as a step (and which the next :class:`CheckpointTier` on
    the directory removes, at the latest before its first save).

    Under ``jax.distributed`` (several processes) every process calls :meth:`save` and
    :meth:`restore` with its part of the global arrays, as with Orbax itself.

    Args:
      directory: where checkpoints live (created if missing).
      keep: how many checkpoints to keep.
      async_save: write in the background (``save`` returns once the data is on the host).

    Example:
      >>> tier = CheckpointTier("runs/ckpt", keep=3)
      >>> tier.save(100, state, meta={"data_index": 100})
      >>> state, meta = tier.restore(like=state)
    """

    def __init__(self, directory: str | Path, *, keep: int = 3, async_save: bool = True):
        if keep < 1:
            raise ValueError(f"CheckpointTier keeps at least one checkpoint, got keep={keep}")
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            create=True,
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True,
        )
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=("state", "integrity")
        )

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints, oldest first."""
        return sorted(self._manager.all_steps())

    def latest_step(self, *, at_most: int | None = None) -> int | None:
        eligible = [s for s in self.steps() if at_most is None or s <= at_most]
        return eligible[-1] if eligible else None

    def save(self, step: int, state, *, meta: dict | None = None) -> None:
        """Starts saving ``state`` as checkpoint ``step`` (returns before the write finishes)."""
        flat = jax.tree.leaves(state)
        leaves, _, _ = _split(state)
        fingerprints = _device_fingerprints(leaves)
        integrity = {
            "format": CHECKPOINT_FORMAT,
            "version": CHECKPOINT_VERSION,
            "step": int(step),
            "meta": dict(meta or {}),
            "fingerprint": _combined(fingerprints, [_words_of(x) for x in flat]),
            "leaves": [
                {"path": path, "dtype": dtype, "shape": list(shape), "fingerprint": fp}
                for (path, dtype, shape), fp in zip(
                    _described(state), fingerprints.tolist(), strict=True
                )
            ],
        }
        self._manager.save(
            int(step),
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), integrity=ocp.args.JsonSave(integrity)
            ),
        )

    def wait(self) -> None:
        """Blocks until the last save is on disk."""
        self._manager.wait_until_finished()

    def delete_newer_than(self, step: int) -> None:
        """Deletes checkpoints after ``step`` (they belong to a timeline that was rolled back)."""
        self.wait()
        for s in self.steps():
            if s > step:
                self._manager.delete(s)

    def _unreadable(self, step: int, what: str):
        return CheckpointCorrupted(
            f"checkpoint step {step} in {self.directory}: {what}. It is truncated, "
            f"tampered with, or from another model: delete {self.directory / str(step)} or "
            f"restore another step with restore(..., step=S); complete steps: {self.steps()}"
        )

    def _read_integrity(self, step: int) -> dict:
        try:
            record = self._manager.restore(
                step, args=ocp.args.Composite(integrity=ocp.args.JsonRestore())
            ).integrity
        except Exception as e:
            raise self._unreadable(
                step, f"its integrity record cannot be read ({type(e).__name__})"
            ) from None
        if not isinstance(record, dict) or record.get("format") != CHECKPOINT_FORMAT:
            raise self._unreadable(step, "its integrity record is not an sdcguard record")
        if record.get("version") != CHECKPOINT_VERSION:
            raise self._unreadable(
                step,
                f"format version {record.get('version')!r} is not the supported "
                f"{CHECKPOINT_VERSION}",
            )
        return record

    def _state_item(self, step: int) -> Path:
        """The directory of the state item of ``step``: ``state``, or plain Orbax's ``default``."""
        root = self.directory / str(step)
        for name in ("state", "default"):
            if (root / name).is_dir():
                return root / name
        items = sorted(p.name for p in root.iterdir() if p.is_dir())
        raise self._unreadable(
            step, f"it has no 'state' or 'default' Orbax item (items: {items or 'none'})"
        )

    def _read_state(self, step: int, item: Path, like):
        """Restores ``item`` into the structure of ``like``; on failure, names the leaves."""
        target = _abstract(like)
        try:
            return ocp.StandardCheckpointer().restore(item, target)
        except Exception as e:
            error = e
        # Which leaves? Restore each alone (only on this error path): Orbax's own error is a
        # dump of the storage driver's spec, which names no leaf of the user's tree.
        bad = []
        with_paths, treedef = jax.tree_util.tree_flatten_with_path(target)
        for i, (path, _) in enumerate(with_paths):
            one = treedef.unflatten(
                [x if j == i else ocp.PLACEHOLDER for j, (_, x) in enumerate(with_paths)]
            )
            args = jax.tree.map(
                lambda a: (
                    ocp.ArrayRestoreArgs(sharding=a.sharding)
                    if isinstance(a, jax.ShapeDtypeStruct)
                    else a
                    if a is ocp.PLACEHOLDER
                    else ocp.RestoreArgs()
                ),
                one,
            )
            try:
                ocp.PyTreeCheckpointer().restore(
                    item, args=ocp.args.PyTreeRestore(item=one, restore_args=args)
                )
            except Exception:
                bad.append(jax.tree_util.keystr(path))
        if bad:
            raise self._unreadable(
                step,
                f"the data of leaf {', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''} cannot "
                "be read (a data file is missing or truncated)",
            ) from None
        first = str(error).splitlines()[0][:200] if str(error) else ""
        raise self._unreadable(
            step, f"its state does not fit the given train state ({type(error).__name__}: {first})"
        ) from None

    def restore(self, like, *, step: int | None = None):
        """Restores checkpoint ``step`` (default: the latest) onto the shardings of ``like``.

        Args:
          like: a train state of the same structure, e.g. a freshly initialised one: the
            target's structure, dtypes, shapes and shardings (its values are not used).
          step: which checkpoint; default the latest complete one.

        Returns:
          ``(state, meta)``: the state, bit-exact as saved, and the ``meta`` given to save
          (``{}`` for a plain Orbax checkpoint, which is restored unverified with a warning).

        Raises:
          RecoveryError: no checkpoint exists.
          CheckpointCorrupted: unreadable, tampered, or a different structure than ``like``;
            the message names the leaf.
        """
        self.wait()  # a save still being written is not restorable yet
        if step is None:
            step = self.latest_step()
            if step is None:
                raise RecoveryError(f"no complete checkpoint in {self.directory}")
        elif step not in self.steps():
            raise RecoveryError(
                f"no complete checkpoint of step {step} in {self.directory}; "
                f"complete steps: {self.steps()}"
            )
        if not (self.directory / str(step) / "integrity").is_dir():
            item = self._state_item(step)
            warnings.warn(
                f"checkpoint step {step} in {self.directory} has no sdcguard integrity record "
                f"(a plain Orbax checkpoint, item '{item.name}'): restored UNVERIFIED",
                stacklevel=2,
            )
            return self._read_state(step, item, like), {}
        record = self._read_integrity(step)
        described = [(e["path"], e["dtype"], tuple(e["shape"])) for e in record["leaves"]]
        expected = _described(like)
        if described != expected:
            diff = next(
                (f"{d} != {e}" for d, e in zip(described, expected, strict=False) if d != e),
                f"{len(described)} leaves stored, {len(expected)} expected",
            )
            raise self._unreadable(step, f"it does not fit the given train state: {diff}")
        state = self._read_state(step, self._state_item(step), like)
        leaves, _, _ = _split(state)
        fingerprints = _device_fingerprints(leaves)
        for entry, fp in zip(record["leaves"], fingerprints.tolist(), strict=True):
            if fp != entry["fingerprint"]:
                raise self._unreadable(step, f"leaf {entry['path']} does not match its fingerprint")
        return state, record["meta"]

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


# --- The loop ----------------------------------------------------------------------------------


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


class TriageEvent(NamedTuple):
    """A spike that triage recomputed (see :mod:`sdcguard.guard.triage`).

    step, data_index: where; reasons: the spike checks that fired on the first pass; outcome:
    the :class:`sdcguard.guard.update_guard.Triage` name (``real_accepted``, ``real_skipped``,
    ``sdc_corrected``, ``refused``).
    """

    step: int
    data_index: int
    reasons: tuple[str, ...]
    outcome: str


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


_TRIAGE = _COUNTERS.index("triage")
_TRIAGE_REASON = _COUNTERS.index("triage_reason")


def _status(state) -> tuple[int, bool, int, int]:
    """(reason mask, rollback_needed, triage outcome, triage reasons) of the last update; waits
    for that step only. One transfer of the guard's small arrays, no computation dispatched."""
    guard = find_guard_state(state.opt_state)
    reason, rollback, counters = jax.device_get(
        (guard.reason, guard.rollback_needed, guard.counters)
    )
    counters = np.asarray(counters).reshape(-1, np.shape(counters)[-1])[0]
    mask = 0
    for v in np.asarray(reason).reshape(-1).tolist():
        mask |= int(v)
    return (
        mask,
        bool(np.any(rollback)),
        int(counters[_TRIAGE]),
        int(counters[_TRIAGE_REASON]),
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
        the guard (:func:`sdcguard.guard.update_guard.refuse_corrupted`) and ``state.step`` counts
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

    Example:
      >>> report = train_with_recovery(jax.jit(step), state, data.batch, num_batches=1000,
      ...                              config=RecoveryConfig(snapshot_every=10))
      >>> report.rollbacks, report.skipped
    """
    if config.checkpoint_every is not None and checkpoints is None:
        raise ValueError("RecoveryConfig.checkpoint_every is set but no checkpoints= was given")
    ring = snapshots if snapshots is not None else SnapshotRing(config.keep_snapshots)
    report = RunReport(state=state)
    skip: set[int] = set()
    streak: list[_Dispatched] = []  # refused updates since the last accepted one
    failed_rollbacks = 0  # rollbacks since training last got past an incident
    incident_step: int | None = None  # first refused step of the last incident rolled back
    restored_step: int | None = None  # where the last rollback went
    cursor = start_index
    ring.take(state, step=int(state.step), meta={"data_index": cursor})

    def accept(done: _Dispatched) -> None:
        nonlocal failed_rollbacks, incident_step
        streak.clear()
        # Replaying the steps before the incident is not progress; getting past it is.
        if incident_step is None or done.step >= incident_step:
            failed_rollbacks, incident_step = 0, None
        step = done.step + 1
        meta = {"data_index": done.data_index + 1}
        if config.snapshot_every is not None and step % config.snapshot_every == 0:
            ring.take(done.state, step=step, meta=meta)
        if config.checkpoint_every is not None and step % config.checkpoint_every == 0:
            checkpoints.save(step, done.state, meta=meta)

    def roll_back(at_step: int, reasons: tuple[str, ...]):
        nonlocal failed_rollbacks, restored_step, incident_step
        failed_rollbacks += 1
        if failed_rollbacks > config.max_rollbacks:
            raise RecoveryError(
                f"updates are still refused after {config.max_rollbacks} rollbacks in a row "
                f"(last reasons: {', '.join(reasons)}); the stored states or this hardware "
                "cannot be trusted: run `sdcguard compare` against a healthy node"
            )
        # The state every refused update started from; walk further back if the last rollback
        # already went there and training did not get past the incident since.
        target = streak[0].step
        incident_step = target
        if failed_rollbacks > 1 and restored_step is not None:
            target = min(target, restored_step - 1)
        if config.on_rollback == "skip":
            skip.update(d.data_index for d in streak)
        ring.drop_newer_than(target)
        # The newest intact state at or before the target, from either tier (a snapshot before
        # a checkpoint of the same step): a corrupt one is reported and passed over.
        candidates = [("snapshot", s.step, s) for s in ring.snapshots() if s.step <= target]
        if checkpoints is not None:
            candidates += [("checkpoint", s, None) for s in checkpoints.steps() if s <= target]
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
                    restored, meta = snapshot.restore(), snapshot.meta
                else:
                    restored, meta = checkpoints.restore(like=report.state, step=to_step)
                break
            except (SnapshotCorrupted, CheckpointCorrupted) as e:
                tried.append(f"{source} of step {to_step}: {e}")
                report.corrupt.append(tried[-1])
                log.warning("sdcguard: %s; trying an older stored state", tried[-1])
                if snapshot is not None:
                    ring.discard(snapshot)
        else:
            raise RecoveryError(
                f"rollback needed at step {at_step} but no stored state at or before step "
                f"{target} is intact; tried, newest first:\n  " + "\n  ".join(tried)
            )
        if checkpoints is not None:
            checkpoints.delete_newer_than(to_step)
        restored_step = to_step
        report.rollbacks.append(Rollback(at_step, to_step, source, reasons))
        log.warning(
            "sdcguard: %d refused updates in a row at step %d (%s): rolled back to %s of step %d",
            len(streak),
            at_step,
            ", ".join(reasons),
            source,
            to_step,
        )
        streak.clear()
        if "data_index" not in meta:
            raise RecoveryError(
                f"rolled back to the {source} of step {to_step}, but it records no data index "
                "(a checkpoint that plain Orbax wrote): restore it yourself and call "
                "train_with_recovery(..., start_index=...) with the data index it belongs to"
            )
        return restored, int(meta["data_index"])

    def next_index(i: int) -> int:
        while i < num_batches and i in skip:
            i += 1
        return i

    pending: _Dispatched | None = None
    while True:
        cursor = next_index(cursor)
        dispatched = None
        if cursor < num_batches:
            step = int(state.step) if pending is None else pending.step + 1
            dispatched = _Dispatched(step_fn(state, batch_at(cursor)), step, cursor)
            report.steps_run += 1
            cursor += 1
        if pending is not None:
            reason, rollback_needed, triage, triage_reason = _status(pending.state)
            if triage:
                report.triage.append(
                    TriageEvent(
                        pending.step,
                        pending.data_index,
                        reason_names(triage_reason),
                        Triage(triage).name.lower(),
                    )
                )
            if reason:
                names = reason_names(reason)
                report.refused.append((pending.step, pending.data_index, names))
                streak.append(pending)
                if rollback_needed:
                    state, cursor = roll_back(pending.step, names)
                    report.state, pending = state, None
                    continue
            else:
                accept(pending)
        if dispatched is None:
            break
        pending = dispatched
        state = report.state = dispatched.state
    ring.wait()
    if checkpoints is not None:
        checkpoints.wait()
    report.skipped = sorted(skip)
    return report
