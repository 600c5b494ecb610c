"""The checked GEMM kernel lowers once per configuration: identical GEMMs share one kernel.

A Mosaic GPU custom call carries its kernel as a serialized MLIR module, and its kernel hash
is the module's SHA-256; XLA compiles one kernel per hash. The module's locations hold the
Python traceback of the trace that made it, so a kernel traced anew at every call site would
be a kernel of its own at each site (issue 36: a d-1024 step did not finish compiling).
These tests lower for sm_90a from this machine (``-m lowering``) and count the kernels.
"""

from __future__ import annotations

import collections
import re

import jax
import jax.numpy as jnp
import pytest

import sdcguard
from sdcguard import ABFTConfig
from sdcguard.protection.pallas import as_h100, interpret_mode, matmul

_CALL = "stablehlo.custom_call @mosaic_gpu"
_HASH = re.compile(r'kernel_hash = "((?:[^"\\]|\\.)*)"')


def _kernels(text: str) -> dict[str, set[str]]:
    """``{kernel hash: {operand and result types of its custom calls}}`` of a lowered module."""
    kernels = collections.defaultdict(set)
    for line in text.splitlines():
        if _CALL in line:
            (kernel_hash,) = _HASH.findall(line)
            kernels[kernel_hash].add(line.rsplit(" : ", 1)[1])
    return kernels


def _lowered_for_h100(f, *args) -> str:
    # Fresh functions, traced here first: jit reuses a trace made outside interpret_mode.
    with interpret_mode(False), as_h100():
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _mlp_step(w, x):
    """Three GEMMs of one shape at three call sites, forward and backward."""

    def loss(w):
        h = jnp.tanh(x @ w[0])
        h = jnp.tanh(h @ w[1])
        h = h @ w[2]
        return jnp.sum(jnp.square(h.astype(jnp.float32)))

    return jax.grad(loss)(w)


@pytest.mark.lowering
def test_identical_gemms_of_a_checked_step_share_one_kernel():
    """A checked step with implementation='pallas' (3 forward, 2 grad_lhs, 3 grad_rhs GEMMs of
    two configurations) lowers to two kernels per distinct configuration (the detection-only
    one and the correcting one behind it): each kernel hash has one signature (shapes and
    dtypes) and each signature two kernel hashes."""
    w = jax.ShapeDtypeStruct((3, 128, 128), jnp.bfloat16)
    x = jax.ShapeDtypeStruct((256, 128), jnp.bfloat16)
    config = ABFTConfig(implementation="pallas")
    sites = [s for s in sdcguard.list_sites(_mlp_step, w, x, config=config) if s.checked]
    kernels = _kernels(_lowered_for_h100(sdcguard.checked(_mlp_step, config), w, x))
    signatures = set().union(*kernels.values())
    assert all(len(types) == 1 for types in kernels.values()), kernels
    assert len(signatures) == 2 and len(kernels) == 2 * len(signatures)
    assert len(sites) == 8  # more GEMMs than kernels: the identical ones share


@pytest.mark.lowering
@pytest.mark.parametrize("check", [True, False], ids=["checked", "unchecked"])
def test_checked_matmul_at_two_call_sites_is_one_kernel(check):
    """The same GEMM called from two lines is one kernel; another shape or another static
    setting (detect only) is another kernel."""
    a = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16)
    b = jax.ShapeDtypeStruct((256, 128), jnp.bfloat16)

    def f(a, b):
        c1, _ = matmul.checked_matmul(a, b, check=check)
        c2, _ = matmul.checked_matmul(a * 2, b, check=check)
        c3, _ = matmul.checked_matmul(a[:256], b, check=check)  # another shape
        c4, _ = matmul.checked_matmul(a, b, check=check, correct=False)
        return c1, c2, c3, c4

    kernels = _kernels(_lowered_for_h100(f, a, b))
    signatures = set().union(*kernels.values())
    # Checked, c1 and c3 run the detection-only kernel and the correcting one, and c4 is c1's
    # detection-only kernel. Unchecked, `correct` does not reach the kernel: c4 is c1's kernel.
    assert len(signatures) == 2
    assert len(kernels) == (4 if check else 2), kernels


def test_kernel_settings_default_to_abft_config_and_key_unchecked_launches_alike():
    """A launch's settings default to ``ABFTConfig``'s ``near_inf`` (not 0, which would locate
    every element of a flagged row directly), and unchecked launches that differ only in the
    epilogue's settings are one jit key (one compiled kernel)."""
    from sdcguard.protection.pallas.matmul_mgpu import KernelSettings

    assert KernelSettings(out_dtype=jnp.bfloat16).near_inf == ABFTConfig().near_inf
    plain = KernelSettings(out_dtype=jnp.bfloat16, check=False)
    other = KernelSettings(out_dtype="bfloat16", check=False, correct=False, near_inf=5.0,
                           num_faults=2)  # fmt: skip
    assert plain == other and hash(plain) == hash(other)
    assert KernelSettings(out_dtype=jnp.bfloat16, near_inf=5.0) != KernelSettings(
        out_dtype=jnp.bfloat16
    )
