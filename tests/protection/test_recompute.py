"""What a checked step costs in control flow, and that ``list_sites`` and the report agree.

On the CPU the checks are branch-free (``repair="auto"``); ``recompute=True`` adds one loop to
the step there, or one conditional with ``repair="cond"`` (the GPU's default, which keeps it
inside the step's CUDA graph).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

import sdcguard
from sdcguard import ABFTConfig
from sdcguard.fault_model import Fault, FaultPlan
from sdcguard.protection import list_sites, total

from tests.helpers.tolerances import assert_close
from tests.helpers.xla_settings import compile_as_users_do
from tests.protection.test_gemm import lm_step


def control_flow(compiled_text: str) -> dict[str, int]:
    """``while`` and ``conditional`` ops of an optimized HLO module."""
    return {op: len(re.findall(rf"\s{op}\(", compiled_text)) for op in ("while", "conditional")}


@pytest.mark.parametrize(
    "config, loops, conditionals_per_gemm",
    [
        pytest.param(None, 0, 0, marks=pytest.mark.slow),
        pytest.param(ABFTConfig(correct=False), 0, 0, marks=pytest.mark.slow),
        (ABFTConfig(), 0, "grouped"),
        # One cond per GEMM: also pinned on a smaller step (test_grouped_repairs).
        pytest.param(ABFTConfig(group_repairs=False), 0, 1, marks=pytest.mark.slow),
        pytest.param(ABFTConfig(repair="branch_free"), 0, 0, marks=pytest.mark.slow),
        (ABFTConfig(recompute=True), 1, 0),
    ],
    ids=["plain", "detect-only", "in-place", "in-place-per-gemm", "branch-free", "recompute"],
)
def test_a_checked_bf16_steps_control_flow(config, loops, conditionals_per_gemm):
    """Detection compiles no control flow; the in-place repair one conditional per group of
    GEMMs that nothing reads between (a layer's two gradient GEMMs; query, key and value), or
    one per checked GEMM (its branch runs only when a check fired); recompute one loop around
    the step (CPU)."""
    step, args = lm_step(jnp.bfloat16)
    fn = step if config is None else sdcguard.checked(step, config)
    checked = (
        0 if config is None else sum(s.checked for s in list_sites(step, *args, config=config))
    )
    text = compile_as_users_do(jax.jit(fn).lower(*args)).as_text()
    found = control_flow(text)
    if conditionals_per_gemm == "grouped":
        # Every backward pair shares one: at most half a conditional per GEMM, and one at least.
        assert found["while"] == loops
        assert 0 < found["conditional"] <= checked // 2 + 1, (found, checked)
    else:
        assert found == {"while": loops, "conditional": conditionals_per_gemm * checked}


def _computations(compiled_text: str) -> dict[str, str]:
    """The computations of an optimized HLO module, by name."""
    out = {}
    for text in re.split(r"\n(?=\S)", compiled_text):
        name = re.match(r"(?:ENTRY )?(%[\w.-]+) ", text)
        if name:
            out[name.group(1)] = text
    return out


def _reachable(computations: dict[str, str], root: str) -> set[str]:
    """``root`` and every computation it calls, directly or not."""
    seen, todo = set(), [root]
    while todo:
        name = todo.pop()
        if name not in seen and name in computations:
            seen.add(name)
            todo += re.findall(r"(?:calls|body|condition|to_apply)=(%[\w.-]+)", computations[name])
    return seen


def test_the_recompute_loop_computes_the_step_on_each_trip():
    """A loop body that does not depend on its trip is loop-invariant, and XLA hoists all of it
    out of the loop: the second trip would then compute nothing again, and a transient fault
    would be met again. Every GEMM of the compiled step must sit inside the loop's body."""

    def step(w, x):
        return jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)

    w = jax.random.normal(jax.random.key(0), (16, 8))
    x = jax.random.normal(jax.random.key(1), (4, 16))
    checked = sdcguard.checked(step, ABFTConfig(recompute=True))
    text = jax.jit(checked).lower(w, x).compile().as_text()
    computations = _computations(text)
    (body,) = re.findall(r"\swhile\(.*?body=(%[\w.-]+)", text)
    inside = sum(computations[c].count(" dot(") for c in _reachable(computations, body))
    assert text.count(" dot(") >= 3  # the forward GEMM and its gradient, at least
    assert inside == text.count(" dot(")


def test_the_recompute_cond_computes_the_step_again_in_its_branch():
    """With ``repair="cond"``: no loop, one conditional, and a second copy of every GEMM of the
    step inside its branch (a copy hoisted out of it would not compute anything again)."""

    def step(w, x):
        return jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)

    w = jax.random.normal(jax.random.key(0), (16, 8))
    x = jax.random.normal(jax.random.key(1), (4, 16))
    checked = sdcguard.checked(step, ABFTConfig(recompute=True, repair="cond"))
    text = jax.jit(checked).lower(w, x).compile().as_text()
    assert not re.search(r"\swhile\(", text)
    (branches,) = re.findall(r"\sconditional\(.*?branch_computations=\{([^}]*)\}", text)
    computations = _computations(text)
    inside = set().union(*(_reachable(computations, b.strip()) for b in branches.split(",")))
    dots_inside = sum(computations[c].count(" dot(") for c in inside)
    assert dots_inside >= 3  # the forward GEMM and its gradient, at least
    assert text.count(" dot(") == 2 * dots_inside


