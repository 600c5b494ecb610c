"""``checked_matmul``: the GEMM checked tile by tile inside one Hopper kernel, and its host side.

:func:`checked_matmul` runs :mod:`sdcguard.protection.pallas.matmul_mgpu`'s kernel for bf16 and
fp16 operands: every ``[tile_m, tile_n]`` tile of ``C`` is checked on its float32 accumulator
before it is rounded and stored, and a single error per row of a tile is located and rebuilt
in registers. A correcting call runs the detection-only kernel first, and the correcting one
and the pass after it only when a tile flagged (:func:`detect_then_locate`), so a clean GEMM
costs what detection costs. Around the kernel, XLA does three small things:

* before: the checksum operand ``Bc`` (one pass over ``B``: eight columns per tile of ``B``)
  and the per-row thresholds (one pass over ``A``: its row norms, which XLA can fuse into
  ``A``'s producer);
* after (on a correcting call, only when a tile flagged): the flagged tiles are taken from the
  correcting kernel's run, and every element it located is **recomputed** from its row of
  ``A`` and column of ``B`` (float32 products, summed in float32) and written over the rebuilt
  value, so a corrected element equals the clean one to the GEMM's own rounding. At most
  ``max_recomputed`` elements per call are recomputed, with a fixed-size gather and scatter
  and no data-dependent control flow; a tile with a located element beyond that is counted
  uncorrectable;
* the counters, summed over tiles: int32 ``[detected, corrected, uncorrectable,
  nonfinite_input]`` as :func:`sdcguard.protection._config.count_outcomes` defines them. A tile
  is *detected* when any of its rows is flagged, *nonfinite_input* when a flagged row's
  checksum, computed from the inputs alone, is not finite (or a recomputed element is: the
  inputs define a non-finite value there; it is left as they define it), *corrected* when
  every flagged row was located, rebuilt and recomputed.

Each part is a function of its own, so that a benchmark can time it alone: :func:`pass_over_b`
and :func:`pass_over_a` (before), :func:`run_kernel`, :func:`locate_if_flagged` (after, on a
correcting call) and :func:`verify.pass_after` (after, detection only).

float32 operands (and mixed dtypes) take the XLA path (``einsum``,
:func:`sdcguard.fault_model.apply`,
:func:`sdcguard.protection.check_contraction`): Hopper's float32 WGMMA rounds its
inputs to TF32, and the XLA path already checks float32 GEMMs.

:func:`checked_matmul_reference` is the pure-jnp reference (``einsum`` and
:func:`sdcguard.protection.check_contraction`).

Why one module: the front door, the passes before and after the kernel, the second run of a
correcting call and the reference share one padded ``[batch, M, K] x [batch, K, N]`` layout and
its tile conventions, and each is a function of its own that a benchmark times alone; the
mapping of any pure contraction onto that layout (the end of the module) is the front door for
einsum callers.

Off a GPU the kernel runs in Mosaic GPU's interpret mode (``interpret=None`` picks it): slow,
for tests, and only with at least four XLA:CPU pool threads
(``PJRT_NPROC=4`` on a machine with fewer CPUs).

Example:
  >>> c, counts = checked_matmul(a, b)   # a: [B, M, K], b: [B, K, N], bf16
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from sdcguard import fault_model as inject
from sdcguard.protection._checks import check_contraction
from sdcguard.protection._config import ABFTConfig, zero_counts, zero_counts_like
from sdcguard.protection._contraction import Contraction
from sdcguard.protection.pallas import matmul_mgpu, verify
from sdcguard.protection.pallas._platform import mosaic_interpret_mode, num_sms, resolve_interpret
from sdcguard.protection.pallas._tiles import cdiv, site_fault_index
from sdcguard.protection.pallas.matmul_mgpu import SUPPORTED_DTYPES, BlockSizes

CANONICAL = Contraction("bmk", "bkn", "bmn")
DEFAULT_BLOCK_SIZES = BlockSizes()


def uses_kernel(a_dtype, b_dtype) -> bool:
    """Whether operands of these dtypes run through the Hopper kernel (else the XLA path)."""
    return jnp.dtype(a_dtype) == jnp.dtype(b_dtype) and jnp.dtype(a_dtype) in SUPPORTED_DTYPES


# Programs (CTAs) the kernel runs on in GPU interpret mode: fewer than the tiles, so that the
# persistent loop over tiles (and the barrier phases it carries from one tile to the next) is
# interpreted too, and more than one, so that tiles are split between programs as on a GPU.
INTERPRET_PROGRAMS = 2


def _grid(a_padded_shape, b_padded_shape, block_sizes: BlockSizes, interpret: bool) -> int:
    """Programs (CTAs) the kernel runs on for padded operands of these shapes."""
    batch, mp, _ = a_padded_shape
    tiles = batch * (mp // block_sizes.cta_m) * (b_padded_shape[2] // block_sizes.tile_n)
    if interpret:
        # The interpreter runs programs one after another: the number only decides how the
        # tiles are shared out (any number is correct on the hardware).
        return min(tiles, INTERPRET_PROGRAMS)
    return num_sms()


@contextlib.contextmanager
def _interpreting(interpret: bool):
    """Runs the kernel traced in the block in Mosaic GPU's interpret mode (when ``interpret``)."""
    if not interpret:
        yield
        return
    fallback = "pass emulate=True to run the kernel's per-tile check as jnp"
    with mosaic_interpret_mode(fallback=fallback):
        yield


