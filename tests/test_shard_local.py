"""The shard-local mechanism shared by fault injection and the checks (sdcguard._shard_local).

Its sharded paths run in tests/protection/test_sharding.py on 8 devices; here, what it sees on
one device.
"""

import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from sdcguard._shard_local import explicit_spec, replicated, spec_axes


def test_spec_axes_reads_every_form_of_an_entry():
    assert spec_axes(None) == ()
    assert spec_axes(P.UNCONSTRAINED) == ()
    assert spec_axes("data") == ("data",)
    assert spec_axes(("data", "model")) == ("data", "model")


def test_an_unsharded_value_has_no_explicit_spec():
    assert explicit_spec(jnp.ones((4, 4))) is None


def test_replicated_specs_every_leaf():
    assert replicated({"a": jnp.ones(2), "b": (jnp.ones(3),)}) == {"a": P(), "b": (P(),)}
