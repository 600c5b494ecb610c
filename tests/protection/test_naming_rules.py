"""GEMMs of custom_vjp / custom_jvp rules: named and directed as backward GEMMs (issue 37)."""

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp

import sdcguard


@jax.custom_vjp
def _attention(q, k, v):
    return jax.nn.softmax(q @ k.T) @ v


def _attention_fwd(q, k, v):
    p = jax.nn.softmax(q @ k.T)
    return p @ v, (q, k, v, p)


def _attention_bwd(res, g):
    q, k, v, p = res
    dv = p.T @ g
    dp = g @ v.T
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    return ds @ k, ds.T @ q, dv


_attention.defvjp(_attention_fwd, _attention_bwd)


class _Attn(nn.Module):
    @nn.compact
    def __call__(self, x):
        q = nn.Dense(8, name="query")(x)
        k = nn.Dense(8, name="key")(x)
        v = nn.Dense(8, name="value")(x)
        return nn.Dense(8, name="out")(_attention(q, k, v))


class _Model(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(2):
            x = x + _Attn(name=f"attn_{i}")(x)
        return x


def _linen_case():
    model, x = _Model(), jnp.linspace(-1, 1, 32).reshape(4, 8)
    params = model.init(jax.random.key(0), x)["params"]
    return jax.grad(lambda p, x: model.apply({"params": p}, x).sum()), (params, x)


def test_custom_vjp_rule_gemms_are_the_gradients_they_compute():
    grad, args = _linen_case()
    sites = {s.name: s.direction for s in sdcguard.list_sites(grad, *args)}
    for i in range(2):
        assert sites[f"attn_{i}:scores"] == sites[f"attn_{i}:context"] == "forward"
        assert sites[f"attn_{i}:context.grad_rhs"] == "grad_rhs"  # dv = pᵀ·g
        assert sites[f"attn_{i}:context.grad_lhs"] == "grad_lhs"  # dp = g·vᵀ
        assert sites[f"attn_{i}:scores.grad_lhs"] == "grad_lhs"  # dq = ds·k
        assert sites[f"attn_{i}:scores.grad_rhs"] == "grad_rhs"  # dk = dsᵀ·q
    assert not any(":dot_general_" in n for n in sites)  # no call-path names


def test_forward_false_still_checks_the_rules_gemms():
    grad, args = _linen_case()
    config = sdcguard.ABFTConfig(forward=False)
    listed = sdcguard.list_sites(grad, *args, config=config)
    rule = [s for s in listed if s.name.startswith("attn_0:") and ".grad_" in s.name]
    assert len(rule) == 4 and all(s.checked for s in rule)
    assert not any(s.checked for s in listed if s.direction == "forward")
    _, report = jax.jit(sdcguard.checked(grad, config))(*args)
    assert "attn_0:scores.grad_lhs" in report


@eqx.filter_custom_vjp
def _flash(qkv):
    q, k, v = qkv
    return jax.nn.softmax(q @ k.T) @ v


@_flash.def_fwd
def _flash_fwd(perturbed, qkv):
    q, k, v = qkv
    return jax.nn.softmax(q @ k.T) @ v, None


@_flash.def_bwd
def _flash_bwd(residuals, g, perturbed, qkv):
    q, k, v = qkv
    p = jax.nn.softmax((q * 1.0) @ k.T)  # recomputed from q and k, as a flash kernel does
    dv = p.T @ g
    dp = g @ v.T
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    return (ds @ k, ds.T @ q, dv)


class _EqxAttn(eqx.Module):
    query_proj: eqx.nn.Linear
    key_proj: eqx.nn.Linear
    value_proj: eqx.nn.Linear

    def __init__(self, key):
        kq, kk, kv = jax.random.split(key, 3)
        self.query_proj = eqx.nn.Linear(8, 8, key=kq)
        self.key_proj = eqx.nn.Linear(8, 8, key=kk)
        self.value_proj = eqx.nn.Linear(8, 8, key=kv)

    def __call__(self, x):
        q = jax.vmap(self.query_proj)(x)
        k = jax.vmap(self.key_proj)(x)
        v = jax.vmap(self.value_proj)(x)
        return _flash((q, k, v))


class _EqxModel(eqx.Module):
    layers: list

    def __init__(self):
        self.layers = [_EqxAttn(jax.random.key(i)) for i in range(2)]

    def __call__(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def test_equinox_filter_custom_vjp_rule_named_by_its_module():
    grad = eqx.filter_grad(lambda m, x: m(x).sum())
    listed = sdcguard.list_sites(grad, _EqxModel(), jnp.linspace(-1, 1, 32).reshape(4, 8))
    sites = {s.name: s.direction for s in listed}
    for i in range(2):
        # The recomputed scores and pᵀ·g (p recomputed): GEMMs of the rule, by the layer.
        assert sites[f"layers[{i}]:backward"] == sites[f"layers[{i}]:backward_1"] == "backward"
        assert sites[f"layers[{i}]:context.grad_lhs"] == "grad_lhs"  # reads v, not p
        assert sites[f"layers[{i}]:scores.grad_lhs"] == "grad_lhs"
    assert "forward" not in {d for n, d in sites.items() if "backward" in n or ".grad_" in n}
    assert not any("_flash_bwd" in n or ":dot_general_" in n for n in sites)
    config = sdcguard.ABFTConfig(forward=False)
    unchecked = {s.name for s in sdcguard.list_sites(
        grad, _EqxModel(), jnp.ones((4, 8)), config=config) if not s.checked}  # fmt: skip
    assert "layers[0]:backward" not in unchecked


def test_scanned_sites_say_how_many_iterations_they_cover():
    def stack(ws, x):
        def layer(x, w):
            return jnp.tanh(x @ w), None

        return jax.lax.scan(layer, x, ws)[0].sum()

    ws, x = jnp.ones((3, 4, 4)) * 0.1, jnp.ones((2, 4))
    listed = sdcguard.list_sites(jax.grad(stack), ws, x)
    assert {s.direction: s.iterations for s in listed} == {
        "forward": 3,
        "grad_lhs": 3,
        "grad_rhs": 3,
    }
    plain = sdcguard.list_sites(lambda w, x: (x @ w).sum(), ws[0], x)
    assert [s.iterations for s in plain] == [1]