class FaultCoords(tuple):
    """``(hit bool[F], batch[F], row[F], col[F], kind[F], bit[F], value f32[F])``: the faults of
    one site in the kernel's ``[batch, M, N]`` coordinates."""


def matrix_faults(plan: inject.FaultPlan | None, site: str, shape) -> FaultCoords | None:
    """The faults of ``site`` for a ``[batch, M, N]`` output (flat index row-major in it)."""
    return _faults_in_layout(plan, site, shape, lambda idx: idx)


def _faults_in_layout(plan, site, shape, to_bmn) -> FaultCoords | None:
    if plan is None or plan.num_faults == 0:
        return None
    size = int(np.prod(shape, dtype=np.int64))
    hits, flat = site_fault_index(plan, site, size)
    fb, fm, fn = to_bmn(jnp.unravel_index(flat, shape))
    return FaultCoords(
        (
            hits,
            fb.astype(jnp.int32),
            fm.astype(jnp.int32),
            fn.astype(jnp.int32),
            jnp.asarray(plan.kind),
            jnp.asarray(plan.bit),
            jnp.asarray(plan.value, jnp.float32),
        )
    )


def _injected_values(a, b, faults: FaultCoords, out_dtype):
    """The value each fault leaves in the accumulator: its corruption of the clean element
    (recomputed here, rounded to the output dtype as the XLA path's ``inject.apply`` sees it)."""
    hit, fb, fm, fn, kind, bit, value = faults
    clean = verify.recompute_elements(a, b, fb, fm, fn).astype(out_dtype)
    corrupted = inject.corrupt(clean, kind, bit, value)
    return hit, fb, fm, fn, corrupted.astype(jnp.float32)


def _batched(a, b):
    """``(squeeze, a, b)``: 2-D operands get a batch axis of 1 (``squeeze``: remove it after)."""
    squeeze = a.ndim == 2 and b.ndim == 2
    return squeeze, (a[None] if squeeze else a), (b[None] if squeeze else b)


def _pad_to(x, shape):
    pads = [(0, t - s) for s, t in zip(x.shape, shape, strict=True)]
    return jnp.pad(x, pads) if any(p for _, p in pads) else x


