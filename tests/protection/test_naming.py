"""Site names of ``sdcguard.checked`` / ``list_sites``: the module paths users see.

Three models as users write them: an NNX Gemma-style model (``sdcguard.models.gemma``), an
Equinox transformer (``tests/equinox_model.py``) and a linen LM in the style of Flax's lm1b
example (``tests/flax_example_lm.py``), each as a whole Adam step. Every GEMM of the step gets a
name of its own that says which layer and which projection it is; adding a layer renames
nothing; an ``include`` pattern selects one layer; the attention core is ``:scores`` /
``:context``, as the drop-ins name it. Then the rules' edges on small plain-JAX programs: what
has no module keeps its call path, tied weights count, a scanned stack is one site.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import sdcguard
from sdcguard.fault_model import Fault, FaultPlan, site_class
from sdcguard.models import _gemma as gemma
from sdcguard.protection import (
    ABFTConfig,
    _naming as naming,
    _walk as walk,
    linen as linen_dropins,
    nnx as nnx_dropins,
    total,
)
from sdcguard.protection._trace import trace

from tests.helpers import equinox_model, flax_example_lm


def gemma_case(num_layers=2, dtype="bfloat16"):
    config = gemma.GemmaConfig(num_layers=num_layers, dtype=dtype)
    model = gemma.Gemma(config, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    tokens = jax.random.randint(jax.random.key(0), (2, 9), 0, config.vocab_size)
    return gemma.train_step, (model, optimizer, tokens)


def equinox_case(num_layers=2, dtype="float32"):
    del dtype  # equinox.nn computes in its parameters' dtype (float32)
    return equinox_model.adam_case(num_layers)


def linen_case(num_layers=2, dtype="bfloat16"):
    step, args, _ = flax_example_lm.adam_case(num_layers, dtype=jnp.dtype(dtype))
    return step, args


CASES = {"gemma": gemma_case, "equinox": equinox_case, "linen": linen_case}
# How each model writes layer i, and a pattern that selects layer 1 (site grammar: ``*`` stays
# within a path component).
LAYER = {
    "gemma": "layers/{}/",
    "equinox": "layers[{}].",
    "linen": "decoder/encoderdecoderblock_{}/",
}
LAYER_1_PATTERN = {
    "gemma": "**layers/1/**",
    "equinox": "**layers[1].**",
    "linen": "**encoderdecoderblock_1/**",
}


def expected_forward(model: str, num_layers: int) -> list[str]:
    """Every forward GEMM of the model, in program order."""
    names = []
    for i in range(num_layers):
        if model == "gemma":
            at = f"layers/{i}"
            names += [
                f"{at}/attn/q_einsum:dot_general",
                f"{at}/attn/kv_einsum:dot_general",
                f"{at}/attn:scores",
                f"{at}/attn:context",
                f"{at}/attn/attn_vec_einsum:dot_general",
                f"{at}/mlp/gate_proj:dot_general",
                f"{at}/mlp/up_proj:dot_general",
                f"{at}/mlp/down_proj:dot_general",
            ]
        elif model == "equinox":
            at = f"layers[{i}]"
            names += [
                f"{at}.attn.query_proj:dot_general",
                f"{at}.attn.key_proj:dot_general",
                f"{at}.attn.value_proj:dot_general",
                f"{at}.attn:scores",
                f"{at}.attn:context",
                f"{at}.attn.output_proj:dot_general",
                f"{at}.mlp.layers[0]:dot_general",
                f"{at}.mlp.layers[1]:dot_general",
            ]
        else:
            attn = f"decoder/encoderdecoderblock_{i}/MultiHeadDotProductAttention_0"
            mlp = f"decoder/encoderdecoderblock_{i}/MlpBlock_0"
            names += [
                f"{attn}/query:dot_general",
                f"{attn}/key:dot_general",
                f"{attn}/value:dot_general",
                f"{attn}:scores",
                f"{attn}:context",
                f"{attn}/out:dot_general",
                f"{mlp}/Dense_0:dot_general",
                f"{mlp}/Dense_1:dot_general",
            ]
    head = {"gemma": "embedder:decode", "equinox": "head:dot_general"}
    return [*names, head.get(model, "decoder/logitdense:dot_general")]


def site_of_each_gemm(fn, *args) -> list[tuple[str, str]]:
    """``(site, direction)`` of every dot_general of ``fn``'s program, one per equation."""
    traced = trace(fn, args, {})
    names = naming.name_gemms(traced.closed.jaxpr, traced.paths)
    return [names[id(g.eqn)] for g in walk.collect_gemms(traced.closed.jaxpr)]


