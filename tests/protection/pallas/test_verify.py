"""The pass after the checked GEMM kernel (``verify``) against a row-by-row reference.

The kernel's row statuses are drawn at random here (no kernel runs): every outcome, several
per tile, and more located elements than the pass recomputes.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from sdcguard.protection.pallas import verify
from sdcguard.protection.pallas.matmul_mgpu import (
    CLEAN,
    LOCATED,
    NONFINITE_INPUT,
    UNCORRECTABLE,
    BlockSizes,
)

from tests.helpers.tolerances import TOLERANCES

TILE_M, TILE_N = 64, 64
# batch, M, K, N: two row tiles, three column tiles.
SHAPE = (2, 128, 48, 192)
DTYPES = [jnp.bfloat16, jnp.float16]


def _statuses(seed, p_flagged):
    """Random float32 ``[batch, N / tile_n, 2, M]`` statuses: most rows clean."""
    batch, m, _, n = SHAPE
    rng = np.random.default_rng(seed)
    shape = (batch, n // TILE_N, m)
    outcome = rng.choice(
        [CLEAN, LOCATED, UNCORRECTABLE, NONFINITE_INPUT],
        size=shape,
        p=[1 - p_flagged, 0.6 * p_flagged, 0.2 * p_flagged, 0.2 * p_flagged],
    )
    column = np.where(outcome == LOCATED, rng.integers(0, TILE_N, size=shape), -1)
    return np.stack([outcome, column], axis=2).astype(np.float32)


def _reference(a, b, c, status, max_recomputed):
    """Row by row, in the statuses' order: the first ``max_recomputed`` located elements are
    recomputed; then each tile's outcome from its rows."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    c = np.array(c, np.float32)
    batch, tiles_n, _, m = status.shape
    recomputed, fresh_nonfinite = set(), set()
    for bi, tj, row in itertools.product(range(batch), range(tiles_n), range(m)):
        if status[bi, tj, 0, row] != LOCATED or len(recomputed) == max_recomputed:
            continue
        col = tj * TILE_N + int(status[bi, tj, 1, row])
        value = a[bi, row] @ b[bi, :, col]
        c[bi, row, col] = value
        recomputed.add((bi, tj, row))
        if not np.isfinite(value):
            fresh_nonfinite.add((bi, tj, row))
    counts = np.zeros(4, np.int64)
    for bi, tj, ti in itertools.product(range(batch), range(tiles_n), range(m // TILE_M)):
        rows = range(ti * TILE_M, (ti + 1) * TILE_M)
        state = status[bi, tj, 0, ti * TILE_M : (ti + 1) * TILE_M]
        detected = bool(np.any(state > CLEAN))
        nonfinite = detected and (
            bool(np.any(state == NONFINITE_INPUT))
            or any((bi, tj, r) in fresh_nonfinite for r in rows)
        )
        beyond = any(
            status[bi, tj, 0, r] == LOCATED and (bi, tj, r) not in recomputed for r in rows
        )
        unfixed = (bool(np.any(state == UNCORRECTABLE)) or beyond) and not nonfinite
        corrected = detected and not unfixed and not nonfinite
        counts += [detected, corrected, detected and not corrected and not nonfinite, nonfinite]
    return c, counts


def _operands(dtype, seed=0):
    batch, m, k, n = SHAPE
    ka, kb, kc = jax.random.split(jax.random.key(seed), 3)
    a = jax.random.normal(ka, (batch, m, k)).astype(dtype)
    b = jax.random.normal(kb, (batch, k, n)).astype(dtype)
    # What the kernel left in C: anything; the recomputed elements are checked, the rest kept.
    c = jax.random.normal(kc, (batch, m, n)).astype(dtype)
    return a, b, c


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("max_recomputed,p_flagged", [(1, 0.02), (4, 0.02), (16, 0.01), (64, 0.05)])
def test_recompute_and_count_matches_the_row_by_row_reference(dtype, max_recomputed, p_flagged):
    a, b, c = _operands(dtype)
    # A row of A with an INF: where it is located, the inputs define a non-finite value.
    a = a.at[1, 70, 5].set(jnp.inf)
    status = _statuses(max_recomputed, p_flagged)
    status[1, 0, :, 70] = [LOCATED, 3.0]
    fixed, counts = jax.jit(
        lambda a, b, c, s: verify.recompute_and_count(
            a, b, c, s, max_recomputed=max_recomputed, tile_m=TILE_M, tile_n=TILE_N
        )
    )(a, b, c, jnp.asarray(status))
    want_c, want_counts = _reference(a, b, c, status, max_recomputed)
    assert counts.tolist() == want_counts.tolist()
    assert counts[0] > counts[1] > 0  # the draw holds both outcomes
    rtol, atol = TOLERANCES[jnp.dtype(dtype)]
    got = np.asarray(fixed, np.float32)
    want = want_c.astype(dtype).astype(np.float32)  # rounded as the GEMM rounds C
    biggest = float(np.max(np.abs(want[np.isfinite(want)])))
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol * biggest)


def test_clean_statuses_change_nothing():
    a, b, c = _operands(jnp.bfloat16)
    status = _statuses(0, 0.0)
    fixed, counts = verify.recompute_and_count(
        a, b, c, jnp.asarray(status), max_recomputed=16, tile_m=TILE_M, tile_n=TILE_N
    )
    assert counts.tolist() == [0, 0, 0, 0]
    np.testing.assert_array_equal(np.asarray(fixed), np.asarray(c))


def _scans(jaxpr) -> list[tuple[str, int]]:
    """``(primitive, operand size)`` of every scan, sort, top-k and scatter, sub-jaxprs too."""
    found = []
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name.startswith(("cum", "sort", "top_k", "scatter")):
            found.append((name, max(int(np.prod(v.aval.shape)) for v in eqn.invars)))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _scans(sub)
    return found


def test_only_one_reduction_reads_every_row_status():
    """After the kernel, scans and scatters run over the tiles or over the rows of the tiles
    taken, never over every row status; C is written at the recomputed elements only."""
    batch, m, k, n = 1, 4096, 64, 2048
    tiles = batch * (m // TILE_M) * (n // TILE_N)
    max_recomputed = 4
    a = jax.ShapeDtypeStruct((batch, m, k), jnp.bfloat16)
    b = jax.ShapeDtypeStruct((batch, k, n), jnp.bfloat16)
    c = jax.ShapeDtypeStruct((batch, m, n), jnp.bfloat16)
    status = jax.ShapeDtypeStruct((batch, n // TILE_N, 2, m), jnp.float32)
    jaxpr = jax.make_jaxpr(
        lambda a, b, c, s: verify.recompute_and_count(
            a, b, c, s, max_recomputed=max_recomputed, tile_m=TILE_M, tile_n=TILE_N
        )
    )(a, b, c, status).jaxpr
    scans = _scans(jaxpr)
    assert {name for name, _ in scans} >= {"top_k", "scatter"}
    small = max(tiles, max_recomputed * TILE_M)
    assert small * 32 <= batch * (n // TILE_N) * m  # the shapes tell the two apart
    for name, size in scans:
        # A scatter into C reads C; every other one is over tiles or taken rows.
        assert size <= small or (name == "scatter" and size == batch * m * n), (name, size)


def test_detection_only_counts_from_the_tiles_alone():
    """A detection-only kernel locates nothing: the pass after it counts what the full pass
    counts, and leaves C as it is."""
    a, b, c = _operands(jnp.float16)
    status = _statuses(7, 0.05)
    status[:, :, 0, :][status[:, :, 0, :] == LOCATED] = UNCORRECTABLE
    status[:, :, 1, :] = -1.0
    blocks = BlockSizes(tile_m=TILE_M, tile_n=TILE_N)
    after = functools.partial(verify.pass_after, a, b, c, jnp.asarray(status), check=True)
    detected, counts = after(max_recomputed=16, block_sizes=blocks, correct=False)
    _, full_counts = after(max_recomputed=16, block_sizes=blocks)
    assert counts.tolist() == full_counts.tolist()
    assert counts[0] > 0 and counts[2] > 0 and counts[3] > 0
    np.testing.assert_array_equal(np.asarray(detected), np.asarray(c))
