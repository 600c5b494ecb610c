"""Faults in the outputs of Flax linen modules: sites ``path:output``.

Flax is imported inside the functions: the rest of the fault model does not depend on it.

Example:
  >>> with faults(plan), module_outputs({"decoder/block_0/mlp:output"}):
  ...     logits = model.apply({"params": params}, tokens)
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator

import jax
import jax.numpy as jnp

from sdcguard.fault_model._apply import apply
from sdcguard.fault_model._context import active_plan
from sdcguard.fault_model._sites import is_output_site, output_site_name, split_site


def _check_output_sites(armed: frozenset[str] | None) -> None:
    for name in armed or ():
        if not is_output_site(name):
            hint = (
                "output sites take forward faults only; backward faults exist at attention "
                "GEMM sites (path:scores.grad_lhs ...)"
                if ".grad" in split_site(name)[1]
                else "attention sites are armed by sdcguard.linen.protect, not here"
            )
            raise ValueError(f"{name!r} is not a module-output site 'path:output' ({hint})")


@contextlib.contextmanager
def module_outputs(
    sites: Iterable[str] | None = None, *, seen: dict[str, tuple[int, ...]] | None = None
) -> Iterator[None]:
    """Injects the active plan's faults into the outputs of Flax linen modules (``path:output``).

    Inside the block, the output of every linen module's ``__call__`` whose site is armed gets
    the active plan's faults for that site, as a GEMM site does: forward only, the gradient
    straight through. Unarmed modules are untouched. The calls are intercepted with
    ``flax.linen.intercept_methods``; the model needs no change. Site names (the module path,
    then ``:output``, ``:output.i`` for the i-th of several arrays; the root is
    ``model:output``) are in docs/faults.md; :func:`output_sites` lists a model's.

    Args:
      sites: the output sites to arm; None arms every module output (a diagnostic setting).
      seen: receives the shape of every module output traced inside the block, armed or not.

    Raises:
      ValueError: on entry, for a name that is not an output site; on leaving a block that
        traced module calls, for an armed site that no module produced.

    Example:
      >>> @jax.jit
      ... def loss_fn(params, tokens, plan):
      ...     with faults(plan), module_outputs({"decoder/block_0/mlp:output"}):
      ...         return lm_loss(model.apply({"params": params}, tokens[:, :-1]), tokens[:, 1:])
    """
    import flax.linen as nn

    armed = None if sites is None else frozenset(sites)
    _check_output_sites(armed)
    traced: dict[str, tuple[int, ...]] = {} if seen is None else seen

    def interceptor(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        if context.method_name != "__call__":
            return out
        leaves, tree = jax.tree_util.tree_flatten(out)
        arrays = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
        for j, i in enumerate(arrays):
            x = leaves[i]
            site = output_site_name(context.module.path, j if len(arrays) > 1 else None)
            traced.setdefault(site, tuple(x.shape))
            if (armed is None or site in armed) and jnp.issubdtype(x.dtype, jnp.inexact):
                leaves[i] = apply(x, active_plan(like=x), site)
        return jax.tree_util.tree_unflatten(tree, leaves)

    with nn.intercept_methods(interceptor):
        yield
    missing = sorted((armed or frozenset()) - set(traced))
    if traced and missing:
        listing = "\n  ".join(sorted(traced))
        raise ValueError(
            f"unknown module-output sites {missing}: no module produced them; the module "
            f"outputs are:\n  {listing}"
        )


def output_sites(fn: Callable, *args, **kwargs) -> dict[str, tuple[int, ...]]:
    """Every module-output site that ``fn(*args, **kwargs)`` produces, with its shape.

    Found by abstract evaluation (``jax.eval_shape``): nothing is computed.

    Example:
      >>> sites = output_sites(lambda: model.init(jax.random.key(0), tokens))
      >>> sites["decoder/block_0/mlp:output"]
      (1, 64, 64)
    """
    seen: dict[str, tuple[int, ...]] = {}
    with module_outputs((), seen=seen):
        jax.eval_shape(functools.partial(fn, *args, **kwargs))
    return seen
