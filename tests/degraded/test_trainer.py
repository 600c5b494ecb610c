"""Degraded mode (MeCeFO): each approximation against its exact counterpart, and training on 8
CPU devices with replicas lost, quarantined by the guard and readmitted."""

from __future__ import annotations

import contextlib
import io

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.ad_checkpoint import print_saved_residuals

from sdcguard.degraded import (
    DegradedConfig,
    DegradedTrainer,
    GPTWorkload,
    MeCeFO,
    ReplicaFault,
    Workload,
    approximately,
    low_rank_basis,
    low_rank_product,
    make_degraded_step,
    mlp_forward,
    range_finder_matrix as _omega,
    replica_row,
    replica_work,
    takeover_assignment,
)
from sdcguard.guard import refuse_corrupted
from sdcguard.models import GPT, MLP, ByteBatches, GPTConfig, init_params, lm_loss

from tests.helpers.multidevice import needs_8, run_on_8_devices
from tests.helpers.tolerances import TOLERANCES, assert_close
from tests.helpers.xla_settings import compile_as_users_do

CONFIG = GPTConfig()  # the reference GPT at its default (tiny) size
# XLA:CPU folds jax.checkpoint's optimization barrier away (pass cse_barrier_expander) and CSE
# then merges the recomputation with the forward pass; without that pass the compiled step
# recomputes, as approximation (ii) intends. The 8-device process runs with it disabled.
KEEP_REMAT = "--xla_disable_hlo_passes=cse_barrier_expander"


