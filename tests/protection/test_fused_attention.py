"""cuDNN attention (``jax.nn.dot_product_attention(implementation="cudnn")``) under ``checked``.

Off a GPU JAX refuses to trace cuDNN attention ("cuDNN is not detected"); the fixture below lets
it trace (abstract evaluation only) by standing in for that version check. The primitives have no
CPU lowering, so a step that runs here proves ``checked`` replaced them by the ABFT flash kernel
(:func:`test_unreplaced_cudnn_attention_cannot_run_here`). cuDNN takes bfloat16 and float16 only
(JAX refuses float32 at trace time), so those are the dtypes here.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention
from jax._src.interpreters import mlir

import sdcguard
from sdcguard.fault_model import Fault, FaultPlan
from sdcguard.protection import _fused_attention as fused_attention
from sdcguard.protection._walk import sub_jaxprs

from tests.helpers.checked_runs import run_with
from tests.helpers.multidevice import needs_8, run_on_8_devices

B, T, H, D = 2, 64, 2, 32
# Flash kernel vs XLA attention on the same values in float32, relative to max|reference|: the
# kernel rounds P and dS to the operand dtype before their tile products (as every flash
# attention does) and its outputs to it (bf16: u = 2^-8; fp16: u = 2^-11).
TOL = {jnp.dtype(jnp.bfloat16): 2e-2, jnp.dtype(jnp.float16): 4e-3}
DTYPES = [jnp.bfloat16, jnp.float16]


@pytest.fixture(autouse=True)
def cudnn_traceable(monkeypatch):
    """JAX's cuDNN attention traces on this CPU (its version check stands in for cuDNN)."""
    monkeypatch.setattr(cudnn_attention, "check_cudnn_version", lambda: 91000)


def _qkv(dtype, kv_heads=H, layout="BTNH"):
    ks = jax.random.split(jax.random.key(0), 3)
    shapes = [(B, T, H, D), (B, T, kv_heads, D), (B, T, kv_heads, D)]
    q, k, v = (jax.random.normal(key, s).astype(dtype) for key, s in zip(ks, shapes, strict=True))
    if layout == "BNTH":
        q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
    return q, k, v


def attend(q, k, v, causal=True, implementation="cudnn"):
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=implementation)


COT = jax.random.normal(jax.random.key(7), (B, T, H, D))


def loss(q, k, v, causal=True, implementation="cudnn"):
    out = attend(q, k, v, causal, implementation).astype(jnp.float32)
    return jnp.sum(out * COT)


def grad_step(q, k, v, causal=True, implementation="cudnn"):
    return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v, causal, implementation)


def _f32(*xs):
    return [x.astype(jnp.float32) for x in xs]


def _close(actual, expected, dtype):
    actual, expected = (np.asarray(x, np.float32) for x in (actual, expected))
    scale = max(1.0, float(np.max(np.abs(expected))))
    np.testing.assert_allclose(actual, expected, rtol=0, atol=TOL[jnp.dtype(dtype)] * scale)


def _primitives(fn, *args) -> set[str]:
    """The primitives of ``fn``'s program, nested ones too."""

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            yield eqn.primitive.name
            for sub in sub_jaxprs(eqn):
                yield from walk(sub)

    return set(walk(jax.make_jaxpr(fn)(*args).jaxpr))


def test_unreplaced_cudnn_attention_cannot_run_here():
    q, k, v = _qkv(jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="dot_product_attention"):
        jax.jit(attend)(q, k, v)
    with pytest.raises(NotImplementedError, match="dot_product_attention"):
        jax.jit(grad_step)(q, k, v)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_and_gradients_equal_xla_attention(dtype, causal):
    q, k, v = _qkv(dtype)
    (value, grads), report = jax.jit(sdcguard.checked(grad_step), static_argnums=3)(q, k, v, causal)
    ref_value, ref_grads = jax.jit(grad_step, static_argnums=(3, 4))(*_f32(q, k, v), causal, "xla")
    _close(value, ref_value, dtype)
    for g, r in zip(grads, ref_grads, strict=True):
        assert g.dtype == dtype
        _close(g, r, dtype)
    expected_sites = [f"loss/attend:{s}" for s in ("scores", "probs", "context")] + [
        f"loss/attend:{p}.{side}"
        for p in ("scores", "context")
        for side in ("grad_lhs", "grad_rhs")
    ]
    assert sorted(report) == sorted(expected_sites)
    assert all(c.tolist() == [0, 0, 0, 0] for c in report.values())  # clean: no alarm
    out, report = jax.jit(sdcguard.checked(attend), static_argnums=3)(q, k, v, causal)
    _close(out, attend(*_f32(q, k, v), causal, "xla"), dtype)
    assert sorted(report) == ["fn:context", "fn:probs", "fn:scores"]


