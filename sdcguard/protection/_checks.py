"""Verify one contraction by its row checksums and repair it in place.

Example:
  >>> ct = Contraction.parse("bmk,bkn->bmn", 3, 3)
  >>> c, counts = check_contraction(jnp.einsum(ct.spec, a, b), a, b, ct, config=ABFTConfig())
"""

from __future__ import annotations

import functools
import math
import string
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from sdcguard._in_place import apply_if
from sdcguard.protection._backend import (
    reductions_share_a_pass,
    sums_low_precision_in_float32,
)
from sdcguard.protection._checksums import reduce_together, row_check
from sdcguard.protection._config import ABFTConfig, count_outcomes, zero_counts_like
from sdcguard.protection._contraction import Contraction, gather_lines, set_lines, unravel
from sdcguard.protection._tolerance import (
    element_tolerance,
    narrower_than_float32,
    output_rounding,
)

# The ``jax.named_scope`` a check's operations run under: in a compiled program's op names,
# and so in a profile, it tells the checks' kernels from the step's own.
CHECK_SCOPE = "sdcguard_check"


def check_scope(site: str | None = None) -> str:
    """The named scope of the check of ``site``: :data:`CHECK_SCOPE`, with the site in brackets
    (its ``/`` written ``|``: op names keep ``/`` between scopes).

    Example:
      >>> check_scope("block_0/mlp_in:dot_general.grad_lhs")
      'sdcguard_check[block_0|mlp_in:dot_general.grad_lhs]'
    """
    return CHECK_SCOPE if site is None else f"{CHECK_SCOPE}[{site.replace('/', '|')}]"


def in_check_scope(fn):
    """``fn`` with the operations it emits under :data:`CHECK_SCOPE` (op-name metadata only)."""

    @functools.wraps(fn)
    def scoped(*args, **kwargs):
        with jax.named_scope(CHECK_SCOPE):
            return fn(*args, **kwargs)

    return scoped


class Verdict(NamedTuple):
    """A contraction's check before its repair is applied: what the step does next.

    Attributes:
      flagged: bool scalar, whether any row of the output failed its check.
      repair: ``c -> (c_repaired, counts)``: the flagged row of each matrix recomputed (a clean
        ``c`` comes back unchanged, with zero counts).
      clean: ``c -> (c, counts)``: ``c`` as it is, with the counts of the check alone (what a
        detection-only check reports).
      site: the GEMM's site name: what its repair runs under is named by it (:func:`check_scope`).
    """

    flagged: jax.Array
    repair: Callable
    clean: Callable
    site: str | None = None


