"""GPU kernels against cuBLAS (and, later, cuDNN): the checked Hopper GEMM at the LM's shapes.

On a GPU (at most ~5 minutes on an H100 or H200), bf16, per GEMM shape ``M x N x K``:

- JAX's unmodified Hopper GEMM (``jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu``) and
  ``sdcguard``'s checked GEMM unchecked / checked / detect-only, each against cuBLAS
  (``jnp.dot``);
- ratios as the median over interleaved rounds (every variant timed once per round, so
  clock and thermal drift hit all alike), with the device kind recorded beside each figure;
- an INF injected into the accumulator of the checked GEMM, corrected on the GPU.

Shapes: 8192x1024x4096, 8192x4096x1024 and the GEMMs of a d-1024 LM step (8192 tokens, MLP
4096, vocabulary 32768), forward and backward.

The cases are data (:class:`Case`): :func:`gemm_cases` builds the GEMM ones, and
:func:`attention_cases` is where attention kernels are added; :func:`run_cases` times any list.

On a machine without a GPU it says so and exits 0.

Usage:
  python scripts/bench_gpu_kernels.py [--rounds 7] [--inner 10] [--out runs/bench_gpu_kernels.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

BUDGET_S = 270.0  # stop starting new cases after this; the whole run stays under 5 minutes


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    """One benchmark case: variants of one computation timed against a baseline.

    Attributes:
      name: what is computed (e.g. ``"gemm 8192x1024x4096"``).
      baseline: the variant the others are divided by.
      variants: name -> ``() -> outputs``, each a compiled function closed over its inputs.
      flops: floating-point operations of one call (for TFLOP/s), or 0.
    """

    name: str
    baseline: str
    variants: dict[str, Callable[[], object]]
    flops: float = 0.0


def _block(x):
    return jax.tree_util.tree_map(lambda y: y.block_until_ready(), x)


def time_case(case: Case, *, rounds: int, inner: int) -> dict:
    """Median seconds per call of every variant and median ratio to the baseline.

    Each round runs every variant ``inner`` times back to back (after one warm-up call each);
    the ratio of a round is taken within the round, and the median over rounds is reported.
    """
    for fn in case.variants.values():  # compile and warm up
        _block(fn())
        _block(fn())
    per_round = {name: [] for name in case.variants}
    for _ in range(rounds):
        for name, fn in case.variants.items():
            t0 = time.perf_counter()
            for _ in range(inner):
                out = fn()
            _block(out)
            per_round[name].append((time.perf_counter() - t0) / inner)
    base = per_round[case.baseline]
    return {
        name: {
            "ms": 1e3 * statistics.median(ts),
            "ratio": statistics.median(t / b for t, b in zip(ts, base, strict=True)),
            "tflops": case.flops / statistics.median(ts) / 1e12 if case.flops else None,
        }
        for name, ts in per_round.items()
    }


def run_cases(cases: list[Case], *, rounds: int, inner: int, device: str, start: float) -> list:
    """Times each case in turn (until the time budget is spent); one row per variant."""
    rows = []
    for case in cases:
        if time.perf_counter() - start > BUDGET_S:
            print(f"skipped (time budget spent): {case.name}")
            continue
        try:
            timings = time_case(case, rounds=rounds, inner=inner)
        except Exception as err:  # a variant that does not compile here is reported, not fatal
            print(f"{case.name}: failed: {type(err).__name__}: {str(err)[:300]}")
            rows.append({"case": case.name, "device": device, "error": str(err)[:1000]})
            continue
        for variant, t in timings.items():
            rows.append(
                {
                    "case": case.name,
                    "variant": variant,
                    "baseline": case.baseline,
                    "device": device,
                    **t,
                }
            )
    return rows


# --- GEMM cases --------------------------------------------------------------------------------

TOKENS, D_MODEL, D_MLP, VOCAB = 8192, 1024, 4096, 32768

# (name, M, N, K)
GEMM_SHAPES = [
    ("8192x1024x4096", 8192, 1024, 4096),
    ("8192x4096x1024", 8192, 4096, 1024),
    ("lm qkv projection", TOKENS, 3 * D_MODEL, D_MODEL),
    ("lm attention output", TOKENS, D_MODEL, D_MODEL),
    ("lm logits", TOKENS, VOCAB, D_MODEL),
    ("lm logits grad_lhs", TOKENS, D_MODEL, VOCAB),
    ("lm logits grad_rhs", D_MODEL, VOCAB, TOKENS),
    ("lm mlp grad_rhs", D_MODEL, D_MLP, TOKENS),
]


def _jax_hopper_gemm():
    """JAX's Hopper GEMM, unmodified, with a tile configuration from its own tuning space."""
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hopper

    config = hopper.TuningConfig(
        tile_m=128,
        tile_n=128,
        tile_k=64,
        max_concurrent_steps=4,
        grid_minor_dim=hopper.MatmulDimension.N,
        grid_tile_width=8,
        wg_dimension=hopper.MatmulDimension.N,
    )
    return lambda a, b: hopper.matmul(a, b, None, config)


