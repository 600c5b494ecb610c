"""The one place where sdcguard depends on the installed JAX's version.

Each function names the JAX versions its branches serve. CI runs the suite under the oldest
supported JAX (0.10) and the newest, and the Mosaic GPU lowering tests under 0.11 too (the
GPU images' version); ``tests/test_jax_compat.py`` runs each function on whichever is
installed.
"""

from __future__ import annotations

import jax

JAX_VERSION = jax.__version_info__[:2]


def varying_axes(x) -> frozenset:
    """The manual mesh axes that ``x`` (an array or an aval) varies over inside ``shard_map``.

    jax 0.10-0.12 keep them in the aval's manual axis type, ``aval.mat.varying``; outside a
    ``shard_map`` an aval has none (or no ``mat`` at all).
    """
    aval = x if isinstance(x, jax.core.AbstractValue) else jax.typeof(x)
    return frozenset(getattr(getattr(aval, "mat", None), "varying", None) or ())


def scan_consts_and_carry(params) -> tuple[int, int]:
    """How many operands of a ``scan`` equation are constants, and how many the carry.

    jax 0.10 names the counts (``num_consts``, ``num_carry``); jax 0.11 and 0.12 pack the
    operands' tree in ``ft_in`` (constants, carry, scanned inputs).
    """
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(list(consts)), len(list(carry))


def mosaic_load(ref, layout) -> jax.Array:
    """The whole of a shared-memory ``ref`` loaded into registers in ``layout`` (Mosaic GPU)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if JAX_VERSION >= (0, 12):
        # jax 0.12: `load(src, *, layout, optimized)` takes no index.
        return plgpu.load(ref, layout=layout)
    # jax 0.10 (index required) and 0.11 (index optional, deprecated).
    return plgpu.load(ref, (), layout=layout)
