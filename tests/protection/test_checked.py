"""``sdcguard.checked``: every GEMM of a whole training step, whatever wrote the model.

Each model is trained for one step by its own plain step function; the same function under
``checked`` must give the same loss and parameters (clean), and an INF injected at an MLP
forward GEMM, an MLP backward GEMM and an attention GEMM must be detected and corrected.
"""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import sdcguard
from sdcguard.fault_model import Fault, FaultPlan, restrict_sites
from sdcguard.protection import list_sites, total

from tests.helpers.tolerances import assert_close

# Parity of a checked step with the plain one. The checked GEMM is the same dot_general on the
# same operands, but its output passes a repair loop, which XLA may not fuse across: float32
# round-off of the fused neighbours (a few ulps of the step's values), nothing more.
PARITY_RTOL, PARITY_ATOL = 1e-5, 1e-6


# Arrays are traced, everything else (an Equinox module's static fields) is static.
jit = eqx.filter_jit


def assert_tree_close(a, b):
    a, b = eqx.filter((a, b), eqx.is_array)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=PARITY_RTOL, atol=PARITY_ATOL)


# --- A linen LM written the way Flax's examples write one -------------------------------------


class MlpBlock(nn.Module):
    mlp_dim: int

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        kernel = nn.with_logical_partitioning(nn.initializers.xavier_uniform(), ("embed", "mlp"))
        h = nn.Dense(self.mlp_dim, kernel_init=kernel, name="wi")(x)
        h = nn.gelu(h)
        kernel = nn.with_logical_partitioning(nn.initializers.xavier_uniform(), ("mlp", "embed"))
        return nn.Dense(d, kernel_init=kernel, name="wo")(h)


class EncoderDecoderBlock(nn.Module):
    heads: int
    mlp_dim: int

    @nn.compact
    def __call__(self, x):
        y = nn.LayerNorm()(x)
        y = nn.SelfAttention(num_heads=self.heads, deterministic=True, name="attn")(
            y, mask=nn.make_causal_mask(jnp.ones(x.shape[:2]))
        )
        x = x + y
        return x + MlpBlock(self.mlp_dim, name="mlp")(nn.LayerNorm()(x))


class TransformerLM(nn.Module):
    vocab: int = 32
    d: int = 16
    heads: int = 2
    mlp_dim: int = 32
    layers: int = 2

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.d, name="embed")(tokens)
        for i in range(self.layers):
            x = EncoderDecoderBlock(self.heads, self.mlp_dim, name=f"block_{i}")(x)
        x = nn.LayerNorm()(x)
        return nn.DenseGeneral(self.vocab, name="head")(x)


