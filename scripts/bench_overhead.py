"""ABFT overhead on the reference GPT: training step and attention alone, protected/unprotected.

Every variant is compiled first, then timed in interleaved rounds (A, B, C, C, B, A, ...) in one
process; an overhead is the median over rounds of the per-round ratio to the unprotected step
(with its interquartile range), the reported time the median over rounds.

    python scripts/bench_overhead.py                 # bench-size GPT (d_model 256, seq 256)
    python scripts/bench_overhead.py --size default  # the tiny default GPT
    python scripts/bench_overhead.py --per-site      # each site alone, and fwd vs fwd+bwd
    python scripts/bench_overhead.py --step-only --rounds 41  # more rounds of the step alone
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
from rich.console import Console
from rich.table import Table
from timing import interleaved, overheads, per_call

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
    # The same checks with no repair loops: what the in-place repair costs on a clean step.
    "forward+backward, detect only": ABFTConfig(correct=False),
}
# Training step only: detection-only checks, the step recomputed with in-place repair when one
# fires (sdcguard.training.TrainConfig.repair).
TRAIN_VARIANTS = {
    **VARIANTS,
    "forward+backward, recompute on detection": (ABFTConfig(), "recompute"),
}
# --per-site: where the forward overhead goes.
PER_SITE_VARIANTS = {
    "unprotected": None,
    "layers swapped, no checks": ABFTConfig(sites=()),
    "projections (fwd)": ABFTConfig(sites=("query", "key", "value", "out"), backward=False),
    "scores (fwd)": ABFTConfig(sites=("scores",), backward=False),
    "probs": ABFTConfig(sites=("probs",), backward=False),
    "context (fwd)": ABFTConfig(sites=("context",), backward=False),
    # Where the backward checks' cost goes: compare each with its forward-only row.
    "projections (fwd+bwd)": ABFTConfig(sites=("query", "key", "value", "out")),
    "scores, probs, context (fwd)": ABFTConfig(
        sites=("scores", "probs", "context"), backward=False
    ),
    "scores, probs, context (fwd+bwd)": ABFTConfig(sites=("scores", "probs", "context")),
}


def train_step_fns(model: GPTConfig, batch_size: int, variants: dict = TRAIN_VARIANTS) -> dict:
    """Compiled steps; a variant is an ABFTConfig (or None), or ``(ABFTConfig, repair)``."""
    batch = ByteBatches(batch_size=batch_size, seq_len=model.seq_len).batch(0)
    plan = FaultPlan.none()
    fns = {}
    for name, variant in variants.items():
        abft, repair = variant if isinstance(variant, tuple) else (variant, "in_place")
        config = TrainConfig(model=model, batch_size=batch_size, abft=abft, repair=repair)
        state, step = make_train_step(config)
        compiled = step.lower(state, batch, plan).compile()
        fns[name] = lambda c=compiled, s=state: c(s, batch, plan)[1].loss
    return fns


def attention_fns(model: GPTConfig, batch_size: int) -> dict:
    x = jax.random.normal(jax.random.key(0), (batch_size, model.seq_len, model.d_model))
    mask = nn.make_causal_mask(jnp.ones((batch_size, model.seq_len)))
    layer = nn.MultiHeadDotProductAttention(num_heads=model.num_heads)
    params = layer.init(jax.random.key(1), x, mask=mask)["params"]
    with sl.protect(ABFTConfig(sites=())):
        sinks = sl.init_sinks(layer, x, mask=mask)
    fns = {}
    for name, abft in VARIANTS.items():

        def loss(params, sinks, x, abft=abft):
            if abft is None:
                return jnp.sum(layer.apply({"params": params}, x, mask=mask) ** 2), {}
            # The counters are outputs, forward ('sdc') and backward (the sinks' gradient), as
            # in a training step: a check whose result nobody reads would be compiled away.
            with sl.protect(abft):
                out, sdc = layer.apply(
                    {"params": params, "sdc_grad": sinks}, x, mask=mask, mutable=["sdc"]
                )
            return jnp.sum(out**2), sdc

        grad_fn = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
        compiled = jax.jit(grad_fn).lower(params, sinks, x).compile()
        fns[name] = lambda c=compiled: c(params, sinks, x)[0][0]
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
    parser.add_argument(
        "--step-only", action="store_true", help="time the training step, not attention alone"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    model = SIZES[args.size]
    console = Console()
    results = {}
    workloads = [("training step", train_step_fns), ("attention fwd+bwd", attention_fns)]
    if args.step_only:
        workloads = workloads[:1]
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
            timers = {name: per_call(fn, args.inner) for name, fn in fns.items()}
            results[what] = overheads(interleaved(timers, args.rounds), base="unprotected")
    table = Table(
        title=f"ABFT overhead, {args.size} GPT {model}, batch {args.batch_size}, "
        f"{jax.default_backend()}"
    )
    columns = ("workload", "variant", "median ms", "overhead", "IQR", "fastest ms", "fastest")
    for col in columns:
        table.add_column(col, justify="left" if col in ("workload", "variant") else "right")
    for what, summary in results.items():
        for name, r in summary.items():
            q1, q3 = r["overhead_iqr"]
            table.add_row(
                what,
                name,
                f"{r['median_s'] * 1e3:.2f}",
                f"{r['overhead'] * 100:+.1f}%",
                f"{q1 * 100:+.1f}..{q3 * 100:+.1f}%",
                f"{r['min_s'] * 1e3:.2f}",
                f"{r['overhead_of_fastest'] * 100:+.1f}%",
            )
    console.print(table)
    console.print(
        "overhead: median over rounds of the per-round ratio to unprotected; "
        "fastest: ratio of each variant's fastest round"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "size": args.size,
        "model": repr(model),
        "batch_size": args.batch_size,
        "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
        "rounds": args.rounds,
        "inner": args.inner,
        "command": " ".join(["python", *sys.argv]),
        "results": results,
    }
    out.write_text(json.dumps(payload, indent=1))
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
