"""The disk tier of recovery: train states as standard Orbax checkpoints with an integrity record.

:class:`CheckpointTier` saves the user's own pytree with Orbax (async save) beside a JSON record of
every leaf's path, dtype, shape and bit fingerprint (the integrity module), and refuses
a checkpoint that does not reproduce them, naming the leaf (:class:`CheckpointCorrupted`).

Example:
  >>> tier = CheckpointTier("runs/ckpt", keep=3)
  >>> tier.save(100, state, meta={"data_index": 100})
  >>> state, meta = tier.restore(like=state)
"""

from __future__ import annotations

import warnings
from pathlib import Path

import jax
import numpy as np

from sdcguard.recovery._extra import require
from sdcguard.recovery._integrity import (
    CheckpointCorrupted,
    RecoveryError,
    device_fingerprints,
    is_key,
    split_leaves,
)

CHECKPOINT_FORMAT = "sdcguard.train_state"
CHECKPOINT_VERSION = 2  # 2: the state item is the user's own pytree


def _orbax():
    """``orbax.checkpoint``, imported on first use (the ``recovery`` extra)."""
    return require("orbax.checkpoint", "CheckpointTier (Orbax checkpoints)")


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
        if is_key(x) or jax.dtypes.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key):
            x = jax.eval_shape(jax.random.key_data, x)
        elif not hasattr(x, "dtype"):
            x = np.asarray(x)
        out.append((jax.tree_util.keystr(path), str(np.dtype(x.dtype)), tuple(x.shape)))
    return out


def _combined(fingerprints: np.ndarray, sizes: list[int]) -> list[int]:
    """The fingerprint of the whole tree (as
    :func:`~sdcguard.guard.tree_fingerprint` of all
    leaves together) from the leaves' own: a leaf's weighted sum shifts by twice its offset."""
    total = weighted = 0
    offset = 0
    for (t, w), n in zip(fingerprints.tolist(), sizes, strict=True):
        total += t
        weighted += w + 2 * offset * t
        offset += n
    return [total % 2**32, weighted % 2**32]


def _words_of(x) -> int:
    """How many uint32 words :func:`~sdcguard.guard.tree_fingerprint` reads from
    leaf ``x``."""
    if is_key(x):
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
        ocp = _orbax()
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
        ocp = _orbax()
        flat = jax.tree.leaves(state)
        leaves, _, _ = split_leaves(state)
        fingerprints = device_fingerprints(leaves)
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
        saved = self._manager.save(
            int(step),
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), integrity=ocp.args.JsonSave(integrity)
            ),
        )
        if not saved:
            # Orbax writes only steps after the newest it holds, and says so by returning False.
            raise RecoveryError(
                f"checkpoint step {step} was not written: {self.directory} already holds steps "
                f"{self.steps()}, and Orbax writes only steps after the newest. Resume from "
                "the newest (restore(like=state)), or give this run a directory of its own"
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
        ocp = _orbax()
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
        ocp = _orbax()
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
        leaves, _, _ = split_leaves(state)
        fingerprints = device_fingerprints(leaves)
        for entry, fp in zip(record["leaves"], fingerprints.tolist(), strict=True):
            if fp != entry["fingerprint"]:
                raise self._unreadable(step, f"leaf {entry['path']} does not match its fingerprint")
        return state, record["meta"]

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
