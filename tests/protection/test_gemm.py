"""Mixed-precision training under ``sdcguard.checked``, and an API that never silently skips.

What users run: bf16 (or fp16) compute with float32 parameters. Every floating GEMM of 16 bits
or more is checked there, a fault at an MLP forward, an MLP backward and an attention GEMM is
corrected, and every setting that would select nothing, or be ignored, is an error that says so.
"""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sdcguard
from sdcguard import ABFTConfig
from sdcguard.fault_model import Fault, FaultPlan, restrict_sites, site_class
from sdcguard.protection import linen as sl, list_sites, total

# A checked clean step against the plain step, per compute dtype: the checked GEMMs are the same
# dot_generals on the same operands, but XLA may keep a low-precision intermediate in float32 in
# one program and round it in the other (`as_stored`), one ulp of the compute dtype at most.
PARITY = {
    jnp.dtype(jnp.bfloat16): (2**-7, 2**-7),
    jnp.dtype(jnp.float16): (2**-10, 2**-10),
    jnp.dtype(jnp.float32): (1e-5, 1e-6),
}


def assert_tree_close(a, b, dtype):
    rtol, atol = PARITY[jnp.dtype(dtype)]
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(
            np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=rtol, atol=atol
        )


# --- A Flax-example LM: bf16/fp16 compute, float32 parameters ---------------------------------


class Block(nn.Module):
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        y = nn.LayerNorm(dtype=self.dtype)(x)
        y = nn.MultiHeadDotProductAttention(
            num_heads=2, dtype=self.dtype, deterministic=True, name="attn"
        )(y, y, mask=nn.make_causal_mask(jnp.ones(x.shape[:2])))
        x = x + y
        h = nn.Dense(32, dtype=self.dtype, name="mlp_in")(nn.LayerNorm(dtype=self.dtype)(x))
        return x + nn.Dense(x.shape[-1], dtype=self.dtype, name="mlp_out")(nn.gelu(h))


class LM(nn.Module):
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(32, 16, dtype=self.dtype, name="embed")(tokens)
        for i in range(2):
            x = Block(self.dtype, name=f"block_{i}")(x)
        return nn.Dense(32, dtype=self.dtype, name="head")(nn.LayerNorm(dtype=self.dtype)(x))


def lm_step(dtype):
    model = LM(dtype)
    tokens = jax.random.randint(jax.random.key(0), (2, 9), 0, 32)
    params = model.init(jax.random.key(1), tokens[:, :-1])["params"]
    tx = optax.adam(1e-3)

    def step(params, opt_state, tokens):
        def loss_fn(p):
            logits = model.apply({"params": p}, tokens[:, :-1]).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, (params, tx.init(params), tokens)


def pick_sites(sites):
    """An MLP forward GEMM, an MLP backward GEMM and an attention GEMM (q·kᵀ: two activations,
    4-D operands), found by what they are rather than by their exact names."""
    forward = [s for s in sites if s.direction == "forward"]
    return {
        "mlp_forward": next(s.name for s in forward if "mlp_in" in s.name),
        "mlp_backward": next(s.name for s in sites if "mlp_out" in s.name and "grad_lhs" in s.name),
        "attention": next(
            s.name
            for s in forward
            if "attn" in s.name and len(s.lhs_shape) == len(s.rhs_shape) == 4
        ),
    }


# fp16 runs with -m slow (the suite's budget); bf16, what users train in, in every run.
@pytest.fixture(
    scope="module",
    params=[jnp.bfloat16, pytest.param(jnp.float16, marks=pytest.mark.slow)],
    ids=lambda d: jnp.dtype(d).name,
)
def lm(request):
    dtype = request.param
    step, args = lm_step(dtype)
    sites = list_sites(step, *args)
    targets = set(pick_sites(sites).values())

    @jax.jit
    def faulty(plan, *args):
        with sdcguard.faults(plan), restrict_sites(targets):  # injection where faulted alone
            return sdcguard.checked(step)(*args)

    plain = jax.jit(step)(*args)
    return dtype, step, args, sites, faulty, plain


