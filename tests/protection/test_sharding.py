"""Checks that stay on the device that holds the data, under ``jit`` with ``NamedSharding``.

With automatic axes (XLA's propagation) and explicit axes (sharding in the types), a checked GEMM
runs on the blocks each device holds (``sdcguard.protection._sharding``): the compiled step gains at
most one collective (the reduction of the counters), the loss is the unsharded run's, and a fault
hits, and is corrected on, the one device that computes the element. The tests run with 8 CPU
devices in a subprocess (``multidevice.py``); ``scripts/bench_sharding.py`` covers the larger grid
(meshes 8x1 and 4x2, shard_map and pmap, a 2-layer LM).
"""

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sdcguard
from sdcguard import linen as sl
from sdcguard.fault_model import Fault, FaultPlan
from sdcguard.protection import ABFTConfig, _sharding as sharding, total

from tests.helpers.multidevice import needs_8, run_on_8_devices
from tests.helpers.tolerances import assert_close

COLLECTIVE = re.compile(
    r"[\]})] (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(-start)?\("
)
AXES = ("data", "model")


def compiled(fn, *args):
    """``(the compiled jit of fn, its collectives)``: one compilation for both."""
    exe = jax.jit(fn).lower(*args).compile()
    return exe, len(COLLECTIVE.findall(exe.as_text()))


def one_inf(site):
    return FaultPlan.from_faults([Fault(site=site, kind="inf", index=3)], capacity=2)


@functools.cache
def _with_plan(fn):
    """``fn`` jitted with a fault plan as its first argument: one compilation for every plan
    of a capacity (and mesh)."""

    @jax.jit
    def go(plan, *args):
        with sdcguard.faults(plan):
            return fn(*args)

    return go


def run_with(plan, fn, *args):
    return _with_plan(fn)(plan, *args)


def assert_trees_close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert_close(x, y, jnp.float32)


def test_sharding_in_a_subprocess_with_8_cpu_devices():
    run_on_8_devices(__file__)


def test_unsharded_values_are_checked_as_they_are():
    # One device, or nothing sharded: no mesh, and the check sees the whole GEMM.
    assert sharding.device_mesh(jnp.ones((4, 4)), jnp.ones((4, 4))) is None


# --- sdcguard.checked on a model-parallel MLP -----------------------------------------------------


def mlp_loss(params, x, y, outs=(None, None, None)):
    for w, out in zip(params, outs, strict=True):
        x = jnp.tanh(x @ w if out is None else jnp.matmul(x, w, out_sharding=out))
    return jnp.mean((x - y) ** 2)


def mlp_step(params, x, y, outs=(None, None, None)):
    loss, grads = jax.value_and_grad(mlp_loss)(params, x, y, outs)
    return [p - 0.1 * g for p, g in zip(params, grads, strict=True)], loss


def mlp_problem():
    keys = jax.random.split(jax.random.key(0), 5)
    params = [jax.random.normal(k, (32, 32)) / np.sqrt(32) for k in keys[:3]]
    return params, jax.random.normal(keys[3], (16, 32)), jax.random.normal(keys[4], (16, 32))


