"""The one place where the kernels depend on the installed JAX's version.

Each branch names the JAX versions it serves; the lowering tests run under jax 0.10, 0.11 and
0.12 (docs/pallas.md, "Supported JAX versions").
"""

from __future__ import annotations

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu

_JAX = jax.__version_info__[:2]


def mosaic_load(ref, layout) -> jax.Array:
    """The whole of a shared-memory ``ref`` loaded into registers in ``layout`` (Mosaic GPU)."""
    if _JAX >= (0, 12):
        # jax 0.12: `load(src, *, layout, optimized)` takes no index.
        return plgpu.load(ref, layout=layout)
    # jax 0.10 (index required) and 0.11 (index optional, deprecated).
    return plgpu.load(ref, (), layout=layout)
