"""An exact bit fingerprint of a pytree: the replicas' agreement check and stored states' integrity.

Example:
  >>> tree_fingerprint({"w": jnp.ones((2, 3))})
  Array([2097152000, 3992977408], dtype=uint32)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
    ``w_j * (2j + 1)`` to the second, modulo 2**32: identical trees give identical fingerprints
    on any device and any reduction order, and one flipped bit changes both entries (see
    docs/guard.md).

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