@pytest.fixture(scope="module", params=list(CASES))
def model(request):
    return request.param


@pytest.fixture(scope="module")
def sites(model):
    return site_of_each_gemm(*_flat(CASES[model]()))


def _flat(case):
    step, args = case
    return (step, *args)


def test_forward_gemms_are_named_by_module_path(model, sites):
    forward = [name for name, direction in sites if direction == "forward"]
    assert forward == expected_forward(model, 2)


def test_every_gemm_of_the_adam_step_has_a_name_of_its_own(sites):
    """Each forward GEMM and its two gradient GEMMs: three names, none shared with another."""
    names = [name for name, _ in sites]
    assert len(names) == len(set(names))
    forward = [name for name, direction in sites if direction == "forward"]
    assert sorted(names) == sorted(f + s for f in forward for s in ("", ".grad_lhs", ".grad_rhs"))
    for name, direction in sites:
        assert direction == "forward" or name.endswith("." + direction)


def test_site_classes_tell_projections_mlp_attention_and_head_apart(model, sites):
    qkv = ["projection"] * (2 if model == "gemma" else 3)  # Gemma: q_einsum and kv_einsum
    mlp = ["mlp"] * (3 if model == "gemma" else 2)  # Gemma: gate, up and down
    expected = [*qkv, "attention", "attention", "projection", *mlp]
    layer_0 = [name for name, d in sites if d == "forward" and LAYER[model].format(0) in name]
    assert [site_class(n) for n in layer_0] == expected
    assert {site_class(name) for name, _ in sites} == {"projection", "attention", "mlp", "head"}


def test_adding_a_layer_renames_no_other_site(model, sites):
    three = site_of_each_gemm(*_flat(CASES[model](num_layers=3)))
    before, after = {n for n, _ in sites}, {n for n, _ in three}
    assert before < after
    added = after - before
    assert len(added) == len(before) // 2 - 1  # a layer's GEMMs: the model's, less the head's
    assert all(LAYER[model].format(2) in n for n in added)


def test_an_include_pattern_selects_exactly_one_layer(model):
    step, args = CASES[model](dtype="float32")  # bf16 GEMMs: see _select.why_unchecked
    config = ABFTConfig(include=(LAYER_1_PATTERN[model],))
    listed = sdcguard.list_sites(step, *args, config=config)
    checked = {s.name for s in listed if s.checked}
    layer_1 = {s.name for s in listed if LAYER[model].format(1) in s.name}
    assert checked == layer_1 and len(checked) == 3 * 8
    assert {s.why_unchecked for s in listed if not s.checked} == {"excluded by include/exclude"}


def test_linen_attention_core_is_named_as_the_dropins_name_it():
    step, (params, opt_state, tokens), lm = flax_example_lm.adam_case()
    with linen_dropins.protect():
        _, state = lm.apply({"params": params}, tokens[:, :-1], mutable=["sdc"])
    core = ("scores", "context")
    dropins = {n for n in linen_dropins.site_counts(state["sdc"]) if n.rpartition(":")[2] in core}
    listed = {s.name for s in sdcguard.list_sites(step, params, opt_state, tokens)}
    assert len(dropins) == 4 and dropins <= listed


class NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=8, decode=False, rngs=rngs)
        self.mlp = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(x)
        return x + self.mlp(x)


class NnxNet(nnx.Module):
    def __init__(self, rngs):
        self.blocks = nnx.List([NnxBlock(rngs) for _ in range(2)])

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_nnx_attention_core_is_named_as_the_nnx_dropins_name_it():
    x = jnp.ones((2, 4, 8))
    protected = nnx_dropins.protect(NnxNet(nnx.Rngs(0)))
    protected(x)
    core = ("scores", "context")
    dropins = {n for n in nnx_dropins.sdc_stats(protected) if n.rpartition(":")[2] in core}
    listed = {s.name for s in sdcguard.list_sites(lambda m, x: m(x).sum(), NnxNet(nnx.Rngs(0)), x)}
    assert len(dropins) == 4 and dropins <= listed
    assert "blocks/1/attn/query:dot_general" in listed