@pytest.mark.parametrize("repair", ["while", "cond"])
@pytest.mark.parametrize(
    "dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name
)
def test_recompute_mode_repairs_what_in_place_cannot(repair, dtype):
    """Two errors in one matrix are beyond the in-place fix (counted uncorrectable, the output
    flagged, never passed on as corrected); the recompute computes the step again, once, and
    the faults, transient, are not met again."""

    def step(w, x):
        return jnp.tanh(x @ w)

    w = jax.random.normal(jax.random.key(0), (8, 6)).astype(dtype)
    x = jax.random.normal(jax.random.key(1), (4, 8)).astype(dtype)
    (site,) = [s.name for s in list_sites(step, w, x)]
    plan = FaultPlan.from_faults([Fault(site=site, kind="nan", index=i) for i in (1, 13)])

    def run(config, plan=plan):
        @jax.jit
        def go(plan, w, x):
            with sdcguard.faults(plan):
                return sdcguard.checked(step, config)(w, x)

        return go(plan, w, x)

    out, report = run(ABFTConfig(repair=repair))
    np.testing.assert_array_equal(report[site], [1, 0, 1, 0])
    assert np.isnan(np.asarray(out, np.float32)).sum() == 2
    config = ABFTConfig(recompute=True, repair=repair)
    out, report = run(config)
    np.testing.assert_array_equal(report[site], [1, 1, 0, 0])
    assert_close(out, step(w, x), dtype)
    # A clean step: computed once, bit for bit the plain one, nothing reported.
    out, report = run(config, FaultPlan.from_faults([], capacity=2))
    np.testing.assert_array_equal(report[site], [0, 0, 0, 0])
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(step(w, x), np.float32))


# --- list_sites and the report agree, whatever holds the GEMMs ---------------------------------

W = jax.random.normal(jax.random.key(2), (6, 6)) / 3
X = jax.random.normal(jax.random.key(3), (3, 6))


def in_scan(w, x):
    return jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, length=3)[0]


def in_while_condition(w, x):
    # The condition holds a GEMM: it runs unchecked (its counters could not leave the loop).
    def cond(c):
        return (jnp.sum(c @ w) < 100.0) & (jnp.sum(c) < 1e3)

    return jax.lax.while_loop(cond, lambda c: c + jnp.tanh(c @ w.T), x)


def in_cond(w, x):
    return jax.lax.cond(x[0, 0] > 0, lambda: x @ w, lambda: x @ w.T)


def in_remat(w, x):
    return jax.grad(lambda w: jnp.sum(jax.checkpoint(lambda w: jnp.tanh(x @ w))(w)))(w)


def in_linear_solve(w, x):
    a = w @ w.T + 6 * jnp.eye(6)  # symmetric positive definite

    def matvec(v):
        return a @ v

    def solve(matvec, b):
        return jax.scipy.sparse.linalg.cg(matvec, b, maxiter=4)[0]

    return jax.lax.custom_linear_solve(matvec, x[0], solve, symmetric=True)


def in_a_kernel(w, x):
    def kernel(x_ref, w_ref, o_ref):
        o_ref[...] = jnp.dot(x_ref[...], w_ref[...])

    out = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((3, 6), jnp.float32), interpret=True
    )
    return out(x, w) + x @ w


PROGRAMS = {
    "scan": in_scan,
    "while-condition": in_while_condition,
    "cond": in_cond,
    "remat": in_remat,
    "custom_linear_solve": in_linear_solve,
    "pallas_call": in_a_kernel,
}


@pytest.mark.parametrize("program", list(PROGRAMS))
def test_every_site_listed_as_checked_is_in_the_report_and_no_other(program):
    fn = PROGRAMS[program]
    sites = list_sites(fn, W, X)
    out, report = jax.jit(sdcguard.checked(fn))(W, X)
    assert set(report) == {s.name for s in sites if s.checked}
    np.testing.assert_array_equal(total(report), [0, 0, 0, 0])
    np.testing.assert_allclose(np.asarray(out), np.asarray(fn(W, X)), rtol=1e-5, atol=1e-5)
    for s in sites:
        assert s.checked == (s.why_unchecked == ""), s


def test_gemms_that_run_unchecked_say_where_and_why():
    why = {s.why_unchecked for s in list_sites(in_while_condition, W, X) if not s.checked}
    assert why == {"in a while loop's condition (run unchecked)"}
    why = {s.why_unchecked for s in list_sites(in_a_kernel, W, X) if not s.checked}
    assert why == {"inside pallas_call, which sdcguard.checked does not open"}
    # A linear solve is opened: what the step runs (the solve) is checked; its other parts,
    # which the differentiated step does not call, are listed as not run.
    sites = list_sites(in_linear_solve, W, X)
    assert any(s.checked for s in sites)
    for s in sites:
        assert s.checked or re.fullmatch(
            r"in custom_linear_solve's (matvec|vecmat|transpose_solve), which the step does not "
            "run",
            s.why_unchecked,
        ), s


def test_a_fault_inside_a_linear_solve_is_corrected():
    checked_sites = [s.name for s in list_sites(in_linear_solve, W, X) if s.checked]
    site = next(n for n in checked_sites if "grad" not in n)
    plan = FaultPlan.from_faults([Fault(site=site, kind="inf", index=2)])

    @jax.jit
    def run(plan, w, x):
        with sdcguard.faults(plan):
            return sdcguard.checked(in_linear_solve)(w, x)

    out, report = run(plan, W, X)
    assert report[site][1] >= 1 and report[site][2] == 0
    np.testing.assert_allclose(np.asarray(out), np.asarray(in_linear_solve(W, X)), rtol=1e-5)