@needs_8
@pytest.mark.parametrize("kind", ["auto", pytest.param("explicit", marks=pytest.mark.slow)])
def test_checked_mlp_under_jit_on_8_devices(kind):
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    axis_type = AxisType.Auto if kind == "auto" else AxisType.Explicit
    mesh = jax.make_mesh((4, 2), AXES, axis_types=(axis_type,) * 2)
    params, x, y = mlp_problem()
    expected = jax.jit(mlp_step)(params, x, y)
    # Column-, row-, column-parallel weights: the middle GEMM's contraction is sharded.
    specs = [P(None, "model"), P("model", None), P(None, "model")]
    params = [jax.device_put(w, NamedSharding(mesh, s)) for w, s in zip(params, specs, strict=True)]
    x, y = jax.device_put((x, y), NamedSharding(mesh, P("data")))
    outs = (None, None, None)
    if kind == "explicit":  # a sharded contraction needs its output sharding stated
        outs = tuple(
            NamedSharding(mesh, s) for s in (P("data", "model"), P("data", None), P("data", None))
        )

    def step(params, x, y):
        return mlp_step(params, x, y, outs)

    checked = sdcguard.checked(step)
    with jax.set_mesh(mesh):
        _, plain_n = compiled(step, params, x, y)
        run_checked, checked_n = compiled(checked, params, x, y)
        assert checked_n - plain_n <= 1, (plain_n, checked_n)
        (new, loss), report = run_checked(params, x, y)
        assert_close(loss, expected[1], jnp.float32)
        assert_trees_close(new, expected[0])
        np.testing.assert_array_equal(total(report), [0, 0, 0, 0])
        # The row-parallel layer's forward GEMM (its contraction is sharded: each device's
        # partial product is checked before the sum), or the last layer's weight gradient
        # (contracted over the batch, sharded over "data"). One device's partial holds the INF;
        # it is found and corrected there, and counted once.
        suffix = {"auto": ":dot_general_1", "explicit": ":dot_general_2.grad_rhs"}[kind]
        site = next(s for s in report if s.endswith(suffix))
        (f_new, f_loss), f_report = run_with(one_inf(site), checked, params, x, y)
        np.testing.assert_array_equal(f_report[site], [1, 1, 0, 0])
        np.testing.assert_array_equal(total(f_report), [1, 1, 0, 0])
        assert_close(f_loss, loss, jnp.float32)
        assert_trees_close(f_new, new)


# --- The linen drop-ins on a small transformer LM ------------------------------------------------


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + nn.SelfAttention(num_heads=2, deterministic=True, name="attn")(x, mask)
        kernel = nn.with_logical_partitioning(nn.initializers.xavier_uniform(), ("embed", "mlp"))
        h = nn.gelu(nn.Dense(32, kernel_init=kernel, name="wi")(nn.LayerNorm()(x)))
        kernel = nn.with_logical_partitioning(nn.initializers.xavier_uniform(), ("mlp", "embed"))
        return x + nn.Dense(x.shape[-1], kernel_init=kernel, name="wo")(h)


class TinyLM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(16, 16, name="embed")(tokens)
        return nn.Dense(16, name="head")(Block(name="block_0")(x))


def lm_step(params, sinks, tokens, protect, config=None):
    def loss_fn(p, s):
        variables = {"params": p, "sdc_grad": s} if protect else {"params": p}
        logits, state = TinyLM().apply(variables, tokens[:, :-1], mutable=["sdc"])
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)), state

    if protect:
        with sl.protect(config):
            (loss, state), (grads, sink_grads) = jax.value_and_grad(loss_fn, (0, 1), has_aux=True)(
                params, sinks
            )
        counts = sl.total_counts(state["sdc"], sink_grads)
    else:
        (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, sinks)
        counts = jnp.zeros((4,), jnp.int32)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss, counts


def lm_setup():
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((4, 2), AXES, axis_types=(AxisType.Auto,) * 2)
    tokens = jax.random.randint(jax.random.key(0), (8, 9), 0, 16)
    boxed = TinyLM().init(jax.random.key(1), tokens[:, :-1])
    params = nn.unbox(boxed)["params"]
    with sl.protect():
        sinks = sl.init_sinks(TinyLM(), tokens[:, :-1])
    expected = jax.jit(lm_step, static_argnums=3)(params, sinks, tokens, False)
    # The MLP kernels are sharded over "model" (logical axis rules), the batch over "data".
    specs = nn.logical_to_mesh(nn.get_partition_spec(boxed)["params"], (("mlp", "model"),))
    sharded = jax.tree.map(
        lambda p, s: jax.device_put(p, NamedSharding(mesh, s)),
        params,
        specs,
        is_leaf=lambda s: isinstance(s, P),
    )
    tokens = jax.device_put(tokens, NamedSharding(mesh, P("data")))
    return mesh, params, sharded, sinks, tokens, expected


