"""The round-off model: how far a clean GEMM's checksums may stray (docs/abft.md).

Every bound here is first-order worst-case round-off (Higham, *Accuracy and Stability*, §3.1),
so it holds for any order of summation.

Example:
  >>> gamma = roundoff_gamma(out_dtype=jnp.bfloat16, contraction=4096, line=1024)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sdcguard.protection._backend import input_rounding


def unit_roundoff(dtype) -> float:
    """Unit round-off ``u = 2^-p`` of a floating dtype (fp32: 2^-24, bf16: 2^-8, fp16: 2^-11)."""
    return float(jnp.finfo(dtype).eps) / 2


def narrower_than_float32(dtype) -> bool:
    """Whether ``dtype`` is a floating dtype of less precision than float32 (bf16, fp16)."""
    return jnp.issubdtype(dtype, jnp.floating) and unit_roundoff(dtype) > unit_roundoff(jnp.float32)


def roundoff_gamma(
    *, out_dtype, contraction: int, line: int, input_unit: float = 0.0, safety: float = 1.0
) -> float:
    """γ of the tolerance model: |checksum deviation| ≤ γ · (|A||B| checksum).

    Args:
      out_dtype: dtype C is rounded to.
      contraction: K, the contraction length.
      line: the length of the summed line (M for column checksums, N for row checksums).
      input_unit: unit round-off of input rounding by the backend (see input_rounding).
      safety: multiplier (>= 1).
    """
    u_acc = unit_roundoff(jnp.float32)
    u_out = unit_roundoff(out_dtype)
    return safety * (2 * input_unit + u_out + (2 * (contraction + line) + 2) * u_acc)


def underflow_slack(out_dtype, contraction: int) -> float:
    """What flushing to zero can move one element of C by, whatever its magnitude.

    GEMM libraries flush subnormal products and partial sums to zero (XLA:CPU does:
    ``4·(1e-20·1e-19)`` comes out 0), each moving the sum by less than float32's smallest normal;
    a GEMM has ``2K`` such operations per element. Rounding C to a narrower dtype can flush it by
    less than that dtype's smallest normal.
    """
    tiny32 = float(jnp.finfo(jnp.float32).tiny)
    return (2 * contraction + 2) * tiny32 + float(jnp.finfo(out_dtype).tiny)


def scaled_line_threshold(
    bound, scale, *, out_dtype, contraction: int, line: int, input_unit: float, safety: float
):
    """How far a clean line's sum may stray from its checksum, in the checksum's scaled units.

    ``γ · bound`` (:func:`roundoff_gamma` for a line of ``line`` elements) plus what flushing
    subnormals to zero can move the line by (:func:`underflow_slack`), scaled by ``scale``, the
    power of two the checksums carry. The Pallas kernels and their verification compare with it;
    :func:`line_checksums` adds the same terms for the XLA path.
    """
    gamma = roundoff_gamma(
        out_dtype=out_dtype,
        contraction=contraction,
        line=line,
        input_unit=input_unit,
        safety=safety,
    )
    return gamma * bound + line * underflow_slack(out_dtype, contraction) * scale


def rounding_of(u_out: float) -> float:
    """Relative bound of one rounding to a dtype of unit round-off ``u_out``, as a fraction of
    the *rounded* value: ``|x - fl(x)| <= u/(1-u)·|fl(x)|``."""
    return u_out / (1 - u_out)


def output_rounding(abs_sum, c_dtype, safety):
    """What rounding a bf16/fp16 ``C`` can move its lines' sums by (0 for wider outputs), from
    its lines' ``Σ|c|`` (``abs_sum``, scaled; None for wider outputs).

    Rounding moves each element by at most ``u_out`` of itself, so a line moves by at most
    ``u_out·Σ|c|``: often far below ``u_out·|A||B|e``, which is loose where terms cancel. A fault
    cannot hide behind it: it raises ``Σ|c|`` by ``u_out·|Δ|``, the deviation by ``|Δ|``; an INF
    would make it INF too, so a non-finite ``Σ|c|`` adds nothing.
    """
    u_out = unit_roundoff(c_dtype)
    if u_out <= unit_roundoff(jnp.float32):
        return 0.0
    rounding = safety * rounding_of(u_out) * abs_sum
    return jnp.where(jnp.isfinite(rounding), rounding, 0.0)


def line_threshold(magnitude, scale, c_dtype, a_dtype, precision, *, k, n_line, safety):
    """γ·magnitude plus what flushing subnormals can move a line of ``n_line`` by, scaled: the
    part of a line's threshold that does not depend on ``C``."""
    # A C wider than float32 is summed in float32 (one more rounding of each element), and each
    # operand wider than float32 is rounded to it for the checksums.
    wide = max(jnp.dtype(c_dtype).itemsize, jnp.dtype(a_dtype).itemsize) > 4
    input_unit = input_rounding(a_dtype, precision) + (unit_roundoff(jnp.float32) if wide else 0)
    low_precision_out = narrower_than_float32(c_dtype)
    gamma = roundoff_gamma(
        # A low-precision C's own rounding is bounded below, by the line it actually has.
        out_dtype=jnp.float32 if (low_precision_out or wide) else c_dtype,
        contraction=k,
        line=n_line,
        input_unit=input_unit,
        safety=safety,
    )
    return gamma * magnitude + n_line * underflow_slack(c_dtype, k) * scale


def element_tolerance(
    row_magnitude, exact, scale, c_dtype, a_dtype, precision, *, k, safety
) -> jax.Array:
    """How far a clean element of ``C`` may lie from its recomputation ``exact``, in scaled units.

    Both are sums of ``k`` products in float32 or wider, each off by at most ``k·u_acc`` of the
    element's ``Σ|a||b|``, which the row's ``|A|(|B|e)`` (``row_magnitude``) bounds; the
    stored one was rounded once more, to ``c_dtype`` (at most ``u_out`` of itself), and its
    inputs perhaps by the backend (TF32); flushed subnormals add a little. Never above the row's
    threshold, so the fault that made a row fail its check is beyond it.
    """
    gamma = roundoff_gamma(
        out_dtype=jnp.float32,
        contraction=k,
        line=0,
        input_unit=input_rounding(a_dtype, precision),
        safety=safety,
    )
    rounding = safety * rounding_of(unit_roundoff(c_dtype)) * jnp.abs(exact)
    return gamma * row_magnitude + rounding + underflow_slack(c_dtype, k) * scale
