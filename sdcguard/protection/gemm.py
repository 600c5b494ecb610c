"""The one checked GEMM: compute, inject, check and correct, on the XLA path or a Pallas kernel.

Every protected GEMM of sdcguard runs through :func:`checked_gemm`: the forward and gradient
GEMMs of the checked einsum (the Flax drop-ins), every ``dot_general`` of a step under
:func:`sdcguard.checked`, and through those the campaigns and the replay tasks. It takes the
contraction in ``lax.dot_general``'s output order (batch, lhs free, rhs free: see
:func:`in_dot_order`), so the GEMM is computed, injected into and checked in its own layout and
no transpose of ``C`` ever enters the check.

Which implementation runs is :func:`implementation_for`'s choice, which :func:`sdcguard.list_sites`
shows per site.

Example:
  >>> ct = in_dot_order(Contraction.parse("btd,df->btf", 3, 2))
  >>> c, counts = checked_gemm(x, w, ct, site="mlp/up", config=ABFTConfig())
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sdcguard.fault_model import inject
from sdcguard.protection import sharding
from sdcguard.protection.checksums import (
    Contraction,
    axes_of,
    backend_sums_low_precision_in_float32,
    check_contraction,
    narrower_than_float32,
)
from sdcguard.protection.config import ABFTConfig, zero_counts

__all__ = ["as_stored", "checked_gemm", "dot", "implementation_for", "in_dot_order"]


def in_dot_order(ct: Contraction) -> Contraction:
    """``ct`` with its output in ``lax.dot_general``'s order: batch, lhs free, rhs free."""
    lhs_free = "".join(c for c in ct.lhs if c in ct.out and c not in ct.rhs)
    rhs_free = "".join(c for c in ct.rhs if c in ct.out and c not in ct.lhs)
    return Contraction(ct.lhs, ct.rhs, ct.batch + lhs_free + rhs_free)


def dot(
    ct: Contraction,
    a,
    b,
    *,
    precision=None,
    preferred_element_type=None,
    float32_accumulation: bool = False,
) -> jax.Array:
    """The GEMM of ``ct`` (output in dot order, see :func:`in_dot_order`) as ``lax.dot_general``.

    Operands of different dtypes are computed in their common dtype, as ``jnp.einsum`` does.
    ``float32_accumulation`` computes a bf16/fp16 GEMM on XLA:CPU from float32 copies of its
    operands, rounded once to its output dtype: see :func:`_pins_accumulation`.
    """
    dimension_numbers = (
        (axes_of(ct.lhs, ct.contracted), axes_of(ct.rhs, ct.contracted)),
        (axes_of(ct.lhs, ct.batch), axes_of(ct.rhs, ct.batch)),
    )
    dtype = jnp.result_type(a, b)
    out_dtype = jnp.dtype(preferred_element_type or dtype)
    if float32_accumulation and _pins_accumulation(dtype, out_dtype):
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


def _pins_accumulation(dtype, out_dtype) -> bool:
    """Whether a checked GEMM of ``dtype`` operands and ``out_dtype`` result is computed from
    float32 copies of its operands.

    The checks' tolerance assumes what GPUs do: products of bf16/fp16 operands summed in float32
    and rounded once. JAX leaves a low-precision dot's accumulation to the backend, and XLA:CPU
    (jax 0.11) sums some batched bf16 dots in bf16 (whose contraction is not the operand's minor
    axis), ``DotAlgorithmPreset.BF16_BF16_F32`` notwithstanding: errors of a few percent, which
    the checks would report as faults. On XLA:CPU (jax 0.10 computes every bf16/fp16 dot so,
    bit for bit) the checked GEMM is therefore computed in float32 and rounded once; elsewhere
    it is the backend's own (see
    :func:`~sdcguard.protection.checksums.backend_sums_low_precision_in_float32`).
    """
    # A float32 result (``preferred_element_type``) is the backend's float32 sum already.
    pinned = narrower_than_float32(dtype) and narrower_than_float32(out_dtype)
    return pinned and not backend_sums_low_precision_in_float32()


def as_stored(x: jax.Array) -> jax.Array:
    """``x`` rounded to its own dtype, even where XLA would keep it in float32.

    XLA may keep a bf16/fp16 intermediate in float32 (``xla_allow_excess_precision``), and then
    the GEMM and the checksums can read different values of one operand. Rounding it once, here,
    gives both the same operand (a no-op when XLA already rounded it).
    """
    info = jnp.finfo(x.dtype)
    if info.bits >= 32:
        return x
    return jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)


def implementation_for(config: ABFTConfig, a, b) -> str:
    """``'xla'`` or ``'pallas'``: the implementation :func:`checked_gemm` runs for these operands.

    ``'pallas'`` is what the config asks for, or an error naming why it cannot run (operands
    sharded across devices by ``jit``: the kernels run on one device's blocks, inside
    ``shard_map``). ``'auto'`` is the XLA path: the Pallas kernels have no GPU timing yet that
    shows them faster (``scripts/bench_gpu_kernels.py``). Off a GPU, ``'pallas'`` runs the
    kernel's tile check emulated in jnp; fp32 and mixed-dtype GEMMs take the XLA path inside it
    (Hopper's fp32 WGMMA rounds to TF32).
    """
    if config.implementation != "pallas":
        return "xla"
    if sharding.device_mesh(a, b) is not None:
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
    plan: inject.FaultPlan | None = None,
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
      contraction: the einsum, its output in dot order (:func:`in_dot_order`).
      site: the site name fault plans address.
      config: the check's settings (``correct``, ``safety``, ``implementation``).
      check: False computes and injects only (an unchecked site keeps its injection point).
      plan: faults to inject, or None.
      precision, preferred_element_type: as for ``lax.dot_general``.
      lhs_nonnegative: ``a >= 0`` on clean data (softmax probabilities): a tighter bound.
      site_axes: when the site's tensor is ``C`` transposed (an einsum whose output order is not
        dot order), ``C``'s axes in the site's order, so that fault indices name the site's
        elements (see :func:`sdcguard.fault_model.inject.apply`).
      mesh: the mesh the operands are sharded over under ``jit``
        (:func:`sdcguard.protection.sharding.device_mesh`), or None: each device then computes and
        checks the blocks it holds, and the counters have one row per device.

    Returns:
      ``(c, counts)``: ``C`` in dot order, its flagged row recomputed where a matrix had one,
      and int32 ``[detected, corrected, uncorrectable, nonfinite_input]`` (``[rows, 4]``, one
      row per device, with a ``mesh``).
    """
    if site_axes is None:
        site_axes = tuple(range(len(contraction.out)))
    if check and implementation_for(config, a, b) == "pallas" and mesh is None:
        from sdcguard.protection import pallas  # Pallas is a heavy import

        return pallas.matmul.checked_contraction(
            a,
            b,
            contraction,
            config=config,
            site=site,
            plan=plan,
            check=check,
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
        # The GEMM each device computes, on the blocks it holds (sdcguard.protection.sharding).
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
        )

    return sharding.shard_local(local, a, b, plan, contraction, mesh=mesh)
