"""Each version-dependent function of ``sdcguard._jax_compat`` on the installed JAX.

CI runs this file under the oldest and the newest supported JAX, so each branch is exercised
by the JAX it serves (the Mosaic GPU ``load`` is exercised by the lowering tests, ``-m
lowering``, under every JAX of the matrix).
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from sdcguard._jax_compat import JAX_VERSION, scan_consts_and_carry, varying_axes


def test_the_version_is_a_supported_one():
    assert JAX_VERSION >= (0, 10), JAX_VERSION


def test_a_scan_equation_counts_its_constants_and_carry_in_either_jax_layout():
    """jax 0.10 names a scan's operand counts (``num_consts``, ``num_carry``); jax 0.11 packs
    the operands' tree in ``ft_in`` (constants, carry, scanned inputs)."""
    w = jnp.ones(())
    closed = jax.make_jaxpr(
        lambda x: jax.lax.scan(lambda c, y: ((c[0] * w + y, c[1] + y), c[0]), (x[0], x[1]), x)
    )(jnp.ones(3))
    (scan,) = [e for e in closed.eqns if e.primitive.name == "scan"]
    assert scan_consts_and_carry(scan.params) == (1, 2)

    class PackedOperands:  # jax 0.11's flat tree of (constants, carry, xs)
        def unpack(self):
            return (None,), (None, None), (None,)

    assert scan_consts_and_carry({"ft_in": PackedOperands()}) == (1, 2)


def test_varying_axes_inside_and_outside_shard_map():
    assert varying_axes(jnp.ones(3)) == frozenset()
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    seen = {}

    def per_device(x):
        seen["x"] = varying_axes(x)
        seen["aval"] = varying_axes(jax.typeof(x))
        return x * 2

    out = jax.shard_map(per_device, mesh=mesh, in_specs=P("data"), out_specs=P("data"))(jnp.ones(4))
    np.testing.assert_array_equal(out, 2 * np.ones(4))
    assert seen == {"x": frozenset({"data"}), "aval": frozenset({"data"})}