def test_the_checked_step_itself_can_be_differentiated():
    """``jax.grad`` outside ``checked``: the forward is the differentiable flash kernel."""
    dtype = jnp.bfloat16
    q, k, v = _qkv(dtype)

    def checked_loss(q, k, v):
        out, _ = sdcguard.checked(attend)(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * COT)

    grads = jax.jit(jax.grad(checked_loss, argnums=(0, 1, 2)))(q, k, v)
    ref = jax.grad(loss, argnums=(0, 1, 2))(*_f32(q, k, v), True, "xla")
    for g, r in zip(grads, ref, strict=True):
        _close(g, r, dtype)


def test_bnth_layout_and_grouped_key_value_heads():
    """The low-level cuDNN entry point with BNTH operands, and jax.nn with one key/value head
    for two query heads (the kernel sees the key/value heads repeated)."""
    dtype = jnp.bfloat16
    q, k, v = _qkv(dtype, layout="BNTH")

    def bnth(q, k, v):
        out = cudnn_attention.dot_product_attention(
            q, k, v, scale=D**-0.5, mask_type=cudnn_attention.MaskType.CAUSAL, qkv_layout="BNTH"
        )
        return jnp.sum(out.astype(jnp.float32) * jnp.swapaxes(COT, 1, 2))

    grads, report = jax.jit(sdcguard.checked(jax.grad(bnth, argnums=(0, 1, 2))))(q, k, v)
    swapped = [jnp.swapaxes(x, 1, 2) for x in (q, k, v)]
    ref = jax.grad(loss, argnums=(0, 1, 2))(*_f32(*swapped), True, "xla")
    for g, r in zip(grads, ref, strict=True):
        _close(jnp.swapaxes(g, 1, 2), r, dtype)
    assert len(report) == 7 and all(c.tolist() == [0, 0, 0, 0] for c in report.values())

    q, k, v = _qkv(dtype, kv_heads=1)
    (value, grads), _ = jax.jit(sdcguard.checked(grad_step))(q, k, v)
    ref_value, ref_grads = jax.jit(grad_step, static_argnums=(3, 4))(*_f32(q, k, v), True, "xla")
    _close(value, ref_value, dtype)
    for g, r in zip(grads, ref_grads, strict=True):
        assert g.shape == r.shape
        _close(g, r, dtype)


def _idx(shape, *at):
    return int(np.ravel_multi_index(at, shape))


BHQK, BTHD = (B, H, T, T), (B, T, H, D)


# fp16 runs the same kernels as bf16 with a narrower exponent: slow (suite budget).
@pytest.mark.parametrize("dtype", [jnp.bfloat16, pytest.param(jnp.float16, marks=pytest.mark.slow)])
def test_faults_at_every_site_are_detected_and_corrected(dtype):
    """INF, NaN and large values in the forward and backward tile products: each detected once
    and corrected, the loss and gradients those of the clean step."""
    q, k, v = _qkv(dtype)
    at = "loss/attend:"
    faults = [
        Fault(site=at + "scores", kind="inf", index=_idx(BHQK, 1, 0, 40, 3)),
        Fault(site=at + "context", kind="nan", index=_idx(BTHD, 0, 17, 1, 4)),
        Fault(site=at + "scores.grad_lhs", kind="value", value=3e4, index=_idx(BTHD, 1, 12, 1, 3)),
        Fault(site=at + "scores.grad_rhs", kind="nan", index=_idx(BTHD, 0, 5, 0, 2)),
        Fault(site=at + "context.grad_lhs", kind="-inf", index=_idx(BHQK, 1, 1, 50, 4)),
        Fault(site=at + "context.grad_rhs", kind="value", value=-2e4, index=_idx(BTHD, 0, 3, 1, 7)),
    ]
    clean, clean_report = run_with(None, grad_step, q, k, v)
    (value, grads), report = run_with(FaultPlan.from_faults(faults), grad_step, q, k, v)
    for f in faults:
        assert report[f.site].tolist() == [1, 1, 0, 0], f.site
    assert report[at + "probs"].tolist() == [0, 0, 0, 0]
    assert all(c.tolist() == [0, 0, 0, 0] for c in clean_report.values())
    _close(value, clean[0], dtype)
    for g, c in zip(grads, clean[1], strict=True):
        _close(g, c, dtype)
    # Detect only: the same faults are seen and counted uncorrectable, and their damage stays.
    detect = sdcguard.ABFTConfig(correct=False)
    (value, _), report = run_with(
        FaultPlan.from_faults(faults[:1]), grad_step, q, k, v, config=detect
    )
    assert report[at + "scores"].tolist() == [1, 0, 1, 0]
    assert not np.isfinite(float(value))  # the fault reached the loss when not corrected


