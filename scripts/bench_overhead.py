"""ABFT overhead on the reference GPT: training step and attention alone, protected/unprotected.

Every variant is compiled first, then timed in interleaved rounds (A, B, C, A, B, C, ...) in one
process; the reported time is the median over rounds, and overheads are ratios of medians.

    python scripts/bench_overhead.py                 # bench-size GPT (d_model 256, seq 256)
    python scripts/bench_overhead.py --size default  # the tiny default GPT
    python scripts/bench_overhead.py --per-site      # forward overhead of each site alone
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from rich.console import Console
from rich.table import Table

from sdcguard import linen as sl
from sdcguard.abft import ABFTConfig
from sdcguard.inject import FaultPlan
from sdcguard.models import ByteBatches, GPTConfig
from sdcguard.training import TrainConfig, make_train_step

SIZES = {
    "default": GPTConfig(),
    "bench": GPTConfig(num_layers=2, d_model=256, num_heads=4, seq_len=256),
}
VARIANTS = {
    "unprotected": None,
    "forward checked": ABFTConfig(backward=False),
    "forward+backward checked": ABFTConfig(),
}
# --per-site: where the forward overhead goes.
PER_SITE_VARIANTS = {
    "unprotected": None,
    "layers swapped, no checks": ABFTConfig(sites=()),
    "projections (fwd)": ABFTConfig(sites=("query", "key", "value", "out"), backward=False),
    "scores (fwd)": ABFTConfig(sites=("scores",), backward=False),
    "probs": ABFTConfig(sites=("probs",), backward=False),
    "context (fwd)": ABFTConfig(sites=("context",), backward=False),
}


def interleaved_medians(fns: dict, rounds: int, inner: int) -> dict[str, float]:
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(inner):
                out = fn()
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - start) / inner)
    return {name: float(np.median(t)) for name, t in times.items()}


def train_step_fns(model: GPTConfig, batch_size: int, variants: dict = VARIANTS) -> dict:
    batch = ByteBatches(batch_size=batch_size, seq_len=model.seq_len).batch(0)
    plan = FaultPlan.none()
    fns = {}
    for name, abft in variants.items():
        state, step = make_train_step(TrainConfig(model=model, batch_size=batch_size, abft=abft))
        compiled = step.lower(state, batch, plan).compile()
        fns[name] = lambda c=compiled, s=state: c(s, batch, plan)[1].loss
    return fns


def attention_fns(model: GPTConfig, batch_size: int) -> dict:
    x = jax.random.normal(jax.random.key(0), (batch_size, model.seq_len, model.d_model))
    mask = nn.make_causal_mask(jnp.ones((batch_size, model.seq_len)))
    layer = nn.MultiHeadDotProductAttention(num_heads=model.num_heads)
    params = layer.init(jax.random.key(1), x, mask=mask)["params"]
    fns = {}
    for name, abft in VARIANTS.items():

        def loss(params, x, abft=abft):
            if abft is None:
                return jnp.sum(layer.apply({"params": params}, x, mask=mask) ** 2)
            with sl.protect(abft):
                return jnp.sum(layer.apply({"params": params}, x, mask=mask) ** 2)

        compiled = jax.jit(jax.value_and_grad(loss)).lower(params, x).compile()
        fns[name] = lambda c=compiled: c(params, x)[0]
    return fns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="bench")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--inner", type=int, default=3)
    parser.add_argument(
        "--per-site", action="store_true", help="training step only, one protected site at a time"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    model = SIZES[args.size]
    console = Console()
    results = {}
    workloads = [("training step", train_step_fns), ("attention fwd+bwd", attention_fns)]
    if args.per_site:
        workloads = [
            ("training step", lambda m, b: train_step_fns(m, b, PER_SITE_VARIANTS)),
        ]
    out = args.out or Path(
        "runs/bench_overhead_per_site.json" if args.per_site else "runs/bench_overhead.json"
    )
    for what, make in workloads:
        with console.status(f"compiling {what} variants"):
            fns = make(model, args.batch_size)
        with console.status(f"timing {what} ({args.rounds} interleaved rounds)"):
            results[what] = interleaved_medians(fns, args.rounds, args.inner)
    table = Table(
        title=f"ABFT overhead, {args.size} GPT {model}, batch {args.batch_size}, "
        f"{jax.default_backend()}"
    )
    for col in ("workload", "variant", "median ms", "overhead"):
        table.add_column(col, justify="left" if col in ("workload", "variant") else "right")
    for what, medians in results.items():
        base = medians["unprotected"]
        for name, t in medians.items():
            table.add_row(what, name, f"{t * 1e3:.2f}", f"{(t / base - 1) * 100:+.1f}%")
    console.print(table)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "size": args.size,
        "model": repr(model),
        "batch_size": args.batch_size,
        "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
        "rounds": args.rounds,
        "median_seconds": results,
        "overhead": {
            what: {k: v / m["unprotected"] - 1 for k, v in m.items()} for what, m in results.items()
        },
    }
    out.write_text(json.dumps(payload, indent=1))
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