def check_contraction(
    c: jax.Array,
    a: jax.Array,
    b: jax.Array,
    contraction: Contraction,
    *,
    config: ABFTConfig,
    precision=None,
    lhs_nonnegative: bool = False,
    site: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Verifies ``c == einsum(contraction, a, b)`` by its row checksums; repairs one row per matrix.

    The flagged row of each matrix is computed again from its row of ``a`` and all of ``b`` and
    written over it; it counts as corrected only if it then passes its check. A matrix with more
    than one flagged row is ``uncorrectable``, one whose inputs define a non-finite row
    ``nonfinite_input``; both are left as they are (docs/abft.md, "Checks").

    Args:
      c: the computed output (possibly corrupted), letters ``contraction.out``.
      a, b: the inputs, letters ``contraction.lhs`` / ``contraction.rhs``.
      contraction: the parsed einsum.
      config: thresholds (``safety``), whether to correct (``correct``) and how (``repair``).
      precision: the precision of the GEMM (for the input-rounding term of the tolerance).
      lhs_nonnegative: ``a >= 0`` elementwise on clean data (see :func:`checked_einsum`).
      site: the GEMM's site name, for the named scope the check runs under
        (:func:`check_scope`); None: :data:`CHECK_SCOPE` alone.

    Returns:
      ``(c_checked, counts)``: ``c`` with a flagged row per matrix recomputed (unchanged when
      clean), and int32 ``[detected, corrected, uncorrectable, nonfinite_input]`` summed over
      the batch of matrices.

    Example:
      >>> ct = Contraction.parse("bmk,bkn->bmn", 3, 3)
      >>> c, counts = check_contraction(jnp.einsum(ct.spec, a, b), a, b, ct, config=ABFTConfig())
    """
    with jax.named_scope(check_scope(site)):
        verdict = contraction_verdict(
            c, a, b, contraction, config=config, precision=precision,
            lhs_nonnegative=lhs_nonnegative,
        )  # fmt: skip
    return apply_verdicts([verdict._replace(site=site)], [c], config)[0]


def apply_verdicts(
    verdicts: Sequence[Verdict], outputs: Sequence[jax.Array], config: ABFTConfig
) -> list[tuple[jax.Array, jax.Array]]:
    """Each output repaired or passed on by its verdict, with one repair decision for them all.

    Under ``repair="cond"`` the group shares one ``lax.cond`` (unless ``config.group_repairs``
    is False): when any of them flagged, every one is repaired (a clean one comes back
    unchanged), else none is. On a GPU a cond is one conditional node of the step's CUDA
    graph, so GEMMs checked as a group cost one node, not one each (docs/performance.md,
    "Repair strategies").

    Args:
      verdicts: from :func:`contraction_verdict`, one per output.
      outputs: the checked tensors, in the same order.
      config: ``correct`` and ``repair``.

    Returns:
      ``[(c_checked, counts)]`` in the order of ``outputs``.
    """
    pairs = list(zip(verdicts, outputs, strict=True))

    def each(fn_of, cs):
        out = []
        for v, c in zip(verdicts, cs, strict=True):
            with jax.named_scope(check_scope(v.site)):
                out.append(fn_of(v)(c))
        return tuple(out)

    if not config.correct:
        return list(each(lambda v: v.clean, outputs))
    strategy = repair_strategy(config)
    if strategy == "branch_free":
        return list(each(lambda v: v.repair, outputs))
    if strategy == "while":
        return list(each(lambda v: functools.partial(repair_if, v.flagged, v.repair), outputs))
    if len(pairs) > 1 and not config.group_repairs:
        return [apply_verdicts([v], [c], config)[0] for v, c in pairs]
    anything = functools.reduce(jnp.logical_or, [v.flagged for v in verdicts])

    def passed_on(v):
        # The branch a clean group takes: no check flagged, so none detected anything (a
        # non-finite input is a detection too) and every count is zero. The branch computes
        # nothing; on a GPU it only writes each GEMM's zeros.
        return lambda c: (c, zero_counts_like(v.flagged))

    # The group's cond is named by its first GEMM's site (each repair by its own): a profile
    # then counts the cond's own cost under a site of the group.
    with jax.named_scope(check_scope(verdicts[0].site)):
        return list(
            lax.cond(
                anything,
                lambda cs: each(lambda v: v.repair, cs),
                lambda cs: each(passed_on, cs),
                tuple(outputs),
            )
        )


def contraction_verdict(
    c: jax.Array,
    a: jax.Array,
    b: jax.Array,
    contraction: Contraction,
    *,
    config: ABFTConfig,
    precision=None,
    lhs_nonnegative: bool = False,
) -> Verdict:
    """The row checks of ``c = einsum(contraction, a, b)``, as a :class:`Verdict`.

    Arguments as for :func:`check_contraction`; the caller applies the verdict
    (:func:`apply_verdicts`).
    """
    ct = contraction
    if not ct.out:
        # A dot of two vectors: one matrix of one element, as a batch of one.
        z = next(x for x in string.ascii_letters if x not in ct.lhs + ct.rhs)
        one = Contraction(z + ct.lhs, z + ct.rhs, z)
        inner = contraction_verdict(
            c[None], a[None], b[None], one, config=config, precision=precision,
            lhs_nonnegative=False,
        )  # fmt: skip

        def unbatched(fn):
            def apply(c):
                fixed, counts = fn(c[None])
                return fixed[0], counts

            return apply

        return Verdict(inner.flagged, unbatched(inner.repair), unbatched(inner.clean))
    return _row_verdict(
        c, a, b, ct, config=config, precision=precision, lhs_nonnegative=lhs_nonnegative
    )


def _row_verdict(c, a, b, ct: Contraction, *, config, precision, lhs_nonnegative) -> Verdict:
    # A detection-only check sums C's rows in steps on a GPU; one that repairs C in place, in
    # one reduction (compiled for an H200, the steps helped the first and only added kernels
    # to the second: docs/performance.md, "Since the fourth H200 run").
    rows = row_check(
        c, a, b, ct, safety=config.safety, precision=precision,
        lhs_nonnegative=lhs_nonnegative, sum_rows_in_steps=not config.correct,
    )  # fmt: skip
    # Per matrix of the batch: rows flattened, [batch..., rows] with the batch letters first.
    row_term = ct.without(ct.rhs_free)
    order = [row_term.index(x) for x in ct.batch + ct.lhs_free]

    def per_matrix(x):
        x = jnp.transpose(x, order)
        return x.reshape((*x.shape[: len(ct.batch)], -1))

    # Per matrix, one reduction of the rows' flags: whether any row failed its check, whether
    # one failed where the inputs alone define a non-finite row sum (an operand already held a
    # NaN or INF: doomed upstream), and, to repair in place, how many rows failed.
    bad_row = rows.bad()
    bad = per_matrix(bad_row)
    terms = {
        "detected": ("max", bad),  # a boolean: the repair's predicate
        "upstream": ("max", per_matrix(bad_row & ~jnp.isfinite(rows.ref))),
    }
    # Where the reductions share a pass (a GPU), the first failed row of each matrix joins
    # them: one more output of the same kernel, and two kernels fewer in the repair's branch,
    # which XLA:GPU compiles for every GEMM (docs/performance.md, "Where XLA:GPU's compile
    # time goes"). On the CPU it would be one more reduction on every step.
    first_in_pass = config.correct and reductions_share_a_pass()
    if config.correct:
        terms["flagged"] = ("sum", bad.astype(jnp.int32))
    if first_in_pass:
        rows_per_matrix = bad.shape[-1]
        at = lax.broadcasted_iota(jnp.int32, bad.shape, bad.ndim - 1)
        terms["first"] = ("min", jnp.where(bad, at, rows_per_matrix))
    reduced = reduce_together(terms, (len(ct.batch),))

    def clean(c):
        # The counts of the check alone: what a detection-only check reports.
        detected, upstream = reduced["detected"], reduced["upstream"]
        return c, count_outcomes(jnp.sum(detected), 0, jnp.sum(upstream))

    detected = reduced["detected"]
    flagged = detected if detected.ndim == 0 else jnp.any(detected)
    if not config.correct:
        # Detection only: C is passed on as it is.
        return Verdict(flagged, clean, clean)

    def repair(c):
        """``c`` with the flagged row of each matrix recomputed, and the counters."""
        dims = ct.sizes(a, b)
        batch_shape = tuple(dims[x] for x in ct.batch)
        n_batch = math.prod(batch_shape)
        n_line = math.prod(dims[x] for x in ct.rhs_free)
        # The flagged row of each matrix (the first, when there are several: then nothing is
        # fixed), and its numbers, one per matrix: [n_batch].
        # What the repair reads is computed here from the check's reductions: behind a cond, a
        # clean step materializes none of it.
        detected, upstream = reduced["detected"], reduced["upstream"]
        if first_in_pass:
            # A clean matrix's "first" is one past its rows: any row will do, nothing is fixed.
            row = jnp.clip(reduced["first"], 0, max(rows_per_matrix - 1, 0)).astype(jnp.uint32)
        else:
            row = jnp.argmax(per_matrix(rows.bad()), axis=-1).astype(jnp.uint32)

        def at_row(x):
            x = jnp.take_along_axis(
                per_matrix(x), row[..., None], axis=-1, mode="promise_in_bounds"
            )
            return x[..., 0].reshape(-1)

        ref, base_threshold = at_row(rows.ref), at_row(rows.base_threshold())
        scale = rows.scale.reshape(-1)
        matrix_at = {
            **unravel(jnp.arange(n_batch), ct.batch, dims),
            **{x: i.reshape(-1) for x, i in unravel(row, ct.lhs_free, dims).items()},
        }
        c_rows = gather_lines(c, ct.out, matrix_at, ct.rhs_free).reshape(n_batch, n_line)
        exact = _recomputed_rows(a, b, ct, matrix_at, dims)
        # Only the elements farther from their recomputation than rounding allows are replaced:
        # the clean ones keep their bits. In the checksums' scaled units, so nothing overflows.
        k = math.prod(dims[x] for x in ct.contracted)
        exact_scaled = exact * scale[:, None].astype(exact.dtype)
        tolerance = element_tolerance(
            at_row(rows.magnitude)[:, None],
            exact_scaled,
            scale[:, None],
            c.dtype,
            a.dtype,
            precision,
            k=k,
            safety=config.safety,
        )
        deviation = jnp.abs(c_rows.astype(exact.dtype) * scale[:, None] - exact_scaled)
        wrong = ~(deviation <= tolerance)  # NaN and INF too
        exact_c = exact.astype(c.dtype)  # rounded as the GEMM rounds its output
        repaired = jnp.where(wrong, exact_c, c_rows)
        # The repaired row must pass the row's check: hardware that corrupts the recomputation too
        # is caught here (a non-finite element makes the sum non-finite, which fails). One pass
        # over the row also says whether the inputs define a non-finite value in it (a max
        # propagates NaN and INF).
        repaired_scaled = repaired.astype(jnp.float32) * scale[:, None]
        # As stored in c's dtype (an fp16 row may overflow there), scaled into float32's range.
        exact_max = jnp.abs(exact_c.astype(exact.dtype) * scale[:, None]).astype(jnp.float32)
        after = {"sum": ("sum", repaired_scaled), "exact_max": ("max", exact_max)}
        if narrower_than_float32(c.dtype):
            after["abs_sum"] = ("sum", jnp.abs(repaired_scaled))
        after = reduce_together(after, (1,))
        threshold_after = base_threshold + output_rounding(
            after.get("abs_sum"), c.dtype, config.safety
        )
        passes = jnp.abs(after["sum"] - ref) <= threshold_after
        single = (reduced["flagged"] == 1).reshape(-1)
        doomed = upstream | (detected & ~jnp.isfinite(after["exact_max"]).reshape(batch_shape))
        fix = detected.reshape(-1) & single & passes & ~doomed.reshape(-1)
        new_rows = jnp.where(fix[:, None], repaired, c_rows)
        return set_lines(c, ct.out, matrix_at, ct.rhs_free, new_rows), count_outcomes(
            jnp.sum(detected), jnp.sum(fix), jnp.sum(doomed)
        )

    return Verdict(flagged, repair, clean)


# What ``repair="auto"`` compiles, as measured (docs/performance.md, "Repair strategies"): a
# cond per GEMM cost 1.57x the plain step on an H200 against 2.47x branch-free, and on the CPU
# 1.085-1.099x against 1.101-1.118x (the Flax-example LM's whole step, in place); one cond per
# group of GEMMs (ABFTConfig.group_repairs) 1.54x against 1.59x per GEMM on the H200.
AUTO_REPAIR = "cond"
# What ``recompute=True`` compiles under ``repair="auto"``, per backend: a second copy of the
# step behind a cond on a GPU (a loop there leaves the step's CUDA graph), elsewhere a loop of
# one or two trips around one copy (half the compile time, the same clean step on the CPU).
AUTO_RECOMPUTE = {"gpu": "cond", "cuda": "cond", "rocm": "cond"}


def repair_strategy(config: ABFTConfig) -> str:
    """The in-place repair :func:`check_contraction` compiles for ``config``.

    Args:
      config: its ``repair`` field.

    Returns:
      ``"branch_free"``, ``"cond"`` or ``"while"``.
    """
    return AUTO_REPAIR if config.repair == "auto" else config.repair


def recompute_strategy(config: ABFTConfig, backend: str | None = None) -> str:
    """How ``recompute=True`` computes a step again: ``"cond"`` or ``"while"``.

    Args:
      config: its ``repair`` field (``"branch_free"`` means the loop: nothing is computed
        twice on every step).
      backend: a JAX platform name; the default backend when None.

    Returns:
      ``"cond"`` (a second copy of the step behind a ``lax.cond``) or ``"while"`` (a loop of
      one or two trips around one copy).
    """
    if config.repair == "auto":
        return AUTO_RECOMPUTE.get(backend or jax.default_backend(), "while")
    return "cond" if config.repair == "cond" else "while"


def repair_if(flagged: jax.Array, repair, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``repair(x)`` when ``flagged``, else ``(x, zero_counts())``; no copy of ``x`` when clean.

    See :func:`sdcguard._in_place.apply_if` for why this is not a ``lax.cond``. It is not
    reverse-differentiable: the checked einsum calls it inside its ``custom_vjp``, the softmax
    check behind an identity ``custom_jvp``.

    Args:
      flagged: bool scalar, whether any line failed its check.
      repair: ``x -> (x_repaired, counts)``; ``x_repaired`` has ``x``'s shape and dtype.
      x: the checked tensor.

    Returns:
      ``(x or x_repaired, int32 [detected, corrected, uncorrectable, nonfinite_input])``.
    """
    # Zero counts typed like the flag, so the loop's carry keeps its type.
    return apply_if(flagged, lambda checked: repair(checked[0]), (x, zero_counts_like(flagged)))


def _recomputed_rows(a, b, ct: Contraction, matrix_at: dict, dims: dict) -> jax.Array:
    """One row of ``einsum(a, b)`` per matrix, computed again: ``[n_batch, N]`` (the rhs-free
    axes flattened in the output's order), in float32 or wider, for the rows ``matrix_at`` names
    (``{letter: [n_batch]}`` over the batch and lhs-free letters).

    The row of ``a`` is gathered (``K`` numbers per matrix); ``b`` is read whole, as a
    vector-matrix product per matrix, in its own layout.
    """
    common = jnp.result_type(a.dtype, b.dtype)
    acc = jnp.promote_types(jnp.float32, common)  # float32, or float64 for float64
    lhs_lines = gather_lines(
        a, ct.lhs, {x: matrix_at[x] for x in ct.lhs if x in matrix_at}, ct.contracted
    )
    batch_shape = tuple(dims[x] for x in ct.batch)
    lhs_k = "".join(x for x in ct.lhs if x in ct.contracted)
    rhs_free = "".join(x for x in ct.out if x in ct.rhs_free)  # the output's order
    spec = f"{ct.batch}{lhs_k},{ct.rhs}->{ct.batch}{rhs_free}"
    lhs_lines = lhs_lines.reshape(*batch_shape, *lhs_lines.shape[1:])
    if narrower_than_float32(common) and sums_low_precision_in_float32():
        # bf16/fp16: each product is exact in float32 and the backend sums them in float32;
        # reading B as stored is a fifth of the traffic of a float32 copy made and read.
        rows = jnp.einsum(
            spec, lhs_lines.astype(common), b.astype(common), preferred_element_type=acc
        )
    else:
        rows = jnp.einsum(
            spec, lhs_lines.astype(acc), b.astype(acc), precision=lax.Precision.HIGHEST
        )
    return rows.reshape(math.prod(batch_shape), -1)