def bits_equal(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def trees_bits_equal(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(bits_equal(x, y) for x, y in zip(la, lb, strict=True))


@pytest.fixture(scope="module")
def gpt():
    """The reference GPT, its parameters, a micro-batch and its MLP inputs per block."""
    model = GPT(CONFIG)
    params = init_params(model, 0)
    micro = jnp.asarray(ByteBatches(batch_size=4, seq_len=CONFIG.seq_len).batch(0))

    @jax.jit
    def mlp_inputs(params, tokens):
        captured = {}

        def capture(next_fun, args, kwargs, context):
            if isinstance(context.module, MLP):
                captured["/".join(context.module.path)] = args[0]
            return next_fun(*args, **kwargs)

        with nn.intercept_methods(capture):
            model.apply({"params": params}, tokens)
        return captured

    return model, params, micro, mlp_inputs(params, micro[:, :-1])


def assert_close_in_norm(actual, expected, dtype=jnp.float32):
    """``‖actual − expected‖_F <= rtol ‖expected‖_F`` with the dtype's rtol (tolerances.py).

    For products of long sums (here 512 tokens), where an element that cancels to near zero
    carries the round-off of the large terms it summed: relative to the matrix, not to itself.
    """
    rtol, _ = TOLERANCES[jnp.dtype(dtype)]
    error = float(jnp.linalg.norm(jnp.asarray(actual) - jnp.asarray(expected)))
    assert error <= rtol * float(jnp.linalg.norm(jnp.asarray(expected))), error


def run_compiled(fn, *args):
    """``jax.jit(fn)(*args)`` and the compiled program's flops (XLA's cost analysis)."""
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled(*args), compiled.cost_analysis()["flops"]


@pytest.fixture(scope="module")
def exact_gradients(gpt):
    """``((loss, grads), flops)`` of the exact reference GPT on the test micro-batch."""
    model, params, micro, _ = gpt
    return run_compiled(jax.value_and_grad(gpt_loss(model)), params, micro)


def gpt_loss(model):
    def loss(params, micro):
        return lm_loss(model.apply({"params": params}, micro[:, :-1]), micro[:, 1:])

    return loss


# --- The quarantine mask's assignment ---------------------------------------------------------


@pytest.mark.parametrize(
    "out, expected",
    [
        ([], [-1] * 8),
        ([3], [-1, -1, -1, -1, 3, -1, -1, -1]),
        ([3, 4], [-1, -1, -1, -1, -1, 3, 4, -1]),  # the next free replica in, cyclically
        ([7], [7, -1, -1, -1, -1, -1, -1, -1]),  # wraps around
        ([0, 2, 4, 6], [-1, 0, -1, 2, -1, 4, -1, 6]),
    ],
)
def test_each_out_replica_is_taken_over_by_one_neighbour(out, expected):
    mask = np.zeros(8, bool)
    mask[out] = True
    assert np.asarray(takeover_assignment(jnp.asarray(mask))).tolist() == expected


# --- (ii) Recomputation -----------------------------------------------------------------------


def test_the_functional_mlp_is_the_flax_mlp_bit_for_bit(gpt):
    _, params, _, captured = gpt
    x = captured["decoder/block_1/mlp"]
    mlp_params = params["decoder"]["block_1"]["mlp"]
    flax_out = MLP(CONFIG).apply({"params": mlp_params}, x)
    assert bits_equal(mlp_forward(mlp_params, x, CONFIG), flax_out)
    assert bits_equal(mlp_forward(mlp_params, x, CONFIG, recompute=True), flax_out)


def test_recomputing_the_ffn_is_bit_identical_to_storing_it(gpt):
    model, params, micro, _ = gpt
    loss = gpt_loss(model)
    key = jax.random.key(0)

    def approx_loss(recompute):
        def fn(params, micro):
            with approximately(
                MeCeFO(skip_attention=False, recompute_ffn=recompute, low_rank=None), key
            ):
                return loss(params, micro)

        return fn

    def gradients(fn):  # compiled as users compile it: the claim is that both round alike
        return compile_as_users_do(jax.jit(jax.value_and_grad(fn)).lower(params, micro))(
            params, micro
        )

    assert trees_bits_equal(gradients(approx_loss(True)), gradients(approx_loss(False)))
    # What autodiff keeps for the backward pass: the [tokens, 4 d] activations of both FFNs
    # without recomputation, none of them with it.
    hidden = f"f32[{micro.shape[0]},{CONFIG.seq_len},{CONFIG.mlp_ratio * CONFIG.d_model}]"

    def hidden_residuals(fn):
        listing = io.StringIO()
        with contextlib.redirect_stdout(listing):
            print_saved_residuals(fn, params, micro)
        lines = listing.getvalue().splitlines()
        # The logits [b, t, vocab] have the FFN's shape at this size: leave out the loss's.
        return [line for line in lines if line.startswith(hidden) and "entropy" not in line]

    assert len(hidden_residuals(approx_loss(False))) >= 2 * CONFIG.num_layers
    assert hidden_residuals(approx_loss(True)) == []


# --- (iii) Low-rank FFN weight gradients ------------------------------------------------------


def ffn_operands(gpt, block: int):
    """Real operands of block ``block``'s FFN kernels: (x, h) for fc_in, (gelu(h), x) mirrored."""
    _, params, _, captured = gpt
    x = captured[f"decoder/block_{block}/mlp"].reshape(-1, CONFIG.d_model)
    fc_in = params["decoder"][f"block_{block}"]["mlp"]["fc_in"]
    h = x @ fc_in["kernel"] + fc_in["bias"]
    return x, h


@pytest.mark.parametrize("rank", [2, 8, 32])
@pytest.mark.parametrize("narrow", ["a", "b"])
def test_low_rank_product_obeys_its_error_bound(gpt, rank, narrow):
    x, h = ffn_operands(gpt, block=0)
    # fc_in's kernel gradient has x (64 wide) on the narrow side; fc_out's has gelu(h) (256
    # wide) against a 64-wide cotangent, so the cotangent's side is projected.
    a, b = (x, h) if narrow == "a" else (nn.gelu(h), x)
    narrow_side = a if narrow == "a" else b
    omega = jax.random.normal(jax.random.key(rank), (narrow_side.shape[1], rank))
    exact = a.T @ b
    estimate = jax.jit(low_rank_product)(a, b, omega)
    basis = jax.jit(low_rank_basis)(narrow_side, omega)
    residual = float(jnp.linalg.norm(narrow_side - (narrow_side @ basis) @ basis.T, 2))
    other = float(jnp.linalg.norm(b if narrow == "a" else a))
    error = float(jnp.linalg.norm(exact - estimate))
    # The stated bound: ‖G − Ĝ‖_F ≤ ‖A (I − P Pᵀ)‖₂ · ‖B‖_F (float32 round-off aside) ...
    assert error <= residual * other * (1 + 1e-4) + 1e-5 * float(jnp.linalg.norm(exact))
    # ... with ‖A (I − P Pᵀ)‖₂ within 2x of the best any rank-r basis can do (σ_{r+1}).
    sigma = np.linalg.svd(np.asarray(narrow_side), compute_uv=False)
    assert sigma[rank] <= residual * (1 + 1e-5) <= 2.0 * sigma[rank]


def test_low_rank_product_at_full_rank_is_exact(gpt):
    x, h = ffn_operands(gpt, block=1)
    omega = jax.random.normal(jax.random.key(0), (CONFIG.d_model, CONFIG.d_model))
    assert_close_in_norm(low_rank_product(x, h, omega), x.T @ h)


def test_the_ffn_kernel_gradients_are_the_low_rank_estimates_and_the_rest_is_exact(gpt):
    _, params, _, captured = gpt
    x = captured["decoder/block_0/mlp"]
    mlp_params = params["decoder"]["block_0"]["mlp"]
    cotangent = jax.random.normal(jax.random.key(1), x.shape)
    key, rank = jax.random.key(7), 4

    def vjp(**options):
        @jax.jit
        def run(params, x, cotangent):
            out, pullback = jax.vjp(lambda p, x: mlp_forward(p, x, CONFIG, **options), params, x)
            return out, pullback(cotangent)

        return run(mlp_params, x, cotangent)

    out_exact, (grads_exact, dx_exact) = vjp()
    out_low, (grads_low, dx_low) = vjp(low_rank=rank, key=key, recompute=True)
    assert bits_equal(out_low, out_exact)  # the forward pass is untouched
    assert_close(dx_low, dx_exact, jnp.float32)
    for layer in ("fc_in", "fc_out"):
        assert_close(grads_low[layer]["bias"], grads_exact[layer]["bias"], jnp.float32)
    # The kernel gradients are the stated estimates, with the operands of the exact backward.
    h = jnp.einsum("btd,df->btf", x, mlp_params["fc_in"]["kernel"]) + mlp_params["fc_in"]["bias"]
    _, gelu_vjp = jax.vjp(nn.gelu, h)
    dh = gelu_vjp(cotangent @ mlp_params["fc_out"]["kernel"].T)[0]
    flat = lambda t: t.reshape(-1, t.shape[-1])
    omega = _omega(key, CONFIG.d_model, rank)
    for layer, a, b in (("fc_in", x, dh), ("fc_out", nn.gelu(h), cotangent)):
        expected = low_rank_product(flat(a), flat(b), omega)
        assert_close_in_norm(grads_low[layer]["kernel"], expected)
        exact = grads_exact[layer]["kernel"]
        assert not np.allclose(grads_low[layer]["kernel"], exact, rtol=1e-3)  # a real estimate


# --- (i) Skip-connection ----------------------------------------------------------------------


def test_skipping_the_attention_backward_is_the_gradient_through_the_residual_only(
    gpt, exact_gradients
):
    model, params, micro, _ = gpt
    loss = gpt_loss(model)
    # The exact counterpart: the same model with each attention output replaced by the
    # constant it has, so that gradient reaches everything except through attention.

    def with_attention(replace):
        def intercept(next_fun, args, kwargs, context):
            if isinstance(context.module, nn.MultiHeadDotProductAttention):
                return replace("/".join(context.module.path), next_fun(*args, **kwargs))
            return next_fun(*args, **kwargs)

        return nn.intercept_methods(intercept)

    @jax.jit
    def attention_outputs(params, micro):
        outputs = {}
        with with_attention(lambda path, y: outputs.setdefault(path, y)):
            loss(params, micro)
        return outputs

    def reference(params, micro, outputs):
        with with_attention(lambda path, y: outputs[path]):
            return loss(params, micro)

    def skipped(params, micro):
        with approximately(MeCeFO(recompute_ffn=False, low_rank=None)):
            return loss(params, micro)

    outputs = attention_outputs(params, micro)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(reference))(params, micro, outputs)
    (skip_loss, skip_grads), skip_flops = run_compiled(jax.value_and_grad(skipped), params, micro)
    (exact_loss, exact_grads), exact_flops = exact_gradients
    assert bits_equal(skip_loss, exact_loss)  # the forward pass is the model's
    for i in range(CONFIG.num_layers):
        block = skip_grads["decoder"][f"block_{i}"]
        for name in ("attn", "ln_attn"):
            assert all(np.all(np.asarray(g) == 0) for g in jax.tree.leaves(block[name]))
            assert any(
                np.any(np.asarray(g) != 0)
                for g in jax.tree.leaves(exact_grads["decoder"][f"block_{i}"][name])
            )
    assert_close(ref_loss, skip_loss, jnp.float32)
    for r, s in zip(jax.tree.leaves(ref_grads), jax.tree.leaves(skip_grads), strict=True):
        assert_close(s, r, jnp.float32)
    # The backward pass of attention is gone from the compiled program, not multiplied by 0:
    # the step is cheaper by more than the attention's forward flops (its backward is ~2x).
    b, t, d = micro.shape[0], CONFIG.seq_len, CONFIG.d_model
    attention_forward = CONFIG.num_layers * (8 * b * t * d * d + 4 * b * t * t * d)
    assert exact_flops - skip_flops >= 1.5 * attention_forward


def test_approximations_refuse_what_they_cannot_do():
    with pytest.raises(ValueError, match="low_rank must be"):
        MeCeFO(low_rank=0)
    with pytest.raises(ValueError, match="scope must be one of"):
        MeCeFO(scope="everyone")
    with pytest.raises(ValueError, match="needs key="):
        approximately(MeCeFO())
    with pytest.raises(ValueError, match="at least 2 replicas"):
        DegradedConfig(replicas=1)


def test_degraded_mode_asks_for_a_model_it_can_train():
    with pytest.raises(ValueError, match=r"needs the model to train: workload=Workload"):
        DegradedTrainer(DegradedConfig())
    with pytest.raises(TypeError, match="has no callable loss"):
        replica_work(Workload(init=lambda key: {}, loss=None))


def test_the_step_asks_for_the_devices_it_needs():
    if jax.device_count() >= 8:
        pytest.skip("this process has 8 devices")
    with pytest.raises(ValueError, match="xla_force_host_platform_device_count=8"):
        make_degraded_step(DegradedConfig(), GPTWorkload())


# --- On 8 CPU devices -------------------------------------------------------------------------


def test_degraded_training_in_a_subprocess_with_8_cpu_devices(monkeypatch):
    """Runs this file's ``on_8_devices`` tests in a process that sees 8 CPU devices."""
    monkeypatch.setenv("XLA_FLAGS", KEEP_REMAT)
    out = run_on_8_devices(__file__)
    assert " passed" in out and "skipped" not in out.splitlines()[-1]


@pytest.fixture(scope="module")
def default_step():
    """One compilation of the default degraded step, shared by the tests that use it."""
    return make_degraded_step(DegradedConfig(), GPTWorkload())


def global_batches(config: DegradedConfig, model: GPTConfig = CONFIG):
    return ByteBatches(batch_size=config.global_batch, seq_len=model.seq_len)


@needs_8
def test_losing_quarantining_and_readmitting_recompile_nothing_on_8_devices(default_step):
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, *_, **__: compiles.append(name) if "backend_compile" in name else None
    )
    config = DegradedConfig()
    trainer = DegradedTrainer(config, compiled=default_step)
    data = global_batches(config)
    trainer.step(data.batch(0))  # compiles (once for the test module)
    before = len(compiles)
    trainer.lose(3)
    trainer.step(data.batch(1))
    trainer.quarantine(6)
    trainer.step(data.batch(2))
    trainer.readmit(3)
    trainer.step(data.batch(3))
    trainer.readmit(6)
    trainer.step(data.batch(4))
    assert compiles[before:] == []
    assert [(e.replica, e.kind) for e in trainer.report.events] == [
        (3, "lost"),
        (6, "quarantined"),
        (3, "readmitted"),
        (6, "readmitted"),
    ]
    assert trainer.report.out_replicas == [0, 1, 2, 1, 0]
    # Readmitted replicas hold the healthy replicas' state again, bit for bit.
    rows = [replica_row(trainer.state, r) for r in range(8)]
    assert all(trees_bits_equal(rows[0], row) for row in rows[1:])