def gemm_cases(dtype=jnp.bfloat16) -> list[Case]:
    """The GEMM cases: JAX's Hopper GEMM and the checked GEMM (3 modes) vs cuBLAS."""
    from sdcguard.protection.pallas import matmul

    hopper = _jax_hopper_gemm()
    cases = []
    for name, m, n, k in GEMM_SHAPES:
        ka, kb = jax.random.split(jax.random.key(0))
        a = jax.random.normal(ka, (m, k), jnp.float32).astype(dtype)
        b = jax.random.normal(kb, (k, n), jnp.float32).astype(dtype)
        fns = {
            "cublas": jax.jit(jnp.dot),
            "jax_hopper": jax.jit(hopper),
            "unchecked": jax.jit(lambda a, b: matmul.checked_matmul(a, b, check=False)),
            "checked": jax.jit(matmul.checked_matmul),
            "detect_only": jax.jit(functools.partial(matmul.checked_matmul, correct=False)),
        }
        cases.append(
            Case(
                name=f"gemm {name} ({m}x{n}x{k})",
                baseline="cublas",
                variants={v: functools.partial(f, a, b) for v, f in fns.items()},
                flops=2.0 * m * n * k,
            )
        )
    return cases


def fault_corrected_on_gpu(dtype=jnp.bfloat16) -> dict:
    """An INF injected into the checked GEMM's accumulator at 8192x1024x4096, corrected."""
    from sdcguard.fault_model import Fault, FaultPlan
    from sdcguard.protection.pallas import matmul

    m, n, k = 8192, 1024, 4096
    ka, kb = jax.random.split(jax.random.key(1))
    a = jax.random.normal(ka, (m, k), jnp.float32).astype(dtype)
    b = jax.random.normal(kb, (k, n), jnp.float32).astype(dtype)
    index = 4099 * n + 777
    plan = FaultPlan.from_faults([Fault(site="bench/gemm:out", kind="inf", index=index)])
    run = jax.jit(lambda a, b, p: matmul.checked_matmul(a, b, plan=p, site="bench/gemm:out"))
    c, counts = _block(run(a, b, plan))
    clean = jnp.dot(a, b, preferred_element_type=jnp.float32).astype(dtype)
    got, want = float(c.reshape(-1)[index]), float(clean.reshape(-1)[index])
    worst = float(jnp.max(jnp.abs(c.astype(jnp.float32) - clean.astype(jnp.float32))))
    return {
        "counts": np.asarray(counts).tolist(),
        "corrected_value": got,
        "clean_value": want,
        "max_abs_difference_to_cublas": worst,
        "ok": np.asarray(counts).tolist() == [1, 1, 0, 0] and abs(got - want) <= 2**-6 * abs(want),
    }


# --- Attention cases ----------------------------------------------------------------------------


def attention_cases(dtype=jnp.bfloat16) -> list[Case]:
    """Attention cases (forward+backward against cuDNN attention), added with their kernel.

    Return :class:`Case` objects with ``baseline="cudnn"``; :func:`run_cases` times them.
    """
    del dtype
    return []


# --- Report ------------------------------------------------------------------------------------


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def print_table(rows: list[dict], device: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"GPU kernels on {device} (median of interleaved rounds)")
    for col in ("case", "variant", "ms", "÷ baseline", "TFLOP/s"):
        table.add_column(col, justify="left" if col in ("case", "variant") else "right")
    for r in rows:
        if "error" in r:
            table.add_row(r["case"], "failed", "", "", "")
            continue
        tflops = "" if r["tflops"] is None else f"{r['tflops']:.0f}"
        table.add_row(r["case"], r["variant"], f"{r['ms']:.3f}", f"{r['ratio']:.3f}", tflops)
    Console().print(table)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--inner", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("runs/bench_gpu_kernels.json"))
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu":
        print(
            f"bench_gpu_kernels: no GPU found (JAX backend: {jax.default_backend()}); "
            "nothing timed."
        )
        return 0
    start = time.perf_counter()
    device = jax.devices()[0].device_kind
    fault = fault_corrected_on_gpu()
    print(f"injected INF on {device}: {fault}")
    cases = gemm_cases() + attention_cases()
    rows = run_cases(cases, rounds=args.rounds, inner=args.inner, device=device, start=start)
    print_table(rows, device)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "device": device,
        "jax": jax.__version__,
        "commit": _commit(),
        "command": " ".join(["python", *sys.argv]),
        "rounds": args.rounds,
        "inner": args.inner,
        "fault": {"device": device, **fault},
        "rows": rows,
        "seconds": time.perf_counter() - start,
    }
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out} ({report['seconds']:.0f} s)")
    return 0 if fault["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
