"""The checked Hopper GEMM (Mosaic GPU) against the XLA path of the checks.

Three layers, fastest first:

* the kernel's per-tile arithmetic (``emulate=True``: :func:`matmul_mgpu.reference_kernel`,
  the epilogue of the kernel as plain jnp on an XLA product) against ``jnp.einsum`` and
  :func:`checked_matmul_reference`: values, counters, fault plans, magnitudes, dtypes;
* the kernel itself lowered for sm_90a from this machine (Pallas -> Mosaic GPU -> layout
  inference -> NVVM-level MLIR, verified), checked and unchecked, with a fault plan;
* the kernel in Mosaic GPU's interpret mode on the CPU (slow; in a subprocess with an XLA:CPU
  pool the interpreter can finish with) against the emulation, the XLA path and ``jnp.dot``.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

from sdcguard import protection as abft
from sdcguard.fault_model import Fault, FaultPlan
from sdcguard.protection import Contraction
from sdcguard.protection.pallas import _platform, _tiles, matmul, matmul_mgpu, verify
from sdcguard.protection.pallas.matmul_mgpu import BlockSizes

from tests.helpers.tolerances import TOLERANCES
from tests.helpers.xla_settings import compile_as_users_do

ROOT = str(Path(__file__).resolve().parents[3])
SMALL = BlockSizes(tile_m=64, tile_n=64, max_concurrent_steps=2)
SITE = "test/gemm:out"
# batch, M, K, N: two CTA tiles of rows, three column tiles (the last one padded), and K
# over two panels (the last one padded).
SHAPE = (2, 128, 100, 160)
DTYPES = [jnp.bfloat16, jnp.float16]


def _operands(dtype, shape=SHAPE, scale_a=1.0, scale_b=1.0, seed=0):
    batch, m, k, n = shape
    ka, kb = jax.random.split(jax.random.key(seed))
    a = jax.random.normal(ka, (batch, m, k), jnp.float32) * scale_a
    b = jax.random.normal(kb, (batch, k, n), jnp.float32) * scale_b
    return a.astype(dtype), b.astype(dtype)


def _clean(a, b, dtype):
    return jnp.einsum("bmk,bkn->bmn", a, b, preferred_element_type=jnp.float32).astype(dtype)


def _assert_close(actual, expected, dtype):
    rtol, atol = TOLERANCES[jnp.dtype(dtype)]
    x, y = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    np.testing.assert_allclose(x, y, rtol=rtol, atol=atol * max(1.0, float(np.max(np.abs(y)))))


# (checksum_gemm, row_bounds): where the expected row sums and the rows' bounds are computed.
KERNEL_VARIANTS = [("fused", "separate"), ("separate", "separate"), ("fused", "fused")]
VARIANT_IDS = ["fused-checksums", "separate-checksums", "bounds-in-kernel"]


@functools.partial(jax.jit, static_argnames=("checksum_gemm", "row_bounds"))
def _emulated(a, b, plan, checksum_gemm="fused", row_bounds="separate"):
    return matmul.checked_matmul(
        a, b, plan=plan, site=SITE, block_sizes=SMALL, emulate=True, checksum_gemm=checksum_gemm,
        row_bounds=row_bounds,
    )  # fmt: skip


def _plan(*faults):
    return FaultPlan.from_faults(list(faults), capacity=len(faults))


def test_block_sizes_are_validated():
    with pytest.raises(ValueError, match="multiple of 64"):
        BlockSizes(tile_m=96)
    with pytest.raises(ValueError, match="tile_k"):
        BlockSizes(tile_k=32)
    with pytest.raises(ValueError, match="max_concurrent_steps"):
        BlockSizes(max_concurrent_steps=1)
    with pytest.raises(ValueError, match="checksum_gemm='inline'"):
        matmul_mgpu.KernelSettings(out_dtype=jnp.bfloat16, checksum_gemm="inline")
    with pytest.raises(ValueError, match="row_bounds='inline'"):
        matmul_mgpu.KernelSettings(out_dtype=jnp.bfloat16, row_bounds="inline")
    with pytest.raises(ValueError, match=r"\[B, M, K\]"):
        matmul.checked_matmul(jnp.ones((2, 3, 4)), jnp.ones((2, 5, 4)))


def test_split_checksum_is_float32_exact():
    """hi + mid + lo of the split column sums rebuild them to float32 accuracy (u³)."""
    for dtype in DTYPES:
        x = jax.random.uniform(jax.random.key(1), (4096,), minval=-1, maxval=1)
        parts = jnp.stack(_tiles.split3(x, dtype), axis=-1).astype(jnp.float32)
        err = np.abs(np.asarray(parts.sum(-1) - x))
        relative, absolute = matmul_mgpu.representation_error(dtype)
        assert np.all(err <= 2**-23 * np.abs(np.asarray(x)) + 3 * absolute + 1e-30)
        assert relative <= 2**-24


def _with_excess_precision(fn, *args):
    """``fn(*args)`` evaluated as XLA:GPU compiles it with ``xla_allow_excess_precision``
    (its default): a conversion back to float32 of a value converted from float32 to a narrower
    dtype gives the float32 value itself, the rounding dropped."""
    closed = jax.make_jaxpr(fn)(*args)
    env, wider = {}, {}  # wider: a narrowed value's float32 origin
    read = lambda v: v.val if isinstance(v, jax.extend.core.Literal) else env[v]
    for var, val in zip(closed.jaxpr.invars, args, strict=True):
        env[var] = val
    for eqn in closed.jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        outs = eqn.primitive.bind(*ins, **eqn.params)
        outs = outs if eqn.primitive.multiple_results else [outs]
        if eqn.primitive.name == "convert_element_type":
            (src,), (out,) = eqn.invars, eqn.outvars
            if src.aval.dtype == jnp.float32 and out.aval.dtype != jnp.float32:
                wider[out] = ins[0]
            elif out.aval.dtype == jnp.float32 and src in wider:
                outs = [wider[src]]
        for var, val in zip(eqn.outvars, outs, strict=True):
            env[var] = val
    return [read(v) for v in closed.jaxpr.outvars]


@pytest.mark.parametrize("dtype", DTYPES)
def test_split_checksum_survives_xlas_excess_precision(dtype):
    """XLA:GPU drops ``f32 -> bf16 -> f32`` round trips; a split computed through them came out
    ``hi`` alone (``x`` to 2⁻⁹, every clean tile of a short contraction alarmed on an H200).
    The split rounds with ``reduce_precision``, which no compiler may drop."""
    x = jax.random.uniform(jax.random.key(1), (4096,), minval=-1, maxval=1)
    parts = _with_excess_precision(lambda x: _tiles.split3(x, dtype), x)
    err = np.abs(np.asarray(sum(p.astype(jnp.float32) for p in parts) - x))
    _, absolute = matmul_mgpu.representation_error(dtype)
    assert np.all(err <= 2**-23 * np.abs(np.asarray(x)) + 3 * absolute + 1e-30)


@pytest.mark.parametrize("checksum_gemm,row_bounds", KERNEL_VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_clean_runs_never_alarm_across_magnitudes(dtype, checksum_gemm, row_bounds):
    """Operands from tiny to huge (as far as the dtype's range keeps C finite): no alarm, and
    C is the XLA product rounded once."""
    if dtype == jnp.bfloat16:
        scales = [(1e-30, 1e-5), (1.0, 1.0), (1e19, 1e15), (1e-20, 1e18)]
    else:
        scales = [(1e-2, 1e-1), (1.0, 1.0), (10.0, 20.0), (1e-1, 30.0)]
    for i, (sa, sb) in enumerate(scales):
        a, b = _operands(dtype, scale_a=sa, scale_b=sb, seed=i)
        c, counts = _emulated(a, b, None, checksum_gemm, row_bounds)
        assert counts.tolist() == [0, 0, 0, 0], (sa, sb)
        _assert_close(c, _clean(a, b, dtype), dtype)


def _tile_epilogue(acc, a, b, out_dtype):
    """The kernel's epilogue (:func:`matmul_mgpu._check_tile`) on one ``[64, 64]`` tile ``acc``
    of ``a @ b``, with the checksums and thresholds the host computes from ``a`` and ``b``."""
    bc, scales, magnitudes = matmul_mgpu.checksum_columns(b, tile_n=64, transposed=False)
    params = matmul_mgpu.tile_parameters(
        a, scales, magnitudes, contraction=a.shape[2], tile_n=64, safety=1.0,
        expected=matmul_mgpu.expected_row_sums(a, bc),
    )  # fmt: skip
    settings = matmul_mgpu.KernelSettings(
        out_dtype=out_dtype, block_sizes=SMALL, checksum_gemm="separate"
    )
    iota = lambda shape, axis: jax.lax.broadcasted_iota(jnp.int32, shape, axis)
    param = lambda r: params[0, 0, r, :64]
    return matmul_mgpu._check_tile(acc, None, param, settings=settings, iota=iota)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_tile_right_to_the_outputs_precision_raises_no_alarm(dtype):
    """A GPU's tensor cores sum a tile in their own order and roundings (clean tiles alarmed on
    an H200 under the float32 round-off model alone). An accumulator off by 2**-12 of each
    element, one way, is right to a bf16 or fp16 output's precision: no alarm, as the XLA path
    allows such a C. A float32 output holds those bits, so there it alarms; a fault in the same
    tile is still located."""
    a, b = _operands(dtype, shape=(1, 64, 128, 64))
    exact = jnp.einsum(
        "bmk,bkn->bmn", a, b, preferred_element_type=jnp.float32, precision="highest"
    )[0]
    biased = exact + 2.0**-12 * jnp.abs(exact)

    _, status, _ = _tile_epilogue(biased, a, b, dtype)
    assert set(np.asarray(status).tolist()) == {matmul_mgpu.CLEAN}
    _, status, _ = _tile_epilogue(biased, a, b, jnp.float32)
    assert np.sum(np.asarray(status) != matmul_mgpu.CLEAN) >= 4, np.asarray(status)

    faulty = biased.at[5, 17].add(100.0 * float(jnp.max(jnp.abs(exact))))
    fixed, status, column = _tile_epilogue(faulty, a, b, dtype)
    status, column = np.asarray(status), np.asarray(column)
    assert status[5] == matmul_mgpu.LOCATED and column[5] == 17
    assert set(np.delete(status, 5).tolist()) == {matmul_mgpu.CLEAN}
    # Rebuilt from the row checksum, it carries the rest of the row's bias (the host then
    # recomputes a located element from A and B).
    rest_bias = 2.0**-12 * (float(jnp.sum(jnp.abs(exact[5]))) - abs(float(exact[5, 17])))
    assert abs(float(fixed[5, 17]) - float(exact[5, 17])) <= 1.01 * rest_bias + 1e-3


# (kind, batch, row, col, bit): corners and edges of the 64x64 tiles, several tiles at once.
FAULTS = [
    ("inf", 0, 0, 0, 0),  # first corner of the matrix
    ("nan", 0, 63, 64, 0),  # bottom-left corner of a tile
    ("near_inf", 0, 64, 127, 0),  # top-right corner of another tile
    ("-inf", 1, 127, 159, 0),  # the last element (padded tile)
    ("bitflip", 1, 5, 70, None),  # the exponent's most significant bit
    ("bitflip", 1, 100, 3, None),
]


def _exponent_msb(dtype) -> int:
    return {jnp.bfloat16: 14, jnp.float16: 14}[dtype]


@pytest.mark.parametrize("checksum_gemm,row_bounds", KERNEL_VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_faults_in_several_tiles_are_corrected_exactly(dtype, checksum_gemm, row_bounds):
    a, b = _operands(dtype)
    n = SHAPE[3]
    faults = []
    for kind, bi, row, col, bit in FAULTS:
        flat = (bi * SHAPE[1] + row) * n + col
        bit = _exponent_msb(dtype) if bit is None else bit
        faults.append(Fault(site=SITE, kind=kind, index=flat, bit=bit))
    clean = _clean(a, b, dtype)
    c, counts = _emulated(a, b, _plan(*faults), checksum_gemm, row_bounds)
    # One fault per tile: each tile detected and corrected.
    assert counts.tolist() == [len(FAULTS), len(FAULTS), 0, 0]
    # Corrected elements are recomputed, not rebuilt from checksums: equal to the clean C.
    _assert_close(c, clean, dtype)
    for _, bi, row, col, _ in FAULTS:
        np.testing.assert_allclose(
            float(c[bi, row, col]), float(clean[bi, row, col]), rtol=2 ** -jnp.finfo(dtype).nmant
        )
    # The XLA path fixes one error per matrix in place; with several per matrix it counts each
    # matrix detected and uncorrectable (for the step-level decision) and passes nothing on as
    # corrected. The kernel, checking per tile, corrects them all.
    _, ref_counts = matmul.checked_matmul_reference(a, b, plan=_plan(*faults), site=SITE)
    assert ref_counts.tolist() == [SHAPE[0], 0, SHAPE[0], 0]


def test_two_errors_in_one_row_are_uncorrectable():
    dtype = jnp.bfloat16
    a, b = _operands(dtype)
    n = SHAPE[3]
    two = [Fault(site=SITE, kind="inf", index=5 * n + col) for col in (2, 9)]
    other = Fault(site=SITE, kind="nan", index=(SHAPE[1] + 7) * n + 100)
    c, counts = _emulated(a, b, _plan(*two, other))
    assert counts.tolist() == [2, 1, 1, 0]
    assert not np.isfinite(np.asarray(c[0, 5, 2], np.float32))  # left for the step decision


@pytest.mark.parametrize("checksum_gemm,row_bounds", KERNEL_VARIANTS, ids=VARIANT_IDS)
def test_detect_only_counts_and_leaves_c(checksum_gemm, row_bounds):
    dtype = jnp.bfloat16
    a, b = _operands(dtype)
    plan = _plan(Fault(site=SITE, kind="inf", index=17))
    c, counts = matmul.checked_matmul(
        a,
        b,
        plan=plan,
        site=SITE,
        correct=False,
        block_sizes=SMALL,
        emulate=True,
        checksum_gemm=checksum_gemm,
        row_bounds=row_bounds,
    )
    assert counts.tolist() == [1, 0, 1, 0]
    assert np.isinf(np.asarray(c, np.float32).reshape(-1)[17])


def test_located_beyond_capacity_counts_uncorrectable():
    dtype = jnp.float16
    a, b = _operands(dtype)
    n = SHAPE[3]
    faults = [Fault(site=SITE, kind="inf", index=row * n) for row in (0, 64)]  # two tiles
    _, counts = matmul.checked_matmul(
        a, b, plan=_plan(*faults), site=SITE, max_recomputed=1, block_sizes=SMALL, emulate=True
    )
    assert counts.tolist() == [2, 1, 1, 0]


@pytest.mark.parametrize("checksum_gemm,row_bounds", KERNEL_VARIANTS, ids=VARIANT_IDS)
def test_nonfinite_inputs_are_their_own_outcome(checksum_gemm, row_bounds):
    dtype = jnp.bfloat16
    a, b = _operands(dtype)
    a = a.at[0, 10, 3].set(jnp.inf)
    c, counts = _emulated(a, b, None, checksum_gemm, row_bounds)
    # Row 10 of matrix 0 is non-finite in all three column tiles: three tiles, inputs to blame.
    assert counts.tolist() == [3, 0, 0, 3]
    assert not np.all(np.isfinite(np.asarray(c[0, 10], np.float32)))


def _parameters(a, b, row_bounds, plan=None):
    """``(params, settings)`` of a correcting call on bf16 ``a``, ``b`` (no padding needed)."""
    faults = matmul.matrix_faults(plan, SITE, (a.shape[0], a.shape[1], b.shape[2]))
    injected = None if faults is None else matmul._injected_values(a, b, faults, jnp.bfloat16)
    settings = matmul_mgpu.KernelSettings(
        out_dtype=jnp.bfloat16, block_sizes=SMALL, row_bounds=row_bounds,
        num_faults=0 if injected is None else injected[0].shape[0],
    )  # fmt: skip
    _, _, scales, magnitudes = matmul.pass_over_b(
        b, a_shape=a.shape, check=True, block_sizes=SMALL, transposed=False
    )
    _, params = matmul.pass_over_a(
        a, scales, magnitudes, b_shape=b.shape, settings=settings, injected=injected
    )
    return params, settings


def _params_only(a, **kwargs):
    return matmul.pass_over_a(a, **kwargs)[1]


def test_bounds_in_the_kernel_leave_nothing_to_read_of_a_before_it():
    """With ``row_bounds="fused"`` the pass before the kernel does not read ``A`` (the rows'
    bounds come from the ``A`` panels in the kernel's shared memory), and its parameters are
    per tile (``[batch, tiles, rows, tile_m]``), not per row of ``A``, unless faults are
    injected. The thresholds the epilogue computes from the rows' bounds are those the pass
    over ``A`` computes with ``"separate"``."""
    a, b = _operands(jnp.bfloat16, shape=(2, 128, 128, 192))  # nothing to pad
    _, _, scales, magnitudes = matmul.pass_over_b(
        b, a_shape=a.shape, check=True, block_sizes=SMALL, transposed=False
    )
    for row_bounds, reads_a in (("separate", True), ("fused", False)):
        settings = matmul_mgpu.KernelSettings(
            out_dtype=jnp.bfloat16, block_sizes=SMALL, row_bounds=row_bounds
        )
        params_only = functools.partial(
            _params_only, scales=scales, magnitudes=magnitudes, b_shape=b.shape, settings=settings
        )
        jaxpr = jax.make_jaxpr(params_only)(a).jaxpr
        used = [v for eqn in jaxpr.eqns for v in eqn.invars] + list(jaxpr.outvars)
        assert any(v is jaxpr.invars[0] for v in used) == reads_a, row_bounds

    separate, _ = _parameters(a, b, "separate")
    fused, settings = _parameters(a, b, "fused")
    batch, m, tiles = a.shape[0], a.shape[1], b.shape[2] // SMALL.tile_n
    assert not settings.params_per_row
    assert separate.shape == (batch, tiles, 4, m)
    assert fused.shape == (batch, tiles, 10, SMALL.tile_m)
    row_l1, row_max = matmul_mgpu.row_bounds(a)  # [batch, M]
    for threshold_row, rows in zip(
        (matmul_mgpu.THRESHOLD_E, matmul_mgpu.THRESHOLD_W), matmul_mgpu.COEFFICIENTS, strict=True
    ):
        # Each tile's coefficients, the same for every row of the tile: [batch, tiles, 1].
        coefficients = [fused[:, :, r, :1] for r in rows]
        assert all(bool(jnp.all(fused[:, :, r] == fused[:, :, r, :1])) for r in rows)
        in_kernel = matmul_mgpu.row_thresholds(
            row_l1[:, None, :], row_max[:, None, :], coefficients
        )
        np.testing.assert_array_equal(
            np.asarray(in_kernel), np.asarray(separate[:, :, threshold_row])
        )

    with_faults, settings = _parameters(a, b, "fused", _plan(Fault(site=SITE, kind="inf", index=5)))
    assert settings.params_per_row and with_faults.shape == (batch, tiles, 12, m)


def _threshold(a, b, batch, row, col) -> float:
    """The threshold (unscaled) of the row check of ``a @ b``'s element at ``(batch, row, col)``
    for a float32 ``C``: how far the row's plain sum may stray on clean data."""
    _, _, scales, magnitudes = matmul.pass_over_b(
        b, a_shape=a.shape, check=True, block_sizes=SMALL, transposed=False
    )
    settings = matmul_mgpu.KernelSettings(out_dtype=jnp.float32, block_sizes=SMALL)
    _, params = matmul.pass_over_a(a, scales, magnitudes, b_shape=b.shape, settings=settings)
    tile = col // SMALL.tile_n
    at = params[batch, tile, :, row]
    return float(at[matmul_mgpu.THRESHOLD_E] / at[matmul_mgpu.SCALE_E])


@pytest.mark.parametrize("row_bounds", matmul_mgpu.ROW_BOUNDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_float32_outputs_threshold_is_its_rows_bound(dtype, row_bounds):
    """A float32 ``C`` keeps the accumulator's bits, so its rows' thresholds are the round-off
    bound alone (no output rounding beside it), from the rows' bounds: clean, no alarm; an
    element off by three times its row's threshold, detected and corrected."""
    a, b = _operands(dtype)
    exact = jnp.einsum("bmk,bkn->bmn", a, b, preferred_element_type=jnp.float32)
    index = (SHAPE[1] + 70) * SHAPE[3] + 100  # matrix 1, row 70, column 100
    value = float(exact.reshape(-1)[index]) + 3 * _threshold(a, b, 1, 70, 100)
    near = _plan(Fault(site=SITE, kind="value", index=index, value=value))
    for plan, want in ((None, [0, 0, 0, 0]), (near, [1, 1, 0, 0])):
        c, counts = matmul.checked_matmul(
            a, b, plan=plan, site=SITE, block_sizes=SMALL, emulate=True, row_bounds=row_bounds,
            out_dtype=jnp.float32,
        )  # fmt: skip
        assert counts.tolist() == want
        _assert_close(c, exact, jnp.float32)


def test_float32_takes_the_xla_path():
    a, b = _operands(jnp.float32)
    plan = _plan(Fault(site=SITE, kind="nan", index=33))
    c, counts = matmul.checked_matmul(a, b, plan=plan, site=SITE)
    ref, ref_counts = matmul.checked_matmul_reference(a, b, plan=plan, site=SITE)
    np.testing.assert_array_equal(np.asarray(c), np.asarray(ref))
    assert counts.tolist() == ref_counts.tolist() == [1, 1, 0, 0]
    assert not matmul.uses_kernel(jnp.float32, jnp.float32)
    assert matmul.uses_kernel(jnp.bfloat16, jnp.bfloat16)


def test_checked_contraction_matches_the_xla_path():
    """Any pure contraction through the kernel's layout: the fault lands where the XLA path
    puts it, and both correct it."""
    dtype = jnp.bfloat16
    ka, kb = jax.random.split(jax.random.key(3))
    x = jax.random.normal(ka, (2, 64, 2, 32)).astype(dtype)  # [batch, seq, heads, dim]
    w = jax.random.normal(kb, (2, 32, 96)).astype(dtype)  # [heads, dim, features]
    spec = "bshd,hdf->bsf"
    ct = Contraction.parse(spec, x.ndim, w.ndim)
    plan = _plan(Fault(site=SITE, kind="inf", index=1234))
    config = abft.ABFTConfig()
    c, counts = matmul.checked_contraction(
        x, w, ct, config=config, site=SITE, plan=plan, block_sizes=SMALL, emulate=True
    )
    ref, ref_counts = abft.checked_einsum(spec, x, w, site=SITE, plan=plan)
    assert counts.tolist() == ref_counts.tolist() == [1, 1, 0, 0]
    _assert_close(c, ref, dtype)


def _prepared(a, b, plan):
    """``(a_p, b_p, bc, params, settings)`` of a correcting emulated call with ``plan``."""
    faults = matmul.matrix_faults(plan, SITE, (a.shape[0], a.shape[1], b.shape[2]))
    injected = None if faults is None else matmul._injected_values(a, b, faults, jnp.bfloat16)
    b_p, bc, scales, magnitudes = matmul.pass_over_b(
        b, a_shape=a.shape, check=True, block_sizes=SMALL, transposed=False
    )
    num_faults = 0 if injected is None else injected[0].shape[0]
    settings = matmul_mgpu.KernelSettings(
        out_dtype=jnp.bfloat16, block_sizes=SMALL, num_faults=num_faults
    )
    a_p, params = matmul.pass_over_a(
        a, scales, magnitudes, b_shape=b.shape, settings=settings, injected=injected
    )
    return a_p, b_p, bc, params, settings


MARK = 4096.0  # added to every element of the correcting launch's output, to tell it apart


@pytest.mark.parametrize("faulty", [False, True], ids=["clean", "faulty"])
def test_a_correcting_call_runs_the_locating_kernel_only_when_a_tile_flagged(faulty):
    """``detect_then_locate`` over the kernel's emulation: the detection-only launch first.
    Clean, its output is the result; when a tile flagged, that tile alone is taken from the
    correcting launch (marked here), and the element it located is recomputed exactly."""
    a, b = _operands(jnp.bfloat16)
    plan = _plan(Fault(site=SITE, kind="inf", index=5)) if faulty else None
    a_p, b_p, bc, params, settings = _prepared(a, b, plan)
    launched = []

    def launch(settings):
        launched.append(settings.correct)
        c, status = matmul_mgpu.reference_kernel(a_p, b_p, bc, params, settings=settings)
        return (c + MARK if settings.correct else c), status

    c, counts = jax.jit(
        lambda: matmul.detect_then_locate(
            launch, a, b, settings, max_recomputed=16, max_rerun_tiles=64
        )
    )()
    assert launched == [False, True]  # both traced, the detection first
    clean = np.asarray(_clean(a_p, b_p, jnp.bfloat16), np.float32)
    marked = np.abs(np.asarray(c, np.float32) - clean) > MARK / 2
    if not faulty:
        assert counts.tolist() == [0, 0, 0, 0] and not marked.any()
        return
    assert counts.tolist() == [1, 1, 0, 0]
    tile = np.zeros_like(marked)
    tile[0, :64, :64] = True  # the tile of element 5 of matrix 0
    tile[0, 0, 5] = False  # recomputed exactly
    np.testing.assert_array_equal(marked, tile)
    assert float(c[0, 0, 5]) == float(clean[0, 0, 5])


def test_a_fault_that_does_not_recur_is_still_counted():
    """A transient fault: the detection-only launch flags it, the correcting launch computes
    the GEMM again clean. The output is the clean one, and the counters still say a fault was
    detected (not located: uncorrectable), rather than nothing."""
    a, b = _operands(jnp.bfloat16)
    plan = _plan(Fault(site=SITE, kind="inf", index=5))
    a_p, b_p, bc, faulty_params, settings = _prepared(a, b, plan)
    *_, clean_params, _ = _prepared(a, b, None)

    def launch(settings):  # the fault strikes the first run only
        if settings.correct:
            clean = dataclasses.replace(settings, num_faults=0)
            return matmul_mgpu.reference_kernel(a_p, b_p, bc, clean_params, settings=clean)
        return matmul_mgpu.reference_kernel(a_p, b_p, bc, faulty_params, settings=settings)

    c, counts = jax.jit(
        lambda: matmul.detect_then_locate(
            launch, a, b, settings, max_recomputed=16, max_rerun_tiles=64
        )
    )()
    assert counts.tolist() == [1, 0, 1, 0]
    _assert_close(c[:, :128, :160], _clean(a, b, jnp.bfloat16), jnp.bfloat16)


@pytest.mark.parametrize("max_rerun_tiles", [1, 2])
def test_flagged_tiles_beyond_the_rerun_capacity_count_uncorrectable(max_rerun_tiles):
    """Faults in two tiles: each tile the second run replaces is corrected; a flagged tile
    beyond ``max_rerun_tiles`` keeps its value and counts detected and uncorrectable."""
    a, b = _operands(jnp.bfloat16)
    # Element 5 of matrix 0 (tile 0 of its column tiles) and element 70 (column tile 1).
    plan = _plan(
        Fault(site=SITE, kind="value", index=5, value=1e4),
        Fault(site=SITE, kind="value", index=70, value=1e4),
    )
    c, counts = jax.jit(
        lambda a, b, plan: matmul.checked_matmul(
            a, b, plan=plan, site=SITE, block_sizes=SMALL, emulate=True,
            max_rerun_tiles=max_rerun_tiles,
        )
    )(a, b, plan)  # fmt: skip
    taken = max_rerun_tiles
    assert counts.tolist() == [2, taken, 2 - taken, 0]
    clean = _clean(a, b, jnp.bfloat16)
    fixed = [float(c[0, 0, j]) == float(clean[0, 0, j]) for j in (5, 70)]
    assert fixed == [True, taken == 2]


@pytest.mark.parametrize("name", ["max_recomputed", "max_rerun_tiles"])
@pytest.mark.parametrize("value", [0, -1, 2.5])
def test_capacities_that_are_not_positive_ints_are_refused(name, value):
    a, b = _operands(jnp.bfloat16)
    with pytest.raises(ValueError, match=f"{name} must be a positive int"):
        matmul.checked_matmul(a, b, block_sizes=SMALL, emulate=True, **{name: value})


def test_a_clean_correcting_call_runs_none_of_the_second_runs_work():
    """Everything after the detection-only launch but the predicate sits behind the
    ``lax.cond``: outside it the traced call has no gather, scatter or top-k (the pass after
    the kernel ran on every call before). Compiled for an H200, the clean call also copies
    nothing through the conditional (``tests/test_gpu_compile_offline.py``)."""
    a, b = _operands(jnp.bfloat16)
    fn = lambda a, b: matmul.checked_matmul(a, b, block_sizes=SMALL, emulate=True)
    outside = collections.Counter()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            outside[eqn.primitive.name] += 1
            if eqn.primitive.name == "cond":
                continue  # its branches: the second run
            for param in eqn.params.values():
                inner = getattr(param, "jaxpr", None)
                if inner is not None:
                    walk(getattr(inner, "jaxpr", inner))

    walk(jax.make_jaxpr(fn)(a, b).jaxpr)
    assert outside["cond"] == 1
    assert not {"gather", "scatter", "top_k", "sort"} & set(outside), outside


def test_recompute_and_count_is_branch_free():
    """The host side after the kernel compiles to no loop or conditional."""
    a, b = _operands(jnp.bfloat16)
    c = jnp.zeros((2, 128, 192), jnp.bfloat16)
    status = jnp.zeros((2, 3, 2, 128), jnp.float32)
    fn = jax.jit(
        lambda a, b, c, s: verify.recompute_and_count(
            a, b, c, s, max_recomputed=4, tile_m=64, tile_n=64
        )
    )
    hlo = compile_as_users_do(fn.lower(a, b, c, status)).as_text()  # XLA:CPU's emitters decide
    assert " while(" not in hlo and " conditional(" not in hlo


# --- The kernel itself -------------------------------------------------------------------------


def _lower_for_h100(
    check: bool, plan, correct: bool = True, checksum_gemm: str = "fused", row_bounds="separate"
):
    from jax.sharding import AbstractDevice, AbstractMesh

    device = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132)
    a = jax.ShapeDtypeStruct((2, 512, 320), jnp.bfloat16)
    b = jax.ShapeDtypeStruct((2, 320, 384), jnp.bfloat16)

    def f(a, b, plan):
        return matmul.checked_matmul(
            a,
            b,
            check=check,
            correct=correct,
            plan=plan,
            site=SITE,
            checksum_gemm=checksum_gemm,
            row_bounds=row_bounds,
            interpret=False,
        )

    with jax.sharding.use_abstract_mesh(AbstractMesh((), (), abstract_device=device)):
        return jax.jit(f).trace(a, b, plan).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.lowering
@pytest.mark.parametrize(
    "check,correct,checksum_gemm,row_bounds,with_plan",
    [
        (True, True, "fused", "separate", True), (True, False, "fused", "separate", True),
        (True, True, "separate", "separate", True), (True, False, "separate", "separate", True),
        (True, True, "fused", "fused", True), (True, False, "fused", "fused", False),
        (False, False, "fused", "separate", True),
    ],
    ids=[
        "checked", "detect-only", "checked-separate", "detect-only-separate",
        "checked-bounds-in-kernel", "detect-only-bounds-in-kernel-per-tile", "unchecked",
    ],
)  # fmt: skip
def test_kernel_lowers_for_sm90a(check, correct, checksum_gemm, row_bounds, with_plan):
    """Pallas -> Mosaic GPU dialect -> layout inference for sm_90 -> lowered MLIR that
    verifies, within Hopper's shared memory: the WGMMAs (the narrow one included, when fused),
    TMA pipeline and epilogue (with the location, or without it for detection only), and the
    rows' bounds from the ``A`` panels (parameters per row with a plan, per tile without) are
    all accepted. PTX and SASS are produced on a GPU, or by a deviceless compile
    (``scripts/gpu_compile_offline.py --mosaic-gemm``)."""
    plan = _plan(Fault(site=SITE, kind="inf", index=5)) if with_plan else None
    text = _lower_for_h100(check, plan, correct, checksum_gemm, row_bounds)
    calls = [line for line in text.splitlines() if "stablehlo.custom_call @mosaic_gpu" in line]
    # A correcting GEMM: the detection-only kernel, and the correcting one in a conditional.
    assert len(calls) == (2 if correct else 1)
    assert ("stablehlo.case" in text) == correct
    assert ("checked_matmul" if check else "matmul") in text


@pytest.mark.lowering
@pytest.mark.parametrize("correct", [True, False], ids=["correcting", "detect-only"])
def test_each_distinct_kernel_is_lowered_once(correct):
    """Three GEMMs of two shapes lower two kernels per kind, each once: the calls of one shape
    share one Mosaic GPU module, so the step compiles one kernel per distinct shape (issue 36,
    item 4; docs/performance.md, "Where XLA:GPU's compile time goes")."""
    from jax.sharding import AbstractDevice, AbstractMesh

    device = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132)
    a = jax.ShapeDtypeStruct((1, 256, 320), jnp.bfloat16)
    b = jax.ShapeDtypeStruct((1, 320, 384), jnp.bfloat16)
    a_other = jax.ShapeDtypeStruct((1, 512, 320), jnp.bfloat16)

    def f(a, b1, b2, a_other):
        gemm = functools.partial(matmul.checked_matmul, correct=correct, interpret=False)
        (c1, n1), (c2, n2), (c3, n3) = gemm(a, b1), gemm(a, b2), gemm(a_other, b1)
        return c1 + c2, c3, n1 + n2 + n3

    with jax.sharding.use_abstract_mesh(AbstractMesh((), (), abstract_device=device)):
        lowered = jax.jit(f).trace(a, b, b, a_other).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    modules = re.findall(r"stablehlo.custom_call @mosaic_gpu\w*\(.*?module = (\"[^\"]*\")", text)
    kinds = 2 if correct else 1
    assert len(modules) == len(set(modules)) == 2 * kinds, len(modules)