def linen_case():
    model = TransformerLM()
    tokens = jax.random.randint(jax.random.key(0), (2, 9), 0, 32)
    params = nn.unbox(model.init(jax.random.key(1), tokens[:, :-1]))["params"]
    # SGD: Adam's first step moves every parameter by about lr·sign(g), which turns the
    # round-off noise of gradients that are exactly zero in theory (the key bias under a
    # softmax) into lr-sized differences between two equally valid runs.
    tx = optax.sgd(0.1)

    def step(params, opt_state, tokens):
        def loss_fn(p):
            logits = model.apply({"params": p}, tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    args = (params, tx.init(params), tokens)
    sites = {
        "mlp_forward": "block_0/mlp/wi:dot_general",
        "mlp_backward": "block_1/mlp/wo:dot_general.grad_lhs",
        "attention": "block_0/attn:scores",
    }
    return step, args, sites


# --- An Equinox transformer built from equinox.nn ---------------------------------------------


class EqxBlock(eqx.Module):
    attn: eqx.nn.MultiheadAttention
    mlp_in: eqx.nn.Linear
    mlp_out: eqx.nn.Linear
    norm: eqx.nn.LayerNorm

    def __init__(self, d, heads, mlp_dim, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.attn = eqx.nn.MultiheadAttention(heads, d, key=k1)
        self.mlp_in = eqx.nn.Linear(d, mlp_dim, key=k2)
        self.mlp_out = eqx.nn.Linear(mlp_dim, d, key=k3)
        self.norm = eqx.nn.LayerNorm(d)

    def __call__(self, x):
        y = jax.vmap(self.norm)(x)
        x = x + self.attn(y, y, y)
        h = jax.vmap(self.mlp_in)(jax.vmap(self.norm)(x))
        return x + jax.vmap(self.mlp_out)(jax.nn.relu(h))


class EqxLM(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: list
    head: eqx.nn.Linear

    def __init__(self, key, vocab=32, d=16, heads=2, mlp_dim=32, layers=2):
        keys = jax.random.split(key, layers + 2)
        self.embed = eqx.nn.Embedding(vocab, d, key=keys[0])
        self.blocks = [EqxBlock(d, heads, mlp_dim, k) for k in keys[1:-1]]
        self.head = eqx.nn.Linear(d, vocab, key=keys[-1])

    def __call__(self, tokens):
        x = jax.vmap(self.embed)(tokens)
        for block in self.blocks:
            x = block(x)
        return jax.vmap(self.head)(x)


def equinox_case():
    model = EqxLM(jax.random.key(2))
    tokens = jax.random.randint(jax.random.key(3), (2, 9), 0, 32)

    def step(model, tokens):
        def loss_fn(m):
            logits = jax.vmap(m)(tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
        return eqx.apply_updates(model, jax.tree.map(lambda g: -0.1 * g, grads)), loss

    sites = {
        "mlp_forward": "blocks[0].mlp_in:dot_general",
        "mlp_backward": "blocks[1].mlp_in:dot_general.grad_rhs",
        "attention": "blocks[0].attn:context",
    }
    return step, (model, tokens), sites


# --- The reference models and a plain-JAX function --------------------------------------------


def reference_case(kind):
    from sdcguard import training
    from sdcguard.models import GPTConfig, init_params

    config = training.TrainConfig(
        model=GPTConfig(seq_len=8, num_layers=2, num_heads=2, d_model=16),
        model_kind=kind,
        batch_size=2,
        abft=None,
    )
    model = training.build_model(config)
    objective = training.objective(config)
    params = init_params(model, seed=0)
    batch = jax.random.randint(jax.random.key(5), (2, 9), 0, 256)
    tx = optax.sgd(0.1)  # see linen_case

    def step(params, opt_state, batch):
        def loss_fn(p):
            return objective(lambda t: model.apply({"params": p}, t), batch, 0)

        value, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    stack = training.STACK_NAMES[kind]
    args = (params, tx.init(params), batch)
    sites = {
        "mlp_forward": f"{stack}/block_0/mlp/fc_in:dot_general",
        "mlp_backward": f"{stack}/block_0/mlp/fc_out:dot_general.grad_lhs",
        "attention": f"{stack}/block_1/attn:scores",
    }
    return step, args, sites


def plain_case():
    def mlp(params, x):
        for w in params:
            x = jnp.tanh(x @ w)
        return x

    def step(params, x, y):
        def loss_fn(p):
            return jnp.mean((mlp(p, x) - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        return [p - 0.1 * g for p, g in zip(params, grads, strict=True)], loss

    keys = jax.random.split(jax.random.key(4), 4)
    params = [jax.random.normal(k, (8, 8)) / 3 for k in keys[:2]]
    x, y = jax.random.normal(keys[2], (4, 8)), jax.random.normal(keys[3], (4, 8))
    sites = {
        "mlp_forward": "loss_fn/mlp:dot_general",
        "mlp_backward": "loss_fn/mlp:dot_general.grad_rhs",
        # No attention here: a third site, the second layer's input gradient (the first layer's
        # input is data, so it has no .grad_lhs).
        "attention": "loss_fn/mlp:dot_general_1.grad_lhs",
    }
    return step, (params, x, y), sites


CASES = {
    "linen": linen_case,
    "equinox": equinox_case,
    "gpt": functools.partial(reference_case, "gpt"),
    "encoder": functools.partial(reference_case, "encoder"),
    "plain": plain_case,
}


class Case(NamedTuple):
    step: Callable
    args: tuple
    sites: dict[str, str]
    expected: Any  # the plain step's outputs
    faulty: Callable  # (plan, *args) -> checked step's (outputs, report), compiled once


# The reference GPT's whole step under `checked` is also in the default run, in
# tests/test_every_gemm.py (clean parity, an INF at each site class); here it runs with -m slow.
SLOW_CASES = {"gpt"}


# The encoder's faults run in the default run as a campaign (tests/campaign/test_models.py:
# scores, a backward projection and an MLP output, bf16); its three whole-step INFs here run
# with -m slow, its clean parity in the default run. The Equinox model's three INFs (the same
# model, the same three site classes) run in the default run in tests/protection/test_gemm.py's
# users' models; here with -m slow.
SLOW_FAULT_CASES = SLOW_CASES | {"encoder", "equinox"}


def _marked(names):
    return [pytest.param(n, marks=pytest.mark.slow) if n in names else n for n in CASES]


@functools.cache
def _case(name: str) -> Case:
    step, args, sites = CASES[name]()

    # One compilation serves every fault plan of a capacity: the sites below share it, and
    # injection code is compiled at those sites alone.
    @jit
    def faulty(plan, *args):
        with sdcguard.faults(plan), restrict_sites(set(sites.values())):
            return sdcguard.checked(step)(*args)

    return Case(step, args, sites, jit(step)(*args), faulty)


@pytest.fixture(scope="module", params=_marked(SLOW_CASES))
def case(request):
    return _case(request.param)


def test_clean_step_matches_the_plain_step_and_reports_every_gemm(case):
    out, report = jit(sdcguard.checked(case.step))(*case.args)
    assert_tree_close(out, case.expected)
    names = {s.name for s in list_sites(case.step, *case.args) if s.checked}
    assert set(report) == names
    assert any(".grad_lhs" in n for n in names) and any(".grad_rhs" in n for n in names)
    np.testing.assert_array_equal(total(report), [0, 0, 0, 0])


@pytest.mark.parametrize("where", ["mlp_forward", "mlp_backward", "attention"])
@pytest.mark.parametrize("name", _marked(SLOW_FAULT_CASES))
def test_inf_at_a_site_is_corrected(name, where):
    case = _case(name)
    site = case.sites[where]
    plan = FaultPlan.from_faults([Fault(site=site, kind="inf", index=5)], capacity=2)
    out, report = case.faulty(plan, *case.args)
    np.testing.assert_array_equal(report[site], [1, 1, 0, 0])
    np.testing.assert_array_equal(total(report), [1, 1, 0, 0])
    assert_tree_close(out, case.expected)


# --- Drop-in attention layers inside a checked step ---------------------------------------------


class _DropInBlock(nn.Module):
    """Drop-in attention (checks its own GEMMs) and a plain MLP (left to ``checked``)."""

    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        from sdcguard.protection import linen as protected

        x = x + protected.MultiHeadDotProductAttention(num_heads=2, dtype=self.dtype, name="attn")(
            x
        )
        h = nn.gelu(nn.Dense(16, dtype=self.dtype, name="mlp_in")(x))
        return nn.Dense(x.shape[-1], dtype=self.dtype, name="mlp_out")(h)


def _drop_in_step(dtype):
    model = _DropInBlock(dtype)
    x = jax.random.normal(jax.random.key(1), (2, 8, 16)).astype(dtype)
    params = jax.jit(model.init)(jax.random.key(0), x)["params"]  # one compile, not op by op

    def step(params, x):
        def loss(params):
            out, state = model.apply({"params": params}, x, mutable=["sdc"])
            return jnp.sum(out.astype(jnp.float32) ** 2), state["sdc"]

        (value, sdc), grads = jax.value_and_grad(loss, has_aux=True)(params)
        return value, grads, sdc

    return step, (params, x)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_a_step_with_drop_in_layers_is_checked_whole_and_injected_once(dtype):
    from sdcguard.protection import linen as protected

    step, args = _drop_in_step(dtype)
    checked = {s.name for s in list_sites(step, *args) if s.checked}
    # The MLP's six GEMMs and the layer's own, so that checked's report, which the guard
    # reads, covers every GEMM of the step.
    assert len([n for n in checked if "mlp_" in n]) == 6, checked
    # A fault at the layer's site is the layer's to inject and correct, once, even where
    # checked names the layer's GEMM the same (in bf16 and fp16: attn:scores); one at the MLP
    # is checked's.
    layer_sites = protected.site_counts(  # the layer's own sites, from shapes alone
        jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), jax.eval_shape(step, *args)[2])
    )
    scores = next(n for n in layer_sites if n.endswith(":scores"))
    mlp = next(n for n in checked if n.endswith("mlp_in:dot_general"))

    @jax.jit
    def faulty(plan, *args):
        # Injection code at the two sites faulted alone: one compilation, clean runs included.
        with sdcguard.faults(plan), restrict_sites({scores, mlp}):
            return sdcguard.checked(step)(*args)

    clean, report = faulty(FaultPlan.from_faults([], capacity=2), *args)
    assert set(report) == checked
    np.testing.assert_array_equal(total(report), [0, 0, 0, 0])
    np.testing.assert_array_equal(protected.total_counts(clean[2]), [0, 0, 0, 0])
    assert set(protected.site_counts(clean[2])) == set(layer_sites)

    assert (scores in checked) == (dtype != jnp.float32)  # the names collide in bf16 and fp16
    for site, layer_counts, checked_counts in (
        (scores, [1, 1, 0, 0], [0, 0, 0, 0]),
        (mlp, [0, 0, 0, 0], [1, 1, 0, 0]),
    ):
        plan = FaultPlan.from_faults([Fault(site=site, kind="inf", index=5)], capacity=2)
        out, report = faulty(plan, *args)
        np.testing.assert_array_equal(protected.total_counts(out[2]), layer_counts)
        np.testing.assert_array_equal(total(report), checked_counts)
        # Against the clean checked step: a corrected element is the clean one to the GEMM's
        # rounding (the plain step may already differ by an ulp: docs/protection.md, "Bit for
        # bit").
        for x, y in zip(jax.tree.leaves(out[:2]), jax.tree.leaves(clean[:2]), strict=True):
            assert_close(x, y, dtype)


# --- An NNX step that updates its module and optimizer in place -------------------------------


class NnxMlp(nnx.Module):
    def __init__(self, dtype, rngs):
        self.fc1 = nnx.Linear(8, 16, dtype=dtype, rngs=rngs)
        self.fc2 = nnx.Linear(16, 4, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.fc2(jnp.tanh(self.fc1(x)))


def nnx_train_step(model, optimizer, x, y):
    """The NNX tutorial's step: updates ``model`` and ``optimizer`` in place, returns the loss."""

    def loss_fn(model):
        return jnp.mean((model(x).astype(jnp.float32) - y) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def nnx_case(dtype):
    model = NnxMlp(dtype, nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    x = jax.random.normal(jax.random.key(1), (4, 8))
    y = jax.random.normal(jax.random.key(2), (4, 4))
    return model, optimizer, x, y


def nnx_arrays(model, optimizer):
    return [x for x in jax.tree.leaves(nnx.state((model, optimizer))) if hasattr(x, "dtype")]


@functools.cache
def nnx_faulty_step(wrap: str):
    def run(model, optimizer, x, y, plan):
        with sdcguard.faults(plan):
            step = nnx.jit(nnx_train_step) if wrap == "checked(nnx.jit)" else nnx_train_step
            return sdcguard.checked(step)(model, optimizer, x, y)

    return run if wrap == "eager" else nnx.jit(run)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("wrap", ["eager", "nnx.jit(checked)", "checked(nnx.jit)"])
def test_an_nnx_step_that_updates_in_place_updates_the_callers_objects(wrap, dtype):
    model, optimizer, x, y = nnx_case(dtype)
    before = [np.asarray(a) for a in nnx_arrays(model, optimizer)]
    nnx.jit(nnx_train_step)(model, optimizer, x, y)  # the plain step, twice
    nnx.jit(nnx_train_step)(model, optimizer, x, y)
    expected = nnx_arrays(model, optimizer)

    model, optimizer, x, y = nnx_case(dtype)
    site = "fc2:dot_general.grad_lhs"
    names = [s.name for s in list_sites(nnx_train_step, model, optimizer, x, y)]
    assert site in names
    clean = FaultPlan.from_faults([], capacity=2)
    inf = FaultPlan.from_faults([Fault(site=site, kind="inf", index=3)], capacity=2)
    _, report = nnx_faulty_step(wrap)(model, optimizer, x, y, clean)
    np.testing.assert_array_equal(total(report), [0, 0, 0, 0])
    _, report = nnx_faulty_step(wrap)(model, optimizer, x, y, inf)
    np.testing.assert_array_equal(report[site], [1, 1, 0, 0])
    assert int(optimizer.step[...]) == 2
    after = nnx_arrays(model, optimizer)
    assert any(not np.array_equal(a, b) for a, b in zip(after, before, strict=True))
    for a, b in zip(after, expected, strict=True):
        assert_close(a, b, dtype)
