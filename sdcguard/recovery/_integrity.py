"""The integrity of stored train states: bit fingerprints, and how each leaf is stored.

Every stored train state (a snapshot, an Orbax checkpoint, an erasure-coded snapshot) carries an
exact bit fingerprint per leaf (:func:`host_fingerprint`, :func:`device_fingerprints`, the host
and per-leaf forms of :func:`sdcguard.guard.tree_fingerprint`); a restore that does not reproduce
it is refused, naming the leaf. :class:`LeafRecipe` says how a leaf is stored and rebuilt (typed
PRNG keys as key data, host scalars as numpy, arrays back on their sharding).

Example:
  >>> leaves, recipes, treedef = split_leaves(state)
  >>> host = [np.array(x) for x in leaves]
  >>> fingerprints = [host_fingerprint(x) for x in host]
  >>> state = jax.tree.unflatten(treedef, [rebuild_leaf(r, x) for r, x in zip(recipes, host)])
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sdcguard.guard import tree_fingerprint


class RecoveryError(RuntimeError):
    """Training cannot be brought back to a state that can be trusted.

    Attributes:
      report: raised by :func:`sdcguard.train_with_recovery`, the run's
        :class:`~sdcguard.recovery.RunReport` up to the error (its refusals and rollbacks);
        else None.
    """

    report = None


class SnapshotCorrupted(RecoveryError):
    """An in-memory snapshot no longer matches the fingerprint taken when it was copied."""


class CheckpointCorrupted(RecoveryError):
    """An Orbax checkpoint is truncated, tampered with, or does not fit the train state."""


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
    """The numpy twin of :func:`tree_fingerprint` for one array:
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


def device_fingerprints(leaves: list) -> np.ndarray:
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


def is_key(x) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


@dataclasses.dataclass(frozen=True)
class LeafRecipe:
    """How to rebuild one leaf: ``kind`` is 'array', 'key' (typed PRNG key) or 'host'."""

    kind: str
    sharding: Any = None
    key_impl: Any = None
    python_type: type | None = None  # for 'host' leaves that were Python scalars


def split_leaves(state) -> tuple[list, list[LeafRecipe], Any]:
    """Flattens ``state`` into storable leaves (key data instead of typed keys) and recipes."""
    leaves, recipes = [], []
    flat, treedef = jax.tree.flatten(state)
    for x in flat:
        if is_key(x):
            leaves.append(jax.random.key_data(x))
            recipes.append(LeafRecipe("key", x.sharding, jax.random.key_impl(x)))
        elif isinstance(x, jax.Array):
            leaves.append(x)
            recipes.append(LeafRecipe("array", x.sharding))
        else:
            scalar = type(x) if isinstance(x, int | float | bool | complex) else None
            leaves.append(np.asarray(x))
            recipes.append(LeafRecipe("host", python_type=scalar))
    return leaves, recipes, treedef


def leaf_paths(treedef) -> list[str]:
    """The key path of every leaf of ``treedef``, as ``jax.tree_util.keystr`` writes it.

    Computed only when needed (errors, checkpoint records): formatting paths costs more than
    flattening, and a snapshot is taken every few steps.
    """
    placeholder = treedef.unflatten(range(treedef.num_leaves))
    return [
        jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(placeholder)[0]
    ]


def rebuild_leaf(recipe: LeafRecipe, data):
    """The leaf for ``recipe`` from stored ``data``, placed on its original sharding."""
    if recipe.kind == "host":
        data = np.array(data)  # a private copy: the stored one must stay as fingerprinted
        return recipe.python_type(data.item()) if recipe.python_type else data
    on_device = jax.device_put(data, recipe.sharding)
    if recipe.kind == "key":
        return jax.random.wrap_key_data(on_device, impl=recipe.key_impl)
    return on_device