def test_a_layer_stack_scanned_and_rematerialised():
    """Attention in a scanned, checkpointed layer: its counters leave the loop, the backward
    pass's recomputation is checked too, and a fault there is corrected."""
    dtype = jnp.bfloat16
    x = jax.random.normal(jax.random.key(0), (B, T, H, D)).astype(dtype)
    w = (0.2 * jax.random.normal(jax.random.key(1), (2, D, D))).astype(dtype)

    def stack(w, x):
        def layer(h, wi):
            def body(h):
                return jax.nn.dot_product_attention(
                    h @ wi, h, h, is_causal=True, implementation="cudnn"
                )

            return jax.checkpoint(body)(h), None

        return jnp.sum(jax.lax.scan(layer, x, w)[0].astype(jnp.float32) ** 2)

    step = jax.value_and_grad(stack)
    (scores,) = [s.name for s in sdcguard.list_sites(step, w, x) if s.name.endswith("body:scores")]
    at = scores.removesuffix("scores")  # "<this test's call path>/stack/layer/body:"
    plan = FaultPlan.from_faults([Fault(site=at + "scores", kind="inf", index=5)])
    clean, _ = run_with(None, step, w, x)
    (value, grad), report = run_with(plan, step, w, x)
    # Two layers, each computed in the forward pass and again under remat in the backward.
    assert report[at + "scores"].tolist() == [4, 4, 0, 0]
    assert all(c.tolist() == [0, 0, 0, 0] for s, c in report.items() if s != at + "scores")
    _close(value, clean[0], dtype)
    _close(grad, clean[1], dtype)


def test_list_sites_shows_the_kernel_and_directions():
    q, k, v = _qkv(jnp.bfloat16)
    sites = {s.name: s for s in sdcguard.list_sites(grad_step, q, k, v)}
    at = "loss/attend:"
    assert sites[at + "scores"].direction == "forward"
    assert sites[at + "scores.grad_lhs"].direction == "grad_lhs"
    assert sites[at + "context.grad_rhs"].direction == "grad_rhs"
    assert sites[at + "context"].out_shape == (B, T, H, D)
    assert all(s.checked and "flash" in s.implementation for s in sites.values()), sites
    # Selection works per site; the two gradient sites of one product are checked together.
    config = sdcguard.ABFTConfig(exclude=("**scores.grad_rhs",))
    sites = {s.name: s for s in sdcguard.list_sites(grad_step, q, k, v, config=config)}
    assert not sites[at + "scores.grad_rhs"].checked
    assert not sites[at + "scores.grad_lhs"].checked
    assert "together with" in sites[at + "scores.grad_lhs"].why_unchecked
    assert sites[at + "context.grad_lhs"].checked and sites[at + "scores"].checked
    _, report = jax.jit(sdcguard.checked(grad_step, config))(q, k, v)
    assert at + "scores.grad_lhs" not in report and at + "context.grad_lhs" in report