def checked_matmul(
    a: jax.Array,
    b: jax.Array,
    *,
    check: bool = True,
    correct: bool = True,
    safety: float = 1.0,
    near_inf: float = ABFTConfig().near_inf,
    precision=None,
    out_dtype=None,
    plan: inject.FaultPlan | None = None,
    site: str = "pallas:gemm",
    faults: FaultCoords | None = None,
    max_recomputed: int = 16,
    max_rerun_tiles: int = 64,
    block_sizes: BlockSizes = DEFAULT_BLOCK_SIZES,
    checksum_gemm: str = "fused",
    row_bounds: str = "separate",
    interpret: bool | None = None,
    emulate: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """``a @ b`` with every output tile checked inside the GEMM kernel; errors corrected.

    Args:
      a: ``[batch, M, K]`` or ``[M, K]``; b: ``[batch, K, N]`` or ``[K, N]``; bf16 or fp16 for
        the kernel (float32 or mixed dtypes take the XLA path).
      check: verify (False gives the plain kernel, for comparison).
      correct: repair located errors (else detections count as uncorrectable).
      safety: multiplier on the round-off bound; near_inf: magnitude located directly.
      precision: MMA precision (used by the XLA path; bf16/fp16 WGMMAs are exact products).
      out_dtype: dtype of ``C`` (default: the operands').
      plan, site: faults of ``plan`` addressed to ``site`` (flat index row-major in ``C``'s
        ``[batch, M, N]``) are injected into the accumulator tile.
      faults: the same, already resolved (:func:`matrix_faults`); overrides ``plan``.
      max_recomputed: how many located elements per call are recomputed exactly.
      max_rerun_tiles: how many flagged tiles per call the correcting kernel's second run
        replaces (a flagged tile beyond them keeps its value and counts uncorrectable).
      block_sizes: tiles.
      checksum_gemm: where the tiles' expected row sums are computed: ``"fused"`` (a narrow
        WGMMA in the kernel's main loop) or ``"separate"`` (an XLA GEMM before the kernel;
        :class:`~sdcguard.protection.pallas.matmul_mgpu.KernelSettings`).
      row_bounds: where each row's ``‖a‖₁`` and ``max|a|`` (its threshold's bound) are
        computed: ``"separate"`` (an XLA pass over ``A`` before the kernel) or ``"fused"``
        (from the ``A`` panels in the kernel's shared memory; ``KernelSettings``).
      interpret: Mosaic GPU interpret mode (default: when the backend is not a GPU). Raises
        ``RuntimeError`` when XLA:CPU's thread pool is too small for the interpreter to finish
        (fewer than four threads; set ``PJRT_NPROC``).
      emulate: run :func:`sdcguard.protection.pallas.matmul_mgpu.reference_kernel` instead of
        the kernel: the kernel's per-tile check as plain jnp on an XLA product (fast on a
        CPU; the tests compare the kernel with it).

    Returns:
      ``(c, counts)``: ``c [batch, M, N]`` (``[M, N]`` for 2-D operands) and int32
      ``[detected, corrected, uncorrectable, nonfinite_input]`` summed over tiles.
    """
    for name, value in (("max_recomputed", max_recomputed), ("max_rerun_tiles", max_rerun_tiles)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(
                f"checked_matmul: {name} must be a positive int (how many per call), got {value!r}"
            )
    squeeze, a, b = _batched(a, b)
    if a.ndim != 3 or b.ndim != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise ValueError(
            f"checked_matmul wants [B, M, K] x [B, K, N] (or [M, K] x [K, N]), got "
            f"{a.shape}, {b.shape}"
        )
    out_dtype = jnp.dtype(out_dtype or jnp.result_type(a.dtype, b.dtype))
    if faults is None:
        faults = matrix_faults(plan, site, (a.shape[0], a.shape[1], b.shape[2]))
    if uses_kernel(a.dtype, b.dtype):
        settings = matmul_mgpu.KernelSettings(
            out_dtype=out_dtype,
            block_sizes=block_sizes,
            check=check,
            correct=correct,
            near_inf=near_inf,
            checksum_gemm=checksum_gemm,
            safety=safety,
            row_bounds=row_bounds,
        )
        c, counts = _kernel_path(
            a,
            b,
            settings,
            faults=faults,
            max_recomputed=max_recomputed,
            max_rerun_tiles=max_rerun_tiles,
            interpret=resolve_interpret(interpret),
            emulate=emulate,
        )
    else:
        c, counts = _xla_path(
            a,
            b,
            check=check,
            config=ABFTConfig(correct=correct, safety=safety, near_inf=near_inf),
            precision=precision,
            out_dtype=out_dtype,
            faults=faults,
        )
    return (c[0] if squeeze else c), counts


def _xla_path(a, b, *, check, config, precision, out_dtype, faults):
    """float32 and mixed operands: einsum, inject, ``check_contraction`` (the XLA path)."""
    c = jnp.einsum("bmk,bkn->bmn", a, b, precision=precision, preferred_element_type=out_dtype)
    if faults is not None:
        hit, fb, fm, fn, kind, bit, value = faults
        for f in range(hit.shape[0]):
            old = c[fb[f], fm[f], fn[f]]
            new = jnp.where(hit[f], inject.corrupt(old, kind[f], bit[f], value[f]), old)
            c = c.at[fb[f], fm[f], fn[f]].set(new)
    if not check:
        return c, zero_counts()
    return check_contraction(c, a, b, CANONICAL, config=config, precision=precision)


def padded_shapes(a_shape, b_shape, block_sizes: BlockSizes):
    """``(a_padded, b_padded)`` shapes: ``M`` to ``2·tile_m``, ``N`` to ``tile_n``, ``K`` to
    ``tile_k`` (zeros add exact zeros to every sum; ``C``'s padding is cut off after)."""
    (batch, m, k), n, bs = a_shape, b_shape[2], block_sizes
    mp, np_, kp = (cdiv(x, t) * t for x, t in ((m, bs.cta_m), (n, bs.tile_n), (k, bs.tile_k)))
    return (batch, mp, kp), (batch, kp, np_)


def pass_over_b(b, *, a_shape, check: bool, block_sizes: BlockSizes, transposed: bool):
    """Before the kernel, over ``B``: its padding and, with ``check``, its checksum operand.

    Args:
      b: ``[batch, K, N]``; a_shape: ``A``'s ``[batch, M, K]`` (for the padded ``K``).
      check, block_sizes: as for :func:`checked_matmul`.
      transposed: ``Bc``'s layout (:func:`matmul_mgpu.checksum_columns`).

    Returns:
      ``(b_padded, bc, scales, magnitudes)`` (the last three None without ``check``).
    """
    _, b_shape = padded_shapes(a_shape, b.shape, block_sizes)
    b_p = _pad_to(b, b_shape)
    if not check:
        return b_p, None, None, None
    bc, scales, magnitudes = matmul_mgpu.checksum_columns(
        b_p, tile_n=block_sizes.tile_n, transposed=transposed
    )
    return b_p, bc, scales, magnitudes


def pass_over_a(
    a,
    scales,
    magnitudes,
    *,
    b_shape,
    settings: matmul_mgpu.KernelSettings,
    injected=None,
    bc=None,
):
    """Before the kernel, over ``A``: its padding and, with ``settings.check``, the parameters:
    with row bounds ``"separate"`` the per-row thresholds (one read of ``A``), with
    ``"fused"`` only what the tiles need (``A`` is not read unless it pads).

    Args:
      a: ``[batch, M, K]``; b_shape: ``B``'s ``[batch, K, N]`` (for the padded ``K``).
      scales, magnitudes: from :func:`pass_over_b`.
      settings: the launch's settings (its ``num_faults`` those of ``injected``).
      injected: the faults' ``(hit, batch, row, col, value)`` (:func:`_injected_values`).
      bc: the checksum operand in the interpret layout, for a kernel with
        ``checksum_gemm="separate"``: the tiles' expected row sums ``A·Bc`` are computed here
        and join the parameters (:func:`matmul_mgpu.expected_row_sums`).

    Returns:
      ``(a_padded, params)`` (``params`` None without ``settings.check``).
    """
    block_sizes = settings.block_sizes
    a_shape, _ = padded_shapes(a.shape, b_shape, block_sizes)
    a_p = _pad_to(a, a_shape)
    if not settings.check:
        return a_p, None
    params = matmul_mgpu.tile_parameters(
        a_p,
        scales,
        magnitudes,
        contraction=a.shape[2],
        tile_n=block_sizes.tile_n,
        safety=settings.safety,
        faults=injected,
        expected=None if bc is None else matmul_mgpu.expected_row_sums(a_p, bc),
        settings=settings,
    )
    return a_p, params


def run_kernel(
    a_p, b_p, bc, params, *, settings: matmul_mgpu.KernelSettings, interpret: bool | None = None
):
    """One launch of the kernel, on the outputs of :func:`pass_over_a` and :func:`pass_over_b`.

    Args:
      settings: the launch's static settings (``settings.correct``: the kernel that locates
        and rebuilds; a checked call runs it only after a detection, :func:`detect_then_locate`).
      interpret: as for :func:`checked_matmul`.

    Returns:
      ``(c, status)`` (padded; ``status`` None without ``settings.check``).
    """
    interpret = resolve_interpret(interpret)
    sms = _grid(a_p.shape, b_p.shape, settings.block_sizes, interpret)
    with _interpreting(interpret):
        return matmul_mgpu.call_kernel(
            a_p, b_p, bc, params, settings=settings, num_sms=sms, interpret=interpret
        )


def detect_then_locate(
    launch, a, b, settings: matmul_mgpu.KernelSettings, *, max_recomputed: int, max_rerun_tiles: int
):
    """A correcting GEMM at detection's cost when it is clean: the detection-only kernel, then
    :func:`locate_if_flagged`.

    Args:
      launch: ``settings -> (c, status)``, the kernel (:func:`run_kernel`) or its emulation.
      a, b: the unpadded operands, ``[batch, M, K]`` and ``[batch, K, N]``.
      settings: a correcting launch's settings.
      max_recomputed, max_rerun_tiles: as for :func:`checked_matmul`.

    Returns:
      ``(c, counts)``: ``c`` padded, ``[batch, Mp, Np]``.
    """
    c, status = launch(dataclasses.replace(settings, correct=False))
    return locate_if_flagged(
        launch, a, b, c, status, settings=settings, max_recomputed=max_recomputed,
        max_rerun_tiles=max_rerun_tiles,
    )  # fmt: skip


def locate_if_flagged(
    launch,
    a,
    b,
    c,
    status,
    *,
    settings: matmul_mgpu.KernelSettings,
    max_recomputed: int,
    max_rerun_tiles: int,
):
    """What follows the detection-only kernel of a correcting call: nothing more unless a tile
    flagged. Then the correcting kernel runs, its tiles replace the flagged ones of ``c``, and
    the elements it located are recomputed exactly (:func:`verify.take_rerun_tiles`,
    :func:`verify.recompute_and_count`).

    All of it sits behind one ``lax.cond`` on the tiles' flags (on a GPU a conditional node
    the device evaluates: no host sync inside a CUDA graph), and the flagged branch writes into
    ``c`` in place, so a clean call runs one reduction of the statuses and the conditional,
    and copies nothing (the correcting kernel locates in every tile: 1.6 to 4.4x cuBLAS on an
    H200, against 1.6 to 1.8x detecting; docs/performance.md).

    A fault that does not recur leaves its tile clean in the second run: the tile is taken
    from it (the value computed again), and its rows keep the detection's verdict (flagged,
    not located: counted detected and uncorrectable), so that no detection goes unreported.

    Args:
      launch: ``settings -> (c, status)``, the kernel or its emulation.
      a, b: the unpadded operands.
      c, status: the detection-only launch's outputs (padded).
      settings: the correcting launch's settings.
      max_recomputed, max_rerun_tiles: as for :func:`checked_matmul`.

    Returns:
      ``(c, counts)``: ``c`` padded.
    """
    bs = settings.block_sizes
    # The rows' states reduced at once (the tiles' flags are computed in the flagged branch).
    anything = jnp.any(status[:, :, 0, :] != matmul_mgpu.CLEAN)

    def rerun(c):
        c_again, status_again = launch(settings)
        c, merged = verify.take_rerun_tiles(
            c, status, c_again, status_again, tile_m=bs.tile_m, tile_n=bs.tile_n,
            max_tiles=max_rerun_tiles,
        )  # fmt: skip
        return verify.recompute_and_count(
            a, b, c, merged, max_recomputed=max_recomputed, tile_m=bs.tile_m, tile_n=bs.tile_n
        )

    def clean(c):
        return c, zero_counts_like(anything)

    return lax.cond(anything, rerun, clean, c)


def _kernel_path(a, b, settings, *, faults, max_recomputed, max_rerun_tiles, interpret, emulate):
    """bf16/fp16 operands: the passes before the kernel, the kernel (or its reference), the
    pass after it."""
    bs, check, out_dtype = settings.block_sizes, settings.check, settings.out_dtype
    fused = settings.fused_checksums
    compiled_layout = fused and not (interpret or emulate)
    b_p, bc, scales, magnitudes = pass_over_b(
        b, a_shape=a.shape, check=check, block_sizes=bs, transposed=compiled_layout
    )
    injected = None
    if check and faults is not None:
        injected = _injected_values(a, b, faults, out_dtype)
        settings = dataclasses.replace(settings, num_faults=injected[0].shape[0])
    a_p, params = pass_over_a(
        a, scales, magnitudes, b_shape=b.shape, settings=settings, injected=injected,
        bc=None if fused else bc,
    )  # fmt: skip
    if not check:
        if emulate:
            c = jnp.einsum("bmk,bkn->bmn", a_p, b_p, preferred_element_type=out_dtype)
        else:
            c, _ = run_kernel(a_p, b_p, bc, params, settings=settings, interpret=interpret)
        return c[:, : a.shape[1], : b.shape[2]], zero_counts()

    def launch(settings):
        if emulate:
            return matmul_mgpu.reference_kernel(a_p, b_p, bc, params, settings=settings)
        return run_kernel(a_p, b_p, bc, params, settings=settings, interpret=interpret)

    if settings.correct:
        c, counts = detect_then_locate(
            launch, a, b, settings, max_recomputed=max_recomputed, max_rerun_tiles=max_rerun_tiles
        )
        return c[:, : a.shape[1], : b.shape[2]], counts
    c, status = launch(settings)
    return verify.pass_after(
        a, b, c, status, check=True, correct=False, max_recomputed=max_recomputed, block_sizes=bs
    )


def checked_matmul_reference(
    a: jax.Array,
    b: jax.Array,
    *,
    correct: bool = True,
    safety: float = 1.0,
    near_inf: float = ABFTConfig().near_inf,
    precision=None,
    out_dtype=None,
    plan: inject.FaultPlan | None = None,
    site: str = "pallas:gemm",
) -> tuple[jax.Array, jax.Array]:
    """Pure-jnp reference of :func:`checked_matmul`: einsum, inject, ``check_contraction``.

    Its counters are per matrix (the XLA path's unit), the kernel's per tile: they agree for
    faults in one tile of each matrix.
    """
    squeeze, a, b = _batched(a, b)
    config = ABFTConfig(correct=correct, safety=safety, near_inf=near_inf)
    c = jnp.einsum(
        "bmk,bkn->bmn",
        a,
        b,
        precision=precision,
        preferred_element_type=out_dtype or jnp.result_type(a.dtype, b.dtype),
    )
    c = inject.apply(c, plan, site)
    c, counts = check_contraction(c, a, b, CANONICAL, config=config, precision=precision, site=site)
    return (c[0] if squeeze else c), counts


# --- Any pure contraction ---------------------------------------------------------------------


def canonical_operands(a, b, contraction: Contraction):
    """``a -> [batch, M, K]``, ``b -> [batch, K, N]`` for any pure contraction (transposes)."""
    ct = contraction
    return (
        _canonical(a, ct.lhs, (ct.batch, ct.lhs_free, ct.contracted)),
        _canonical(b, ct.rhs, (ct.batch, ct.contracted, ct.rhs_free)),
    )


def _canonical(x, term: str, groups: tuple[str, ...]):
    order = "".join(groups)
    y = jnp.transpose(x, tuple(term.index(ch) for ch in order))
    sizes = [int(np.prod([x.shape[term.index(ch)] for ch in g], dtype=np.int64)) for g in groups]
    return y.reshape(sizes)


def _uncanonical(y, term: str, groups: tuple[str, ...], dims: dict):
    order = "".join(groups)
    y = y.reshape([dims[ch] for ch in order])
    return jnp.transpose(y, tuple(order.index(ch) for ch in term))


def contraction_dims(a, b, contraction: Contraction) -> dict:
    """Size of every einsum letter of the contraction."""
    ct = contraction
    return {**dict(zip(ct.lhs, a.shape, strict=True)), **dict(zip(ct.rhs, b.shape, strict=True))}


def contraction_faults(plan, site: str, a, b, contraction: Contraction) -> FaultCoords | None:
    """The faults of ``site`` mapped from the einsum's output layout to ``(batch, m, n)``."""
    ct = contraction
    dims = contraction_dims(a, b, ct)
    shape = tuple(dims[ch] for ch in ct.out)

    def to_bmn(idx):
        at = dict(zip(ct.out, idx, strict=True))

        def flat(letters):
            if not letters:
                return jnp.zeros_like(idx[0])
            return jnp.ravel_multi_index(
                tuple(at[ch] for ch in letters), tuple(dims[ch] for ch in letters), mode="clip"
            )

        return flat(ct.batch), flat(ct.lhs_free), flat(ct.rhs_free)

    return _faults_in_layout(plan, site, shape, to_bmn)


def checked_contraction(
    a: jax.Array,
    b: jax.Array,
    contraction: Contraction,
    *,
    config: ABFTConfig,
    site: str,
    plan: inject.FaultPlan | None = None,
    check: bool = True,
    precision=None,
    preferred_element_type=None,
    block_sizes: BlockSizes = DEFAULT_BLOCK_SIZES,
    interpret: bool | None = None,
    emulate: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Einsum + injection + check for any pure contraction, on :func:`checked_matmul`.

    The Pallas counterpart of the XLA path's ``einsum -> inject.apply -> check_contraction``:
    same arguments and the same ``(c, counts)`` (counted per tile of the kernel); faults of
    ``plan`` addressed to ``site`` are injected inside the kernel at the element the XLA path
    would corrupt.
    """
    ct = contraction
    groups = (ct.batch, ct.lhs_free, ct.rhs_free)
    a3, b3 = canonical_operands(a, b, ct)
    c3, counts = checked_matmul(
        a3,
        b3,
        check=check,
        correct=config.correct,
        safety=config.safety,
        near_inf=config.near_inf,
        precision=precision,
        out_dtype=preferred_element_type or jnp.result_type(a.dtype, b.dtype),
        faults=contraction_faults(plan, site, a, b, ct),
        block_sizes=block_sizes,
        interpret=interpret,
        emulate=emulate,
    )
    return _uncanonical(c3, ct.out, groups, contraction_dims(a, b, ct)), counts