@needs_8
def test_the_mask_refuses_more_replicas_out_than_neighbours_on_8_devices(default_step):
    trainer = DegradedTrainer(DegradedConfig(), compiled=default_step)
    for r in range(4):
        trainer.lose(r)
    with pytest.raises(ValueError, match="at most 4 of 8 may be out"):
        trainer.lose(4)
    with pytest.raises(ValueError, match="is not out"):
        trainer.readmit(5)
    with pytest.raises(ValueError, match="micro_batch 2 need 16"):
        trainer.step(np.zeros((8, 65), np.int32))


@needs_8
def test_the_update_is_the_full_batch_average_on_8_devices():
    """Replica 3 out, replica 4 computes micro-batches 4 and 3 (with the skip-connection): the
    update is every micro-batch's gradient once, weight 1/8 (the attention branch's parameters:
    over the 6 micro-batches that computed their gradient), each gradient computed here
    independently."""
    approximations = MeCeFO(recompute_ffn=False, low_rank=None)
    small = GPTConfig(num_layers=1, d_model=32, num_heads=2, seq_len=16)
    config = DegradedConfig()
    workload = GPTWorkload(model=small, approximations=approximations)
    state, step = make_degraded_step(config, workload, optax.sgd(1.0))
    batch = jnp.asarray(global_batches(config, small).batch(0)).reshape(8, config.micro_batch, -1)
    params = replica_row(state.params, 0)
    loss = gpt_loss(GPT(small))

    def approximate(params, micro):
        with approximately(approximations):
            return loss(params, micro)

    def per_micro_batch(fn):
        values = jax.jit(jax.vmap(fn, in_axes=(None, 0)))(params, batch)
        return [jax.tree.map(lambda x, r=r: x[r], values) for r in range(8)]

    grads = per_micro_batch(jax.grad(loss))
    approximated = per_micro_batch(jax.grad(approximate))  # scope 'both': 4's own and 3
    full = [grads[r] for r in (0, 1, 2, 5, 6, 7)] + [approximated[3], approximated[4]]
    attended = 6

    def expected(path, *per_micro_batch):
        if any(getattr(k, "key", None) in ("attn", "ln_attn") for k in path):
            return sum(per_micro_batch[:attended]) / attended
        return sum(per_micro_batch) / 8

    want = jax.tree_util.tree_map_with_path(expected, *full)
    mask = np.zeros(8, bool)
    mask[3] = True
    new, info = step(state, batch, mask, ReplicaFault.none())
    assert np.asarray(info.role).tolist() == [1, 1, 1, 0, 2, 1, 1, 1]
    got = jax.tree.map(jnp.subtract, params, replica_row(new.params, 0))  # sgd(1): -update
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert_close(g, w, jnp.float32)
    # The loss is the full batch's, approximations or not (forward passes are exact).
    want_loss = np.mean(per_micro_batch(loss))
    assert_close(replica_row(info.loss, 0), want_loss, jnp.float32)


