"""Overhead of the ABFT Pallas kernels against their unprotected equivalents.

On a GPU: times, interleaved and as the median of repeats, in one process,

- ``checked_matmul`` vs the XLA GEMM and vs the same Pallas GEMM without checks
  (``scripts/bench_gpu_kernels.py`` times it at the LM's shapes),
- ``flash_attention`` (checked) vs the same kernel with checks off, and vs XLA attention,
  forward and forward+backward,

prints a table of ratios (protected / unprotected) and writes it as JSON.

On a machine without a GPU it says so, checks the kernels' correctness in interpret mode at
small shapes, and exits 0.

Usage:
  python scripts/bench_kernels.py [--repeats 50] [--json bench_kernels.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from sdcguard import protection as abft
from sdcguard.protection.pallas import flash as fa, matmul

UNCHECKED = dataclasses.replace(abft.ABFTConfig(), forward=False, backward=False)


def _block(x):
    return jax.tree_util.tree_map(lambda y: y.block_until_ready(), x)


def time_interleaved(fns: dict, args: dict, repeats: int) -> dict:
    """Median seconds of each compiled function, run round-robin so drift hits all alike."""
    for name, f in fns.items():  # compile and warm up
        _block(f(*args[name]))
        _block(f(*args[name]))
    samples = {name: [] for name in fns}
    for _ in range(repeats):
        for name, f in fns.items():
            t0 = time.perf_counter()
            _block(f(*args[name]))
            samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(s) for name, s in samples.items()}


def gemm_cases(dtype):
    """(name, [B, M, K], [B, K, N]): the reference GPT's attention GEMMs and a large one."""
    return [
        ("gpt_scores", (32, 256, 64), (32, 64, 256)),
        ("gpt_proj", (1, 512, 64), (1, 64, 128)),
        ("large", (8, 2048, 1024), (8, 1024, 2048)),
    ]


def _fwd(config):
    return jax.jit(lambda q, k, v: fa.flash_attention(q, k, v, causal=True, config=config))


def _fwd_bwd(config):
    def loss(q, k, v):
        out, _ = fa.flash_attention(q, k, v, causal=True, config=config)
        return jnp.sum(out.astype(jnp.float32))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def _xla_loss(q, k, v):
    return jnp.sum(fa.attention_reference(q, k, v, causal=True).astype(jnp.float32))


def bench_gpu(repeats: int, dtype) -> list[dict]:
    rows = []
    for name, sa, sb in gemm_cases(dtype):
        ka, kb = jax.random.split(jax.random.key(0))
        a = jax.random.normal(ka, sa, jnp.float32).astype(dtype)
        b = jax.random.normal(kb, sb, jnp.float32).astype(dtype)
        fns = {
            "xla": jax.jit(lambda a, b: jnp.einsum("bmk,bkn->bmn", a, b)),
            "pallas": jax.jit(lambda a, b: matmul.checked_matmul(a, b, check=False)[0]),
            "checked": jax.jit(lambda a, b: matmul.checked_matmul(a, b)),
        }
        t = time_interleaved(fns, dict.fromkeys(fns, (a, b)), repeats)
        rows.append(
            {
                "kernel": f"checked_matmul[{name}]",
                "ms": t["checked"] * 1e3,
                "vs_xla": t["checked"] / t["xla"],
                "vs_unchecked_pallas": t["checked"] / t["pallas"],
            }
        )
    for name, (b, t_, h, d) in [("gpt", (8, 64, 4, 16)), ("large", (4, 2048, 16, 64))]:
        ks = jax.random.split(jax.random.key(1), 3)
        q, k, v = (jax.random.normal(kk, (b, t_, h, d), jnp.float32).astype(dtype) for kk in ks)

        fns = {
            "fwd_checked": _fwd(abft.ABFTConfig()),
            "fwd_plain": _fwd(UNCHECKED),
            "fwd_xla": jax.jit(lambda q, k, v: fa.attention_reference(q, k, v, causal=True)),
            "bwd_checked": _fwd_bwd(abft.ABFTConfig()),
            "bwd_plain": _fwd_bwd(UNCHECKED),
            "bwd_xla": jax.jit(jax.grad(_xla_loss, argnums=(0, 1, 2))),
        }
        tm = time_interleaved(fns, dict.fromkeys(fns, (q, k, v)), repeats)
        for phase in ("fwd", "bwd"):
            label = "forward" if phase == "fwd" else "forward+backward"
            rows.append(
                {
                    "kernel": f"flash_attention[{name}, {label}]",
                    "ms": tm[f"{phase}_checked"] * 1e3,
                    "vs_xla": tm[f"{phase}_checked"] / tm[f"{phase}_xla"],
                    "vs_unchecked_pallas": tm[f"{phase}_checked"] / tm[f"{phase}_plain"],
                }
            )
    return rows


def check_correctness() -> None:
    """Interpret-mode checks at small shapes (what can be verified without a GPU)."""
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (2, 40, 24)).astype(jnp.bfloat16)
    b = jax.random.normal(kb, (2, 24, 40)).astype(jnp.bfloat16)
    # The GEMM kernel's per-tile check, emulated (its interpret mode is minutes per call).
    c, counts = matmul.checked_matmul(a, b, emulate=True)
    ref = jnp.einsum("bmk,bkn->bmn", a, b, preferred_element_type=jnp.float32)
    np.testing.assert_allclose(np.asarray(c, np.float32), ref, rtol=2**-7, atol=2**-5)
    assert counts.tolist() == [0, 0, 0, 0], counts
    q, k, v = (jax.random.normal(kk, (1, 24, 2, 16)) for kk in jax.random.split(ka, 3))
    out, counts = fa.flash_attention(q, k, v, causal=True, interpret=True)
    np.testing.assert_allclose(out, fa.attention_reference(q, k, v, causal=True), atol=1e-5)
    assert counts.tolist() == [[0, 0, 0, 0]] * 3, counts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--json", default="bench_kernels.json")
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu":
        print(
            f"bench_kernels: timing needs a GPU (backend here: {jax.default_backend()}); "
            "checking correctness in interpret mode instead."
        )
        check_correctness()
        print("bench_kernels: interpret-mode correctness checks passed; no timings taken.")
        return 0
    device = jax.devices()[0].device_kind
    rows = bench_gpu(args.repeats, jnp.dtype(args.dtype))
    print(f"device: {device}, dtype: {args.dtype}, median of {args.repeats} interleaved runs")
    print(f"{'kernel':45s} {'ms':>9s} {'/ XLA':>8s} {'/ unchecked':>12s}")
    for r in rows:
        print(
            f"{r['kernel']:45s} {r['ms']:9.3f} {r['vs_xla']:8.3f} {r['vs_unchecked_pallas']:12.3f}"
        )
    with open(args.json, "w") as f:
        json.dump({"device": device, "dtype": args.dtype, "rows": rows}, f, indent=2)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
