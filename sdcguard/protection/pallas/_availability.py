"""Which kernels lower on the installed JAX: each is lowered once per process, tiny, for sm_90a.

``kernel="auto"`` (the flash front door) and ``implementation="auto"`` (the protection layer)
ask :func:`kernel_unavailable` before they pick a kernel, and fall back where it gives a reason.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from sdcguard import fault_model
from sdcguard._jax_compat import JAX_VERSION
from sdcguard.protection._config import ABFTConfig
from sdcguard.protection.pallas import flash_mgpu, flash_triton, matmul
from sdcguard.protection.pallas._platform import as_h100, outside_gpu_interpret_mode
from sdcguard.protection.pallas._tiles import fault_table


def _plan(*sites: str) -> fault_model.FaultPlan:
    faults = [fault_model.Fault(site=f"probe:{s}", kind="nan", index=3) for s in sites]
    return fault_model.FaultPlan.from_faults(faults)


def _tables(plan, shape, *sites):
    return {s: fault_table(plan, f"probe:{s}", shape, lambda i: i) for s in sites}


def _lower(f, *args) -> None:
    """Lowers ``f`` for CUDA as for an H100 (GPU interpret mode lifted)."""
    with outside_gpu_interpret_mode(), as_h100():
        jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))


def _probe_flash_mgpu() -> None:
    q = jax.ShapeDtypeStruct((1, 128, 1, 64), jnp.bfloat16)
    lse = jax.ShapeDtypeStruct((1, 1, 128), jnp.float32)
    kw = dict(causal=True, sm_scale=1.0, config=ABFTConfig(), blocks=flash_mgpu.MosaicBlockSizes())

    def forward(q, plan):
        return flash_mgpu.forward(q, q, q, tables=_tables(plan, (1, 1, 128, 128), "scores"), **kw)

    def backward(q, lse, plan):
        tables = _tables(plan, (1, 128, 1, 64), "scores.grad_lhs")
        return flash_mgpu.backward(q, q, q, q, lse, q, tables=tables, **kw)

    _lower(forward, q, _plan("scores"))
    _lower(backward, q, lse, _plan("scores.grad_lhs"))


def _probe_flash_triton() -> None:
    q = jax.ShapeDtypeStruct((1, 16, 1, 16), jnp.float32)
    lse = jax.ShapeDtypeStruct((1, 1, 16), jnp.float32)
    st = flash_triton.Settings(
        causal=True, sm_scale=1.0, config=ABFTConfig(), precision=None,
        block_sizes=flash_triton.BlockSizes.fitting(16, 16), interpret=False, mask_shape=None,
    )  # fmt: skip

    def forward(q, plan):
        return flash_triton.forward(st, q, q, q, None, _tables(plan, (1, 1, 16, 16), "scores"))

    def backward(q, lse, plan):
        tables = _tables(plan, (1, 1, 16, 16), "context.grad_lhs")
        return flash_triton.backward(st, q, q, q, None, tables, q, lse, q)

    _lower(forward, q, _plan("scores"))
    _lower(backward, q, lse, _plan("context.grad_lhs"))


def _probe_matmul_mgpu() -> None:
    a = jax.ShapeDtypeStruct((1, 256, 64), jnp.bfloat16)
    b = jax.ShapeDtypeStruct((1, 64, 128), jnp.bfloat16)

    def f(a, b, plan):
        return matmul.checked_matmul(a, b, plan=plan, site="probe:out", interpret=False)

    _lower(f, a, b, _plan("out"))


# Each kernel's probe: lowers a tiny instance (forward and backward) with a fault plan.
PROBES: dict[str, Callable[[], None]] = {
    "flash_mgpu": _probe_flash_mgpu,
    "flash_triton": _probe_flash_triton,
    "matmul_mgpu": _probe_matmul_mgpu,
}


# Kernels that lower but have not run correctly on a GPU, by the first JAX version concerned:
# the flash kernel under Lane semantics stopped with CUDA_ERROR_ILLEGAL_ADDRESS on an H200 with
# jax 0.11.2, and its Warpgroup lowering (the default now) has not been run on a GPU yet
# (docs/pallas.md, "Supported JAX versions"). Interpret mode runs it correctly.
FAILS_ON_GPU = {"flash_mgpu": (0, 11)}


def fails_on_gpu(kernel: str) -> str | None:
    """Why ``kernel`` is not run on a GPU with the installed JAX, though it lowers (None: it runs).

    Example:
      >>> reason = fails_on_gpu("flash_mgpu")  # on jax 0.11 or newer
      >>> reason.startswith("flash_mgpu has not run correctly on a GPU with jax 0.11+")
      True
    """
    first = FAILS_ON_GPU.get(kernel)
    if first is None or first > JAX_VERSION:
        return None
    return (
        f"{kernel} has not run correctly on a GPU with jax {first[0]}.{first[1]}+ "
        "(Lane semantics: CUDA_ERROR_ILLEGAL_ADDRESS on an H200; Warpgroup: not yet run on one)"
    )


@functools.cache
def kernel_unavailable(kernel: str) -> str | None:
    """Why ``kernel`` cannot be lowered for sm_90a on the installed JAX (None: it can).

    Lowers a tiny instance once per process (cached), from any machine.

    Args:
      kernel: ``"flash_mgpu"``, ``"flash_triton"`` or ``"matmul_mgpu"``.

    Returns:
      None, or the reason: the JAX version and the lowering's error.

    Example:
      >>> if kernel_unavailable("matmul_mgpu") is not None: implementation = "xla"
    """
    if kernel not in PROBES:
        raise ValueError(f"kernel={kernel!r}: use one of {sorted(PROBES)}")
    try:
        PROBES[kernel]()
    except Exception as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return f"{kernel} does not lower on jax {jax.__version__}: {type(error).__name__}: {first}"
    return None