@needs_8
def test_linen_dropins_under_jit_on_8_devices():
    _, _, params, sinks, tokens, expected = lm_setup()
    _, plain_n = compiled(lambda *a: lm_step(*a, False), params, sinks, tokens)
    protected, protected_n = compiled(lambda *a: lm_step(*a, True), params, sinks, tokens)
    assert protected_n - plain_n <= 1, (plain_n, protected_n)
    new, loss, counts = protected(params, sinks, tokens)
    assert_close(loss, expected[1], jnp.float32)
    np.testing.assert_array_equal(counts, [0, 0, 0, 0])
    # An INF in the value projection, on the device that computes that element.
    f_new, f_loss, f_counts = run_with(
        one_inf("block_0/attn:value"), lambda *a: lm_step(*a, True), params, sinks, tokens
    )
    np.testing.assert_array_equal(f_counts, [1, 1, 0, 0])
    assert_close(f_loss, loss, jnp.float32)
    assert_trees_close(f_new, new)


@needs_8
@pytest.mark.slow
def test_linen_dropins_under_shard_map_with_check_vma_on_8_devices():
    from jax.sharding import PartitionSpec as P

    mesh, params, _, sinks, tokens, expected = lm_setup()

    # shard_map with its default check_vma=True: each device checks its own batch shard. (A
    # replicated weight's gradient is the devices' sum there, in the plain step as well.)
    def dp_step(params, sinks, tokens, protect):
        new, loss, _ = lm_step(params, sinks, tokens, protect)
        return jax.lax.pmean((new, loss), AXES)

    def mapped(protect):
        return jax.jit(
            jax.shard_map(
                functools.partial(dp_step, protect=protect),
                mesh=mesh,
                in_specs=(P(), P(), P(AXES)),
                out_specs=P(),
            )
        )

    new, loss = mapped(True)(params, sinks, tokens)
    plain_new, plain_loss = mapped(False)(params, sinks, tokens)
    assert_close(loss, expected[1], jnp.float32)
    assert_close(loss, plain_loss, jnp.float32)
    assert_trees_close(new, plain_new)


def block_step(params, sinks, x, config):
    """One SGD step of a transformer block on a regression loss, its attention protected."""

    def loss_fn(p, s):
        y, state = Block().apply({"params": p, "sdc_grad": s}, x, mutable=["sdc"])
        return jnp.mean(y**2), state

    with sl.protect(config):
        (loss, state), (grads, sink_grads) = jax.value_and_grad(loss_fn, (0, 1), has_aux=True)(
            params, sinks
        )
    new = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    return new, loss, sl.total_counts(state["sdc"], sink_grads)


@needs_8
@pytest.mark.parametrize("config", [ABFTConfig(), ABFTConfig(sites=())], ids=["checked", "off"])
def test_linen_dropins_on_explicit_axes_on_8_devices(config):
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    # jax.make_mesh's default: sharding in the types. Data parallel: each weight's gradient
    # contracts over the sharded batch, a GEMM whose output sharding JAX cannot infer unless
    # told (as its own transpose rule is), with the checks on or off.
    x = jax.random.normal(jax.random.key(0), (8, 8, 16))
    params = nn.unbox(Block().init(jax.random.key(1), x))["params"]
    with sl.protect():
        sinks = sl.init_sinks(Block(), x)
    step = functools.partial(block_step, config=config)
    expected = jax.jit(step)(params, sinks, x)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(mesh):
        params, sinks = jax.device_put((params, sinks), NamedSharding(mesh, P()))
        x = jax.device_put(x, NamedSharding(mesh, P("data")))
        new, loss, counts = jax.jit(step)(params, sinks, x)
        assert_close(loss, expected[1], jnp.float32)
        assert_trees_close(new, expected[0])
        np.testing.assert_array_equal(counts, [0, 0, 0, 0])
        # A fault lands on the device that holds its element: a GEMM output (corrected when
        # checked) and the softmax output (repaired by the softmax check).
        for site in ("attn:value", "attn:probs"):
            f_new, f_loss, f_counts = run_with(one_inf(site), step, params, sinks, x)
            if config.sites == ():
                assert not np.isfinite(f_loss), site
            else:
                np.testing.assert_array_equal(f_counts, [1, 1, 0, 0], err_msg=site)
                assert_close(f_loss, loss, jnp.float32)
                assert_trees_close(f_new, new)
