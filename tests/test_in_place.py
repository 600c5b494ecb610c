"""``sdcguard._in_place``: conditionals that leave their operands in place when they do nothing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdcguard._in_place import apply_if, indexed_cond


@pytest.mark.parametrize("flag", [False, True])
def test_apply_if_applies_only_when_flagged(flag):
    x = {"a": jnp.arange(4.0), "b": jnp.ones((2, 3), jnp.bfloat16)}
    out = jax.jit(lambda f, x: apply_if(f, lambda t: jax.tree.map(lambda v: v * 2, t), x))(
        jnp.bool_(flag), x
    )
    for key in x:
        expected = x[key] * 2 if flag else x[key]
        np.testing.assert_array_equal(np.asarray(out[key]), np.asarray(expected))


@pytest.mark.parametrize("flag", [False, True])
def test_indexed_cond_takes_the_branch_lax_cond_takes(flag):
    def if_true(x, y):
        return x + y, {"n": jnp.int32(1)}

    def if_false(x, y):
        return x, {"n": jnp.int32(0)}

    x, y = jnp.arange(6.0).reshape(2, 3), jnp.full((2, 3), 10.0)
    got = jax.jit(lambda f: indexed_cond(f, if_true, if_false, x, y))(jnp.bool_(flag))
    want = jax.lax.cond(flag, if_true, if_false, x, y)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_indexed_cond_refuses_branches_of_different_structure():
    with pytest.raises(TypeError):
        indexed_cond(jnp.bool_(True), lambda x: (x, x), lambda x: x, jnp.ones(3))
