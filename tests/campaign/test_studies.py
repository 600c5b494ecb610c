"""Without protection, faults spread as ATTNChecker describes (the harm ABFT prevents)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdcguard import fault_model as inject
from sdcguard.fault_model import Fault, FaultPlan

B, L, H, D = 2, 16, 4, 8


def qkv():
    kq, kk = jax.random.split(jax.random.key(0))
    return jax.random.normal(kq, (B, L, H, D)), jax.random.normal(kk, (B, L, H, D))


def pattern(diff: np.ndarray) -> tuple[str, set, set]:
    """The error pattern of one corrupted attention matrix: 0D, 1D (row/col) or 2D."""
    rows, cols = np.nonzero(diff)
    rows, cols = set(rows.tolist()), set(cols.tolist())
    if len(rows) * len(cols) == 1:
        return "0D", rows, cols
    if len(rows) == 1 or len(cols) == 1:
        return "1D", rows, cols
    return "2D", rows, cols


@pytest.mark.parametrize("operand, line", [("query", "row"), ("key", "column")])
def test_projection_fault_becomes_1d_in_scores(operand, line):
    q, k = qkv()
    # Element (batch 1, position 5, head 2, dim 3) of the projection output.
    index = ((1 * L + 5) * H + 2) * D + 3
    plan = FaultPlan.from_faults([Fault(site=f"x:{operand}", kind="scale", value=1e4, index=index)])
    faulty_q = inject.apply(q, plan, "x:query")
    faulty_k = inject.apply(k, plan, "x:key")
    clean = jnp.einsum("bqhd,bkhd->bhqk", q, k)
    bad = jnp.einsum("bqhd,bkhd->bhqk", faulty_q, faulty_k)
    diff = np.asarray(~np.isclose(bad, clean, rtol=1e-4))
    touched = {tuple(x) for x in np.argwhere(diff.any(axis=(2, 3)))}
    assert touched == {(1, 2)}  # one matrix: the fault's batch and head
    kind, rows, cols = pattern(diff[1, 2])
    assert kind == "1D"
    if line == "row":
        assert rows == {5} and len(cols) == L
    else:
        assert cols == {5} and len(rows) == L


def test_scores_fault_becomes_row_of_probs_then_spreads():
    q, k = qkv()
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k)
    plan = FaultPlan.from_faults([Fault(site="x:scores", kind="near_inf", index=5 * L + 2)])
    probs = jax.nn.softmax(inject.apply(scores, plan, "x:scores"))
    diff = np.asarray(~np.isclose(probs, jax.nn.softmax(scores), atol=1e-6))
    assert pattern(diff[0, 0])[0] == "1D"  # the whole softmax row changes
    v = jax.random.normal(jax.random.key(2), (B, L, H, D))
    ctx = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
    ctx_diff = np.asarray(
        ~np.isclose(ctx, jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores), v), atol=1e-6)
    )
    assert ctx_diff[0, 5, 0].all() and ctx_diff.sum() == D  # one token's head output
