"""After the checked GEMM kernel: exact recomputation of located elements, and the counters.

The kernel (:mod:`sdcguard.protection.pallas.matmul_mgpu`) leaves, per row of every output
tile, a status (clean, located, uncorrectable, non-finite inputs) and the located column, and
has already rebuilt each located element from its row checksum. A rebuilt value is only as
exact as the checksums (float32 round-off of the whole row), so :func:`recompute_and_count`
recomputes every located element from its row of ``A`` and column of ``B`` (float32 products,
summed in float32: the GEMM's own arithmetic) and writes it over the rebuilt one.

Everything here is branch-free and fixed-size, and only one pass grows with the matrix: the
statuses (``1 / tile_n`` of ``C``) reduced per tile (:func:`summarize_tiles`). The rest works on
the tiles: an index pass picks the first tiles holding a located element, their rows are
gathered, and at most ``max_recomputed`` located elements per call are recomputed (a gather of
that many rows of ``A`` and columns of ``B``, and a scatter into ``C``); a tile holding a
located element beyond them is counted uncorrectable. On a clean call the scatter writes
nothing.

Example:
  >>> c, counts = recompute_and_count(a, b, c, status, max_recomputed=16, tile_m=128,
  ...                                 tile_n=128)
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from sdcguard.protection._checksums import reduce_together
from sdcguard.protection._config import count_outcomes, zero_counts
from sdcguard.protection.pallas.matmul_mgpu import (
    CLEAN,
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


class TileSummary(NamedTuple):
    """What the rows of each output tile say, one entry per tile, ``[batch, N / tile_n,
    M / tile_m]`` (the tiles in the order of the kernel's status rows)."""

    flagged: jax.Array  # bool: a row of the tile failed its check
    located: jax.Array  # int32: rows whose one error the kernel located and rebuilt
    uncorrectable: jax.Array  # bool: a flagged row could not be located
    nonfinite_input: jax.Array  # bool: a flagged row's checksum (the inputs alone) is not finite


def tile_states(status: jax.Array, *, tile_m: int) -> jax.Array:
    """The rows' states per tile: ``[batch, N / tile_n, M / tile_m, tile_m]`` from the kernel's
    ``[batch, N / tile_n, 2, M]`` statuses."""
    batch, tiles_n, _, m = status.shape
    return status[:, :, 0, :].reshape(batch, tiles_n, m // tile_m, tile_m)


def summarize_tiles(status: jax.Array, *, tile_m: int) -> TileSummary:
    """The kernel's row statuses reduced per tile: one pass over the statuses, the only work
    after the kernel that grows with ``M x N`` (``1 / tile_n`` of ``C``).

    Args:
      status: float32 ``[batch, N / tile_n, 2, M]``: each row's status and located column.
      tile_m: the rows of one check (a warpgroup's accumulator).

    Returns:
      The per-tile :class:`TileSummary`.
    """
    state = tile_states(status, tile_m=tile_m)
    out = reduce_together(
        {
            "flagged": ("max", state > CLEAN),
            "located": ("sum", (state == LOCATED).astype(jnp.int32)),
            "uncorrectable": ("max", state == UNCORRECTABLE),
            "nonfinite_input": ("max", state == NONFINITE_INPUT),
        },
        (3,),
    )
    return TileSummary(**out)


def tile_flags(status: jax.Array, *, tile_m: int) -> jax.Array:
    """Whether a row of each tile flagged: bool ``[batch, N / tile_n, M / tile_m]``, one
    reduction of the rows' states."""
    return jnp.any(tile_states(status, tile_m=tile_m) != CLEAN, axis=3)


def take_rerun_tiles(
    c: jax.Array,
    status: jax.Array,
    c_again: jax.Array,
    status_again: jax.Array,
    *,
    tile_m: int,
    tile_n: int,
    max_tiles: int,
) -> tuple[jax.Array, jax.Array]:
    """``c`` with its flagged tiles taken from a second, correcting run, and the statuses merged.

    The first ``max_tiles`` flagged tiles (in the order of ``status``) are gathered from
    ``c_again`` and scattered into ``c`` (in place: a fixed-size gather and scatter of whole
    tiles); a flagged tile beyond them keeps its value and its first-run status (flagged, not
    located: uncorrectable). A taken tile that flagged again takes the second run's row
    statuses (what it located and rebuilt); one that did not (a fault that did not recur: its
    value was computed again, clean) keeps the first run's, so the detection stays counted.
    A tile that flagged only in the second run is not taken.

    Args:
      c, status: the detection-only run's outputs, ``[batch, Mp, Np]`` and ``[batch, Np /
        tile_n, 2, Mp]``.
      c_again, status_again: the correcting run's.
      tile_m, tile_n: the tile of one check.
      max_tiles: how many flagged tiles are taken (static).

    Returns:
      ``(c, status)``: for :func:`recompute_and_count`.
    """
    batch = c.shape[0]
    flagged = tile_flags(status, tile_m=tile_m)
    taken_ok, taken = _first(flagged.reshape(-1).astype(jnp.int32), min(max_tiles, flagged.size))
    bi, tj, ti = jnp.unravel_index(taken, flagged.shape)
    rows = (ti[:, None] * tile_m + jnp.arange(tile_m)[None, :])[:, :, None]  # [T, tm, 1]
    cols = (tj[:, None] * tile_n + jnp.arange(tile_n)[None, :])[:, None, :]  # [T, 1, tn]
    tiles = c_again[bi[:, None, None], rows, cols]  # [T, tm, tn]
    write_at = jnp.where(taken_ok, bi, batch)[:, None, None]  # untaken slots are dropped
    c = c.at[write_at, rows, cols].set(tiles, mode="drop")
    taken_tiles = jnp.zeros(flagged.size, bool).at[taken].set(taken_ok).reshape(flagged.shape)
    use_again = taken_tiles & tile_flags(status_again, tile_m=tile_m)
    use_again = jnp.repeat(use_again, tile_m, axis=2)[:, :, None, :]  # [batch, tiles_n, 1, Mp]
    return c, jnp.where(use_again, status_again, status)


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

    One reduction summarizes the tiles (:func:`summarize_tiles`); everything after it is
    proportional to the tiles, or to the ``max_recomputed`` tiles that hold the first located
    elements: their rows are gathered, and their located elements recomputed. The located
    elements taken are the first ``max_recomputed`` in the order of ``status``; a tile with a
    located element beyond them is uncorrectable.

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
    batch = status.shape[0]
    m, n = a.shape[1], b.shape[2]
    tiles = summarize_tiles(status, tile_m=tile_m)
    grid = tiles.located.shape  # [batch, tiles_n, tiles_m]
    # The index pass: the first tiles holding a located element (each holds at least one, so
    # these hold the first max_recomputed located elements), in the order of ``status``.
    has_located = (tiles.located > 0).reshape(-1).astype(jnp.int32)
    taken_ok, taken = _first(has_located, min(max_recomputed, has_located.size))
    bi, tj, ti = jnp.unravel_index(taken, grid)
    # Their rows, [taken, tile_m], and the first located elements among them.
    rows = ti[:, None] * tile_m + jnp.arange(tile_m)[None, :]
    state = status[bi[:, None], tj[:, None], 0, rows]
    column = status[bi[:, None], tj[:, None], 1, rows]
    located = ((state == LOCATED) & taken_ok[:, None]).reshape(-1).astype(jnp.int32)
    used, slots = _first(located, min(max_recomputed, located.size))
    tile_of, within = lax.div(slots, tile_m), lax.rem(slots, tile_m)  # slots >= 0
    e_b, e_row = bi[tile_of], rows[tile_of, within]
    e_col = tj[tile_of] * tile_n + column.reshape(-1)[slots].astype(jnp.int32)
    # The elements' coordinates, computed once: fused into the gathers and the scatter below,
    # XLA would recompute them for every element those read.
    e_b, e_row, e_col = lax.optimization_barrier((e_b, e_row, e_col))
    # Located rows and columns are inside the matrix; the clamps only touch unused slots.
    fresh = recompute_elements(a, b, e_b, jnp.minimum(e_row, m - 1), jnp.minimum(e_col, n - 1))
    write_at = jnp.where(used, e_b, batch)  # unused slots point outside and are dropped
    c = c.at[write_at, e_row, e_col].set(fresh.astype(c.dtype), mode="drop")

    # Per taken tile: whether all its located elements were recomputed, and whether the inputs
    # define a non-finite value at one of them (it is left as they define it).
    in_tile = (tile_of[None, :] == jnp.arange(taken.size)[:, None]) & used
    recomputed = jnp.sum(in_tile, axis=1)
    fresh_nonfinite = jnp.any(in_tile & ~jnp.isfinite(fresh)[None, :], axis=1)
    at_taken = lambda x: x.reshape(-1)[taken]
    # A tile is corrected only when every flagged row in it was located and recomputed, so
    # every corrected tile is a taken one; the other outcomes follow from the counts.
    nonfinite_input = at_taken(tiles.nonfinite_input)
    corrected = (
        taken_ok
        & ~nonfinite_input
        & ~at_taken(tiles.uncorrectable)
        & (recomputed == at_taken(tiles.located))
        & ~fresh_nonfinite
    )
    nonfinite = jnp.sum(tiles.nonfinite_input) + jnp.sum(
        taken_ok & fresh_nonfinite & ~nonfinite_input
    )
    return c, count_outcomes(jnp.sum(tiles.flagged), jnp.sum(corrected), nonfinite)


def _first(flags: jax.Array, count: int) -> tuple[jax.Array, jax.Array]:
    """``(set, index)`` of the first ``count`` entries of an int32 0/1 vector that are 1, in
    order; where fewer are set, the rest of ``index`` points at entries that are not."""
    score, index = lax.top_k(flags, count)  # stable: equal scores in the order of ``flags``
    return score > 0, index


def pass_after(
    a, b, c, status, *, check: bool, max_recomputed: int, block_sizes: BlockSizes, correct=True
):
    """Everything after the kernel: :func:`recompute_and_count` (with ``check``), and the
    padding of ``c`` cut off.

    Args:
      a, b: the unpadded operands; c, status: the kernel's outputs (``status`` None unchecked).
      check, max_recomputed, block_sizes, correct: as for
        :func:`sdcguard.protection.pallas.checked_matmul`. A detection-only kernel locates
        nothing, so without ``correct`` the counters come from the tiles' summary alone.

    Returns:
      ``(c [batch, M, N], counts)``.
    """
    m, n = a.shape[1], b.shape[2]
    if not check:
        return c[:, :m, :n], zero_counts()
    if not correct:
        # Each tile's worst row state, one reduction: NONFINITE_INPUT is the largest state, so
        # the tile's maximum says both whether it flagged and whether the inputs were at fault.
        worst = jnp.max(tile_states(status, tile_m=block_sizes.tile_m), axis=3)
        counts = count_outcomes(jnp.sum(worst > CLEAN), 0, jnp.sum(worst == NONFINITE_INPUT))
        return c[:, :m, :n], counts
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
