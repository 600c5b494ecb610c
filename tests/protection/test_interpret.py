"""``sdcguard.checked`` on program structure: control flow, selection, modes, and sharding.

Small plain-JAX functions, so every case compiles in a second. The sharded cases run with 8
CPU devices in a subprocess (see ``multidevice.py``) and are judged by the collectives in the
compiled HLO: a check runs where its data is, so the step gains at most the one reduction of
its counters.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sdcguard
from sdcguard.fault_model import Fault, FaultPlan
from sdcguard.protection import ABFTConfig, list_sites, total, unsafe_checks

from tests.helpers.checked_runs import run_with
from tests.helpers.multidevice import needs_8, run_on_8_devices
from tests.helpers.tolerances import assert_close

KEY = jax.random.key(0)
W = jax.random.normal(KEY, (3, 8, 8)) / 3
X = jax.random.normal(jax.random.key(1), (4, 8))


def stack_loss(w, x):
    """Three layers in a scan, each rematerialised: a layer stack as nn.scan writes one."""

    def layer(h, wi):
        return jax.checkpoint(lambda h: jnp.tanh(h @ wi))(h), None

    return jnp.sum(jax.lax.scan(layer, x, w)[0] ** 2)


def grad_step(w, x):
    return jax.value_and_grad(stack_loss)(w, x)


def only(site, kind="inf", index=3, **fault):
    return FaultPlan.from_faults([Fault(site=site, kind=kind, index=index, **fault)], capacity=2)


def test_scan_and_remat_forward_and_backward():
    names = [s.name for s in list_sites(grad_step, W, X)]
    forward = "stack_loss/layer/<lambda>:dot_general"
    assert forward in names and f"{forward}.grad_lhs" in names and f"{forward}.grad_rhs" in names
    expected = jax.jit(grad_step)(W, X)
    for site in (forward, f"{forward}.grad_lhs", f"{forward}.grad_rhs"):
        out, report = run_with(only(site), grad_step, W, X)
        # A fault at a site fires wherever the site runs: in each of the 3 scan iterations (and
        # in the backward pass's recomputation of the forward GEMM under remat).
        assert int(report[site][0]) >= 3 and int(report[site][2]) == 0
        assert_close(out[1], expected[1], jnp.float32)


def checkpointed_step(w, x):
    """Two layers, each under jax.checkpoint (no scan): the backward pass recomputes each
    forward GEMM beside its gradients."""

    @jax.checkpoint
    def block(wi, h):
        return jnp.tanh(h @ wi)

    def loss(w, x):
        return jnp.sum(block(w[1], block(w[0], x)) ** 2)

    return jax.grad(loss)(w, x)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_a_recomputation_under_checkpoint_takes_its_forward_gemms_name(dtype):
    w, x = (W[0].astype(dtype), W[1].astype(dtype)), X.astype(dtype)
    sites = {s.name: s.direction for s in list_sites(checkpointed_step, w, x)}
    first = "checkpointed_step/block:dot_general"
    # x is data: the first layer has no input gradient, only the recomputation of its forward
    # (which was named as one).
    assert sites == {
        first: "forward",
        f"{first}_1": "forward",
        f"{first}.grad_rhs": "grad_rhs",
        f"{first}_1.grad_lhs": "grad_lhs",
        f"{first}_1.grad_rhs": "grad_rhs",
    }, sites
    expected = jax.jit(checkpointed_step)(w, x)
    # A fault at a forward site strikes the GEMM and its recomputation; at a gradient, once.
    for site, count in ((f"{first}_1", 2), (f"{first}_1.grad_lhs", 1)):
        out, report = run_with(only(site), checkpointed_step, w, x)
        np.testing.assert_array_equal(report[site], [count, count, 0, 0])
        assert_close(out, expected, dtype)


def test_per_iteration_counters_of_a_scan():
    site = "stack_loss/layer/<lambda>:dot_general.grad_rhs"
    config = ABFTConfig(per_iteration=True)
    _, report = run_with(only(site, step=-1), grad_step, W, X, config=config)
    assert report[site].shape == (3, 4)
    np.testing.assert_array_equal(report[site], [[1, 1, 0, 0]] * 3)


def test_while_cond_custom_vjp_and_vmap():
    @jax.custom_vjp
    def custom(a, b):
        return a @ b

    custom.defvjp(lambda a, b: (a @ b, (a, b)), lambda r, g: (g @ r[1].T, r[0].T @ g))

    def fn(x, w):
        y = jax.lax.while_loop(lambda c: c[1] < 2, lambda c: (jnp.tanh(c[0] @ w), c[1] + 1), (x, 0))
        z = jax.lax.cond(jnp.sum(y[0]) > -1e9, lambda v: v @ w.T, lambda v: v, y[0])
        return jax.vmap(lambda row: custom(row[None], w))(z).sum()

    names = [s.name for s in list_sites(fn, X, W[0])]
    assert len(names) == 3
    for site in names:
        out, report = run_with(only(site, index=1), fn, X, W[0])
        assert int(report[site][0]) >= 1 and int(report[site][0]) == int(report[site][1])
        assert_close(out, jax.jit(fn)(X, W[0]), jnp.float32)


def test_include_and_exclude_select_sites():
    config = ABFTConfig(include=("**grad**",), exclude=("**grad_lhs",))
    sites = {s.name: s for s in list_sites(grad_step, W, X, config=config)}
    checked = {n for n, s in sites.items() if s.checked}
    assert checked == {"stack_loss/layer/<lambda>:dot_general.grad_rhs"}
    assert {s.why_unchecked for s in sites.values() if not s.checked} == {
        "excluded by include/exclude"
    }
    _, report = jax.jit(sdcguard.checked(grad_step, config))(W, X)
    assert set(report) == checked
    with pytest.raises(TypeError, match="tuple of glob patterns"):
        ABFTConfig(include="**attn**")


def test_integer_gemms_pass_through_unchecked_and_are_listed():
    def fn(a, b, x):
        return (a @ b).astype(jnp.float32).sum() + (x @ x.T).sum()

    a = jnp.arange(12, dtype=jnp.int8).reshape(3, 4)
    b = jnp.ones((4, 2), jnp.int8)
    sites = list_sites(fn, a, b, X)
    assert [(s.checked, s.why_unchecked) for s in sites] == [
        (False, "int8 operands (integer, fp8 and complex GEMMs pass through)"),
        (True, ""),
    ]
    out, report = jax.jit(sdcguard.checked(fn))(a, b, X)
    assert list(report) == [sites[1].name]
    assert_close(out, fn(a, b, X), jnp.float32)


def test_checked_refuses_what_is_not_a_function_before_it_is_called():
    with pytest.raises(TypeError, match=r"takes the function to check.*not callable"):
        sdcguard.checked(X)


def test_complex_gemms_pass_through_unchecked_and_are_listed():
    def fn(a, x):
        return jnp.abs(a @ a).sum() + (x @ x.T).sum()

    a = (jnp.arange(16, dtype=jnp.float32).reshape(4, 4) * (1 + 1j)).astype(jnp.complex64)
    sites = list_sites(fn, a, X)
    assert [(s.checked, s.why_unchecked) for s in sites] == [
        (False, "complex64 operands (integer, fp8 and complex GEMMs pass through)"),
        (True, ""),
    ]
    out, report = jax.jit(sdcguard.checked(fn))(a, X)
    assert list(report) == [sites[1].name]
    assert_close(out, fn(a, X), jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize(
    "lhs, rhs", [((0, 8), (8, 4)), ((3, 0), (0, 4)), ((2, 0, 8), (8, 4))],
    ids=["no_rows", "nothing_contracted", "empty_batch"],
)  # fmt: skip
def test_empty_gemms_pass_through_and_say_why(lhs, rhs, dtype):
    def fn(a, b, x):
        return jnp.sum((a @ b).astype(jnp.float32)) + jnp.sum(x @ x.T), a @ b

    step = jax.grad(fn, argnums=(0, 1), has_aux=True)
    a, b = jnp.ones(lhs, dtype), jnp.ones(rhs, dtype)
    sites = list_sites(step, a, b, X)
    empty = [s for s in sites if not s.checked]
    assert empty and all("zero-size operands" in s.why_unchecked for s in empty)
    assert all(0 in s.lhs_shape + s.rhs_shape for s in empty)
    assert any(s.checked for s in sites)  # x @ x.T and its gradient GEMMs
    out, report = jax.jit(sdcguard.checked(step))(a, b, X)
    assert set(report) == {s.name for s in sites if s.checked}
    np.testing.assert_array_equal(total(report), [0, 0, 0, 0])
    jax.tree.map(lambda x, y: assert_close(x, y, dtype), out, jax.jit(step)(a, b, X))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize(
    "lhs, rhs", [((0, 8), (8, 4)), ((2, 0, 8), (8, 4))], ids=["no_rows", "empty_batch"]
)
def test_empty_gemms_run_under_a_fault_plan(lhs, rhs, dtype):
    def fn(a, b, x):
        return a @ b, x @ x.T

    a, b, x = jnp.ones(lhs, dtype), jnp.ones(rhs, dtype), X.astype(dtype)
    site = next(s.name for s in list_sites(fn, a, b, x) if s.checked)
    (empty, out), report = run_with(only(site, index=5), fn, a, b, x)
    assert empty.shape == lhs[:-1] + rhs[-1:]
    np.testing.assert_array_equal(report[site], [1, 1, 0, 0])
    assert_close(out, x @ x.T, dtype)


def nested_jit_step(w, x):
    """A step whose GEMMs are in functions the user jitted: a layer, and the loss."""
    layer = jax.jit(lambda h, wi: jnp.tanh(h @ wi))

    @jax.jit
    def loss(w, x):
        return jnp.sum(layer(layer(x, w[0]), w[1]) ** 2)

    return jax.value_and_grad(loss)(w, x)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_gemms_inside_a_nested_jit_are_checked_and_corrected(dtype):
    w, x = W.astype(dtype), X.astype(dtype)
    sites = list_sites(nested_jit_step, w, x)
    assert len(sites) == 5 and all(s.checked for s in sites), sites  # 2 forward, 3 gradients
    expected = jax.jit(nested_jit_step)(w, x)
    for site in [s.name for s in sites]:
        out, report = run_with(only(site), nested_jit_step, w, x)
        assert int(report[site][0]) >= 1, site
        np.testing.assert_array_equal(total(report)[1:], [total(report)[0], 0, 0])
        jax.tree.map(lambda a, b: assert_close(a, b, dtype), out, expected)


def test_a_gradient_gemm_of_a_literal_cotangent_is_named_checked_and_corrected():
    # grad of a dot of two vectors: JAX multiplies by the scalar cotangent 1.0 with a
    # dot_general whose operand is a jaxpr literal, not a variable.
    def fn(w, v):
        return jax.grad(lambda w, v: jnp.dot(v, w @ v), argnums=(0, 1))(w, v)

    w, v = W[0], X[0]

    def literal_operands(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name == "dot_general":
                yield any(isinstance(x, jax.extend.core.Literal) for x in e.invars)
            for value in e.params.values():
                for sub in value if isinstance(value, (tuple, list)) else [value]:
                    sub = getattr(sub, "jaxpr", sub)  # a closed jaxpr's jaxpr
                    if hasattr(sub, "eqns"):
                        yield from literal_operands(sub)

    assert any(literal_operands(jax.make_jaxpr(fn)(w, v).jaxpr)), "a dot_general of a literal"
    sites = [s for s in list_sites(fn, w, v) if s.checked]
    expected = jax.jit(fn)(w, v)
    out, report = jax.jit(sdcguard.checked(fn))(w, v)
    assert set(report) == {s.name for s in sites} and int(total(report)[0]) == 0
    jax.tree.map(lambda x, y: assert_close(x, y, jnp.float32), out, expected)
    for site in {s.name for s in sites}:
        out, report = run_with(only(site, index=0), fn, w, v)
        assert int(report[site][0]) >= 1 and int(unsafe_checks(total(report))) == 0, site
        jax.tree.map(lambda x, y: assert_close(x, y, jnp.float32), out, expected)


@pytest.mark.parametrize("mode", ["detect_only", "recompute"])
def test_detect_only_and_recompute_modes(mode):
    site = "stack_loss/layer/<lambda>:dot_general.grad_rhs"
    config = ABFTConfig(correct=False) if mode == "detect_only" else ABFTConfig(recompute=True)
    expected = jax.jit(grad_step)(W, X)
    out, report = run_with(only(site, kind="nan", step=-1), grad_step, W, X, config=config)
    if mode == "detect_only":
        # Detected, not repaired: the NaN is passed on for the update guard to refuse.
        assert int(report[site][0]) == 3 and int(report[site][1]) == 0
        assert int(total(report)[2]) >= 3
        assert not bool(jnp.all(jnp.isfinite(out[1])))
    else:
        # The fault is transient (a plan is inert on the recomputation): the step computed
        # again is clean, and its detections count as corrected.
        np.testing.assert_array_equal(report[site], [3, 3, 0, 0])
        assert_close(out[1], expected[1], jnp.float32)
    # A clean call computes the step once and reports nothing.
    out, report = run_with(FaultPlan.none(), grad_step, W, X, config=config)
    np.testing.assert_array_equal(total(report), [0, 0, 0, 0])
    assert_close(out[1], expected[1], jnp.float32)


def test_recompute_reports_a_fault_that_the_recomputation_meets_again():
    """A NaN in the step's input is met by both computations: nothing is counted corrected,
    and the report says why the update guard must refuse the step."""
    x = X.at[0, 0].set(jnp.nan)
    out, report = run_with(FaultPlan.none(), grad_step, W, x, config=ABFTConfig(recompute=True))
    counts = total(report)
    assert int(counts[0]) > 0 and int(counts[1]) == 0
    assert int(unsafe_checks(counts)) == int(counts[0])
    assert not bool(jnp.isfinite(out[0]))


# --- Sharded: the checks stay on the device that holds the data ---------------------------------

# An instruction of the compiled HLO whose op is a collective (``... f32[8]{0} all-reduce(``),
# not a mention of one as an operand (``get-tuple-element(%all-reduce)``).
COLLECTIVE = re.compile(
    r"[\]})] (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(-start)?\("
)


def _collectives(compiled_text: str) -> int:
    return len(COLLECTIVE.findall(compiled_text))


def test_sharded_checks_in_a_subprocess_with_8_cpu_devices():
    run_on_8_devices(__file__)


@needs_8
@pytest.mark.parametrize("mesh_shape", [(8, 1), (4, 2)], ids=["8x1", "4x2"])
def test_shard_map_adds_one_reduction_on_8_devices(mesh_shape):
    from jax.sharding import AxisType, PartitionSpec as P

    mesh = jax.make_mesh(mesh_shape, ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    axes = ("data", "model")
    x = jax.random.normal(jax.random.key(2), (16, 8))

    def dp_step(w, x):
        loss, grads = jax.value_and_grad(stack_loss)(w, x)
        return jax.lax.pmean((loss, grads), axes)

    step = jax.shard_map(dp_step, mesh=mesh, in_specs=(P(), P(axes)), out_specs=(P(), P()))
    checked = sdcguard.checked(step)
    plain_n = _collectives(jax.jit(step).lower(W, x).compile().as_text())
    checked_n = _collectives(jax.jit(checked).lower(W, x).compile().as_text())
    assert checked_n - plain_n <= 1, (plain_n, checked_n)
    expected = jax.jit(step)(W, x)
    unsharded = jax.jit(grad_step)(W, x)
    # pmean of the per-shard sums is the whole batch's sum over the number of shards.
    assert_close(expected[0] * mesh_shape[0] * mesh_shape[1], unsharded[0], jnp.float32)
    site = "stack_loss/layer/<lambda>:dot_general.grad_rhs"
    out, report = run_with(only(site, index=5), step, W, x)
    # The fault fires on every device's shard (the plan is replicated); each device corrects
    # its own, and the counters are summed over devices once.
    assert int(report[site][0]) == 3 * mesh_shape[0] * mesh_shape[1]
    assert int(report[site][0]) == int(report[site][1])
    assert_close(out[1], expected[1], jnp.float32)
    # Recompute mode: the per-device counters go through the loop stacked, and the step
    # computed again is clean.
    out, report = run_with(only(site, index=5), step, W, x, config=ABFTConfig(recompute=True))
    np.testing.assert_array_equal(report[site], [3 * mesh_shape[0] * mesh_shape[1]] * 2 + [0, 0])
    assert_close(out[1], expected[1], jnp.float32)


@needs_8
def test_pmap_adds_no_collective_on_8_devices():
    xs = jax.random.normal(jax.random.key(3), (8, 2, 8))

    def dp_step(w, x):
        loss, grads = jax.value_and_grad(stack_loss)(w, x)
        return jax.lax.pmean((loss, grads), "data")

    plain = jax.pmap(dp_step, axis_name="data", in_axes=(None, 0))
    checked = jax.pmap(sdcguard.checked(dp_step), axis_name="data", in_axes=(None, 0))
    plain_n = _collectives(plain.lower(W, xs).compile().as_text())
    assert _collectives(checked.lower(W, xs).compile().as_text()) == plain_n
    out, report = checked(W, xs)
    assert_close(out[0][0], plain(W, xs)[0][0], jnp.float32)
    assert all(r.shape == (8, 4) for r in report.values())  # per device under pmap
