"""``ABFTConfig(implementation='pallas')`` runs the protected attention core through the fused
flash-attention kernel (interpret mode here), with the XLA path's sites, counters and faults.

Kept tiny (batch 1, 2 heads, 16 tokens, head_dim 16): on the CPU every kernel is interpreted
and each (implementation, dtype) is compiled once, then run under every fault plan.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sdcguard import linen as sl, nnx as snnx
from sdcguard.fault_model import Fault, FaultPlan, faults
from sdcguard.protection import (
    ABFTConfig,
    Counts,
    PallasFallbackWarning,
    SiteRecorder,
    protected_attention,
)
from sdcguard.protection.pallas import as_h100, gpu_interpret_mode, interpret_mode

from tests.helpers.tolerances import assert_close

B, T, F, H = 1, 16, 32, 2  # head_dim F / H = 16
# The attention core's sites, which the fused kernel checks. The projections are checked by
# the GEMM kernel either way (test_matmul.py, and the whole GPT step in float32 in
# test_train_step.py); leaving them out here halves the compile time.
CORE = ABFTConfig(sites=("scores", "probs", "context"))
FLASH_KERNELS = (
    "checked_flash_attention_fwd",
    "checked_flash_attention_dkdv",
    "checked_flash_attention_dq",
)


class Net(nn.Module):
    """One protected attention layer named ``attn`` (sites ``attn:scores`` ...)."""

    implementation: str
    dtype: object = jnp.float32
    dropout_rate: float = 0.0
    config: ABFTConfig = CORE

    @nn.compact
    def __call__(self, x, mask, deterministic=True):
        return sl.MultiHeadDotProductAttention(
            num_heads=H,
            dtype=self.dtype,
            dropout_rate=self.dropout_rate,
            deterministic=deterministic,
            abft=dataclasses.replace(self.config, implementation=self.implementation),
            name="attn",
        )(x, mask=mask)


def _gemm_tolerance(dtype):
    """The tolerance row for results of ``dtype`` GEMMs at default precision: on a GPU, float32
    GEMMs round their inputs to TF32 (10 mantissa bits, as float16), differently in XLA and in
    Triton; on the CPU (interpret mode) they are exact float32."""
    if jnp.dtype(dtype) == jnp.float32 and jax.default_backend() == "gpu":
        return jnp.float16
    return dtype


def _inputs(dtype):
    kx, kc = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (B, T, F), jnp.float32).astype(dtype)
    cot = jax.random.normal(kc, (B, T, F), jnp.float32)
    # Causal, and the last three keys padded out for the second half of the queries.
    mask = nn.make_causal_mask(jnp.ones((B, T), jnp.int32)).astype(bool)
    mask = mask & ~((jnp.arange(T)[:, None] >= T // 2) & (jnp.arange(T)[None, :] >= T - 3))
    return x, cot, mask


@functools.cache
def _setup(dtype):
    x, cot, mask = _inputs(dtype)
    # The parameters are Flax's own (the protected layer's tree is the same): initialised by
    # a plain Flax layer, whose eager init is cheap.
    plain = nn.MultiHeadDotProductAttention(num_heads=H, dtype=dtype)
    params = {"attn": plain.init(jax.random.key(1), x, mask=mask)["params"]}
    sinks = sl.init_sinks(Net("xla", dtype), x, mask)
    return x, cot, mask, params, sinks


def _loss(implementation, dtype, params, sinks, x, cot, mask, plan):
    with faults(plan):
        y, state = Net(implementation, dtype).apply(
            {"params": params, "sdc_grad": sinks}, x, mask, mutable=["sdc"]
        )
    return jnp.sum(y.astype(jnp.float32) * cot), (y, state["sdc"])


@functools.cache
def _step(implementation: str, dtype):
    """value_and_grad of the layer, compiled once per (implementation, dtype)."""
    grad = jax.value_and_grad(
        functools.partial(_loss, implementation, dtype), argnums=(0, 1), has_aux=True
    )
    return jax.jit(grad)


def _run(implementation, dtype, plan):
    x, cot, mask, params, sinks = _setup(dtype)
    (_, (y, sdc)), (g_params, g_sinks) = _step(implementation, dtype)(
        params, sinks, x, cot, mask, plan
    )
    counts = {**sl.site_counts(sdc), **sl.backward_site_counts(g_sinks)}
    return y, g_params, {k: v.tolist() for k, v in counts.items()}


def _idx(shape, *at):
    return int(np.ravel_multi_index(at, shape))


BHQK, BTHD = (B, H, T, T), (B, T, H, F // H)
FAULTS = {
    "clean": None,
    "scores-inf": Fault(site="attn:scores", kind="inf", index=_idx(BHQK, 0, 1, 9, 4)),
    "scores-nan-masked": Fault(site="attn:scores", kind="nan", index=_idx(BHQK, 0, 0, 3, 12)),
    "probs-nan": Fault(site="attn:probs", kind="nan", index=_idx(BHQK, 0, 0, 7, 2)),
    "context-nan": Fault(site="attn:context", kind="nan", index=_idx(BTHD, 0, 5, 1, 3)),
    "context-near_inf": Fault(site="attn:context", kind="near_inf", index=_idx(BTHD, 0, 12, 0, 9)),
    "scores.grad_lhs-nan": Fault(
        site="attn:scores.grad_lhs", kind="nan", index=_idx(BTHD, 0, 11, 1, 2)
    ),
    "scores.grad_rhs-inf": Fault(
        site="attn:scores.grad_rhs", kind="inf", index=_idx(BTHD, 0, 4, 0, 6)
    ),
    "context.grad_lhs-inf": Fault(
        site="attn:context.grad_lhs", kind="-inf", index=_idx(BHQK, 0, 1, 13, 6)
    ),
    "context.grad_rhs-nan": Fault(
        site="attn:context.grad_rhs", kind="nan", index=_idx(BTHD, 0, 2, 1, 15)
    ),
}


@functools.cache
def _float32_reference(dtype):
    """Output and parameter gradients of Flax's own layer in float32 on the same inputs."""
    x, cot, mask, params, _ = _setup(dtype)
    plain = nn.MultiHeadDotProductAttention(num_heads=H, dtype=jnp.float32)

    def loss(params):
        y = plain.apply({"params": params["attn"]}, x.astype(jnp.float32), mask=mask)
        return jnp.sum(y * cot), y

    (_, y), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return y, grads


