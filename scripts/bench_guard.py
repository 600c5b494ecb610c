"""Overhead of the update guard on the reference GPT training step: guarded / unguarded.

Both steps are compiled first, then timed interleaved in one process (the order alternates
every repeat, so drift in machine load hits both alike); the result is the median over repeats
of the per-step time, and the median of the per-repeat ratios.

Usage:
  python scripts/bench_guard.py                       # default tiny GPT
  python scripts/bench_guard.py --d-model 256 --layers 4 --out runs/bench_guard_256.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
from rich.console import Console
from rich.table import Table
from timing import interleaved, overheads, per_call

from sdcguard.models import GPT, ByteBatches, GPTConfig, init_params, lm_loss
from sdcguard.optim import describe, refuse_corrupted


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=20, help="steps per timed repeat")
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument(
        "--update-calls", type=int, default=200, help="optimizer updates per timed repeat"
    )
    p.add_argument("--out", type=Path, default=Path("runs/bench_guard.json"))
    args = p.parse_args(argv)
    if args.steps < 1 or args.repeats < 3:
        p.error("--steps must be >= 1 and --repeats >= 3")
    return args


def loss_fn(model: GPT, params, batch):
    return lm_loss(model.apply({"params": params}, batch[:, :-1]), batch[:, 1:])


def make_step(model: GPT, tx, *, guarded: bool):
    """A jitted ``step(params, opt_state, batch)``; the guarded one gets every extra input."""

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn, argnums=1)(model, params, batch)
        extra = {"loss": loss, "abft_uncorrectable": jnp.int32(0)} if guarded else {}
        updates, opt_state = tx.update(grads, opt_state, params, **extra)
        return optax.apply_updates(params, updates), opt_state

    return step


def time_steps(step, carry, batches) -> tuple[float, tuple]:
    """Seconds per step over ``batches`` (dispatch and wait included, as in training)."""
    params, opt_state = carry
    start = time.perf_counter()
    for batch in batches:
        params, opt_state = step(params, opt_state, batch)
    jax.block_until_ready((params, opt_state))
    return (time.perf_counter() - start) / len(batches), (params, opt_state)


def update_seconds(tx, params, grads, *, guarded: bool, calls: int):
    """A zero-argument callable timing ``calls`` optimizer steps alone (seconds per step).

    An optimizer step is ``tx.update`` and ``optax.apply_updates``, as in a training step (the
    guard's select of the updates fuses into the latter). The guard's own work (norms,
    z-scores, the selects) is a few passes over the parameters; timed without the forward and
    backward passes it is resolvable on a noisy machine, where the whole-step ratio is not.
    """
    extra = {"loss": jnp.float32(3.0), "abft_uncorrectable": jnp.int32(0)} if guarded else {}

    @jax.jit
    def update(g, s, p):
        updates, s = tx.update(g, s, p, **extra)
        return optax.apply_updates(p, updates), s

    state = tx.init(params)
    jax.block_until_ready(update(grads, state, params))  # compile
    return per_call(lambda: update(grads, state, params), calls)


def environment() -> dict:
    return {
        "jax": jax.__version__,
        "optax": optax.__version__,
        "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "command": " ".join(["python", *sys.argv]),
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    config = GPTConfig(
        d_model=args.d_model, num_layers=args.layers, num_heads=args.heads, seq_len=args.seq_len
    )
    model = GPT(config)
    data = ByteBatches(batch_size=args.batch_size, seq_len=args.seq_len, seed=0)
    batches = [jnp.asarray(data.batch(i)) for i in range(args.steps)]
    params = init_params(model, 0)
    n_params = sum(x.size for x in jax.tree.leaves(params))

    variants = {
        "unguarded": (optax.adam(3e-3), False),
        "guarded": (refuse_corrupted(optax.adam(3e-3)), True),
        # A reference for the cost of any global decision: every parameter update waits for
        # the norm of all gradients (the bound is never reached, so updates are unchanged).
        "adam after clip_by_global_norm": (
            optax.chain(optax.clip_by_global_norm(1e30), optax.adam(3e-3)),
            False,
        ),
    }
    steps, carries = {}, {}
    for name, (tx, guarded) in variants.items():
        steps[name] = make_step(model, tx, guarded=guarded)
        carries[name] = (params, tx.init(params))
        _, carries[name] = time_steps(steps[name], carries[name], batches[:2])  # compile

    def step_timer(name):
        def run() -> float:
            seconds, carries[name] = time_steps(steps[name], carries[name], batches)
            return seconds

        return run

    per_step = interleaved({name: step_timer(name) for name in variants}, args.repeats)

    summary = overheads(per_step, base="unguarded")

    def median_ratio(name):
        return 1 + summary[name]["overhead"]

    med = {name: summary[name]["median_s"] for name in variants}

    grads = jax.grad(loss_fn, argnums=1)(model, params, batches[0])
    updates = {
        name: update_seconds(tx, params, grads, guarded=guarded, calls=args.update_calls)
        for name, (tx, guarded) in variants.items()
    }
    per_update = interleaved(updates, args.repeats)
    update_med = {name: statistics.median(v) for name, v in per_update.items()}
    guard_share = (update_med["guarded"] - update_med["unguarded"]) / med["unguarded"]
    result = {
        "benchmark": "guard_overhead",
        "model": {**vars(config), "params": n_params, "batch_size": args.batch_size},
        "steps_per_repeat": args.steps,
        "repeats": args.repeats,
        "median_step_s": med,
        "ratio_of_medians": med["guarded"] / med["unguarded"],
        "median_ratio": median_ratio("guarded"),
        "median_ratio_per_variant": {name: median_ratio(name) for name in variants},
        "ratio_iqr": [1 + q for q in summary["guarded"]["overhead_iqr"]],
        "median_update_s": update_med,
        "guard_share_of_step": guard_share,
        "guard_state": describe(carries["guarded"][1]),
        "environment": environment(),
    }

    table = Table(title=f"Update guard overhead, reference GPT ({n_params:,} parameters)")
    table.add_column("variant")
    table.add_column("median step (ms)", justify="right")
    table.add_column("ratio of medians", justify="right")
    table.add_column("median of ratios", justify="right")
    for name in variants:
        ratio = med[name] / med["unguarded"]
        table.add_row(name, f"{1e3 * med[name]:.3f}", f"{ratio:.4f}", f"{median_ratio(name):.4f}")
    console = Console()
    console.print(table)
    console.print(
        f"median of per-repeat ratios: {result['median_ratio']:.4f} "
        f"(IQR {result['ratio_iqr'][0]:.4f}..{result['ratio_iqr'][1]:.4f}); "
        f"{args.repeats} repeats x {args.steps} steps, interleaved; guard: "
        f"{result['guard_state']}"
    )
    console.print(
        f"optimizer step alone (update + apply_updates): unguarded "
        f"{1e6 * update_med['unguarded']:.1f} us, guarded "
        f"{1e6 * update_med['guarded']:.1f} us, clipped "
        f"{1e6 * update_med['adam after clip_by_global_norm']:.1f} us; the guard's extra work is "
        f"{100 * guard_share:.2f}% of an unguarded step"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    console.print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