@needs_8
def test_one_replica_out_for_a_stretch_ends_within_2_percent_on_8_devices(default_step):
    config = DegradedConfig()
    data = global_batches(config)
    held_out = ByteBatches(batch_size=64, seq_len=CONFIG.seq_len, seed=99)
    model = GPT(CONFIG)
    evaluate = jax.jit(gpt_loss(model))

    def run(out_from, out_until):
        trainer = DegradedTrainer(config, compiled=default_step)
        around = []  # the parameters before and after step 10
        for i in range(60):
            if i == out_from:
                trainer.lose(3)
            if i == out_until:
                trainer.readmit(3)
            if i in (10, 11):
                around.append(trainer.params())
            trainer.step(data.batch(i))
        params = trainer.params()
        loss = float(np.mean([evaluate(params, held_out.batch(j)) for j in range(4)]))
        return trainer, loss, around

    clean, clean_loss, clean_around = run(None, None)
    degraded, degraded_loss, degraded_around = run(10, 50)
    assert degraded.report.out_replicas.count(1) == 40
    # Identical runs up to step 10; its degraded update is the approximate one, not rounding.
    assert trees_bits_equal(clean_around[0], degraded_around[0])
    flat = lambda tree: np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])
    changed = np.linalg.norm(flat(degraded_around[1]) - flat(clean_around[1]))
    rtol, _ = TOLERANCES[jnp.dtype(jnp.float32)]
    assert changed > rtol * np.linalg.norm(flat(clean_around[1])), changed
    assert clean.report.refused == degraded.report.refused == []
    assert abs(degraded_loss - clean_loss) <= 0.02 * clean_loss, (degraded_loss, clean_loss)
    assert clean_loss < 0.6 * clean.report.losses[0]  # it did train


