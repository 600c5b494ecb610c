"""The integrity of stored train states: bit fingerprints, and how each leaf is stored.

Every stored train state (an in-memory snapshot, :mod:`sdcguard.guard.snapshots`; an Orbax
checkpoint, :mod:`sdcguard.guard.checkpoints`; an erasure-coded snapshot,
:mod:`sdcguard.guard.erasure`) carries an exact bit fingerprint per leaf, and a restore that does
not reproduce it is refused with an error that names the leaf. This module holds that format:

- :func:`tree_fingerprint` (on the device, also the update guard's cross-replica check) and its
  numpy twin :func:`host_fingerprint`;
- how a leaf is stored and rebuilt (:class:`LeafRecipe`, :func:`split_leaves`,
  :func:`rebuild_leaf`): typed PRNG keys as their key data, host scalars as numpy, and every
  array back on the sharding it had;
- the errors of the recovery tiers.

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

__all__ = [
    "CheckpointCorrupted",
    "LeafRecipe",
    "RecoveryError",
    "SnapshotCorrupted",
    "device_fingerprints",
    "host_fingerprint",
    "is_key",
    "leaf_paths",
    "rebuild_leaf",
    "split_leaves",
    "tree_fingerprint",
]


class RecoveryError(RuntimeError):
    """Training cannot be brought back to a state that can be trusted."""


class SnapshotCorrupted(RecoveryError):
    """An in-memory snapshot no longer matches the fingerprint taken when it was copied."""


class CheckpointCorrupted(RecoveryError):
    """An Orbax checkpoint is truncated, tampered with, or does not fit the train state."""


# --- Fingerprints ------------------------------------------------------------------------------


def _words(x: jax.Array) -> jax.Array:
    """The bit patterns of ``x`` as a flat uint32 vector (one or two words per element)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.reshape(-1).astype(jnp.uint32)
    bits = x.dtype.itemsize * 8
    if bits == 32:
        return jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)
    if bits == 64:
        return jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)  # [..., 2] words
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{bits}")).reshape(-1).astype(jnp.uint32)


def tree_fingerprint(tree) -> jax.Array:
    """An exact, order-independent checksum of every bit of ``tree``: uint32 ``[2]``.

    Word ``j`` (counting through all leaves in order) contributes ``w_j`` to the first entry and
    ``w_j * (2j + 1)`` to the second, modulo 2**32. Integer addition is associative, so the
    result does not depend on how a backend orders its reduction: identical trees give identical
    fingerprints on any device, and a single flipped bit always changes both entries (the
    weights are odd). Two differing trees collide only by coincidence of both sums.

    Args:
      tree: a pytree of arrays (any dtypes, typed PRNG keys included).

    Returns:
      uint32 ``[2]``: (sum of words, position-weighted sum of words).

    Example:
      >>> tree_fingerprint({"w": jnp.ones((2, 3))})
      Array([2097152000, 3992977408], dtype=uint32)
    """
    total = jnp.zeros((), jnp.uint32)
    weighted = jnp.zeros((), jnp.uint32)
    offset = 0
    for leaf in jax.tree.leaves(tree):
        words = _words(jnp.asarray(leaf))
        position = jnp.arange(words.size, dtype=jnp.uint32) + jnp.uint32(offset % 2**32)
        total += jnp.sum(words, dtype=jnp.uint32)
        weighted += jnp.sum(words * (2 * position + 1), dtype=jnp.uint32)
        offset += words.size
    return jnp.stack([total, weighted])


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