@pytest.mark.lowering
def test_kernel_with_too_much_shared_memory_is_refused():
    too_deep = BlockSizes(tile_m=128, tile_n=256, max_concurrent_steps=6)
    from jax.sharding import AbstractDevice, AbstractMesh

    device = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132)
    a = jax.ShapeDtypeStruct((1, 256, 256), jnp.bfloat16)
    b = jax.ShapeDtypeStruct((1, 256, 256), jnp.bfloat16)
    f = lambda a, b: matmul.checked_matmul(a, b, block_sizes=too_deep, interpret=False)
    mesh = AbstractMesh((), (), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh), pytest.raises(Exception, match="shared memory"):
        jax.jit(f).trace(a, b).lower(lowering_platforms=("cuda",))


# The kernel in GPU interpret mode runs in a subprocess: the interpreter needs an XLA:CPU pool of
# at least `_platform.INTERPRETER_POOL_THREADS` threads, sized from PJRT_NPROC when JAX starts (this
# machine may have fewer CPUs), and a hang must fail the test rather than stall the suite.
_INTERPRET_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax.numpy as jnp, numpy as np
    from sdcguard.fault_model import Fault, FaultPlan
    from sdcguard.protection.pallas import matmul
    from sdcguard.protection.pallas.matmul_mgpu import BlockSizes
    spec = json.loads(sys.argv[1])
    operands = np.load(sys.argv[2])
    block_sizes = BlockSizes(**spec["block_sizes"])
    faults = [Fault(**f) for f in spec["faults"]]
    plan = FaultPlan.from_faults(faults, capacity=len(faults))
    results = {}
    for name in spec["dtypes"]:
        a = jnp.asarray(operands[name + "/a"]).astype(name)
        b = jnp.asarray(operands[name + "/b"]).astype(name)
        run = lambda **kw: matmul.checked_matmul(
            a, b, site=spec["site"], block_sizes=block_sizes, interpret=True, **kw)
        for gemm, bounds in spec["variants"]:
            c, counts = run(plan=plan, checksum_gemm=gemm, row_bounds=bounds)
            results[name + "/" + gemm + "/" + bounds + "/c"] = np.asarray(c, np.float32)
            results[name + "/" + gemm + "/" + bounds + "/counts"] = np.asarray(counts)
        # The bounds in the kernel with a float32 C (no output rounding to hide them behind):
        # clean (the parameters per tile, not per row), then one element off by a few of its
        # row's thresholds.
        f32 = spec["float32_fault"][name]
        near = FaultPlan.from_faults([Fault(site=spec["site"], kind="value", **f32)], capacity=1)
        for label, p in (("clean32", None), ("near32", near)):
            c, counts = run(plan=p, row_bounds="fused", out_dtype=np.float32)
            results[name + "/" + label + "/c"] = np.asarray(c, np.float32)
            results[name + "/" + label + "/counts"] = np.asarray(counts)
        plain, _ = run(check=False)
        results[name + "/unchecked"] = np.asarray(plain, np.float32)
    np.savez(sys.argv[3], **results)
    print("interpret ok")
    """
)


# (kind, batch, row, col): a fault at a tile corner (the top-right one of the tile at rows
# 64-127, columns 64-127 of matrix 0) and one on a tile edge (the bottom edge of the padded
# last column tile of matrix 1); one per matrix, so the XLA path corrects both too.
INTERPRET_FAULTS = [("bitflip", 0, 64, 127), ("near_inf", 1, 127, 150)]
INTERPRET_LIMIT_S = 420  # a correcting GEMM with faults interprets two kernels


@pytest.mark.slow
def test_kernel_in_gpu_interpret_mode_matches_the_xla_path_and_the_emulation(tmp_path):
    """The kernel itself, interpreted on the CPU (Mosaic GPU interpret mode; its persistent loop
    over 2 programs with 3 tiles each, two K panels, padding), checked (with the checksum GEMM
    fused and separate, the rows' bounds from a pass over ``A`` and from the kernel's ``A``
    panels) and unchecked, for both dtypes: counters equal the emulation's and the XLA path's,
    values equal the emulation's and ``jnp.dot``'s, and the corrupted elements are corrected
    to the clean ones. With the bounds in the kernel and a float32 ``C``, whose threshold they
    decide, a clean call (its parameters per tile) counts nothing and an element off by three
    times its row's threshold is corrected."""
    n = SHAPE[3]
    faults = [
        Fault(site=SITE, kind=kind, index=(bi * SHAPE[1] + row) * n + col, bit=14)
        for kind, bi, row, col in INTERPRET_FAULTS
    ]
    names = [jnp.dtype(d).name for d in DTYPES]
    operands, float32_fault = {}, {}
    near_index = (SHAPE[1] + 70) * n + 100  # matrix 1, row 70, column 100
    for dtype, name in zip(DTYPES, names, strict=True):
        a, b = _operands(dtype)
        operands[name + "/a"] = np.asarray(a, np.float32)  # exact: bf16/fp16 fit in float32
        operands[name + "/b"] = np.asarray(b, np.float32)
        exact = jnp.einsum("bmk,bkn->bmn", a, b, preferred_element_type=jnp.float32)
        float32_fault[name] = {
            "index": near_index,
            "value": float(exact.reshape(-1)[near_index]) + 3 * _threshold(a, b, 1, 70, 100),
        }
    np.savez(tmp_path / "operands.npz", **operands)
    spec = {
        "dtypes": names,
        "variants": KERNEL_VARIANTS,
        "float32_fault": float32_fault,
        "site": SITE,
        "block_sizes": {"tile_m": SMALL.tile_m, "tile_n": SMALL.tile_n, "max_concurrent_steps": 2},
        "faults": [
            {"site": f.site, "kind": f.kind, "index": f.index, "bit": f.bit} for f in faults
        ],
    }
    env = {**os.environ, "PJRT_NPROC": str(_platform.INTERPRETER_POOL_THREADS), "PYTHONPATH": ROOT}
    args = [json.dumps(spec), str(tmp_path / "operands.npz"), str(tmp_path / "kernel.npz")]
    try:
        done = subprocess.run(
            [sys.executable, "-c", _INTERPRET_SCRIPT, *args],
            capture_output=True,
            text=True,
            timeout=INTERPRET_LIMIT_S,
            env=env,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the kernel did not finish in GPU interpret mode in {INTERPRET_LIMIT_S} s")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "interpret ok" in done.stdout
    kernel = np.load(tmp_path / "kernel.npz")
    plan = _plan(*faults)
    variants = itertools.product(zip(DTYPES, names, strict=True), KERNEL_VARIANTS)
    for (dtype, name), (gemm, bounds) in variants:
        a, b = _operands(dtype)
        clean = _clean(a, b, dtype)
        emulated, emulated_counts = _emulated(a, b, plan, gemm, bounds)
        _, xla_counts = matmul.checked_matmul_reference(a, b, plan=plan, site=SITE)
        got = kernel[f"{name}/{gemm}/{bounds}/c"]
        counts = kernel[f"{name}/{gemm}/{bounds}/counts"].tolist()
        assert counts == emulated_counts.tolist() == xla_counts.tolist() == [2, 2, 0, 0], name
        _assert_close(got, emulated, dtype)
        _assert_close(got, clean, dtype)
        for _, bi, row, col in INTERPRET_FAULTS:
            np.testing.assert_allclose(
                got[bi, row, col],
                float(clean[bi, row, col]),
                rtol=2 ** -jnp.finfo(dtype).nmant,
                err_msg=f"{name}, {gemm}, {bounds}: element {(bi, row, col)} not corrected",
            )
        _assert_close(kernel[name + "/unchecked"], clean, dtype)
    for dtype, name in zip(DTYPES, names, strict=True):
        a, b = _operands(dtype)
        exact = jnp.einsum("bmk,bkn->bmn", a, b, preferred_element_type=jnp.float32)
        assert kernel[name + "/clean32/counts"].tolist() == [0, 0, 0, 0], name
        assert kernel[name + "/near32/counts"].tolist() == [1, 1, 0, 0], name
        for label in ("clean32", "near32"):
            _assert_close(kernel[f"{name}/{label}/c"], exact, jnp.float32)


def test_interpret_mode_refuses_a_pool_that_would_deadlock(monkeypatch):
    """With fewer XLA:CPU pool threads than the interpreter's threads need, interpret mode
    raises and says what to set, instead of hanging."""
    monkeypatch.setenv("PJRT_NPROC", "2")
    assert _platform.xla_cpu_pool_threads() == 2
    a, b = _operands(jnp.bfloat16, shape=(1, 128, 64, 64))
    with pytest.raises(RuntimeError, match="PJRT_NPROC=4"):
        matmul.checked_matmul(a, b, block_sizes=SMALL, interpret=True)
    monkeypatch.setenv("PJRT_NPROC", "not a number")
    monkeypatch.setenv("NPROC", "6")
    assert _platform.xla_cpu_pool_threads() == 6
