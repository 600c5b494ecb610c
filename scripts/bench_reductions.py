"""The reductions of a check on this backend: separate ones against one multi-output reduction.

``reduce_together`` (``sdcguard.protection._checksums``) makes a check's reductions one
reduction with several outputs, one pass over the tensor. This times, per layout, ``Σx`` and
``Σ|x|`` as two reductions against one, and ``max|x|`` against ``max(max x, -min x)`` in one,
each compiled alone, interleaved over rounds (medians), float32:

    python scripts/bench_reductions.py --rounds 11
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from sdcguard.protection._checksums import _one_reduction

# name: (shape, reduced axes)
LAYOUTS = {
    "[2048, 1024], axis 0": ((2048, 1024), (0,)),
    "[2048, 1024], axis 1": ((2048, 1024), (1,)),
    "[8, 4, 256, 256], axis 2": ((8, 4, 256, 256), (2,)),
    "[8, 4, 256, 256], axis 3": ((8, 4, 256, 256), (3,)),
}


def variants(axes) -> dict:
    def sums_apart(x):
        return jnp.sum(x, axis=axes), jnp.sum(jnp.abs(x), axis=axes)

    def sums_together(x):
        out = _one_reduction({"v": ("sum", x), "w": ("sum", jnp.abs(x))}, axes)
        return out["v"], out["w"]

    def max_abs(x):
        return jnp.max(jnp.abs(x), axis=axes)

    def max_and_min(x):
        out = _one_reduction({"hi": ("max", x), "lo": ("min", x)}, axes)
        return jnp.maximum(out["hi"], -out["lo"])

    return {
        "Σx, Σ|x|: two reductions": sums_apart,
        "Σx, Σ|x|: one reduction": sums_together,
        "max|x|": max_abs,
        "max x, min x: one reduction": max_and_min,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--inner", type=int, default=10)
    parser.add_argument("--out", help="write the medians (ms) as JSON here")
    args = parser.parse_args()
    results = {}
    for layout, (shape, axes) in LAYOUTS.items():
        x = jax.random.normal(jax.random.key(0), shape, jnp.float32)
        fns = {name: jax.jit(f) for name, f in variants(axes).items()}
        for f in fns.values():
            jax.block_until_ready(f(x))
        times = {name: [] for name in fns}
        for _ in range(args.rounds):
            for name, f in fns.items():
                start = time.perf_counter()
                for _ in range(args.inner):
                    jax.block_until_ready(f(x))
                times[name].append((time.perf_counter() - start) / args.inner)
        results[layout] = {name: float(np.median(t)) * 1e3 for name, t in times.items()}
        row = "  ".join(f"{name} {ms:.3f} ms" for name, ms in results[layout].items())
        print(f"{layout:26s} {row}")
    report = {"jax": jax.__version__, "backend": jax.default_backend(), "ms": results}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
