"""After the checked GEMM kernel: exact recomputation of located elements, and the counters.

The kernel (:mod:`sdcguard.protection.pallas.matmul_mgpu`) leaves, per row of every output
tile, a status (clean, located, uncorrectable, non-finite inputs) and the located column, and
has already rebuilt each located element from its row checksum. A rebuilt value is only as
exact as the checksums (float32 round-off of the whole row), so :func:`recompute_and_count`
recomputes every located element from its row of ``A`` and column of ``B`` (float32 products,
summed in float32: the GEMM's own arithmetic) and writes it over the rebuilt one.

Everything here is branch-free and fixed-size: at most ``max_recomputed`` elements per call are
recomputed (a gather of that many rows of ``A`` and columns of ``B``, and a scatter into ``C``);
a tile holding a located element beyond that is counted uncorrectable. On a clean call this is
a search over the ``[batch, N / tile_n, M]`` statuses (``1 / tile_n`` of ``C``) and a scatter
that writes nothing.

Example:
  >>> c, counts = recompute_and_count(a, b, c, status, max_recomputed=16, tile_m=128,
  ...                                 tile_n=128)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sdcguard.protection._config import count_outcomes, zero_counts
from sdcguard.protection.pallas.matmul_mgpu import (
    LOCATED,
    NONFINITE_INPUT,
    UNCORRECTABLE,
    BlockSizes,
)


def recompute_elements(a: jax.Array, b: jax.Array, bi, m, n) -> jax.Array:
    """float32 ``C[bi, m, n]`` for index vectors ``[R]``, from a row of ``a`` ``[batch, M, K]``
    and a column of ``b`` ``[batch, K, N]``: exact products, summed in float32."""
    rows = a[bi, m, :].astype(jnp.float32)  # [R, K]
    cols = b[bi, :, n].astype(jnp.float32)  # [R, K]
    return jnp.sum(rows * cols, axis=-1)


def recompute_and_count(
    a: jax.Array,
    b: jax.Array,
    c: jax.Array,
    status: jax.Array,
    *,
    max_recomputed: int,
    tile_m: int,
    tile_n: int,
) -> tuple[jax.Array, jax.Array]:
    """Recomputes the located elements exactly and turns row statuses into tile counters.

    Args:
      a: ``[batch, M, K]``, b: ``[batch, K, N]``: the unpadded operands.
      c: ``[batch, Mp, Np]``: the kernel's (padded) output.
      status: float32 ``[batch, Np / tile_n, 2, Mp]``: each row's status and located column.
      max_recomputed: how many located elements are recomputed (static).
      tile_m, tile_n: the tile of one check (a warpgroup's accumulator).

    Returns:
      ``(c, counts)``: ``c`` with the located elements recomputed, and int32 ``[detected,
      corrected, uncorrectable, nonfinite_input]`` summed over tiles.
    """
    batch, tiles_n, _, mp = status.shape
    m, n = a.shape[1], b.shape[2]
    state, column = status[:, :, 0, :], status[:, :, 1, :]  # [batch, tiles_n, Mp]
    located = state == LOCATED
    flat = located.reshape(-1)
    (slots,) = jnp.nonzero(flat, size=max_recomputed, fill_value=flat.size)
    used = slots < flat.size
    safe = jnp.where(used, slots, 0)
    bi, tj, row = jnp.unravel_index(safe, located.shape)
    col = tj * tile_n + column.reshape(-1)[safe].astype(jnp.int32)
    # Located rows and columns are inside the matrix; the clamps only touch unused slots.
    fresh = recompute_elements(a, b, bi, jnp.minimum(row, m - 1), jnp.minimum(col, n - 1))
    fresh_nonfinite = used & ~jnp.isfinite(fresh)
    write_at = jnp.where(used, bi, batch)  # unused slots point outside and are dropped
    c = c.at[write_at, row, col].set(fresh.astype(c.dtype), mode="drop")

    def per_tile(rows):  # [batch, tiles_n, Mp] bool -> [batch, tiles_m, tiles_n]
        r = rows.reshape(batch, tiles_n, mp // tile_m, tile_m)
        return jnp.transpose(jnp.any(r, axis=-1), (0, 2, 1))

    beyond = located & (jnp.cumsum(flat).reshape(located.shape) > max_recomputed)
    # The inputs define a non-finite value: a flagged row whose checksum is not finite, or a
    # located element whose recomputation is not.
    recomputed_nonfinite = jnp.zeros(flat.shape, bool).at[safe].max(fresh_nonfinite)
    nonfinite_rows = (state == NONFINITE_INPUT) | recomputed_nonfinite.reshape(located.shape)
    detected = per_tile(state > 0)
    nonfinite = per_tile(nonfinite_rows) & detected
    unfixed = per_tile((state == UNCORRECTABLE) | beyond) & ~nonfinite
    corrected = detected & ~unfixed & ~nonfinite
    return c, count_outcomes(jnp.sum(detected), jnp.sum(corrected), jnp.sum(nonfinite))


def pass_after(a, b, c, status, *, check: bool, max_recomputed: int, block_sizes: BlockSizes):
    """Everything after the kernel: :func:`recompute_and_count` (with ``check``), and the
    padding of ``c`` cut off.

    Args:
      a, b: the unpadded operands; c, status: the kernel's outputs (``status`` None unchecked).
      check, max_recomputed, block_sizes: as for
        :func:`sdcguard.protection.pallas.checked_matmul`.

    Returns:
      ``(c [batch, M, N], counts)``.
    """
    m, n = a.shape[1], b.shape[2]
    if not check:
        return c[:, :m, :n], zero_counts()
    c, counts = recompute_and_count(
        a,
        b,
        c,
        status,
        max_recomputed=max_recomputed,
        tile_m=block_sizes.tile_m,
        tile_n=block_sizes.tile_n,
    )
    return c[:, :m, :n], counts
