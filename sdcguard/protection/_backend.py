"""What the default backend does to a GEMM's arithmetic (docs/abft.md, "Tolerance model")."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sums_low_precision_in_float32() -> bool:
    """Whether the backend computes a bf16/fp16 dot with a float32 result in float32.

    True on GPUs (cuBLAS and Triton GEMMs); False on XLA:CPU, where the checked GEMMs widen
    their operands to float32 first (docs/abft.md, "How the code is cut").
    """
    return jax.default_backend() != "cpu"


def reductions_share_a_pass(backend: str | None = None) -> bool:
    """Whether a check's reductions over one tensor run best as one multi-output reduction.

    True on GPUs and TPUs: one pass over the tensor, one kernel. False on XLA:CPU, where one
    reduction with several outputs measures several times slower than separate reductions
    (docs/performance.md, "Reductions on the CPU").
    """
    return (backend or jax.default_backend()) != "cpu"


def outer_sums_as_products(backend: str | None = None) -> bool:
    """Whether a sum along a tensor's leading (outermost) axes runs best as a product with a
    vector of ones.

    True on XLA:CPU, whose reduction over a leading axis measured 30-50x slower than the same
    sum as a matrix-vector product (docs/performance.md, "Grouped GEMMs and convolutions");
    False elsewhere, where a reduction fuses with what it reads.
    """
    return (backend or jax.default_backend()) == "cpu"


def ungrouped_convolution_groups(backend: str | None = None) -> int:
    """Up to how many groups a convolution's check runs as one ungrouped convolution.

    64 on XLA:CPU, which computes grouped convolutions several times slower than dense ones
    of as many outputs (docs/performance.md, "Grouped GEMMs and convolutions"); 1 elsewhere
    (cuDNN runs grouped convolutions as they are; not measured).
    """
    return 64 if (backend or jax.default_backend()) == "cpu" else 1


def input_rounding(dtype, precision=None, backend: str | None = None) -> float:
    """Unit round-off of the backend's rounding of matmul inputs (0 when exact).

    TF32 on GPU and one bf16 pass on TPU for float32 at default precision; 0 on CPU.
    """
    backend = backend or jax.default_backend()
    highest = precision in (jax.lax.Precision.HIGHEST, "highest", "float32")
    if jnp.dtype(dtype) != jnp.float32 or highest or backend == "cpu":
        return 0.0
    return 2.0**-11 if backend == "gpu" else 2.0**-8  # TF32 on GPU, one bf16 pass on TPU
