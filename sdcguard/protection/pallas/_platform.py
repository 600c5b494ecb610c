"""Where the kernels run: interpret modes, the Hopper probe, an abstract H100 to lower for.

Version-dependent code does not live here (see ``sdcguard/_jax_compat.py``).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator

import jax
from jax._src import config as jax_config

_INTERPRET: contextvars.ContextVar[bool | None] = contextvars.ContextVar(
    "sdcguard_pallas_interpret", default=None
)

# The device an abstract mesh names to lower for sm_90a from a machine without a GPU.
H100_KIND = "NVIDIA H100 80GB HBM3"
H100_SMS = 132

# XLA:CPU threads GPU interpret mode needs: a kernel's three warpgroups (two compute, one memory)
# and the grid loop that waits for them.
INTERPRETER_POOL_THREADS = 4


@contextlib.contextmanager
def interpret_mode(interpret: bool | None) -> Iterator[None]:
    """Sets how kernels called with ``interpret=None`` run while code is traced in the block.

    ``False`` compiles (to lower for CUDA from a CPU-only machine, together with
    :func:`as_h100`), ``True`` interprets on a GPU (to debug), ``None`` restores the default
    (interpret unless the default backend is a GPU). Read when a function is *traced*: trace a
    fresh function inside.

    Example:
      >>> with interpret_mode(False), as_h100():
      ...     jax.jit(lambda x: layer.apply(variables, x)).trace(x).lower(
      ...         lowering_platforms=("cuda",))
    """
    token = _INTERPRET.set(None if interpret is None else bool(interpret))
    try:
        yield
    finally:
        _INTERPRET.reset(token)


def resolve_interpret(interpret: bool | None) -> bool:
    """``None`` means: as set by :func:`interpret_mode`, else interpret unless the default
    backend is a GPU."""
    if interpret is None:
        interpret = _INTERPRET.get()
    if interpret is None:
        return jax.default_backend() != "gpu"
    return bool(interpret)


def h100_mesh() -> jax.sharding.AbstractMesh:
    """An abstract mesh whose device is an H100: Mosaic GPU and Triton lower for it."""
    from jax.sharding import AbstractDevice, AbstractMesh

    device = AbstractDevice(device_kind=H100_KIND, platform="gpu", num_cores=H100_SMS)
    return AbstractMesh((), (), abstract_device=device)


@contextlib.contextmanager
def as_h100() -> Iterator[None]:
    """Traces and lowers the block as for an H100 (lower with ``lowering_platforms=("cuda",)``).

    Example:
      >>> with as_h100():
      ...     jax.jit(f).trace(q, k, v).lower(lowering_platforms=("cuda",))
    """
    with jax.sharding.use_abstract_mesh(h100_mesh()):
        yield


def num_sms() -> int:
    """SMs of the GPU lowered for: the abstract mesh's device, else the default device."""
    abstract = jax.sharding.get_abstract_mesh().abstract_device
    if abstract is not None:
        return int(abstract.num_cores)
    return int(jax.devices()[0].core_count)


def on_hopper() -> bool:
    """Whether the default device is a Hopper GPU (compute capability 9.x)."""
    if jax.default_backend() != "gpu":
        return False
    return str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9")


def cuda_runtime_version() -> int | None:
    """The CUDA runtime's version (e.g. 12080), None without a CUDA plugin."""
    try:
        from jax._src.lib import cuda_versions
    except ImportError:
        return None
    if cuda_versions is None:  # no CUDA plugin (a CPU-only install)
        return None
    return int(cuda_versions.cuda_runtime_get_version())


# --- Mosaic GPU interpret mode on a CPU ---------------------------------------------------------


def interpreting() -> bool:
    """Whether Pallas kernels traced now run in GPU interpret mode (forced by
    ``force_gpu_interpret_mode``)."""
    return jax_config.pallas_tpu_interpret_mode_context_manager.value is not None


def xla_cpu_pool_threads() -> int:
    """Threads of XLA:CPU's intra-op pool: ``PJRT_NPROC`` (else ``NPROC``) when an integer, else
    the CPUs this process may run on."""
    for name in ("PJRT_NPROC", "NPROC"):
        try:
            return max(0, int(os.environ[name]))
        except (KeyError, ValueError):
            continue
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def require_interpreter_pool(*, fallback: str) -> None:
    """Refuses to start Mosaic GPU interpret mode where it would deadlock (see docs/pallas.md).

    Args:
      fallback: what the caller can do instead, for the error message.

    Raises:
      RuntimeError: XLA:CPU's pool has fewer than :data:`INTERPRETER_POOL_THREADS` threads.
    """
    pool = xla_cpu_pool_threads()
    if pool < INTERPRETER_POOL_THREADS:
        raise RuntimeError(
            f"Mosaic GPU interpret mode needs at least {INTERPRETER_POOL_THREADS} XLA:CPU pool "
            f"threads (its warpgroup threads block inside host callbacks), but this process has "
            f"{pool}: the interpreter would deadlock. Start Python with PJRT_NPROC="
            f"{INTERPRETER_POOL_THREADS} (or more) in the environment (it is read when JAX "
            f"starts its CPU client), or {fallback}."
        )


@contextlib.contextmanager
def mosaic_interpret_mode(*, fallback: str) -> Iterator[None]:
    """Runs the Mosaic GPU kernels traced in the block in GPU interpret mode.

    Args:
      fallback: what the caller can do where the interpreter would deadlock.
    """
    from jax._src.pallas.mosaic_gpu.interpret.params import (
        InterpretGPUParams,
        force_gpu_interpret_mode,
    )

    require_interpreter_pool(fallback=fallback)
    with force_gpu_interpret_mode(InterpretGPUParams()):
        yield


@contextlib.contextmanager
def gpu_interpret_mode() -> Iterator[None]:
    """Runs the Mosaic GPU kernels traced in the block in GPU interpret mode, as on an H100.

    Call the kernels eagerly inside (not under an enclosing ``jax.jit`` with other work): the
    interpreter runs each warpgroup as a thread that blocks on barriers.
    """
    with as_h100(), mosaic_interpret_mode(fallback="run the flash kernels with kernel='triton'"):
        yield


@contextlib.contextmanager
def outside_gpu_interpret_mode(active: bool = True) -> Iterator[None]:
    """Lifts ``force_gpu_interpret_mode`` while the block is traced (when ``active``).

    The Mosaic GPU interpreter has no rules for Triton kernels, which run in Pallas's own
    interpret mode instead; a lowering probe lifts it to lower the real kernel.
    """
    if not (active and interpreting()):
        yield
        return
    state = jax_config.pallas_tpu_interpret_mode_context_manager
    previous = state.swap_local(None)
    try:
        yield
    finally:
        state.set_local(previous)
