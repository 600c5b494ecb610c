"""The flash attention front door: which kernel ``kernel="auto"`` picks, and its fallbacks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from sdcguard.protection import pallas
from sdcguard.protection.pallas import _availability, flash as fa, flash_mgpu

from tests.protection.pallas.test_flash_mgpu import _mosaic_qkv
from tests.protection.pallas.test_flash_triton import SMALL, _qkv


@pytest.fixture
def fresh_probes():
    """kernel_unavailable's per-process cache, emptied before and after the test."""
    _availability.kernel_unavailable.cache_clear()
    yield
    _availability.kernel_unavailable.cache_clear()


def _raises(message):
    def probe():
        raise NotImplementedError(message)

    return probe


def test_kernel_choice_and_what_the_mosaic_kernel_refuses():
    q, k, v = _mosaic_qkv(jnp.bfloat16)
    assert fa._choose_kernel("auto", q, k, v, None, fa.BlockSizes()).kernel == "triton"
    with pallas.gpu_interpret_mode():
        assert fa._choose_kernel("auto", q, k, v, None, fa.BlockSizes()).kernel == "mosaic"
        # Tiles below 64 or operands it cannot take: the Triton kernel.
        assert fa._choose_kernel("auto", q, k, v, None, SMALL).kernel == "triton"
        assert fa._choose_kernel("auto", *_qkv(jnp.float32, 1, 128, 128, 1, 64), None,
                                 fa.BlockSizes()).kernel == "triton"  # fmt: skip
    with pytest.raises(ValueError, match="dtype float32"):
        fa.flash_attention(*_qkv(jnp.float32, 1, 128, 128, 1, 64), kernel="mosaic")
    with pytest.raises(ValueError, match="head_dim 16"):
        fa.flash_attention(*_mosaic_qkv(jnp.bfloat16, d=16), kernel="mosaic")
    with pytest.raises(ValueError, match="q_len 96"):
        fa.flash_attention(*_mosaic_qkv(jnp.bfloat16, tq=96), kernel="mosaic")
    with pytest.raises(ValueError, match="kernel='cudnn'"):
        fa.flash_attention(q, k, v, kernel="cudnn")
    with pytest.raises(ValueError, match=r"mosaic_lowering='thread'.*'lane', 'warpgroup'"):
        fa.flash_attention(q, k, v, kernel="mosaic", mosaic_lowering="thread")
    with pytest.raises(ValueError, match=r"lowering='Lane': use one of \['lane', 'warpgroup'\]"):
        flash_mgpu.MosaicBlockSizes(lowering="Lane")


@pytest.mark.lowering
@pytest.mark.parametrize("kernel", ["flash_mgpu", "flash_triton", "matmul_mgpu"])
def test_every_kernel_lowers_on_this_jax(kernel, fresh_probes):
    """Each kernel, a tiny instance with a fault plan, forward and backward, lowers for sm_90a
    on the installed JAX (the probe ``auto`` asks)."""
    assert pallas.kernel_unavailable(kernel) is None


def test_auto_falls_back_to_triton_where_mosaic_does_not_lower(monkeypatch, fresh_probes):
    """The Mosaic GPU kernel's lowering raising (as jax 0.11 did): ``auto`` takes Triton and
    says why; asked for by name, the Mosaic GPU kernel is still chosen."""
    message = "Implicit broadcast not implemented with warpgroup semantics"
    monkeypatch.setitem(_availability.PROBES, "flash_mgpu", _raises(message))
    reason = pallas.kernel_unavailable("flash_mgpu")
    assert reason.startswith(f"flash_mgpu does not lower on jax {jax.__version__}")
    assert message in reason
    q, k, v = _mosaic_qkv(jnp.bfloat16)
    with pallas.gpu_interpret_mode():
        choice = fa._choose_kernel("auto", q, k, v, None, fa.BlockSizes())
        assert choice.kernel == "triton"
        assert message in choice.reason
        assert pallas.kernel_for(q, k, v) == "triton"
        assert fa._choose_kernel("mosaic", q, k, v, None, fa.BlockSizes()).kernel == "mosaic"


def test_auto_says_when_no_kernel_lowers(monkeypatch, fresh_probes):
    """Neither kernel lowers (compiled): ``auto`` raises naming both reasons and the XLA path."""
    monkeypatch.setitem(_availability.PROBES, "flash_mgpu", _raises("no mosaic"))
    monkeypatch.setitem(_availability.PROBES, "flash_triton", _raises("no triton"))
    q, k, v = _mosaic_qkv(jnp.bfloat16)
    with pallas.gpu_interpret_mode(), pytest.raises(RuntimeError, match=r"no mosaic.*no triton"):
        fa._choose_kernel("auto", q, k, v, None, fa.BlockSizes(), interpret=False)
    # Interpreted, the Triton kernels need no lowering.
    assert fa._choose_kernel("auto", q, k, v, None, fa.BlockSizes(), interpret=True).kernel == (
        "triton"
    )


def test_kernel_unavailable_refuses_an_unknown_kernel():
    with pytest.raises(ValueError, match="flash_mgpu"):
        pallas.kernel_unavailable("cudnn")


@pytest.mark.parametrize("jax_version, kernel", [((0, 10), "mosaic"), ((0, 11), "triton")])
def test_on_a_gpu_auto_skips_the_mosaic_kernel_where_it_fails_at_run_time(
    monkeypatch, fresh_probes, jax_version, kernel
):
    """On a Hopper GPU (simulated) with jax 0.11+, where the Mosaic GPU flash kernel lowers but
    stops with an illegal address, ``auto`` takes Triton and says why; under jax 0.10 it runs."""
    monkeypatch.setattr(fa, "on_hopper", lambda: True)
    monkeypatch.setattr(fa, "interpreting", lambda: False)
    monkeypatch.setattr(_availability, "JAX_VERSION", jax_version)
    monkeypatch.setitem(_availability.PROBES, "flash_mgpu", lambda: None)
    monkeypatch.setitem(_availability.PROBES, "flash_triton", lambda: None)
    q, k, v = _mosaic_qkv(jnp.bfloat16)
    choice = fa._choose_kernel("auto", q, k, v, None, fa.BlockSizes())
    assert choice.kernel == kernel
    if kernel == "triton":
        assert "CUDA_ERROR_ILLEGAL_ADDRESS" in choice.reason
        assert "jax 0.11+" in choice.reason
