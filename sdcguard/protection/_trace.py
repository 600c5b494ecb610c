"""``fn(*args, **kwargs)`` traced to a jaxpr over its array arguments, and its outputs rebuilt.

Flax NNX objects among the arguments (a module, an ``nnx.Optimizer``) may be updated in place
by ``fn``, as an NNX training step does: their state after ``fn`` is an output of the traced
program too, and rebuilding the outputs writes it back into the caller's objects, as
``nnx.jit`` does.

The naming of sites (:mod:`sdcguard.protection._walk`) takes the Python frames below this
module's as the user's code: the traced function is called from :func:`trace` only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import nnx


def is_array(x) -> bool:
    # ShapeDtypeStruct: list_sites traces abstract arguments (make_jaxpr takes them as is).
    return isinstance(x, jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct)


def _is_nnx_object(x) -> bool:
    return isinstance(x, nnx.Pytree)


def nnx_objects(tree) -> list:
    """The Flax NNX objects (modules, optimizers, ``nnx.Rngs``) in ``tree``, outermost ones, in
    order; not the variables of an ``nnx.State``."""
    leaves = jax.tree_util.tree_leaves(tree, is_leaf=_is_nnx_object)
    return [x for x in leaves if _is_nnx_object(x)]


class Traced(NamedTuple):
    closed: Any  # the ClosedJaxpr of fn over its array arguments (and the NNX state after it)
    rebuild: Callable  # the jaxpr's outputs -> fn's output pytree (NNX arguments updated)
    arrays: list  # the array arguments, in the order of the jaxpr's inputs
    paths: list[str]  # each array argument's key path in ``(args, kwargs)``, ``jax.tree_util``'s


def trace(fn, args, kwargs) -> Traced:
    """``fn(*args, **kwargs)`` traced to a jaxpr over its array arguments.

    Only arrays are arguments of the traced program; any other leaf (a Python bool, a
    callable, an Equinox module's static field) stays what it is, as under ``eqx.filter_jit``.
    """
    with_paths, in_tree = jax.tree_util.tree_flatten_with_path((args, kwargs))
    leaves = [x for _, x in with_paths]
    dynamic = [i for i, x in enumerate(leaves) if is_array(x)]
    out_tree = []
    updated = nnx_objects((args, kwargs))  # written back after the run

    def flat_fn(*arrays):
        full = list(leaves)
        for i, x in zip(dynamic, arrays, strict=True):
            full[i] = x
        a, k = jax.tree_util.tree_unflatten(in_tree, full)
        out = fn(*a, **k)
        # fn's output, then the state of each NNX argument as fn left it.
        states = [nnx.state(obj) for obj in nnx_objects((a, k))] if updated else []
        out_leaves, tree = jax.tree_util.tree_flatten((out, states))
        out_tree.append((tree, [not is_array(x) for x in out_leaves]))
        return [x for x in out_leaves if is_array(x)], [x for x in out_leaves if not is_array(x)]

    arrays = [leaves[i] for i in dynamic]
    static_out = []

    def traced(*arrays):
        outs, static = flat_fn(*arrays)
        static_out.append(static)
        return outs

    closed = jax.make_jaxpr(traced)(*arrays)
    tree, is_static = out_tree[0]

    def rebuild(outs):
        it_dyn, it_static = iter(outs), iter(static_out[0])
        out, states = jax.tree_util.tree_unflatten(
            tree, [next(it_static) if s else next(it_dyn) for s in is_static]
        )
        for obj, state in zip(updated, states, strict=True):
            nnx.update(obj, state)
        return out

    paths = [jax.tree_util.keystr(with_paths[i][0]) for i in dynamic]
    return Traced(closed, rebuild, arrays, paths)
