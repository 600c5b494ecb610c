"""Module-output sites (``path:output``): injection, straight-through gradient, discovery, errors;
and the hit log of a training step's output fault."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdcguard.fault_model import Fault, FaultPlan, HitLog, faults, module_outputs, output_sites
from sdcguard.training import TrainConfig, make_train_step, model_output_sites


class Net(nn.Module):
    """x -> a (Dense) -> relu -> b (Dense); the loss is linear in b's output."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(8, name="a")(x)
        return nn.Dense(3, name="b")(nn.relu(h))


X = jnp.linspace(-1.0, 1.0, 4 * 5).reshape(4, 5)
PARAMS = Net().init(jax.random.key(0), X)["params"]
INDEX = 13  # element (1, 5) of a's [4, 8] output


def _run(plan, armed):
    """Outputs of a and b, and the gradient of sum(b) with respect to the parameters."""

    def loss(params, plan):
        seen = {}

        def tap(next_fun, args, kwargs, context):
            out = next_fun(*args, **kwargs)
            seen[context.module.name] = out
            return out

        # `tap` is entered first, so it sees each output after the injection.
        with nn.intercept_methods(tap), faults(plan), module_outputs(armed):
            y = Net().apply({"params": params}, X)
        return y.sum(), (seen["a"], y)

    return jax.jit(jax.value_and_grad(loss, has_aux=True))(PARAMS, plan)


def test_output_fault_changes_exactly_that_element_and_grad_is_straight_through():
    plan = FaultPlan.from_faults([Fault(site="a:output", kind="value", value=50.0, index=INDEX)])
    (_, (a_clean, y_clean)), g_clean = _run(FaultPlan.from_faults([], capacity=1), {"a:output"})
    (_, (a_bad, y_bad)), g_bad = _run(plan, {"a:output"})
    changed = np.argwhere(np.asarray(a_bad != a_clean).reshape(-1)).ravel()
    assert changed.tolist() == [INDEX] and float(a_bad.reshape(-1)[INDEX]) == 50.0
    # Downstream: only the row of the corrupted element changes in b's output.
    assert np.asarray(y_bad != y_clean).any(axis=1).tolist() == [False, True, False, False]
    # Straight through: a's parameters get the clean gradient (the loss is linear after a);
    # b's kernel sees the corrupted activation, as the faulty chip's backward pass would.
    np.testing.assert_array_equal(g_bad["a"]["kernel"], g_clean["a"]["kernel"])
    np.testing.assert_array_equal(g_bad["a"]["bias"], g_clean["a"]["bias"])
    assert not np.array_equal(g_bad["b"]["kernel"], g_clean["b"]["kernel"])
    # The same plan with the site not armed does nothing.
    (_, (a_off, _)), _ = _run(plan, {"b:output"})
    np.testing.assert_array_equal(a_off, a_clean)


def test_unarmed_module_outputs_compile_to_nothing():
    plan = FaultPlan.from_faults([Fault(site="a:output", kind="nan")])

    def fwd(plan, armed):
        with faults(plan), module_outputs(armed):
            return Net().apply({"params": PARAMS}, X)

    plain = str(jax.make_jaxpr(lambda p: Net().apply({"params": PARAMS}, X))(plan))
    assert str(jax.make_jaxpr(lambda p: fwd(p, ()))(plan)) == plain
    assert str(jax.make_jaxpr(lambda p: fwd(p, {"a:output"}))(plan)) != plain


def test_output_site_discovery_and_errors():
    sites = output_sites(lambda: Net().init(jax.random.key(0), X))
    assert sites == {"a:output": (4, 8), "b:output": (4, 3), "model:output": (4, 3)}
    unknown = r"unknown module-output sites \['c:output'\](.|\n)*b:output"
    with pytest.raises(ValueError, match=unknown), module_outputs({"c:output"}):
        jax.eval_shape(lambda: Net().apply({"params": PARAMS}, X))
    with (
        pytest.raises(ValueError, match="forward faults only"),
        module_outputs({"a:output.grad_lhs"}),
    ):
        pass
    with pytest.raises(ValueError, match=r"armed by sdcguard\.linen\.protect"):
        module_outputs({"a:scores"}).__enter__()


def test_train_step_output_sites_and_hit_log():
    from sdcguard.models import ByteBatches, GPTConfig

    tiny = GPTConfig(num_layers=1, d_model=16, num_heads=2, seq_len=8)
    names = model_output_sites(TrainConfig(model=tiny))
    assert {"decoder/block_0/mlp:output", "decoder/block_0:output", "model:output"} <= set(names)
    assert "decoder/block_0/ln_mlp:output" in names
    # A site name is checked against the model when the step is built (the configuration does
    # not build the model); the error lists the close names.
    misspelt = TrainConfig(model=tiny, output_sites=("decoder/block_0/ln_1:output",))
    with pytest.raises(ValueError, match=r"unknown module-output sites(.|\n)*ln_mlp:output"):
        make_train_step(misspelt)
    site = "decoder/block_0/mlp:output"
    log = HitLog()
    state, step = make_train_step(
        TrainConfig(model=tiny, batch_size=1, abft=None, output_sites=(site,)), hit_log=log
    )
    batch = jnp.asarray(ByteBatches(batch_size=1, seq_len=8).batch(0))
    plan = FaultPlan.from_faults([Fault(site=site, kind="bitflip", bit=30, index=5, step=1)])
    losses = []
    for _ in range(2):
        state, out = step(state, batch, plan)
        losses.append(float(out.loss))
    (hit,) = log.take()
    assert (hit.site, hit.index, hit.step) == (site, 5, 1)
    old = np.float32(hit.old)
    flipped = (old.view(np.uint32) ^ np.uint32(1 << 30)).view(np.float32)
    assert hit.new == float(flipped) or (np.isnan(hit.new) and np.isnan(flipped))
    assert np.isfinite(losses[0]) and log.take() == []