class Attention(nn.Module):
    implementation: str

    @nn.compact
    def __call__(self, x):
        dense = functools.partial(nn.DenseGeneral, (H, D), dtype=jnp.bfloat16)
        q, k, v = (dense(name=n)(x) for n in ("query", "key", "value"))
        out = jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation=self.implementation
        )
        return nn.DenseGeneral(x.shape[-1], axis=(-2, -1), name="out")(out)


class Model(nn.Module):
    implementation: str

    @nn.compact
    def __call__(self, x):
        return Attention(self.implementation, name="attn")(x)


def test_sites_are_named_as_the_xla_paths_attention_gemms():
    """A Flax module: cuDNN attention's sites are the names the XLA path gives its GEMMs."""
    x = jax.random.normal(jax.random.key(3), (B, T, 64), jnp.bfloat16)
    params = Model("xla").init(jax.random.key(0), x)

    def step(params, x, implementation):
        return jax.grad(lambda p: jnp.sum(Model(implementation).apply(p, x) ** 2))(params)

    names = {
        impl: {s.name for s in sdcguard.list_sites(step, params, x, impl) if s.checked}
        for impl in ("xla", "cudnn")
    }
    core = {f"attn:{s}" for s in ("scores", "context")}
    core |= {f"{c}.{side}" for c in core for side in ("grad_lhs", "grad_rhs")}
    assert core <= names["xla"] and core <= names["cudnn"]
    assert names["cudnn"] - names["xla"] == {"attn:probs"}


def _stand_in_for_cudnn(q, k, v, bias, *rest, scale, mask_type, is_training, **_):
    """A CPU lowering of cuDNN's forward primitive (XLA attention with its additive bias),
    so that a step that keeps the primitive runs here."""
    s = jnp.einsum("btnh,bsnh->bnts", q, k, preferred_element_type=jnp.float32) * scale
    s = s + bias.astype(jnp.float32)
    if mask_type == cudnn_attention.MaskType.CAUSAL:
        s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -1e30)
    out = jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s), v.astype(jnp.float32))
    outs = [out.astype(q.dtype)]
    if is_training:
        outs.append(jax.nn.logsumexp(s, axis=-1))
    return outs


@pytest.fixture
def cudnn_stand_in(monkeypatch):
    prim = cudnn_attention._dot_product_attention_fwd_p_wrapper
    lowerings = mlir._platform_specific_lowerings["cpu"]
    monkeypatch.setitem(lowerings, prim, None)  # removed again after the test
    mlir.register_lowering(
        prim, mlir.lower_fun(_stand_in_for_cudnn, multiple_results=True), platform="cpu"
    )


def with_bias(q, k, v, bias):
    return jax.nn.dot_product_attention(q, k, v, bias=bias, implementation="cudnn")


def _attention_equations(jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name.startswith("dot_product_attention"):
            yield eqn
        for sub in sub_jaxprs(eqn):
            yield from _attention_equations(sub)


def test_a_score_mod_is_unsupported_and_none_is_the_plain_call():
    # jax 0.12 binds both primitives with a score_mod parameter (None unless flex attention);
    # jax 0.10-0.11 bind none. Either way the plain call runs through the flash kernel, and a
    # real score_mod (which needs a Hopper GPU to trace) is left to cuDNN, said why.
    q, k, v = _qkv(jnp.bfloat16)
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v).jaxpr
    equations = list(_attention_equations(jaxpr))
    assert len(equations) == 2  # the forward and the backward equation
    for eqn in equations:
        assert fused_attention.unsupported(eqn) == ""
        assert eqn.params.get("score_mod") is None

        def soft_cap(scores):
            return 30.0 * jnp.tanh(scores / 30.0)

        flex = eqn.replace(params={**eqn.params, "score_mod": soft_cap})
        assert fused_attention.unsupported(flex) == "a score_mod (soft_cap)"