@needs_8
def test_the_guard_quarantines_a_persistently_corrupting_replica_on_8_devices(default_step):
    config = DegradedConfig()
    data = global_batches(config)
    trainer = DegradedTrainer(config, compiled=default_step)
    fault = ReplicaFault.on(5, scale=1.0001)  # its copy of the gradients, every step
    for i in range(12):
        trainer.step(data.batch(i), fault=fault if i >= 4 else None)
    assert trainer.report.quarantined() == [5]
    event = next(e for e in trainer.report.events if e.kind == "quarantined")
    assert event.step == 4 and "update guard" in event.detail
    assert "sdcguard compare --node-a local:0 --node-b local:5" in event.detail
    assert trainer.report.refused == []  # the step was recomputed without it and accepted
    assert trainer.report.steps_run == 12 + 2  # step 4 was computed three times
    assert trainer.report.out_replicas == [0] * 4 + [1] * 8
    assert trainer.report.losses[-1] < trainer.report.losses[4]  # training went on
    rows = [replica_row(trainer.state.params, r) for r in range(8)]
    assert all(trees_bits_equal(rows[0], rows[r]) for r in (1, 2, 3, 4, 6, 7))
    # Readmitted without being replaced, the faulty replica is caught again at once.
    trainer.readmit(5)
    trainer.step(data.batch(12), fault=fault)
    assert trainer.report.quarantined() == [5, 5]
    assert trainer.report.refused == []