def test_every_floating_gemm_of_a_low_precision_model_is_checked(lm):
    dtype, step, args, sites, _, plain = lm
    unchecked = [(s.name, s.why_unchecked) for s in sites if not s.checked]
    assert not unchecked, f"{jnp.dtype(dtype).name} GEMMs left unchecked: {unchecked}"
    assert any(jnp.dtype(dtype).name in s.dtype for s in sites)
    assert {s.direction for s in sites} == {"forward", "grad_lhs", "grad_rhs"}
    out, report = jax.jit(sdcguard.checked(step))(*args)
    assert set(report) == {s.name for s in sites}  # list_sites and the report agree
    np.testing.assert_array_equal(total(report), [0, 0, 0, 0])
    assert_tree_close(out, plain, dtype)


@pytest.mark.parametrize("where", ["mlp_forward", "mlp_backward", "attention"])
def test_inf_in_a_low_precision_step_is_corrected(lm, where):
    dtype, _, args, sites, faulty, plain = lm
    site = pick_sites(sites)[where]
    plan = FaultPlan.from_faults([Fault(site=site, kind="inf", index=5)], capacity=2)
    out, report = faulty(plan, *args)
    np.testing.assert_array_equal(report[site], [1, 1, 0, 0])
    np.testing.assert_array_equal(total(report), [1, 1, 0, 0])
    assert_tree_close(out, plain, dtype)


# --- Dtypes of one GEMM -----------------------------------------------------------------------


def one_gemm_fault(fn, *args):
    """``fn`` under checked with an INF at its first GEMM: ``(report of that site, output)``."""
    (site,) = [s.name for s in list_sites(fn, *args)][:1]
    plan = FaultPlan.from_faults([Fault(site=site, kind="inf", index=3)])

    @jax.jit
    def run(plan, *args):
        with sdcguard.faults(plan):
            return sdcguard.checked(fn)(*args)

    out, report = run(plan, *args)
    return report[site], out


X16 = jax.random.normal(jax.random.key(2), (16, 32))
W16 = jax.random.normal(jax.random.key(3), (32, 24))


@pytest.mark.parametrize(
    "fn, args",
    [
        # The usual mixed-precision dot: bf16 operands, float32 accumulation and output.
        (
            lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32),
            (X16.astype(jnp.bfloat16), W16.astype(jnp.bfloat16)),
        ),
        # ... and its output rounded to bf16 after the float32 accumulation.
        (
            lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16),
            (X16.astype(jnp.bfloat16), W16.astype(jnp.bfloat16)),
        ),
        # Operands of two dtypes: bf16 activations, float32 weights.
        (
            lambda x, w: jax.lax.dot_general(x, w, (((1,), (0,)), ((), ()))),
            (X16.astype(jnp.bfloat16), W16),
        ),
        (lambda x, w: x @ w, (X16.astype(jnp.float16), W16.astype(jnp.float16))),
    ],
    ids=["bf16-acc-f32", "bf16-acc-f32-out-bf16", "bf16-x-f32", "fp16"],
)
def test_mixed_precision_gemms_are_checked_and_corrected(fn, args):
    (site,) = list_sites(fn, *args)
    assert site.checked and site.implementation == "xla", site
    counts, out = one_gemm_fault(fn, *args)
    np.testing.assert_array_equal(counts, [1, 1, 0, 0])
    expected = fn(*args)
    np.testing.assert_array_equal(np.isfinite(out), np.isfinite(expected))
    rtol = 2 * float(jnp.finfo(expected.dtype).eps)
    np.testing.assert_allclose(
        np.asarray(out, np.float32), np.asarray(expected, np.float32), rtol=rtol, atol=rtol
    )


def test_float64_gemms_are_checked_and_corrected():
    with jax.enable_x64(True):
        x, w = X16.astype(jnp.float64), W16.astype(jnp.float64)
        (site,) = list_sites(lambda x, w: x @ w, x, w)
        assert site.checked and site.dtype == "float64"
        counts, out = one_gemm_fault(lambda x, w: x @ w, x, w)
        np.testing.assert_array_equal(counts, [1, 1, 0, 0])
        assert out.dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(out), np.asarray(x @ w), rtol=1e-12, atol=1e-12)


