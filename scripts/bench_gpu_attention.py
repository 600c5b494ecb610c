"""ABFT flash attention (Mosaic GPU kernels) against cuDNN attention on a Hopper GPU.

For each sequence length (bf16, causal, batch 4, 16 heads, head_dim 128): forward and
forward+backward of

- ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")``, unchecked;
- ``abft``: :func:`sdcguard.protection.pallas.flash.flash_attention` with ``kernel="mosaic"``
  (every tile check on, forward and backward), and ``abft-unchecked``: the same kernels with no
  site checked (the cost of the checks is the difference). Both only where the Mosaic GPU
  kernel is not recorded as failing on a GPU with the installed JAX
  (:func:`sdcguard.protection.pallas.fails_on_gpu`), or with ``--mosaic``: on an H200 with jax
  0.11.2 it stops with an illegal memory access, after which the process cannot use the GPU;
- ``triton``: the same call with ``kernel="triton"`` (the Triton-backend kernels);
- ``checked(cudnn)``: the ``cudnn`` function under :func:`sdcguard.checked` (gradients taken
  inside it), which runs the ABFT flash kernels in place of cuDNN's: what a user's step with
  fused attention costs once checked.

Every variant is compiled first, then timed in interleaved rounds (medians; the ratio to cuDNN
is the median of per-round ratios). Before timing, on the GPU (with the Mosaic kernels, or the
Triton ones where those are left out): the ABFT output equals cuDNN's
within bf16 tolerance and counts nothing when clean, and one NaN injected into the scores is
detected and corrected (counters printed). A variant that fails is reported and the others
are timed; the JSON is written after each sequence length.

Without a GPU it says so and exits 0. About 3 minutes on an H100 at the defaults.

Usage:
  python scripts/bench_gpu_attention.py [--seqs 1024 2048 4096] [--rounds 10] [--inner 5]
      [--out runs/bench_gpu_attention.json] [--mosaic]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from rich.console import Console
from rich.table import Table
from timing import interleaved, overheads, per_call

import sdcguard
from sdcguard.fault_model import Fault, FaultPlan
from sdcguard.protection import ABFTConfig, pallas
from sdcguard.protection.pallas import flash

BATCH, HEADS, HEAD_DIM = 4, 16, 128
UNCHECKED = ABFTConfig(sites=())


def variants(q, k, v, cot, *, mosaic: bool = True):
    """``{name: (forward, forward_and_backward)}`` jitted functions of ``(q, k, v)``; without
    ``mosaic``, none that runs the Mosaic GPU kernels."""
    scale = 1.0 / np.sqrt(q.shape[-1])

    def cudnn(q, k, v):
        return jax.nn.dot_product_attention(
            q, k, v, scale=scale, is_causal=True, implementation="cudnn"
        )

    def abft(kernel, config):
        def f(q, k, v):
            out, _ = flash.flash_attention(
                q, k, v, causal=True, sm_scale=scale, config=config, kernel=kernel
            )
            return out

        return f

    fns = {"cudnn": cudnn, "triton": abft("triton", ABFTConfig())}
    if mosaic:
        fns.update(
            abft=abft("mosaic", ABFTConfig()), **{"abft-unchecked": abft("mosaic", UNCHECKED)}
        )
    out = {}
    for name, f in fns.items():

        def loss(q, k, v, f=f):
            return jnp.sum(f(q, k, v).astype(jnp.float32) * cot)

        out[name] = (jax.jit(f), jax.jit(jax.grad(loss, argnums=(0, 1, 2))))

    def cudnn_loss(q, k, v):
        return jnp.sum(cudnn(q, k, v).astype(jnp.float32) * cot)

    out["checked(cudnn)"] = (
        jax.jit(lambda q, k, v: sdcguard.checked(cudnn)(q, k, v)[0]),
        jax.jit(
            lambda q, k, v: sdcguard.checked(jax.grad(cudnn_loss, argnums=(0, 1, 2)))(q, k, v)[0]
        ),
    )
    return out


def correctness(q, k, v, kernel: str = "mosaic") -> dict:
    """On the GPU: ``kernel``'s clean output and counters, and one NaN in the scores corrected."""
    scale = 1.0 / np.sqrt(q.shape[-1])
    ref = jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, implementation="cudnn")
    t = q.shape[1]
    report = {}
    for name, faults in {
        "clean": [],
        "scores nan": [Fault(site="attn:scores", kind="nan", index=(t + 1) * (t // 2))],
    }.items():
        plan = FaultPlan.from_faults(faults, capacity=1)
        out, counts = jax.jit(
            lambda q, k, v, plan: flash.flash_attention(
                q, k, v, causal=True, sm_scale=scale, plan=plan, kernel=kernel
            )
        )(q, k, v, plan)
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
        report[name] = {"max_abs_diff_to_cudnn": err, "counts": counts.tolist()}
    return report


def commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--inner", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("runs/bench_gpu_attention.json"))
    parser.add_argument(
        "--mosaic",
        action="store_true",
        help="run the Mosaic GPU kernels even where sdcguard records that they fail on a GPU "
        "with the installed JAX (a failure there can end the process's use of the GPU)",
    )
    args = parser.parse_args()
    console = Console()
    if jax.default_backend() != "gpu":
        console.print("no GPU: the Mosaic GPU kernel would only be interpreted; nothing to time")
        return 0
    device = jax.devices()[0].device_kind
    fails = pallas.fails_on_gpu("flash_mgpu")
    mosaic = args.mosaic or fails is None
    results = {"device": device, "jax": jax.__version__, "commit": commit(), "cases": {}}
    if not mosaic:
        results["mosaic_skipped"] = fails
        console.print(f"the Mosaic GPU kernels are not run: {fails} (--mosaic runs them)")
    table = Table(title=f"ABFT flash attention vs cuDNN, bf16, causal ({device})")
    for column in ("seq", "pass", "variant", "median ms", "x cuDNN (IQR)"):
        table.add_column(column, justify="right" if column != "variant" else "left")
    for seq in args.seqs:
        keys = jax.random.split(jax.random.key(seq), 4)
        shape = (BATCH, seq, HEADS, HEAD_DIM)
        q, k, v = (jax.random.normal(r, shape, jnp.float32).astype(jnp.bfloat16) for r in keys[:3])
        cot = jax.random.normal(keys[3], shape, jnp.float32)
        case = {"shape": shape, "failed": {}}
        results["cases"][str(seq)] = case
        try:  # the checks run the Triton kernels where the Mosaic ones are left out
            case["checks_kernel"] = "mosaic" if mosaic else "triton"
            case["checks"] = correctness(q, k, v, case["checks_kernel"])
        except Exception as error:  # a kernel that does not lower or run: say so, time the rest
            case["failed"]["checks"] = f"{type(error).__name__}: {error}"[:2000]
            console.print(f"seq {seq}: checks failed: {case['failed']['checks'][:600]}")
        fns = variants(q, k, v, cot, mosaic=mosaic)
        for pass_index, pass_name in enumerate(("forward", "forward+backward")):
            timers = {}
            for name, pair in fns.items():
                fn = pair[pass_index]
                try:
                    jax.block_until_ready(fn(q, k, v))  # compile
                except Exception as error:
                    why = f"{type(error).__name__}: {error}"[:2000]
                    case["failed"][f"{pass_name} {name}"] = why
                    console.print(f"seq {seq} {pass_name} {name}: failed: {str(error)[:600]}")
                    continue
                timers[name] = per_call(lambda fn=fn, q=q, k=k, v=v: fn(q, k, v), args.inner)
            if "cudnn" not in timers:
                continue
            timing = overheads(interleaved(timers, args.rounds), base="cudnn")
            case[pass_name] = timing
            for name, t in timing.items():
                lo, hi = t["overhead_iqr"]
                table.add_row(
                    str(seq),
                    pass_name,
                    name,
                    f"{t['median_s'] * 1e3:.3f}",
                    f"{1 + t['overhead']:.3f} ({1 + lo:.3f}..{1 + hi:.3f})",
                )
        console.print(f"seq {seq}: checks {case.get('checks')}")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))
    console.print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
