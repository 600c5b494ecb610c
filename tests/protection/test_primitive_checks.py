"""Grouped GEMMs and convolutions under ``sdcguard.checked``: named, checked, corrected.

Two linen models written as users write them, trained by ``jax.value_and_grad``: a
mixture-of-experts layer (tokens sorted by expert, one ``jax.lax.ragged_dot`` per expert
weight) and a small convolutional network (a strided patch embedding, a grouped convolution).
Each grouped GEMM and convolution, and both its gradients, is a site of its own; a fault at any
of them is detected and corrected to the clean step, and what cannot be corrected is counted,
never passed off.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sdcguard
from sdcguard.fault_model import Fault, FaultPlan
from sdcguard.protection import ABFTConfig, _primitive_checks as primitive_checks, list_sites, total
from sdcguard.protection._primitive_checks import PrimitiveGemm

from tests.helpers.checked_runs import run_with, with_plan
from tests.helpers.multidevice import needs_8, run_on_8_devices
from tests.helpers.tolerances import assert_close

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
EXPERTS, D, HIDDEN, TOKENS = 4, 16, 32, 24


class MoE(nn.Module):
    """Top-1 routing; the tokens sorted by expert, each expert's MLP one ``ragged_dot``."""

    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):  # x: [tokens, d]
        init = nn.initializers.lecun_normal()
        router = nn.Dense(EXPERTS, dtype=self.dtype, name="router")
        wi = self.param("wi", init, (EXPERTS, D, HIDDEN)).astype(self.dtype)
        wo = self.param("wo", init, (EXPERTS, HIDDEN, D)).astype(self.dtype)
        expert = jnp.argmax(router(x), axis=-1)
        order = jnp.argsort(expert)
        sizes = jnp.bincount(expert, length=EXPERTS).astype(jnp.int32)
        h = jax.nn.gelu(jax.lax.ragged_dot(x[order], wi, sizes))
        y = jax.lax.ragged_dot(h, wo, sizes)
        return jnp.zeros_like(x).at[order].set(y)


class Model(nn.Module):
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(D, dtype=self.dtype, name="embed")(x)
        return x + MoE(self.dtype, name="moe")(x)


class ConvNet(nn.Module):
    """A strided patch embedding, a grouped 3x3 convolution, a depthwise one (checked along the
    batch), a linear head (NHWC)."""

    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):  # x: [batch, 8, 8, 3]
        x = nn.Conv(16, (2, 2), strides=2, dtype=self.dtype, name="patches")(x)
        x = x + nn.gelu(nn.Conv(16, (3, 3), feature_group_count=4, dtype=self.dtype, name="mix")(x))
        x = x + nn.Conv(16, (3, 3), feature_group_count=16, dtype=self.dtype, name="depthwise")(x)
        return nn.Dense(4, dtype=self.dtype, name="head")(x.mean(axis=(1, 2)))


def model_and_batch(dtype, kind="moe"):
    if kind == "moe":
        x, model = jax.random.normal(jax.random.key(1), (TOKENS, D)), Model(dtype)
    else:
        x, model = jax.random.normal(jax.random.key(1), (2, 8, 8, 3)), ConvNet(dtype)
    params = model.init(jax.random.key(0), x)
    return model, params, x.astype(dtype)


def train_step(model):
    def loss(params, x):
        return jnp.mean(model.apply(params, x).astype(jnp.float32) ** 2)

    return jax.value_and_grad(loss)


@functools.cache
def compiled_step(model_kind, dtype, config=None):
    """The model's checked training step, compiled once for every fault plan of a capacity
    (plans are data, as in a campaign), its arguments, and the plain step's result.

    Returns:
      ``(run, args, expected)``: ``run(plan, *args) -> ((loss, grads), report)``.
    """
    model, params, x = model_and_batch(dtype, model_kind)
    step = train_step(model)
    return with_plan(step, config), (params, x), jax.jit(step)(params, x)


def only(site, kind="inf", index=3, **fault):
    return FaultPlan.from_faults([Fault(site=site, kind=kind, index=index, **fault)], capacity=2)


