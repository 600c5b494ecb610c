"""The one checked GEMM: compute, inject, check and correct, on the XLA path or a Pallas kernel.

Every protected GEMM runs through :func:`checked_gemm` (docs/abft.md, "Checks"), in
``lax.dot_general``'s output order (:meth:`Contraction.in_dot_order`); :func:`implementation_for`
is the one place that chooses the implementation.

Example:
  >>> ct = Contraction.parse("btd,df->btf", 3, 2).in_dot_order()
  >>> c, counts = checked_gemm(x, w, ct, site="mlp/up", config=ABFTConfig())
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from sdcguard import fault_model
from sdcguard.fault_model import FaultPlan
from sdcguard.protection._backend import sums_low_precision_in_float32
from sdcguard.protection._checks import (
    Verdict,
    apply_verdicts,
    check_contraction,
    check_scope,
    contraction_verdict,
)
from sdcguard.protection._config import ABFTConfig, zero_counts
from sdcguard.protection._contraction import Contraction, empty_gemm
from sdcguard.protection._sharding import device_mesh, shard_local
from sdcguard.protection._tolerance import narrower_than_float32


def dot(
    ct: Contraction,
    a,
    b,
    *,
    precision=None,
    preferred_element_type=None,
    float32_accumulation: bool = False,
) -> jax.Array:
    """The GEMM of ``ct`` (output in dot order) as ``lax.dot_general``.

    Operands of different dtypes are computed in their common dtype, as ``jnp.einsum`` does.

    Args:
      ct: the contraction, its output in dot order (:meth:`Contraction.in_dot_order`).
      a, b: the operands.
      precision, preferred_element_type: as for ``lax.dot_general``.
      float32_accumulation: compute a bf16/fp16 GEMM from float32 copies of its operands where
        the backend would not sum it in float32 (XLA:CPU), rounded once to its output dtype.
    """
    dimension_numbers = ct.dimension_numbers
    dtype = jnp.result_type(a, b)
    out_dtype = jnp.dtype(preferred_element_type or dtype)
    if float32_accumulation and pins_accumulation(dtype, out_dtype):
        out = jax.lax.dot_general(
            a.astype(jnp.float32), b.astype(jnp.float32), dimension_numbers, precision=precision
        )
        return out.astype(out_dtype)
    return jax.lax.dot_general(
        a.astype(dtype),
        b.astype(dtype),
        dimension_numbers,
        precision=precision,
        preferred_element_type=preferred_element_type,
    )


def pins_accumulation(dtype, out_dtype) -> bool:
    """Whether a checked GEMM of ``dtype`` operands and ``out_dtype`` result is computed from
    float32 copies of its operands (docs/abft.md, "How the code is cut")."""
    # A float32 result (``preferred_element_type``) is the backend's float32 sum already.
    pinned = narrower_than_float32(dtype) and narrower_than_float32(out_dtype)
    return pinned and not sums_low_precision_in_float32()


def as_stored(x: jax.Array) -> jax.Array:
    """``x`` rounded to its own dtype, even where XLA would keep it in float32.

    So that the GEMM and its checksums read the same operand (a no-op when XLA already rounded
    it; docs/abft.md, "Low precision on the CPU").
    """
    info = jnp.finfo(x.dtype)
    if info.bits >= 32:
        return x
    return jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)


def implementation_for(config: ABFTConfig, *operands) -> str:
    """``'xla'`` or ``'pallas'``: the implementation that checks a GEMM (the one chooser).

    ``'auto'`` is the XLA path (docs/abft.md, "How the code is cut"); ``'pallas'`` off a GPU runs
    the kernels' tile checks emulated in jnp.

    Args:
      config: the check's settings; reads ``implementation``.
      *operands: the GEMM's operands, if known: ``'pallas'`` refuses operands that ``jit``
        shards across devices.

    Raises:
      ValueError: ``'pallas'`` asked for operands sharded across devices by ``jit``.
    """
    if config.implementation != "pallas":
        return "xla"
    if operands and device_mesh(*operands) is not None:
        raise ValueError(
            "ABFTConfig(implementation='pallas') checks a GEMM inside one kernel on one device, "
            "but these operands are sharded across devices by jit; run the step inside "
            "jax.shard_map (each device then checks its own blocks), or use "
            "implementation='xla'"
        )
    return "pallas"


def checked_gemm(
    a: jax.Array,
    b: jax.Array,
    contraction: Contraction,
    *,
    site: str,
    config: ABFTConfig,
    check: bool = True,
    plan: FaultPlan | None = None,
    precision=None,
    preferred_element_type=None,
    lhs_nonnegative: bool = False,
    site_axes: tuple[int, ...] | None = None,
    mesh=None,
) -> tuple[jax.Array, jax.Array]:
    """``C = einsum(contraction, a, b)``, with the faults of ``plan`` at ``site``, checked.

    Args:
      a, b: the operands, letters ``contraction.lhs`` / ``contraction.rhs``; any floating dtypes
        of 16 bits or more (mixed: computed in the common dtype).
      contraction: the einsum, its output in dot order (:meth:`Contraction.in_dot_order`).
      site: the site name fault plans address.
      config: the check's settings (``correct``, ``safety``, ``implementation``).
      check: False computes and injects only (an unchecked site keeps its injection point).
      plan: faults to inject, or None.
      precision, preferred_element_type: as for ``lax.dot_general``.
      lhs_nonnegative: ``a >= 0`` on clean data (softmax probabilities): a tighter bound.
      site_axes: when the site's tensor is ``C`` transposed (an einsum whose output order is not
        dot order), ``C``'s axes in the site's order, so that fault indices name the site's
        elements (see :func:`sdcguard.fault_model.apply`).
      mesh: the mesh the operands are sharded over under ``jit``
        (:func:`device_mesh`), or None: each device then computes and
        checks the blocks it holds, and the counters have one row per device.

    Returns:
      ``(c, counts)``: ``C`` in dot order, its flagged row recomputed where a matrix had one,
      and int32 ``[detected, corrected, uncorrectable, nonfinite_input]`` (``[rows, 4]``, one
      row per device, with a ``mesh``).
    """
    if site_axes is None:
        site_axes = tuple(range(len(contraction.out)))
    check = check and not empty_gemm(a.shape, b.shape)
    if check and implementation_for(config, a, b) == "pallas" and mesh is None:
        from sdcguard.protection import pallas  # Pallas is a heavy import

        return pallas.checked_contraction(
            a,
            b,
            contraction,
            config=config,
            site=site,
            plan=plan,
            precision=precision,
            preferred_element_type=preferred_element_type,
            # Off a GPU the kernel's own tile check runs as jnp: the GPU interpreter takes
            # seconds per call and blocks XLA:CPU threads inside an enclosing program, and a
            # step calls many GEMMs (pallas.interpret_mode(False) still lowers the kernel itself,
            # for CUDA; the kernel's tests interpret it).
            emulate=pallas.resolve_interpret(None),
        )
    a, b = as_stored(a), as_stored(b)

    def local(a, b, plan, block):
        # The GEMM each device computes, on the blocks it holds (protection._sharding).
        c = dot(
            contraction,
            a,
            b,
            precision=precision,
            preferred_element_type=preferred_element_type,
            float32_accumulation=check,
        )
        c = block.inject(c, plan, site, site_axes)
        if not check:
            return c, zero_counts()
        return check_contraction(
            c,
            a,
            b,
            contraction,
            config=config,
            precision=precision,
            lhs_nonnegative=lhs_nonnegative,
            site=site,
        )

    return shard_local(local, a, b, plan, contraction, mesh=mesh)


class GemmJob(NamedTuple):
    """One GEMM of a :func:`checked_gemm_group`: arguments as for :func:`checked_gemm`."""

    a: jax.Array
    b: jax.Array
    contraction: Contraction  # output in dot order
    site: str
    lhs_nonnegative: bool = False
    site_axes: tuple[int, ...] | None = None


def groups_checks(config: ABFTConfig, *operands: jax.Array) -> bool:
    """Whether GEMMs of these operands can share one repair decision (:func:`checked_gemm_group`):
    checked on the XLA path, on one device (no mesh to shard over), none of them empty."""
    if empty_gemm(*(x.shape for x in operands)):
        return False
    return implementation_for(config) == "xla" and device_mesh(*operands) is None


def gemm_verdict(
    job: GemmJob,
    *,
    config: ABFTConfig,
    plan: FaultPlan | None = None,
    precision=None,
    preferred_element_type=None,
) -> tuple[jax.Array, Verdict]:
    """``C`` computed and injected into as :func:`checked_gemm` does, and its check's verdict,
    not yet applied (:func:`apply_verdicts` applies the verdicts of a group together).

    Only for GEMMs that :func:`groups_checks` accepts.
    """
    a, b = as_stored(job.a), as_stored(job.b)
    ct = job.contraction
    c = dot(
        ct,
        a,
        b,
        precision=precision,
        preferred_element_type=preferred_element_type,
        float32_accumulation=True,
    )
    axes = tuple(range(len(ct.out))) if job.site_axes is None else job.site_axes
    c = fault_model.apply(c, plan, job.site, axes=axes)
    with jax.named_scope(check_scope(job.site)):
        verdict = contraction_verdict(
            c, a, b, ct, config=config, precision=precision,
            lhs_nonnegative=job.lhs_nonnegative,
        )  # fmt: skip
    return c, verdict._replace(site=job.site)


def checked_gemm_group(
    jobs: Sequence[GemmJob],
    *,
    config: ABFTConfig,
    plan: FaultPlan | None = None,
    precision=None,
    preferred_element_type=None,
) -> list[tuple[jax.Array, jax.Array]]:
    """GEMMs computed, injected into and checked as :func:`checked_gemm` does, with one repair
    decision for the group (:func:`apply_verdicts`: one cond where the config repairs by cond).

    Only for GEMMs that :func:`groups_checks` accepts.

    Returns:
      ``[(c, counts)]``, one per job, as :func:`checked_gemm` returns them.

    Example:
      >>> (da, ca), (db, cb) = checked_gemm_group(
      ...     [GemmJob(g, b, ct.grad_lhs().in_dot_order(), "s.grad_lhs"),
      ...      GemmJob(a, g, ct.grad_rhs().in_dot_order(), "s.grad_rhs")], config=ABFTConfig())
    """
    settings = dict(precision=precision, preferred_element_type=preferred_element_type)
    checked = [gemm_verdict(job, config=config, plan=plan, **settings) for job in jobs]
    return apply_verdicts([v for _, v in checked], [c for c, _ in checked], config)
