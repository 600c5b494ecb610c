"""What a checked step costs before it runs: control flow, compile time, program size, bytes.

The GPU costs that a CPU can show (``while``/``conditional`` ops: a loop leaves XLA:GPU's CUDA
graphs, a conditional stays in them; compile time; HLO size; XLA's bytes-accessed estimate) for
a Flax-example LM step (2 layers, d 256, MLP 1024, seq 256, batch 8, Adam) in bf16 compute with
fp32 parameters: plain, and under ``sdcguard.checked`` detect-only, in place (the default
repair, a cond per GEMM, and branch-free) and recompute on detection (a loop on the CPU, and the
GPU's cond). Compile times are the
median of ``--repeats`` compilations, interleaved.

    python scripts/bench_clean_path.py --out runs/bench_clean_path.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from bench_overhead import FlaxExampleLM
from rich.console import Console
from rich.table import Table

import sdcguard
from sdcguard import ABFTConfig

VARIANTS = {
    "plain": None,
    "detect only": ABFTConfig(correct=False),
    "in place": ABFTConfig(),
    "in place, branch-free": ABFTConfig(repair="branch_free"),
    "recompute": ABFTConfig(recompute=True),
    "recompute, cond": ABFTConfig(recompute=True, repair="cond"),
}


def lm_step(dtype, layers: int):
    net = FlaxExampleLM(layers=layers)
    tx = optax.adam(1e-3)
    tokens = jax.random.randint(jax.random.key(0), (8, 257), 0, 256)
    params = nn.unbox(net.init(jax.random.key(1), tokens[:, :-1]))["params"]

    def step(params, opt_state, tokens):
        def loss_fn(p):
            compute = jax.tree.map(lambda x: x.astype(dtype), p)  # fp32 parameters, cast once
            logits = net.apply({"params": compute}, tokens[:, :-1]).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, (params, tx.init(params), tokens)


def costs(fn, args) -> dict:
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    seconds = time.perf_counter() - start
    text = compiled.as_text()
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, list) else analysis
    return {
        "compile_s": seconds,
        "hlo_lines": text.count("\n"),
        "control_flow": len(re.findall(r"\s(?:while|conditional)\(", text)),
        "bytes_accessed": float(analysis.get("bytes accessed", 0.0)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("runs/bench_clean_path.json"))
    args = parser.parse_args()
    step, step_args = lm_step(jnp.dtype(args.dtype), args.layers)
    fns = {n: step if c is None else sdcguard.checked(step, c) for n, c in VARIANTS.items()}
    runs: dict[str, list[dict]] = {n: [] for n in fns}
    for r in range(args.repeats):
        for name in list(fns) if r % 2 == 0 else list(reversed(fns)):
            jax.clear_caches()  # each compilation from scratch
            runs[name].append(costs(fns[name], step_args))
    result = {"device": jax.devices()[0].device_kind, "dtype": args.dtype, "variants": {}}
    plain = runs["plain"]
    for name, r in runs.items():
        result["variants"][name] = {
            "compile_s": statistics.median(x["compile_s"] for x in r),
            "compile_ratio": statistics.median(
                x["compile_s"] / p["compile_s"] for x, p in zip(r, plain, strict=True)
            ),
            "hlo_lines": r[0]["hlo_lines"],
            "control_flow": r[0]["control_flow"],
            "bytes_accessed": r[0]["bytes_accessed"],
        }
    console = Console(width=max(Console().width, 120))
    table = Table(
        title=f"checked {args.dtype} LM step, {args.layers} layers, d 256, before it runs"
    )
    for col in ("variant", "while+cond", "compile (÷ plain)", "HLO lines (÷)", "bytes (÷)"):
        table.add_column(col)
    base = result["variants"]["plain"]
    for name, v in result["variants"].items():
        table.add_row(
            name,
            str(v["control_flow"]),
            f"{v['compile_s']:.1f} s ({v['compile_ratio']:.2f})",
            f"{v['hlo_lines']} ({v['hlo_lines'] / base['hlo_lines']:.2f})",
            f"{v['bytes_accessed'] / 1e6:.0f} MB "
            f"({v['bytes_accessed'] / base['bytes_accessed']:.2f})",
        )
    console.print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