def test_fp8_and_integer_gemms_pass_through_and_say_why():
    def fn(x8, i8):
        fp8 = jnp.dot(x8, x8.T, preferred_element_type=jnp.float32)
        ints = jnp.dot(i8, i8.T, preferred_element_type=jnp.int32)
        return fp8.sum() + ints.sum()

    x8 = X16.astype(jnp.float8_e4m3fn)
    i8 = jnp.arange(16 * 32, dtype=jnp.int32).reshape(16, 32).astype(jnp.int8)
    sites = list_sites(fn, x8, i8)
    assert [(s.checked, s.why_unchecked.split(" (")[0]) for s in sites] == [
        (False, "float8_e4m3fn operands"),
        (False, "int8 operands"),
    ]
    out, report = sdcguard.checked(fn)(x8, i8)
    assert report == {}
    assert out == fn(x8, i8)


# --- Nothing asked for is silently ignored -----------------------------------------------------


def mlp_step(w1, w2, x):
    def loss(w1, w2):
        with jax.named_scope("mlp"):
            return jnp.mean(jnp.tanh(x @ w1) @ w2)

    return jax.grad(loss, argnums=(0, 1))(w1, w2)


W1, W2, X = (
    jax.random.normal(jax.random.key(4), (8, 16)),
    jax.random.normal(jax.random.key(5), (16, 4)),
    jax.random.normal(jax.random.key(6), (2, 8)),
)


@pytest.mark.parametrize("field", ["include", "exclude"])
def test_a_pattern_that_matches_no_site_is_an_error_with_close_matches(field):
    config = ABFTConfig(**{field: ("mpl:loss*",)})
    with pytest.raises(ValueError, match=rf"{field}=.*'mpl:loss\*' matches no GEMM site.*mlp:loss"):
        sdcguard.checked(mlp_step, config)(W1, W2, X)
    # list_sites is where to look: it lists every site, each saying why it is unchecked.
    listed = list_sites(mlp_step, W1, W2, X, config=config)
    assert any(s.checked for s in listed) == (field == "exclude")
    # The explicit opt-out: the pattern selects nothing here, and that is accepted.
    relaxed = ABFTConfig(**{field: ("mpl:loss*",)}, allow_unmatched=True)
    _, report = sdcguard.checked(mlp_step, relaxed)(W1, W2, X)
    assert (report == {}) == (field == "include")


def test_a_fault_plan_site_that_matches_nothing_is_an_error():
    plan = FaultPlan.from_faults([Fault(site="mlp:los", kind="nan", index=0)])

    @jax.jit
    def step(plan, *args):
        with sdcguard.faults(plan):
            return sdcguard.checked(mlp_step)(*args)

    with pytest.raises(ValueError, match=r"unknown site 'mlp:los' \(close: mlp:loss"):
        jax.block_until_ready(step(plan, W1, W2, X))
    # A plan aimed at a real site, or a fault not due at this step, is fine.
    ok = FaultPlan.from_faults([Fault(site="mlp:loss", kind="nan", index=0)])
    _, report = step(ok, W1, W2, X)
    assert report["mlp:loss"].tolist() == [1, 1, 0, 0]
    later = FaultPlan.from_faults([Fault(site="mlp:los", kind="nan", index=0, step=3)])
    jax.block_until_ready(step(later, W1, W2, X))


def test_forward_and_backward_select_gemms_by_direction():
    for config, checked_directions in [
        (ABFTConfig(backward=False), {"forward"}),
        (ABFTConfig(forward=False), {"grad_lhs", "grad_rhs"}),
    ]:
        sites = list_sites(mlp_step, W1, W2, X, config=config)
        assert {s.direction for s in sites if s.checked} == checked_directions
        assert all("not selected" in s.why_unchecked for s in sites if not s.checked)
        _, report = sdcguard.checked(mlp_step, config)(W1, W2, X)
        assert set(report) == {s.name for s in sites if s.checked}


def test_attention_layer_fields_are_refused_by_checked_and_checked_fields_by_the_layers():
    with pytest.raises(ValueError, match=r"sites=.*drop-in attention layers.*include="):
        sdcguard.checked(mlp_step, ABFTConfig(sites=("scores",)))
    layer = sl.MultiHeadDotProductAttention(num_heads=2, abft=ABFTConfig(include=("**attn**",)))
    x = jnp.ones((1, 4, 8))
    with pytest.raises(ValueError, match=r"\['include'\] are read by sdcguard.checked only"):
        layer.init(jax.random.key(0), x)


