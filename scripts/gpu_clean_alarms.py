"""Clean alarms of the Mosaic checked GEMM on the LM's attention contractions (issue 36).

The d-1024 step with ``implementation="pallas"`` alarmed on clean data at the attention core's
batched contractions only (H200, jax 0.11.2, at 6366785). This runs those contractions alone on
random data, batched and as single matrices, with the checksum GEMM fused and separate, and
prints each one's counters and its largest difference to an XLA float32 einsum. On one H200
every tile of the ``[1024, 1024]`` contractions over 128 alarmed (scores and the probabilities'
gradient), fused or separate, batched or not; those over 1024 did not
(``docs/measurements/gpu_clean_alarms_h200_6366785.log``).

``--sweep`` runs one ``[1024, 1024]`` matrix over ``K`` in 64, 128, 192, 256, 1024 with the
pipeline's depth (``BlockSizes.max_concurrent_steps``) 2, 3 and 4: whether the alarms follow
the number of K steps, the depth, or both.

Usage:
  python scripts/gpu_clean_alarms.py            # on a GPU: the real kernel
  python scripts/gpu_clean_alarms.py --sweep    # on a GPU: K and the pipeline's depth
  python scripts/gpu_clean_alarms.py --emulate  # anywhere: the kernel's check as jnp
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from sdcguard.protection._contraction import Contraction
from sdcguard.protection.pallas.matmul import (
    DEFAULT_BLOCK_SIZES,
    canonical_operands,
    checked_matmul,
)


def cases(batch: int, seq: int, heads: int, head_dim: int):
    keys = jax.random.split(jax.random.key(0), 6)
    bf16 = jnp.bfloat16

    def normal(key, shape, scale=1.0):
        return (scale * jax.random.normal(key, shape, jnp.float32)).astype(bf16)

    q = normal(keys[0], (batch, seq, heads, head_dim), head_dim**-0.5)
    k = normal(keys[1], (batch, seq, heads, head_dim))
    v = normal(keys[2], (batch, seq, heads, head_dim))
    logits = jax.random.normal(keys[3], (batch, heads, seq, seq), jnp.float32)
    p = jax.nn.softmax(logits, -1).astype(bf16)
    do = normal(keys[4], (batch, seq, heads, head_dim), 1e-3)
    ds = normal(keys[5], (batch, heads, seq, seq), 1e-4)
    return {
        "scores": ("bqhd,bkhd->bhqk", q, k),
        "context": ("bhqk,bkhd->bqhd", p, v),
        "context.grad_lhs": ("bqhd,bkhd->bhqk", do, v),
        "context.grad_rhs": ("bhqk,bqhd->bkhd", p, do),
        "scores.grad_lhs": ("bhqk,bkhd->bqhd", ds, k),
        "scores.grad_rhs": ("bhqk,bqhd->bkhd", ds, q),
    }


def run(label: str, a, b, *, emulate: bool, **kwargs) -> None:
    """One checked GEMM, detection only: its counters and its largest difference to XLA's."""
    fn = jax.jit(lambda x, y: checked_matmul(x, y, correct=False, emulate=emulate, **kwargs))
    ref = jnp.einsum("...mk,...kn->...mn", a.astype(jnp.float32), b.astype(jnp.float32))
    try:
        c, counts = fn(a, b)
        diff = float(jnp.max(jnp.abs(c.astype(jnp.float32) - ref)))
        counts = np.asarray(counts).tolist()
        print(f"{label}: counts {counts}, max |c - einsum| {diff:.3g}", flush=True)
    except Exception as error:  # a failure is reported, and the next case runs
        print(f"{label}: {type(error).__name__}: {str(error)[:300]}", flush=True)


def sweep(*, emulate: bool, ks=(64, 128, 192, 256, 1024), depths=(2, 3, 4)) -> None:
    """One ``[1024, 1024]`` matrix over each K, at each pipeline depth."""
    for k in ks:
        keys = jax.random.split(jax.random.key(k))
        a = (k**-0.5 * jax.random.normal(keys[0], (1024, k))).astype(jnp.bfloat16)
        b = jax.random.normal(keys[1], (k, 1024)).astype(jnp.bfloat16)
        for depth in depths:
            sizes = dataclasses.replace(DEFAULT_BLOCK_SIZES, max_concurrent_steps=depth)
            label = f"1024x1024x{k}, {k // sizes.tile_k} K steps, depth {depth}"
            run(label, a, b, emulate=emulate, block_sizes=sizes)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--emulate", action="store_true")
    parser.add_argument("--sweep", action="store_true", help="K and the pipeline's depth")
    parser.add_argument("--size", default="8,1024,8,128", help="batch,seq,heads,head_dim")
    args = parser.parse_args()
    if jax.default_backend() != "gpu" and not args.emulate:
        print("no GPU: run with --emulate")
        return 0
    print("device", jax.devices()[0].device_kind, "jax", jax.__version__, flush=True)
    if args.sweep:
        sweep(emulate=args.emulate)
        return 0
    for name, (spec, a, b) in cases(*map(int, args.size.split(","))).items():
        ct = Contraction.parse(spec, a.ndim, b.ndim)
        a3, b3 = canonical_operands(a, b, ct)
        shape = f"{name} {spec} [{a3.shape[1]}x{b3.shape[2]}x{a3.shape[2]}]"
        run(f"{shape} batched, fused", a3, b3, emulate=args.emulate)
        run(f"{shape} batched, separate", a3, b3, emulate=args.emulate, checksum_gemm="separate")
        run(f"{shape} first matrix", a3[0], b3[0], emulate=args.emulate)
        run(f"{shape} two matrices", a3[:2], b3[:2], emulate=args.emulate)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