@needs_8
def test_a_mismatch_that_does_not_come_back_quarantines_nobody_on_8_devices(default_step):
    config = DegradedConfig()
    data = global_batches(config)
    trainer = DegradedTrainer(config, compiled=default_step)
    trainer.step(data.batch(0))
    calls = []
    run = trainer._run

    def transient(batch, fault):  # the fault hits the first computation of step 1 only
        calls.append(1)
        return run(batch, ReplicaFault.on(2) if len(calls) == 1 else fault)

    trainer._run = transient
    trainer.step(data.batch(1))
    assert [(e.replica, e.kind) for e in trainer.report.events] == [(2, "mismatch_not_repeated")]
    assert not trainer.out.any() and len(calls) == 2 and trainer.report.refused == []


@needs_8
def test_the_neighbour_does_at_most_1_5x_a_normal_replicas_work_on_8_devices():
    """XLA's cost analysis of each role's compiled work (the branches of the step)."""
    params = init_params(GPT(CONFIG), 0)
    micro = jnp.asarray(ByteBatches(batch_size=2, seq_len=CONFIG.seq_len).batch(0))

    def cost(role):
        work = replica_work(GPTWorkload())[role]
        analysis = jax.jit(work).lower(params, micro, micro, jax.random.key(0)).compile()
        analysis = analysis.cost_analysis()
        return np.array([analysis["flops"], analysis["bytes accessed"]])

    normal, neighbour = cost("normal"), cost("neighbour")
    assert np.all(neighbour <= 1.5 * normal), neighbour / normal
    assert np.all(neighbour >= 1.1 * normal)  # it did take on a second micro-batch


@needs_8
@pytest.mark.parametrize("recompute, dots", [(False, 5), (True, 6)])
def test_the_compiled_ffn_recomputes_its_activations_on_8_devices(recompute, dots):
    """In this process (KEEP_REMAT) XLA keeps the recomputation: the FFN's forward + backward
    has a sixth GEMM, fc_in computed again in the backward pass."""
    mlp_params = init_params(GPT(CONFIG), 0)["decoder"]["block_0"]["mlp"]
    x = jnp.ones((2, CONFIG.seq_len, CONFIG.d_model))

    def loss(params, x):
        return jnp.sum(mlp_forward(params, x, CONFIG, recompute=recompute) ** 2)

    hlo = jax.jit(jax.value_and_grad(loss)).lower(mlp_params, x).compile().as_text()
    assert hlo.count(" dot(") == dots


@needs_8
def test_a_users_own_model_trains_in_degraded_mode_on_8_devices():
    """No GPT: a linear regression handed in as functions (exact takeover). With replica 2 out,
    replica 3 computes micro-batch 2 as well, and the update is the full batch's gradient."""

    def init(key):
        return {"w": jax.random.normal(key, (4,)), "b": jnp.zeros(())}

    def loss(params, micro):  # micro [m, 5]: four features, then the target
        return jnp.mean((micro[:, :4] @ params["w"] + params["b"] - micro[:, 4]) ** 2)

    config = DegradedConfig(micro_batch=3, seed=7)
    tx = refuse_corrupted(optax.sgd(0.1), axis_name=config.axis_name)
    trainer = DegradedTrainer(config, Workload(init=init, loss=loss), tx)
    batch = jax.random.normal(jax.random.key(1), (config.global_batch, 5))
    before = trainer.params()
    assert trees_bits_equal(before, init(jax.random.key(7)))
    trainer.lose(2)
    trainer.step(batch)
    full_loss, full_grad = jax.value_and_grad(loss)(before, batch)
    want = jax.tree.map(lambda p, g: p - 0.1 * g, before, full_grad)
    for got, expected in zip(jax.tree.leaves(trainer.params()), jax.tree.leaves(want), strict=True):
        assert_close(got, expected, jnp.float32)
    assert_close(trainer.report.losses[-1], full_loss, jnp.float32)
    assert trainer.report.refused == [] and trainer.report.out_replicas == [1]
