"""Per-dtype tolerances for comparing a corrected (or protected) result with the clean one.

A corrected element is rebuilt from a checksum minus the rest of its line, summed in float32
and rounded once to the output dtype, so it may differ from the clean element by a few units of
the output's last place relative to the line's magnitude; everything uncorrupted is untouched.
"""

import jax.numpy as jnp
import numpy as np

# dtype -> (rtol, atol) for values of order 1.
TOLERANCES = {
    jnp.dtype(jnp.float32): (1e-5, 1e-5),  # ~100 float32 ulps: float32 line-sum rounding
    jnp.dtype(jnp.bfloat16): (2**-6, 2**-5),  # 2-4 bf16 ulps: one rounding of a float32 sum
    jnp.dtype(jnp.float16): (2**-9, 2**-9),  # 2 fp16 ulps: one rounding of a float32 sum
}
# Parity of the protected layers with Flax's when nothing is corrupted.
PARITY = {
    jnp.dtype(jnp.float32): (1e-6, 1e-6),  # the bound: same arithmetic, same order
    jnp.dtype(jnp.bfloat16): (2**-7, 2**-7),  # one bf16 ulp: einsum vs dot_general rounding
}

# Gradients made of terms that cancel, next to gradients of order 10-30: attention's key
# projection (the softmax does not change when every key moves by one vector, so the keys'
# gradient sums to zero over positions: the key bias's gradient is zero in exact arithmetic and
# the key kernel's a sum of cancelling terms). What is left of the cancelled terms is their
# round-off, which each compiler's bf16 arithmetic leaves differently: an absolute bound of one
# ulp of those terms, beside TOLERANCES' relative one.
CANCELLED = {
    jnp.dtype(jnp.float32): (1e-5, 1e-5),  # as TOLERANCES: float32 round-off stays below it
    jnp.dtype(jnp.bfloat16): (2**-6, 2**-3),  # atol: one bf16 ulp at 16 (values of 16 to 32)
}


def assert_close(actual, expected, dtype, table=TOLERANCES):
    rtol, atol = table[jnp.dtype(dtype)]
    np.testing.assert_allclose(
        np.asarray(actual, np.float32), np.asarray(expected, np.float32), rtol=rtol, atol=atol
    )