def _close_to_reference(actual, reference, dtype):
    """Per-dtype tolerance relative to the tensor's largest magnitude: a low-precision sum is
    rounded relative to its largest terms (a bias gradient that is 0 in exact arithmetic is
    rounding noise of the size of the others)."""
    scale = max(1.0, float(np.max(np.abs(np.asarray(reference, np.float32)))))
    assert_close(np.asarray(actual, np.float32) / scale, np.asarray(reference) / scale, dtype)


@pytest.mark.parametrize("fault", list(FAULTS), ids=list(FAULTS))
def test_linen_layer_pallas_matches_xla(fault, dtype=jnp.bfloat16):
    """Values, gradients and every site's counters: the fused kernel against the XLA path,
    in bfloat16 (float32: the whole GPT step in tests/protection/pallas/test_train_step.py).

    Each fault is detected and corrected at its own site (counters ``[1, 1, 0, 0]`` there and
    zero elsewhere, on both paths); the outputs of both paths agree, and the kernel's outputs
    and gradients are those of the clean layer in float32 within bfloat16's tolerance. (The
    paths round at different points: Flax's core rounds scores and probabilities to bfloat16,
    the kernel keeps them in float32; so gradients, where that rounding noise is of the size of
    the tolerance, are compared with the float32 reference rather than with each other.)
    """
    plan = FaultPlan.from_faults([FAULTS[fault]] if FAULTS[fault] else [], capacity=1)
    y_p, g_p, counts_p = _run("pallas", dtype, plan)
    y_x, _, counts_x = _run("xla", dtype, plan)

    expected = {site: [0] * len(Counts._fields) for site in counts_x}
    if FAULTS[fault] is not None:
        expected[FAULTS[fault].site] = [1, 1, 0, 0]
    assert counts_p == counts_x == expected

    assert y_p.dtype == y_x.dtype == dtype
    assert_close(y_p, y_x, dtype)
    y_ref, g_ref = _float32_reference(dtype)
    _close_to_reference(y_p, y_ref, dtype)
    jax.tree_util.tree_map(lambda a, r: _close_to_reference(a, r, dtype), g_p, g_ref)