@pytest.mark.slow  # compiles the whole checked step of the linen LM
def test_a_fault_at_a_named_attention_site_is_caught_there():
    step, args, _ = flax_example_lm.adam_case(dtype=jnp.float32)
    site = "decoder/encoderdecoderblock_1/MultiHeadDotProductAttention_0:scores"
    plan = FaultPlan.from_faults([Fault(site=site, kind="inf", index=3)], capacity=1)

    @jax.jit
    def run(plan, *args):
        with sdcguard.faults(plan):
            return sdcguard.checked(step)(*args)

    _, report = run(plan, *args)
    np.testing.assert_array_equal(report[site], [1, 1, 0, 0])
    np.testing.assert_array_equal(total(report), [1, 1, 0, 0])


def test_nnx_split_state_and_module_give_the_same_names():
    model = gemma.Gemma(gemma.GemmaConfig(num_layers=1), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    tokens = jnp.zeros((1, 9), jnp.int32)

    def from_state(state, tokens):
        return gemma.loss(nnx.merge(graphdef, state), tokens)

    by_module = site_of_each_gemm(gemma.loss, model, tokens)
    assert site_of_each_gemm(from_state, state, tokens) == by_module
    assert by_module[0] == ("layers/0/attn/q_einsum:dot_general", "forward")


# --- The rules' edges, on plain JAX ------------------------------------------------------------

X = jnp.ones((4, 8))


def mlp_loss(weights, x):
    for w in weights:
        x = jnp.tanh(x @ w)
    return x.sum()


def mlp_step(weights, x):
    return jax.grad(mlp_loss)(weights, x)


def test_arrays_that_no_module_owns_keep_the_call_path():
    sites = site_of_each_gemm(mlp_step, [jnp.ones((8, 8))] * 2, X)
    forward = [n for n, d in sites if d == "forward"]
    assert forward == ["mlp_loss:dot_general", "mlp_loss:dot_general_1"]


def test_weights_of_one_module_keep_their_leaf_names():
    def attn(params, x):
        p = params["attn"]
        scores = (x @ p["wq"]) @ (x @ p["wk"]).T
        return (jax.nn.softmax(scores) @ (x @ p["wv"])).sum()

    params = {"attn": {k: jnp.ones((8, 8)) for k in ("wq", "wk", "wv")}}
    forward = [n for n, d in site_of_each_gemm(attn, params, X) if d == "forward"]
    assert forward == [
        "attn/wq:dot_general",
        "attn/wk:dot_general",
        "attn:scores",
        "attn/wv:dot_general",
        "attn:context",
    ]


def test_a_weight_read_twice_counts_its_uses():
    def tied(params, x):
        h = x @ params["embed"]["table"].T
        return (h @ params["embed"]["table"]).sum()

    params = {"embed": {"table": jnp.ones((16, 8))}}
    forward = [n for n, d in site_of_each_gemm(tied, params, X) if d == "forward"]
    assert forward == ["embed:dot_general", "embed:dot_general_1"]


@pytest.mark.parametrize("grouped", [False, True])
def test_a_weight_applied_twice_in_a_loop_gives_each_gradient_its_own_name(grouped):
    # ALBERT-style sharing: one weight, two forward GEMMs at one line of code. Each input
    # gradient reads the weight and its own output's cotangent, which the weight gradient of
    # the same forward GEMM reads too: that tells the two apart.
    sizes = jnp.array([2, 2], jnp.int32)

    def shared(params, x):
        w = params["shared"]["w"]
        x = x @ params["embed"]["kernel"]
        for _ in range(2):
            x = jax.lax.ragged_dot(x, w, sizes) if grouped else x @ w[0]
            x = jnp.sin(x)
        return x.sum()

    params = {"shared": {"w": jnp.ones((2, 8, 8)) / 8}, "embed": {"kernel": jnp.ones((8, 8))}}
    step = jax.grad(shared)
    names = [s.name for s in sdcguard.list_sites(step, params, X)]
    assert len(names) == len(set(names)) == 8, names
    kind = "ragged_dot_general" if grouped else "dot_general"
    for d in ("", ".grad_lhs", ".grad_rhs"):
        assert f"shared:{kind}{d}" in names and f"shared:{kind}_1{d}" in names
    for site in [n for n in names if n.startswith("shared:") and n.endswith(".grad_lhs")]:
        plan = FaultPlan.from_faults([Fault(site=site, kind="nan", index=3)], capacity=2)

        @jax.jit
        def go(plan, params, x):
            with sdcguard.faults(plan):
                return sdcguard.checked(step)(params, x)

        _, report = go(plan, params, X)
        np.testing.assert_array_equal(report[site], [1, 1, 0, 0])  # struck once, not twice


def test_a_scanned_layer_stack_is_one_site_per_module():
    def stack(params, x):
        def layer(h, p):
            return jnp.tanh(jnp.tanh(h @ p["mlp"]["wi"]["kernel"]) @ p["mlp"]["wo"]["kernel"]), None

        return jax.lax.scan(layer, x, params["layers"])[0].sum()

    stacked = {"layers": {"mlp": {k: {"kernel": jnp.ones((3, 8, 8))} for k in ("wi", "wo")}}}
    names = {n for n, _ in site_of_each_gemm(jax.grad(stack), stacked, X)}
    forward = ("layers/mlp/wi:dot_general", "layers/mlp/wo:dot_general")
    assert names == {f + s for f in forward for s in ("", ".grad_lhs", ".grad_rhs")}


def test_linen_scopes_lose_the_root_class_where_no_parameter_names_a_gemm():
    class Gram(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(16, 8, name="embed")(tokens)
            with jax.named_scope("gram"):
                g = x @ jnp.swapaxes(x, -1, -2)  # embeddings times embeddings: no GEMM made them
            return nn.Dense(4, name="out")(g).sum()

    tokens = jnp.zeros((2, 5), jnp.int32)
    params = Gram().init(jax.random.key(0), tokens)["params"]
    forward = [n for n, d in site_of_each_gemm(Gram().apply, {"params": params}, tokens)]
    assert forward == ["gram:dot_general", "out:dot_general"]


def two_layer_net(params, x):
    a = x @ params["layers"][0]["proj"]["w"]
    b = jnp.tanh(a) @ params["layers"][1]["mlp"]["up"]["w"]
    return (a.T @ b).sum()


def two_layer_step(params, x):
    return two_layer_net(params, x)


def test_activations_from_far_apart_are_not_called_attention():
    """A GEMM of two activations made in different layers is not one module's: call path."""
    params = {
        "layers": [{"proj": {"w": jnp.ones((8, 8))}}, {"mlp": {"up": {"w": jnp.ones((8, 8))}}}]
    }
    forward = [n for n, d in site_of_each_gemm(two_layer_step, params, X) if d == "forward"]
    assert forward == [
        "layers/0/proj:dot_general",
        "layers/1/mlp/up:dot_general",
        "two_layer_net:dot_general",
    ]


@pytest.mark.parametrize(
    ("path", "module"),
    [
        (
            "[0][0]['params']['decoder']['block_0']['mlp']['fc_in']['kernel']",
            "decoder/block_0/mlp/fc_in",
        ),
        ("[0][0]['decoder']['block_0']['attn']['query']['kernel']", "decoder/block_0/attn/query"),
        ("[0][0].params['encoder']['out']['kernel']", "encoder/out"),  # a TrainState's field
        ("[0][0].layers[0].attn.q_einsum.kernel.value", "layers/0/attn/q_einsum"),  # NNX
        ("[0][2]['layers'][1]['mlp']['up_proj']['kernel'].value", "layers/1/mlp/up_proj"),  # state
        ("[0][0].layers[0].mlp.layers[1].weight", "layers[0].mlp.layers[1]"),  # Equinox
        ("[1]['model'].head.weight", "head"),  # a keyword argument
        ("[0][1]", None),  # a bare array
        ("[0][0]['kernel']", None),  # a weight at the root: no module
        ("[0][0][1]", None),
        ("", None),
    ],
)
def test_module_of_a_key_path(path, module):
    found = naming.module_of_path(path)
    assert (None if found is None else str(found[0])) == module