@pytest.mark.parametrize(
    ("variant", "reason"),
    [
        ("bias", "additive bias"),
        ("mask", "additive bias"),
        ("window", "sliding window"),
        ("padding", "mask_type=PADDING"),
        ("dropout", "dropout"),
    ],
)
def test_unsupported_variants_are_listed_unchecked_with_the_reason(variant, reason):
    q, k, v = _qkv(jnp.bfloat16)
    calls = {
        "bias": lambda q, k, v: with_bias(q, k, v, jnp.zeros((1, H, T, T), q.dtype)),
        "mask": lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, mask=jnp.ones((1, 1, T, T), bool), implementation="cudnn"
        ),
        "window": lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, local_window_size=(8, 0), implementation="cudnn"
        ),
        "padding": lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, query_seq_lengths=jnp.full((B,), T, jnp.int32), implementation="cudnn"
        ),
        "dropout": lambda q, k, v: cudnn_attention.dot_product_attention(
            q, k, v, scale=0.1, dropout_rate=0.1
        ),
    }
    fn = calls[variant]
    (site,) = sdcguard.list_sites(fn, q, k, v)
    assert site.name == "fn:dot_product_attention_fwd_wrapper" and not site.checked
    assert reason in site.why_unchecked and "cuDNN runs it" in site.why_unchecked
    # Left as it is: the checked step still holds cuDNN's primitive; a supported call does not.
    assert "dot_product_attention_fwd_wrapper" in _primitives(sdcguard.checked(fn), q, k, v)
    assert "dot_product_attention_fwd_wrapper" not in _primitives(sdcguard.checked(attend), q, k, v)


def test_an_unsupported_variant_runs_unchecked_and_a_fault_there_matches_nothing(cudnn_stand_in):
    q, k, v = _qkv(jnp.bfloat16)
    bias = jax.random.normal(jax.random.key(9), (1, H, T, T), jnp.bfloat16)
    out, report = jax.jit(sdcguard.checked(with_bias))(q, k, v, bias)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(jax.jit(with_bias)(q, k, v, bias)))
    assert report == {}
    plan = FaultPlan.from_faults([Fault(site="fn:scores", kind="inf", index=0)])
    with pytest.raises(ValueError, match=r"unknown site 'fn:scores'"):
        jax.block_until_ready(run_with(plan, with_bias, q, k, v, bias))
    # The same plan on the supported call is injected (and corrected).
    _, report = run_with(plan, attend, q, k, v)
    assert report["fn:scores"].tolist() == [1, 1, 0, 0]


@pytest.mark.slow
def test_sharded_steps_in_a_subprocess_with_8_cpu_devices():
    run_on_8_devices(__file__)


@needs_8
@pytest.mark.parametrize("how", ["explicit", "auto", "shard_map"])
def test_sharded_step_on_8_devices(how):
    """Batch-sharded under jit (explicit or automatic axes) and per device under shard_map:
    the same loss as unsharded, and a fault corrected once (shard_map: on every device)."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    kind = AxisType.Auto if how == "auto" else AxisType.Explicit
    mesh = jax.make_mesh((8,), ("data",), axis_types=(kind,))
    dtype = jnp.bfloat16
    q, k, v = (
        jax.random.normal(key, (8, 32, H, D)).astype(dtype)
        for key in jax.random.split(jax.random.key(0), 3)
    )

    def whole_step(q, k, v):
        def loss(q, k, v):
            return jnp.sum(attend(q, k, v).astype(jnp.float32) ** 2)

        return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)

    step = whole_step
    expected, _ = jax.jit(sdcguard.checked(step))(q, k, v)
    if how == "shard_map":

        def per_device(q, k, v):
            value, grads = whole_step(q, k, v)
            return jax.lax.psum(value, "data"), grads

        step = jax.shard_map(
            per_device, mesh=mesh, in_specs=P("data"), out_specs=(P(), P("data")), check_vma=False
        )
    q, k, v = (jax.device_put(x, NamedSharding(mesh, P("data"))) for x in (q, k, v))
    (scores,) = [s.name for s in sdcguard.list_sites(step, q, k, v) if s.name.endswith(":scores")]
    clean, report = run_with(None, step, q, k, v)
    assert all(c.tolist() == [0, 0, 0, 0] for c in report.values())
    _close(clean[0], expected[0], dtype)
    (value, grads), report = run_with(
        FaultPlan.from_faults([Fault(site=scores, kind="inf", index=3)]), step, q, k, v
    )
    _close(value, clean[0], dtype)
    devices_hit = 8 if how == "shard_map" else 1
    assert report[scores].tolist() == [devices_hit, devices_hit, 0, 0]
    for g, c in zip(grads, clean[1], strict=True):
        _close(g, c, dtype)