def _pallas_call_names(closed_jaxpr) -> list[str]:
    """Names of the ``pallas_call`` kernels in a jaxpr, nested jaxprs included."""
    names = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                names.append(str(eqn.params["name"]))
                continue
            for value in eqn.params.values():
                for sub in value if isinstance(value, (list, tuple)) else [value]:
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        walk(sub.jaxpr)
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        walk(sub)

    walk(closed_jaxpr.jaxpr)
    return names


def _linen_loss(implementation, dropout_rate=0.0, config=CORE):
    """``(loss, args)``: the linen layer's loss of its parameters and sinks."""
    x, cot, mask, params, sinks = _setup(jnp.float32)

    def loss(params, sinks, rng):
        y, _ = Net(implementation, dropout_rate=dropout_rate, config=config).apply(
            {"params": params, "sdc_grad": sinks},
            x,
            mask,
            deterministic=dropout_rate == 0.0,
            mutable=["sdc"],
            rngs={"dropout": rng},
        )
        return jnp.sum(y * cot)

    return loss, (params, sinks, jax.random.key(2))


def _nnx_layer(implementation, config=CORE):
    layer = nnx.MultiHeadAttention(num_heads=H, in_features=F, decode=False, rngs=nnx.Rngs(0))
    return snnx.protect(layer, dataclasses.replace(config, implementation=implementation))


def _nnx_loss(implementation, config=CORE):
    """``(loss, args)``: the NNX layer's loss of its state (parameters, sinks and counters)."""
    x, cot, mask, _, _ = _setup(jnp.float32)
    graph, state = nnx.split(_nnx_layer(implementation, config))

    def loss(state):
        y = nnx.merge(graph, state)(x, mask=mask)
        return jnp.sum(y * cot)

    return loss, (state,)


LOSSES = {"linen": _linen_loss, "nnx": _nnx_loss}


@pytest.mark.parametrize("layer", ["linen", "nnx"])
def test_fused_kernel_runs_forward_and_backward(layer):
    """implementation='pallas' traces the three flash kernels (and no fallback warning);
    'xla' traces none."""
    names = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", PallasFallbackWarning)
        for impl in ("pallas", "xla"):
            loss, args = LOSSES[layer](impl)
            grad = jax.grad(loss, allow_int=True)
            names[impl] = _pallas_call_names(jax.make_jaxpr(grad)(*args))
    for kernel in FLASH_KERNELS:
        assert names["pallas"].count(kernel) == 1, names["pallas"]
    assert names["xla"] == []


def test_nnx_layer_pallas_matches_xla():
    """NNX's core is jax.nn's arithmetic (scale after QKᵀ, float32 logits): forward values and
    counters of the fused kernel equal the XLA path's, clean and with a corrected fault."""
    x, _, mask, _, _ = _setup(jnp.float32)
    fault = Fault(site="attn:scores", kind="nan", index=_idx(BHQK, 0, 0, 9, 2))
    out = {}
    for impl in ("pallas", "xla"):
        layer = _nnx_layer(impl)
        graph, state = nnx.split(layer)

        @jax.jit
        def apply(state, plan, graph=graph):
            layer = nnx.merge(graph, state)
            with faults(plan):
                y = layer(x, mask=mask)
            return y, nnx.state(layer, snnx.SDCCounts)

        for name, plan in [("clean", []), ("fault", [fault])]:
            y, counts = apply(state, FaultPlan.from_faults(plan, capacity=1))
            nnx.update(layer, counts)
            out[impl, name] = (y, snnx.sdc_stats(layer))
    for name in ("clean", "fault"):
        assert_close(out["pallas", name][0], out["xla", name][0], _gemm_tolerance(jnp.float32))
        stats = {k: v.tolist() for k, v in out["pallas", name][1].items()}
        assert stats == {k: v.tolist() for k, v in out["xla", name][1].items()}
        assert stats["attn:scores"] == ([1, 1, 0, 0] if name == "fault" else [0, 0, 0, 0])
    assert_close(out["pallas", "fault"][0], out["pallas", "clean"][0], _gemm_tolerance(jnp.float32))


