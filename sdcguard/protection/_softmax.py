"""The softmax check of the attention core: every row of ``probs`` sums to 1.

Example:
  >>> probs, counts = check_softmax_rows(probs, scores, jax.nn.softmax, ABFTConfig())
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.interpreters import ad

from sdcguard.protection._checks import in_check_scope, repair_if, repair_strategy
from sdcguard.protection._config import ABFTConfig, count_outcomes
from sdcguard.protection._sharding import device_mesh, shard_rows, sum_rows
from sdcguard.protection._tolerance import unit_roundoff


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
def check_softmax_rows(
    probs: jax.Array, scores: jax.Array, softmax, config: ABFTConfig
) -> tuple[jax.Array, jax.Array]:
    """Checks the softmax invariant: every row of ``probs`` ``[..., q, k]`` sums to 1.

    A row that does not (beyond round-off), or holds a non-finite value, is recomputed as
    ``softmax(scores)`` (``scores`` being the already-checked input of the softmax). The
    repair is an identity for autodiff: gradients flow to ``probs`` as if it were clean.

    Args:
      probs: ``[..., q, k]``, the softmax output, possibly corrupted.
      scores: the softmax input, of the shape ``softmax`` expects.
      softmax: ``scores -> probs``, the computation to redo (static; hashable).
      config: ABFT settings.

    Returns:
      ``(probs_checked, counts)`` with counts over the ``[...]`` matrices.

    Example:
      >>> probs, counts = check_softmax_rows(probs, scores, jax.nn.softmax, ABFTConfig())
    """

    local = functools.partial(_check_softmax_rows_local, softmax=softmax, config=config)
    mesh = device_mesh(probs, scores) if probs.shape == scores.shape else None
    if mesh is None:
        return local(probs, scores)
    # Each device checks the rows it holds; counters summed here.
    probs, counts = shard_rows(local, probs, scores, mesh=mesh)
    return probs, sum_rows(counts, mesh)


@in_check_scope
def _check_softmax_rows_local(probs, scores, *, softmax, config):
    if probs.size == 0:
        # No rows, or rows of no keys: there is no sum to check.
        return probs, count_outcomes(0, 0)
    k = probs.shape[-1]
    p32 = probs.astype(jnp.float32)
    # Each element is rounded once (relative u_out, weighted by p: sums to u_out), plus the
    # float32 exp/normalise/sum chain (a few u_acc per element, K of them).
    tol = config.safety * (
        4 * unit_roundoff(probs.dtype) + (2 * k + 8) * unit_roundoff(jnp.float32)
    )
    row_sum = jnp.sum(p32, axis=-1)
    bad = ~(jnp.abs(row_sum - 1.0) <= tol)  # NaN/inf rows fail too

    def per_matrix(rows):
        return jnp.any(rows.reshape(-1, rows.shape[-1]), axis=-1)

    def upstream_rows():
        # A flagged row whose softmax, recomputed from its (already checked) input, is not
        # finite was made non-finite upstream: a fully -inf (masked) row, a NaN score.
        redo = softmax(scores).astype(probs.dtype)
        return redo, bad & ~jnp.all(jnp.isfinite(redo), axis=-1)

    if not config.correct:
        # Telling an upstream non-finite row apart needs the recomputed softmax, which a
        # detect-only check does not compute (no loop for the step to wait on): every flagged
        # row counts uncorrectable; the recompute pass of ``repair='recompute'`` classifies it.
        return probs, count_outcomes(jnp.sum(per_matrix(bad)), 0)

    def fix(probs):
        redo, upstream = upstream_rows()
        fixed = jnp.where(bad[..., None], redo, probs)
        after = jnp.sum(fixed.astype(jnp.float32), axis=-1)
        still_bad = ~(jnp.abs(after - 1.0) <= tol)
        detected, upstream = per_matrix(bad), per_matrix(upstream)
        corrected = detected & ~upstream & ~per_matrix(still_bad)
        return fixed, count_outcomes(jnp.sum(detected), jnp.sum(corrected), jnp.sum(upstream))

    if repair_strategy(config) == "cond":
        # The default: on a GPU the conditional stays inside the step's CUDA graph, where a
        # loop would not. The clean branch's counters come from the check's own data (zero when
        # clean), so inside shard_map both branches are typed alike.
        def clean(probs):
            return probs, count_outcomes(jnp.sum(per_matrix(bad)), 0)

        return lax.cond(jnp.any(bad), fix, clean, probs)
    # Otherwise a loop of zero or one trips (branch-free has no softmax of its own: it loops).
    return repair_if(jnp.any(bad), fix, probs)


def no_tangent(counts: jax.Array) -> jax.Array:
    """The float0 tangent of integer counters, typed like them (varying across the devices
    of a ``shard_map`` when they are, as ``check_vma`` requires)."""
    return ad.zeros_like_aval(jax.typeof(counts).to_tangent_aval())


@check_softmax_rows.defjvp
def _check_softmax_rows_jvp(softmax, config, primals, tangents):
    out = check_softmax_rows(*primals, softmax, config)
    return out, (tangents[0], no_tangent(out[1]))
