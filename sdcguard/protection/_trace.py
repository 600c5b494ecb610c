"""``fn(*args, **kwargs)`` traced to a jaxpr over its array arguments, and its outputs rebuilt.

The naming of sites (:mod:`sdcguard.protection._walk`) takes the Python frames below this
module's as the user's code: the traced function is called from :func:`trace` only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np


def is_array(x) -> bool:
    # ShapeDtypeStruct: list_sites traces abstract arguments (make_jaxpr takes them as is).
    return isinstance(x, jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct)


class Traced(NamedTuple):
    closed: Any  # the ClosedJaxpr of fn over its array arguments
    rebuild: Callable  # the jaxpr's outputs -> fn's output pytree
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

    def flat_fn(*arrays):
        full = list(leaves)
        for i, x in zip(dynamic, arrays, strict=True):
            full[i] = x
        a, k = jax.tree_util.tree_unflatten(in_tree, full)
        out_leaves, tree = jax.tree_util.tree_flatten(fn(*a, **k))
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
        return jax.tree_util.tree_unflatten(
            tree, [next(it_static) if s else next(it_dyn) for s in is_static]
        )

    paths = [jax.tree_util.keystr(with_paths[i][0]) for i in dynamic]
    return Traced(closed, rebuild, arrays, paths)