def test_implementation_applies_under_checked():
    """``'pallas'`` runs the Pallas GEMM (interpret mode off a GPU), ``'auto'`` the XLA path,
    and list_sites says which; each gives the checked result."""
    fn = lambda x, w: x @ w
    x, w = X16.astype(jnp.float16), W16.astype(jnp.float16)
    for implementation, expected in [("auto", "xla"), ("xla", "xla"), ("pallas", "pallas")]:
        config = ABFTConfig(implementation=implementation)
        (site,) = list_sites(fn, x, w, config=config)
        assert site.implementation == expected
        out, report = jax.jit(sdcguard.checked(fn, config))(x, w)
        np.testing.assert_array_equal(report[site.name], [0, 0, 0, 0])
        np.testing.assert_allclose(
            np.asarray(out, np.float32), np.asarray(fn(x, w), np.float32), rtol=2**-9, atol=2**-9
        )


# --- Models written as users write them: NNX Gemma, Equinox, Flax's example LM, in bf16 -------


def gemma_case():
    from flax import nnx

    from sdcguard.models import _gemma as gemma

    config = gemma.GemmaConfig(num_layers=2, dtype="bfloat16")
    model = gemma.Gemma(config, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    tokens = jax.random.randint(jax.random.key(0), (2, 9), 0, config.vocab_size)
    return gemma.train_step, (model, optimizer, tokens)


def equinox_case():
    import equinox as eqx

    from tests.helpers import equinox_model

    step, (model, _, tokens) = equinox_model.adam_case(num_layers=2)
    # bf16 parameters: equinox.nn computes in its parameters' dtype.
    model = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if eqx.is_inexact_array(x) else x, model)
    return step, (model, optax.adam(1e-3).init(eqx.filter(model, eqx.is_array)), tokens)


def flax_example_case():
    from tests.helpers import flax_example_lm

    step, args, _ = flax_example_lm.adam_case(num_layers=2, dtype=jnp.bfloat16)
    return step, args


MODELS = {"gemma-nnx": gemma_case, "equinox": equinox_case, "flax-example": flax_example_case}


# The Flax-example LM runs with -m slow here; the default run corrects faults in a linen LM
# written the same way in test_checked.py.
@pytest.fixture(
    scope="module",
    params=[
        pytest.param(name, marks=pytest.mark.slow) if name == "flax-example" else name
        for name in MODELS
    ],
)
def model_step(request):
    import equinox as eqx

    step, args = MODELS[request.param]()
    sites = list_sites(step, *args)
    targets = _fault_targets(sites)

    @eqx.filter_jit
    def faulty(plan, *args):
        # Injection code at the sites faulted alone: the step compiles about as fast as clean.
        with sdcguard.faults(plan), restrict_sites(targets):
            return sdcguard.checked(step)(*args)

    # The plain step's outputs: a copy of the arguments first, for NNX updates them in place.
    plain = eqx.filter_jit(step)(*jax.tree.map(lambda x: x, args))
    return step, args, sites, faulty, plain


def _fault_targets(sites) -> list[str]:
    """An MLP forward GEMM, an MLP input gradient and an attention core's scores."""
    forward = [s for s in sites if s.direction == "forward"]
    return [
        next(s.name for s in forward if site_class(s.name) == "mlp"),
        next(s.name for s in sites if site_class(s.name) == "mlp" and s.direction == "grad_lhs"),
        next(s.name for s in forward if s.name.endswith(":scores")),
    ]


def _arrays(tree):
    import equinox as eqx
    from flax import nnx

    tree = jax.tree.map(lambda x: x, tree)
    leaves = []
    for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array)):
        leaves.append(x.value if isinstance(x, nnx.Variable) else x)
    return leaves