GROUPED_SITES = [
    f"moe/{w}:ragged_dot_general{d}" for w in ("wi", "wo") for d in ("", ".grad_lhs", ".grad_rhs")
]
# The patch embedding's input gradient is of data: JAX does not compute it.
CONV_SITES = [
    "patches:conv_general_dilated",
    "patches:conv_general_dilated.grad_rhs",
    *[
        f"{layer}:conv_general_dilated{d}"
        for layer in ("mix", "depthwise")
        for d in ("", ".grad_lhs", ".grad_rhs")
    ],
]
SITES = [("moe", s) for s in GROUPED_SITES] + [("conv", s) for s in CONV_SITES]
KINDS = ["inf", "nan", "bitflip"]


@pytest.mark.parametrize(("model_kind", "names", "primitive"), [
    ("moe", GROUPED_SITES, "ragged_dot_general"), ("conv", CONV_SITES, "conv_general_dilated"),
])  # fmt: skip
def test_each_grouped_gemm_and_convolution_and_its_gradients_are_sites_checked_on_xla(
    model_kind, names, primitive
):
    model, params, x = model_and_batch(jnp.float32, model_kind)
    sites = {s.name: s for s in list_sites(train_step(model), params, x)}
    ours = {n: s for n, s in sites.items() if primitive in n}
    assert sorted(ours) == sorted(names), sorted(ours)
    assert all(s.checked and s.implementation == "xla" for s in sites.values())
    pallas = list_sites(train_step(model), params, x, config=ABFTConfig(implementation="pallas"))
    assert {s.implementation for s in pallas if primitive in s.name} == {"xla"}
    if model_kind == "moe":
        assert sites["moe/wi:ragged_dot_general.grad_rhs"].out_shape == (EXPERTS, D, HIDDEN)
        assert sites["moe/wo:ragged_dot_general.grad_lhs"].direction == "grad_lhs"
    else:
        assert sites["mix:conv_general_dilated.grad_rhs"].out_shape == (3, 3, 4, 16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model_kind", ["moe", "conv"])
def test_a_clean_step_raises_no_alarm_and_equals_the_plain_step(model_kind, dtype):
    model, params, x = model_and_batch(dtype, model_kind)
    step = train_step(model)
    out, report = jax.jit(sdcguard.checked(step))(params, x)
    np.testing.assert_array_equal(total(report), [0, 0, 0, 0])
    assert all(site in report for m, site in SITES if m == model_kind)
    jax.tree.map(lambda a, b: assert_close(a, b, dtype), out, jax.jit(step)(params, x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("model_kind", "site", "kind"), [
    (m, s, KINDS[i % len(KINDS)]) for i, (m, s) in enumerate(SITES)
])  # fmt: skip
def test_a_fault_at_a_grouped_gemm_or_convolution_is_detected_and_corrected(
    model_kind, site, kind, dtype
):
    run, args, expected = compiled_step(model_kind, dtype)
    bit = {jnp.float32: 30, jnp.bfloat16: 14, jnp.float16: 14}[dtype]
    out, report = run(only(site, kind, index=37, bit=bit), *args)
    np.testing.assert_array_equal(report[site], [1, 1, 0, 0])
    np.testing.assert_array_equal(total(report), [1, 1, 0, 0])
    jax.tree.map(lambda a, b: assert_close(a, b, dtype), out, expected)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("repair", ["cond", "while", "branch_free"])
@pytest.mark.parametrize(("model_kind", "site"), [
    ("moe", "moe/wo:ragged_dot_general.grad_rhs"), ("conv", "mix:conv_general_dilated.grad_lhs"),
])  # fmt: skip
def test_every_repair_strategy_corrects_every_kind_of_fault(model_kind, site, repair, kind):
    run, args, expected = compiled_step(model_kind, jnp.bfloat16, ABFTConfig(repair=repair))
    out, report = run(only(site, kind, bit=14), *args)
    np.testing.assert_array_equal(report[site], [1, 1, 0, 0])
    jax.tree.map(lambda a, b: assert_close(a, b, jnp.bfloat16), out, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("model_kind", "site"), [
    ("moe", "moe/wi:ragged_dot_general"), ("conv", "mix:conv_general_dilated"),
])  # fmt: skip
def test_recompute_on_detection_corrects_a_grouped_gemm_or_convolution(model_kind, site, dtype):
    run, args, expected = compiled_step(model_kind, dtype, ABFTConfig(recompute=True))
    out, report = run(only(site), *args)
    # The first computation only detects: the INF reaches the GEMMs downstream, whose checks
    # detect it too; the step computed again is clean, and every detection counts corrected.
    np.testing.assert_array_equal(report[site], [1, 1, 0, 0])
    detected, corrected, *_ = total(report)
    assert detected == corrected > 1 and np.all(total(report)[2:] == 0)
    jax.tree.map(lambda a, b: assert_close(a, b, dtype), out, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("model_kind", "site"), [
    ("moe", "moe/wi:ragged_dot_general"), ("conv", "mix:conv_general_dilated"),
])  # fmt: skip
def test_detection_only_counts_and_passes_the_output_on(model_kind, site, dtype):
    run, args, _ = compiled_step(model_kind, dtype, ABFTConfig(correct=False))
    (loss, _), report = run(only(site), *args)
    np.testing.assert_array_equal(report[site], [1, 0, 1, 0])
    assert not np.isfinite(loss)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_nonfinite_input_is_counted_as_such_and_not_corrected(dtype):
    rhs = jax.random.normal(jax.random.key(2), (3, 8, 5)).astype(dtype)
    lhs = jax.random.normal(jax.random.key(3), (10, 8)).at[4, 2].set(jnp.nan).astype(dtype)
    sizes = jnp.array([3, 3, 4], jnp.int32)
    out, report = jax.jit(sdcguard.checked(jax.lax.ragged_dot))(lhs, rhs, sizes)
    np.testing.assert_array_equal(total(report), [1, 0, 0, 1])
    assert np.isnan(out[4]).all() and np.isfinite(np.delete(np.asarray(out), 4, axis=0)).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_recomputation_that_fails_its_check_is_uncorrectable_and_left_as_it_was(
    monkeypatch, dtype
):
    # Hardware that corrupts the recomputation too: the repair must not take its rows.
    compute = primitive_checks.PrimitiveGemm.compute
    calls = []

    def corrupting_the_second(self, a, b, rest):
        out = compute(self, a, b, rest)
        calls.append(1)
        return out if len(calls) == 1 else out.at[0, 1].add(100.0)

    monkeypatch.setattr(primitive_checks.PrimitiveGemm, "compute", corrupting_the_second)
    rhs = jax.random.normal(jax.random.key(2), (3, 8, 5)).astype(dtype)
    lhs = jax.random.normal(jax.random.key(3), (10, 8)).astype(dtype)
    sizes = jnp.array([3, 3, 4], jnp.int32)
    site = "fn:ragged_dot_general"
    out, report = run_with(only(site, index=2), jax.lax.ragged_dot, lhs, rhs, sizes)
    assert len(calls) == 2
    np.testing.assert_array_equal(report[site], [1, 0, 1, 0])
    assert np.isinf(out[0, 2])  # the fault stays where it struck, and is counted


# Weight magnitudes across each dtype's range (fp16's is narrow: its outputs stay finite).
MAGNITUDES = [
    *[(d, m) for d in (jnp.float32, jnp.bfloat16) for m in (1e-20, 1.0, 1e15)],
    *[(jnp.float16, m) for m in (1e-2, 1.0, 1e2)],
]


def grouped_gemm_and_gradients(lhs, rhs, cotangent):
    sizes = jnp.array([0, 120, 1, 100, 60], jnp.int32)  # 19 rows in no group: zeros

    def loss(lhs, rhs):
        return jnp.sum(jax.lax.ragged_dot(lhs, rhs, sizes) * cotangent)

    return jax.grad(loss, (0, 1))(lhs, rhs)


def convolution_and_gradients(lhs, rhs, cotangent):
    def loss(lhs, rhs):
        out = jax.lax.conv_general_dilated(
            lhs, rhs, (2, 1), [(1, 2), (0, 1)], rhs_dilation=(1, 2), feature_group_count=2,
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
        )  # fmt: skip
        return jnp.sum(out * cotangent)

    return jax.grad(loss, (0, 1))(lhs, rhs)


def depthwise_convolution_and_gradients(lhs, rhs, cotangent):
    def loss(lhs, rhs):
        out = jax.lax.conv_general_dilated(
            lhs, rhs, (1, 1), "SAME", feature_group_count=lhs.shape[-1],
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
        )  # fmt: skip
        return jnp.sum(out * cotangent)

    return jax.grad(loss, (0, 1))(lhs, rhs)


# Shapes (lhs, rhs, output) with contractions of 256, 128 and 9 terms (the depthwise
# convolution's value and input gradient are checked along the batch, its kernel gradient
# along the kernel's features).
PRIMITIVES = {
    "ragged_dot": (grouped_gemm_and_gradients, (300, 256), (5, 256, 64), (300, 64)),
    "convolution": (convolution_and_gradients, (4, 12, 10, 32), (4, 2, 16, 32), (4, 6, 9, 32)),
    "depthwise": (depthwise_convolution_and_gradients, (6, 9, 8, 16), (3, 3, 1, 16), (6, 9, 8, 16)),
}


@pytest.mark.parametrize("primitive", PRIMITIVES)
@pytest.mark.parametrize(("dtype", "magnitude"), MAGNITUDES)
def test_no_alarm_on_clean_calls_across_magnitudes_groups_and_layouts(primitive, dtype, magnitude):
    fn, lhs_shape, rhs_shape, out_shape = PRIMITIVES[primitive]
    rhs = jax.random.normal(jax.random.key(4), rhs_shape) * magnitude
    lhs = jax.random.normal(jax.random.key(5), lhs_shape)
    cotangent = jax.random.normal(jax.random.key(6), out_shape).astype(dtype)
    a, b = lhs.astype(dtype), rhs.astype(dtype)
    out, report = jax.jit(sdcguard.checked(fn))(a, b, cotangent)
    np.testing.assert_array_equal(total(report), [0, 0, 0, 0])
    assert len(report) == 3
    jax.tree.map(lambda p, q: assert_close(p, q, dtype), out, jax.jit(fn)(a, b, cotangent))


def test_grouped_gemms_in_a_scanned_layer_stack_count_every_layer():
    w = jax.random.normal(jax.random.key(6), (3, 2, 8, 8)) / 3  # [layers, experts, d, d]
    x = jax.random.normal(jax.random.key(7), (6, 8))
    sizes = jnp.array([2, 4], jnp.int32)

    def loss(w, x):
        def layer(h, wl):
            return jnp.tanh(jax.lax.ragged_dot(h, wl, sizes)), None

        return jnp.sum(jax.lax.scan(layer, x, w)[0] ** 2)

    step = jax.grad(loss)
    sites = [s for s in list_sites(step, w, x) if "ragged" in s.name]
    assert len(sites) == 3 and all(s.iterations == 3 and s.checked for s in sites), sites
    forward = next(s.name for s in sites if s.direction == "forward")
    out, report = run_with(only(forward), step, w, x)
    np.testing.assert_array_equal(report[forward], [3, 3, 0, 0])  # in each of the 3 layers
    assert_close(out, jax.jit(step)(w, x), jnp.float32)


def test_grouped_gemms_and_convolutions_on_8_devices_in_a_subprocess():
    run_on_8_devices(__file__)


def _grouped_gemm(lhs, rhs, out_sharding=None):
    sizes = jnp.array([lhs.shape[0] // 2, lhs.shape[0] - lhs.shape[0] // 2], jnp.int32)
    if out_sharding is None:
        return jax.lax.ragged_dot(lhs, rhs, sizes)
    numbers = jax.lax.RaggedDotDimensionNumbers((([1], [1]), ([], [])), [0], [0])
    return jax.lax.ragged_dot_general(lhs, rhs, sizes, numbers, out_sharding=out_sharding)


def _convolution(lhs, rhs, out_sharding=None):
    numbers = ("NHWC", "HWIO", "NHWC")
    if out_sharding is None:
        return jax.lax.conv_general_dilated(lhs, rhs, (1, 1), "SAME", dimension_numbers=numbers)
    return jax.lax.conv_general_dilated(
        lhs, rhs, (1, 1), "SAME", dimension_numbers=numbers, out_sharding=out_sharding
    )


SHARDED = {  # the primitive, its operands' shapes (lhs sharded along its first axis)
    "ragged_dot_general": (_grouped_gemm, (64, 8), (2, 8, 4)),
    "conv_general_dilated": (_convolution, (16, 5, 5, 3), (3, 3, 3, 4)),
}


@needs_8
@pytest.mark.parametrize("primitive", SHARDED)
@pytest.mark.parametrize("how", ["jit", "jit, explicit axes", "shard_map"])
def test_grouped_gemms_and_convolutions_sharded_on_8_devices(how, primitive):
    explicit = how == "jit, explicit axes"
    axis_type = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
    mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
    P = jax.sharding.PartitionSpec
    call, lhs_shape, rhs_shape = SHARDED[primitive]
    lhs = jax.random.normal(jax.random.key(3), lhs_shape)
    rhs = jax.random.normal(jax.random.key(2), rhs_shape)
    lhs = jax.device_put(lhs, jax.sharding.NamedSharding(mesh, P("data")))
    # On explicit axes JAX asks a grouped GEMM for its output's sharding.
    out_sharding = jax.sharding.NamedSharding(mesh, P("data")) if explicit else None

    def fn(lhs, rhs):
        return call(lhs, rhs, out_sharding)

    if how == "shard_map":
        fn = jax.shard_map(fn, mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data"))
    site = next(s.name for s in list_sites(fn, lhs, rhs) if primitive in s.name)
    out, report = run_with(only(site), fn, lhs, rhs)
    expected = 8 if how == "shard_map" else 1  # a plan strikes every device's block
    np.testing.assert_array_equal(report[site], [expected, expected, 0, 0])
    np.testing.assert_allclose(out, jax.jit(fn)(lhs, rhs), rtol=1e-6, atol=1e-6)


def _equations(fn, *args, primitive):
    jaxpr = jax.make_jaxpr(fn)(*args)
    return [e for e in jaxpr.eqns if e.primitive.name == primitive]


def _lines_both_ways(eqn, rest=()):
    """The check's line sums of ``eqn`` (its fast path, if any) and the primitive's own."""
    gemm = primitive_checks.PrimitiveGemm.of(eqn)
    a = jax.random.normal(jax.random.key(8), eqn.invars[0].aval.shape)
    b = jax.random.normal(jax.random.key(9), eqn.invars[1].aval.shape)
    operands = [a, b]
    operands[gemm.summed] = gemm.line_sums(operands[gemm.summed], gemm.free)
    params = dict(
        gemm.params, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32
    )
    return gemm.lines(*operands, rest), eqn.primitive.bind(*operands, *rest, **params)


def test_a_grouped_gemms_lines_from_its_rows_by_group_equal_the_primitives():
    # Rows grouped (forward, input gradient) and contraction grouped (weight gradient), with
    # an empty group and rows in no group.
    sizes = jnp.array([3, 0, 4, 2], jnp.int32)  # 9 of 11 rows

    def loss(x, w):
        return jnp.sum(jax.lax.ragged_dot(x, w, sizes) ** 2)

    x, w = jnp.ones((11, 6)), jnp.ones((4, 6, 5))
    eqns = _equations(jax.grad(loss, (0, 1)), x, w, primitive="ragged_dot_general")
    assert len(eqns) == 3
    for eqn in eqns:
        fast, primitive = _lines_both_ways(eqn, (sizes,))
        assert fast.shape == primitive.shape
        np.testing.assert_allclose(fast, primitive, rtol=1e-5, atol=1e-5)


def test_a_grouped_convolutions_lines_computed_ungrouped_equal_the_primitives():
    # Feature groups (forward, input gradient) and batch groups (the kernel's gradient).
    def loss(x, w):
        out = jax.lax.conv_general_dilated(x, w, (2, 1), "SAME", feature_group_count=4)
        return jnp.sum(out**2)

    x, w = jnp.ones((3, 8, 7, 6)), jnp.ones((12, 2, 3, 2))
    eqns = _equations(jax.grad(loss, (0, 1)), x, w, primitive="conv_general_dilated")
    counts = sorted((e.params["feature_group_count"], e.params["batch_group_count"]) for e in eqns)
    assert counts == [(1, 4), (4, 1), (4, 1)]
    for eqn in eqns:
        ungrouped, primitive = _lines_both_ways(eqn)
        np.testing.assert_allclose(ungrouped, primitive, rtol=1e-5, atol=1e-5)


def test_a_convolution_is_checked_along_its_batch_where_that_is_the_longer_line():
    # A depthwise convolution (one output feature per group) of a batch of 6: its value and
    # input gradient are checked along the batch; its kernel gradient, batch-grouped, along
    # the kernel's features. An ordinary convolution of 32 features keeps its feature lines.
    fn, lhs_shape, rhs_shape, out_shape = PRIMITIVES["depthwise"]
    args = [jnp.ones(shape) for shape in (lhs_shape, rhs_shape, out_shape)]
    eqns = _equations(fn, *args, primitive="conv_general_dilated")
    summed = {e.params["batch_group_count"] > 1: PrimitiveGemm.of(e).summed for e in eqns}
    assert len(eqns) == 3 and summed == {False: 0, True: 1}, summed
    fn, *shapes = PRIMITIVES["convolution"]
    eqns = _equations(fn, *[jnp.ones(shape) for shape in shapes], primitive="conv_general_dilated")
    assert [PrimitiveGemm.of(e).summed for e in eqns] == [1, 1, 1]
    for eqn in eqns:
        lines, primitive = _lines_both_ways(eqn)
        np.testing.assert_allclose(lines, primitive, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_grouped_gemm_with_batch_axes_is_checked_and_corrected_by_the_primitive(dtype):
    # A mode the row-by-group path does not cover: the check calls the primitive itself.
    sizes = jnp.array([[4, 6], [5, 5], [1, 9]], jnp.int32)
    numbers = jax.lax.RaggedDotDimensionNumbers((([2], [2]), ([0], [0])), [1], [1])

    def loss(lhs, rhs):
        return jnp.sum(jnp.sin(jax.lax.ragged_dot_general(lhs, rhs, sizes, numbers)))

    step = jax.grad(loss, (0, 1))
    lhs = jax.random.normal(jax.random.key(0), (3, 10, 8)).astype(dtype)
    rhs = jax.random.normal(jax.random.key(1), (3, 2, 8, 5)).astype(dtype)
    sites = [s.name for s in list_sites(step, lhs, rhs)]
    assert len(sites) == 3
    expected, run = jax.jit(step)(lhs, rhs), with_plan(step)
    for site in sites:
        out, report = run(only(site, "nan", index=11), lhs, rhs)
        np.testing.assert_array_equal(report[site], [1, 1, 0, 0])
        jax.tree.map(lambda p, q: assert_close(p, q, dtype), out, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_in_no_group_are_read_by_nothing_not_even_their_nans(dtype):
    # Padded tokens (NaN hidden states, say) sorted last and left out of the group sizes: the
    # grouped GEMM never reads them, and neither does its check (no alarm, no nonfinite input).
    sizes = jnp.array([3, 4], jnp.int32)  # 7 of 10 rows
    x = jax.random.normal(jax.random.key(0), (10, 8)).at[7:].set(jnp.nan).astype(dtype)
    w = jax.random.normal(jax.random.key(1), (2, 8, 5)).astype(dtype)

    def loss(w, x):
        y = jax.lax.ragged_dot(x, w, sizes)
        return jnp.sum(y[:7].astype(jnp.float32) ** 2)

    step = jax.value_and_grad(loss)
    out, report = jax.jit(sdcguard.checked(step))(w, x)
    np.testing.assert_array_equal(total(report), [0, 0, 0, 0])
    assert len(report) == 2  # the forward GEMM and the weight gradient
    jax.tree.map(lambda p, q: assert_close(p, q, dtype), out, jax.jit(step)(w, x))


@pytest.mark.parametrize("axes", [(0,), (0, 1), (1,), (3,)])
def test_line_sums_along_leading_axes_as_a_product_equal_the_sum(axes):
    # On XLA:CPU a sum along leading axes runs as a product with ones; elsewhere jnp.sum.
    x = jax.random.normal(jax.random.key(10), (6, 5, 4, 3)) * 1e3
    fast = jax.jit(lambda x: primitive_checks._sum_kept(x, axes))(x)
    np.testing.assert_allclose(fast, jnp.sum(x, axis=axes, keepdims=True), rtol=1e-6, atol=1e-3)