def test_unsupported_feature_falls_back_with_one_warning():
    """Attention dropout is not in the kernel: one PallasFallbackWarning naming it and what to
    do, and the core runs unfused (checked GEMM kernels, no flash kernel)."""
    loss, args = _linen_loss("pallas", dropout_rate=0.1)
    with pytest.warns(PallasFallbackWarning) as record:
        names = _pallas_call_names(jax.make_jaxpr(jax.grad(loss, allow_int=True))(*args))
    messages = [str(w.message) for w in record if w.category is PallasFallbackWarning]
    assert len(messages) == 1, messages
    assert "attn: " in messages[0] and "dropout" in messages[0]
    assert "dropout_rate=0" in messages[0]  # what to do
    assert not set(FLASH_KERNELS) & set(names)
    # float32 scores and context take the XLA path (Hopper's fp32 WGMMA rounds to TF32).
    assert "checked_matmul" not in names


def test_fallback_is_checked_like_the_xla_path():
    """An attention bias falls back: the unfused Pallas core equals the XLA one, faults
    included (forward)."""
    kq, kk, kv, kb = jax.random.split(jax.random.key(3), 4)
    q, k, v = (jax.random.normal(r, (B, T, H, F // H)) for r in (kq, kk, kv))
    bias = jax.random.normal(kb, (B, H, T, T))
    plan = FaultPlan.from_faults(
        [Fault(site="attn:context", kind="inf", index=_idx(BTHD, 0, 3, 1, 5))]
    )

    def core(implementation, plan):
        recorder = SiteRecorder(("attn",), ABFTConfig(implementation=implementation))
        with faults(plan):
            out = protected_attention(q, k, v, bias, recorder=recorder)
        return out, recorder.stacked()

    with pytest.warns(PallasFallbackWarning, match="additive attention bias"):
        out_p, counts_p = jax.jit(functools.partial(core, "pallas"))(plan)
    out_x, counts_x = jax.jit(functools.partial(core, "xla"))(plan)
    assert counts_p.tolist() == counts_x.tolist()
    assert counts_p.sum() == 2  # context: detected and corrected
    assert_close(out_p, out_x, _gemm_tolerance(jnp.float32))


def _lowered_for_cuda(f, *args) -> str:
    with interpret_mode(False), as_h100():  # jax 0.11+ lowers for a named GPU only
        lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
    return lowered.as_text()


@pytest.mark.lowering
@pytest.mark.parametrize("layer", ["linen", "nnx"])
def test_protected_layer_lowers_for_cuda(layer):
    """The whole protected layer (every site checked) with implementation='pallas', forward
    and value_and_grad, lowers for CUDA from this machine: the flash kernels as Triton calls
    (float32; its projection GEMMs take the XLA path, see pallas.matmul)."""
    # Fresh functions, traced here first: jit reuses a trace made outside interpret_mode.
    loss, args = LOSSES[layer]("pallas", config=ABFTConfig())
    grad = jax.value_and_grad(loss, allow_int=True)
    for f, kernels in [(loss, FLASH_KERNELS[:1]), (grad, FLASH_KERNELS)]:
        text = _lowered_for_cuda(f, *args)
        assert "xla.gpu.triton" in text
        for kernel in kernels:
            assert kernel in text, kernel
    if jax.default_backend() != "gpu":
        # Without interpret_mode(False), on a machine without a GPU the kernels are interpreted.
        loss, args = LOSSES[layer]("pallas", config=ABFTConfig())
        text = jax.jit(loss).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "xla.gpu.triton" not in text


def _mosaic_core_case():
    """The layers' protected core on bf16 operands the Mosaic GPU kernel can take (Flax's causal
    mask, head_dim 64, 128 tokens), a fault at ``scores`` and at ``context``: ``(loss, args)``
    with ``loss(implementation, *args)``."""
    from sdcguard.fault_model import GEMM_SITES

    b, t, h, d, dtype = 1, 128, 2, 64, jnp.bfloat16
    keys = jax.random.split(jax.random.key(3), 4)
    q, k, v = (jax.random.normal(r, (b, t, h, d), jnp.float32).astype(dtype) for r in keys[:3])
    cot = jax.random.normal(keys[3], (b, t, h, d), jnp.float32)
    sinks = Counts.zeros(len(GEMM_SITES), 2, dtype=jnp.float32)
    mask = nn.make_causal_mask(jnp.ones((b, t), jnp.int32)).astype(bool)  # as Flax passes it
    plan = FaultPlan.from_faults(
        [
            Fault(site="attn:scores", kind="inf", index=_idx((b, h, t, t), 0, 1, 64, 0)),
            Fault(site="attn:context", kind="nan", index=_idx((b, t, h, d), 0, 127, 0, 63)),
        ]
    )

    def loss(implementation, q, k, v, sinks, plan):
        config = dataclasses.replace(CORE, implementation=implementation)
        recorder = SiteRecorder(("attn",), config, sinks)
        with faults(plan):
            out = protected_attention(q, k, v, None, mask, recorder=recorder)
        return jnp.sum(out.astype(jnp.float32) * cot), (out, recorder.stacked())

    return loss, (q, k, v, sinks, plan)


def test_attention_core_traces_to_the_mosaic_gpu_kernels_in_gpu_interpret_mode():
    """Under GPU interpret mode, the layers' protected core (``protected_attention``, what the
    drop-ins call) with ``implementation='pallas'`` traces, forward and backward, to the three
    Mosaic GPU flash kernels and no other Pallas call.

    The core alone: the layers' projection GEMMs with implementation='pallas' are Triton-backend
    kernels, which the GPU interpreter cannot run. Running it: the slow test below.
    """
    loss, args = _mosaic_core_case()
    grad = jax.grad(functools.partial(loss, "pallas"), argnums=(0, 1, 2, 3), has_aux=True)
    with gpu_interpret_mode():
        jaxpr = jax.make_jaxpr(grad)(*args)
    for kernel in FLASH_KERNELS:  # forward, dK/dV and dQ, all on Mosaic GPU
        assert f"{kernel}_mgpu" in str(jaxpr), kernel
    assert not _pallas_call_names(jaxpr)


# Interpreting the three kernels takes ~40 s; test_flash_mgpu.py runs them against the XLA
# path at this size in CI: slow (suite budget).
@pytest.mark.slow
def test_attention_core_runs_the_mosaic_gpu_kernel_in_gpu_interpret_mode():
    """The same core run: values, gradients and counters as the XLA path's, with the fault at
    ``scores`` and at ``context`` corrected. Eager: see ``gpu_interpret_mode``."""
    loss, args = _mosaic_core_case()
    results = {}
    for impl in ("pallas", "xla"):
        grad = jax.grad(functools.partial(loss, impl), argnums=(0, 1, 2, 3), has_aux=True)
        with gpu_interpret_mode():
            results[impl] = grad(*args)
    (g_p, (y_p, c_p)), (g_x, (y_x, c_x)) = results["pallas"], results["xla"]
    assert c_p.tolist() == c_x.tolist()
    assert int(c_p.sum()) == 4  # scores and context: [1, 1, 0, 0] each
    assert np.asarray(g_p[3]).tolist() == np.asarray(g_x[3]).tolist()  # backward: clean
    _close_to_reference(y_p, y_x, jnp.bfloat16)
    for a, r in zip(g_p[:3], g_x[:3], strict=True):
        _close_to_reference(a, r, jnp.bfloat16)