def test_a_users_bf16_model_is_checked_everywhere_and_corrected(model_step):
    """Every GEMM of the whole Adam step checked; names that tell layers and projections apart;
    a clean step equal to the plain one; an INF at an MLP forward GEMM, an MLP backward GEMM and
    an attention GEMM corrected to the clean step."""
    _step, args, sites, faulty, plain = model_step
    assert all(s.checked for s in sites), [
        (s.name, s.why_unchecked) for s in sites if not s.checked
    ]
    assert any("bfloat16" in s.dtype for s in sites)
    names = [s.name for s in sites]
    assert len(set(names)) == len(names)
    assert not any(re.search(r"_\d+$", n.split(":")[-1].split(".")[0]) for n in names), names
    layer_0 = {n.replace("0", "#", 1) for n in names if "0" in n}
    assert layer_0 & {n.replace("1", "#", 1) for n in names if "1" in n}  # layers differ by index
    out, report = faulty(FaultPlan.from_faults([], capacity=1), *args)
    np.testing.assert_array_equal(total(report), [0, 0, 0, 0])
    for x, y in zip(_arrays(out), _arrays(plain), strict=True):
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), **TOL)
    for site in _fault_targets(sites):
        plan = FaultPlan.from_faults([Fault(site=site, kind="inf", index=3)], capacity=1)
        out, report = faulty(plan, *args)
        np.testing.assert_array_equal(report[site], [1, 1, 0, 0], err_msg=site)
        np.testing.assert_array_equal(total(report), [1, 1, 0, 0], err_msg=site)
        for x, y in zip(_arrays(out), _arrays(plain), strict=True):
            np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), **TOL)


# A bf16 step's outputs against the plain step's: one bf16 ulp (see PARITY).
TOL = dict(zip(("rtol", "atol"), PARITY[jnp.dtype(jnp.bfloat16)], strict=True))


# --- The accumulation the checks assume ---------------------------------------------------------

# Batched contractions whose contracted axis is not the operands' minor one: the dots that
# XLA:CPU (jax 0.11) sums in bf16. Attention's key gradient (scores.grad_rhs) is the first.
BATCHED_NON_MINOR = [
    ("bhqk,bqhd->bhkd", (2, 2, 32, 32), (2, 32, 2, 32)),
    ("bhqk,bkhd->bhqd", (2, 2, 32, 32), (2, 32, 2, 32)),
    ("btd,bte->de", (2, 32, 64), (2, 32, 16)),
]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize(("spec", "lhs_shape", "rhs_shape"), BATCHED_NON_MINOR)
def test_a_checked_low_precision_gemm_sums_in_float32_and_rounds_once(
    spec, lhs_shape, rhs_shape, dtype
):
    """The checks' tolerance assumes float32 accumulation; JAX leaves a bf16 dot's to the
    backend. The checked GEMM equals the float32 sum of its products rounded once to its dtype,
    and raises no alarm, whatever the backend's own dot does with these layouts."""
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, lhs_shape, dtype)
    b = jax.random.normal(kb, rhs_shape, dtype)
    out, report = jax.jit(sdcguard.checked(lambda a, b: jnp.einsum(spec, a, b)))(a, b)
    exact = np.einsum(spec, np.asarray(a, np.float64), np.asarray(b, np.float64))
    # float32 summation error is far below a bf16/fp16 ulp: at most a tie rounds differently.
    rounded_once = np.asarray(jnp.asarray(exact, jnp.float32).astype(dtype), np.float32)
    mismatched = np.mean(np.asarray(out, np.float32) != rounded_once)
    assert mismatched < 1e-3, f"{mismatched:.1%} of the elements are not the rounded float32 sum"
    np.testing.assert_array_equal(total(report), [0, 0, 0, 0])


def test_on_the_cpu_a_checked_bf16_gemm_is_a_float32_dot():
    """What makes the test above hold on every XLA:CPU: the program, not the backend's choice."""
    a = jnp.ones((2, 2, 32, 32), jnp.bfloat16)
    b = jnp.ones((2, 32, 2, 32), jnp.bfloat16)
    fn = sdcguard.checked(lambda a, b: jnp.einsum("bhqk,bqhd->bhkd", a, b))
    text = jax.jit(fn).lower(a, b).as_text()
    if jax.default_backend() != "cpu":
        pytest.skip("the backend's own accumulation: float32 on GPUs")
    # The GEMM itself (the row recomputation of the in-place fix is float32 anyway).
    gemms = [x for x in text.splitlines() if "stablehlo.dot_general" in x and "2x2x32x32x" in x]
    assert len(gemms) == 1 and "xbf16>" not in gemms[0], gemms
