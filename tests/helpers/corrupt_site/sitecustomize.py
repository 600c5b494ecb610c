"""Makes this process get one number wrong, the way faulty hardware does.

Every compiled XLA program run here returns its first floating-point output of more than one
element with 1e-4 added to its first element: the programs (and their fingerprints) are
those of a healthy node, only a result differs. Put on ``PYTHONPATH`` of one replay node by
``tests/replay_launcher.py``; sdcguard's fault injection plays no part.
"""

import jax
import jax.numpy as jnp

_call = jax.stages.Compiled.__call__


def _wrong_once(out):
    leaves, tree = jax.tree.flatten(out)
    for i, x in enumerate(leaves):
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating) and x.size > 1:
            leaves[i] = x.at[(0,) * x.ndim].add(1e-4)
            break
    return jax.tree.unflatten(tree, leaves)


def _faulty_call(self, *args, **kwargs):
    return _wrong_once(_call(self, *args, **kwargs))


jax.stages.Compiled.__call__ = _faulty_call
