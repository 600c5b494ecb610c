"""The Mosaic checked GEMM on the d-1024 step's own attention scores (issue 36's clean alarms).

On one H200 at 3e8f72e the step with ``implementation="pallas"`` counted clean alarms at the
scores of blocks 1 to 3 (none at block 0), while the same contraction on random operands
raised none (``docs/measurements/gpu_session_h200_*_3e8f72e.*``). This runs the scores
contraction ``bqhd,bkhd->bhqk`` on the queries and keys the step's forward computes, block by
block, detection only, two ways: the kernel, and the kernel's epilogue emulated on XLA's
product (on a GPU, cuBLAS's tensor cores). It prints each one's counters, the largest
difference of the kernel's ``C`` to XLA's, and the operands' statistics: alarms of the kernel
alone point at its accumulator or pipeline, alarms of both at the tolerance model.

Usage:
  python scripts/gpu_step_alarms.py             # on a GPU
  python scripts/gpu_step_alarms.py --force     # anywhere, at the tiny size (emulation only)
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from bench_gpu import SIZES, lm_step

from sdcguard.protection.pallas import matmul


def attention_operands(size: str):
    """``{block: (q / sqrt(d), k)}``, bf16 ``[batch, seq, heads, head_dim]``, as the step's
    forward computes them (Flax scales the query before the scores' einsum)."""
    from bench_gpu import LM

    layers, d, heads, mlp, _, _, vocab = SIZES[size]
    _, (params, _, tokens) = lm_step(size, jnp.bfloat16)
    model = LM(layers, d, heads, mlp, vocab, jnp.bfloat16)
    _, state = jax.jit(lambda p, t: model.apply({"params": p}, t, capture_intermediates=True))(
        params, tokens[:, :-1]
    )
    inter = state["intermediates"]
    out = {}
    for i in range(layers):
        attn = inter[f"block_{i}"]["attn"]
        q, k = attn["query"]["__call__"][0], attn["key"]["__call__"][0]
        depth = q.shape[-1]
        out[i] = (q / jnp.sqrt(depth).astype(q.dtype), k)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="no GPU: emulation, tiny size")
    parser.add_argument("--size", default=None)
    args = parser.parse_args()
    gpu = jax.default_backend() == "gpu"
    if not gpu and not args.force:
        print("no GPU: run with --force")
        return 0
    size = args.size or ("d1024" if gpu else "tiny")
    print("device", jax.devices()[0].device_kind, "jax", jax.__version__, "size", size, flush=True)
    from sdcguard.protection._contraction import Contraction

    spec = "bqhd,bkhd->bhqk"
    for block, (q, k) in attention_operands(size).items():
        ct = Contraction.parse(spec, q.ndim, k.ndim)
        a3, b3 = matmul.canonical_operands(q, k, ct)
        stats = ", ".join(
            f"{name} mean {float(jnp.mean(x.astype(jnp.float32))):.3g} "
            f"rms {float(jnp.sqrt(jnp.mean(jnp.square(x.astype(jnp.float32))))):.3g} "
            f"max {float(jnp.max(jnp.abs(x.astype(jnp.float32)))):.3g}"
            for name, x in (("q", q), ("k", k))
        )
        print(f"block {block}: {stats}", flush=True)
        ways = {"emulated on XLA's product": True}
        if gpu:
            ways = {"kernel": False, **ways}
        outputs = {}
        for label, emulate in ways.items():
            run = lambda x, y, e=emulate: matmul.checked_matmul(x, y, correct=False, emulate=e)
            fn = jax.jit(run)
            try:
                c, counts = fn(a3, b3)
                outputs[label] = c.astype(jnp.float32)
                print(f"  {label}: counts {np.asarray(counts).tolist()}", flush=True)
            except Exception as error:  # reported; the next way runs
                print(f"  {label}: {type(error).__name__}: {str(error)[:300]}", flush=True)
        if len(outputs) == 2:
            kernel, xla = outputs.values()
            print(f"  max |c_kernel - c_xla| {float(jnp.max(jnp.abs(kernel - xla))):.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
