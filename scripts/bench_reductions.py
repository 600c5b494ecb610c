"""The reductions of a check on this backend: separate ones against one multi-output reduction.

``reduce_together`` (``sdcguard.protection._checksums``) takes a check's reductions over one
tensor as one reduction with several outputs (one pass) on a GPU or TPU, as separate reductions
on XLA:CPU (``reductions_share_a_pass``). This times, per layout, ``Σx`` and ``Σ|x|`` as two
reductions against one, and ``max|x|`` against ``max(max x, -min x)`` in one, each compiled
alone, interleaved over rounds (medians), float32:

    python scripts/bench_reductions.py --rounds 11

``--whole-step`` times both forms where they count, in the whole training step of the
Flax-example LM of ``bench_overhead.py`` (every GEMM checked, and the drop-ins), each variant
traced once per form, all timed interleaved in one process:

    python scripts/bench_reductions.py --whole-step --rounds 15
    python scripts/bench_reductions.py --whole-step --dtype bfloat16 --rounds 11

With ``--dtype bfloat16`` or ``float16`` the step is ``bench_clean_path.py``'s: the same LM
(4 layers) computing in that dtype from float32 parameters, every GEMM checked (detect only and
in place; the drop-ins compute in float32 only).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from sdcguard.protection import _checksums
from sdcguard.protection._checksums import _one_reduction

# --whole-step: the bench_overhead.py variants timed in both forms.
WHOLE_STEP_VARIANTS = (
    "every GEMM, in place",
    "every GEMM, detect only",
    "drop-in attention (linen.protect), in place",
    "drop-in attention (linen.protect), detect only",
)
FORMS = {"one pass": True, "separate": False}

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


def _low_precision_step_fns(dtype) -> dict:
    """The LM step in ``dtype``: plain, and every GEMM checked (detect only, in place)."""
    from bench_clean_path import lm_step

    import sdcguard
    from sdcguard import ABFTConfig

    step, args = lm_step(jnp.dtype(dtype), layers=4)
    variants = {
        "unprotected": None,
        "every GEMM, in place": ABFTConfig(),
        "every GEMM, detect only": ABFTConfig(correct=False),
    }
    fns = {}
    for name, config in variants.items():
        fn = step if config is None else sdcguard.checked(step, config)
        compiled = jax.jit(fn).lower(*args).compile()
        fns[name] = lambda c=compiled: c(*args)
    return fns


def whole_step(rounds: int, inner: int, dtype: str = "float32") -> dict:
    """Per variant and form, the step's time and overhead against the unprotected step."""
    import bench_overhead  # a sibling script: run from the repository root or scripts/
    from timing import interleaved, overheads, per_call

    fns = {}
    for form, one_pass in FORMS.items():
        # Only the trace differs: the form is read while the checks are traced.
        with mock.patch.object(_checksums, "reductions_share_a_pass", lambda p=one_pass: p):
            if dtype == "float32":
                traced = bench_overhead.whole_step_linen_lm_fns(
                    bench_overhead.SIZES["bench"], 8, variants=list(WHOLE_STEP_VARIANTS)
                )
            else:
                traced = _low_precision_step_fns(dtype)
        for name, fn in traced.items():
            if name == "unprotected" and name in fns:
                continue  # one plain step: it has no check to trace two ways
            fns[name if name == "unprotected" else f"{name} [{form}]"] = fn
    timers = {name: per_call(fn, inner) for name, fn in fns.items()}
    results = overheads(interleaved(timers, rounds), base="unprotected")
    for name, r in results.items():
        q1, q3 = r["overhead_iqr"]
        print(
            f"{name:62s} {r['median_s'] * 1e3:8.2f} ms  {r['overhead'] * 100:+6.1f}% "
            f"(IQR {q1 * 100:+.1f}..{q3 * 100:+.1f}%)"
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--inner", type=int, default=None, help="calls per timing (10; 3 steps)")
    parser.add_argument("--whole-step", action="store_true")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="with --whole-step: the step's compute dtype",
    )
    parser.add_argument("--out", help="write the medians (ms) as JSON here")
    args = parser.parse_args()
    if args.whole_step:
        results = whole_step(args.rounds, args.inner or 3, args.dtype)
        report = {
            "dtype": args.dtype,
            "jax": jax.__version__,
            "backend": jax.default_backend(),
            "device": jax.devices()[0].device_kind,
            "command": " ".join(["python", *sys.argv]),
            "rounds": args.rounds,
            "results": results,
        }
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
        return
    args.inner = args.inner or 10
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
