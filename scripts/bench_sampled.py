"""Sampled checking (``protected_step(..., every=k)``): what it costs and how late it detects.

1. Cost: the checked step, the plain step (no GEMM checked, the guard on) and the sampled step
   for each ``k`` (``protected(state, batch)``, which runs the checked program on one step per
   window of ``k``), each a loop of ``--steps-per-round`` training steps, timed interleaved in
   one process; ratios to the plain loop are medians of per-round ratios. The predicted
   amortised cost is ``checked/plain * 1/k + (k-1)/k``.
2. Steps to detection: a recurring fault, a unit that corrupts with probability ``--rate`` on
   every step (a flip of the top exponent bit, ``--bits top``, or of any exponent bit,
   ``--bits exponent``, at a random element of a random GEMM site, forward or backward). For
   each ``k``, ``--trials`` runs from the same initial state until ABFT first detects a fault;
   steps to detection count from the first faulty step (0: detected on it).
   Faulty steps before the detection that the guard accepted are corrupted updates applied.

Usage:
  python scripts/bench_sampled.py                        # small MLP, a few minutes on 2 cores
  python scripts/bench_sampled.py --every 1 4 16 --rate 0.05 --trials 40
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from timing import interleaved, overheads, per_call

import sdcguard
from sdcguard import Fault, FaultPlan

DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}
# [low, high) bit positions of each dtype's exponent.
EXPONENT_BITS = {"fp32": (23, 31), "bf16": (7, 15), "fp16": (10, 15)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--every", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="compute dtype")
    p.add_argument("--width", type=int, default=256, help="hidden width of the MLP")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--rounds", type=int, default=41, help="interleaved timing rounds")
    p.add_argument("--steps-per-round", type=int, default=32, help="a multiple of every k")
    p.add_argument("--rate", type=float, default=0.1, help="probability of a fault per step")
    p.add_argument(
        "--bits",
        choices=["top", "exponent"],
        default="top",
        help="which bit a fault flips: the top exponent bit (always a large error) or any "
        "exponent bit (some flips are below the round-off bound and harmless)",
    )
    p.add_argument("--trials", type=int, default=20, help="runs per k for steps to detection")
    p.add_argument("--max-steps", type=int, default=2000, help="a run's end without detection")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("runs/bench_sampled.json"))
    return p.parse_args(argv)


class MLP(nn.Module):
    width: int
    layers: int
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        for i in range(self.layers):
            x = nn.gelu(nn.Dense(self.width, dtype=self.dtype, name=f"fc{i}")(x))
        return nn.Dense(16, dtype=self.dtype, name="head")(x)


def workload(args):
    model = MLP(args.width, args.layers, DTYPES[args.dtype])
    x = jax.random.normal(jax.random.key(1), (args.batch_size, args.width))
    y = jax.random.normal(jax.random.key(2), (args.batch_size, 16))
    params = model.init(jax.random.key(0), x)["params"]

    def loss_fn(params, batch):
        x, y = batch
        return jnp.mean((model.apply({"params": params}, x).astype(jnp.float32) - y) ** 2)

    return loss_fn, params, (x, y)


def make(loss_fn, every: int, seed: int):
    return sdcguard.protected_step(loss_fn, optax.adam(1e-3), every=every, seed=seed)


def loop(call, state, steps: int):
    """A timer over ``steps`` steps threading the state (kept between rounds)."""
    holder = [state]

    def run():
        s = holder[0]
        for _ in range(steps):
            s, _ = call(s)
        holder[0] = s
        return s.step

    return per_call(run, 1)


def time_programs(args, loss_fn, params, batch) -> dict:
    base = make(loss_fn, 1, args.seed)
    state = base.init(params)
    n = args.steps_per_round
    timers = {
        "plain": loop(lambda s: base.plain_program(s, batch), state, n),
        "checked": loop(lambda s: base.checked_program(s, batch), state, n),
    }
    for k in args.every:
        if n % k:
            sys.exit(f"--steps-per-round {n} is not a multiple of every={k}")
        sampled = make(loss_fn, k, args.seed)
        timers[f"every={k}"] = loop(lambda s, p=sampled: p(s, batch), sampled.init(params), n)
    for timer in timers.values():  # compile everything first
        timer()
    times = interleaved(timers, args.rounds)
    return overheads(times, base="plain")


def fault_sites(loss_fn, params, batch) -> list[str]:
    grads = jax.value_and_grad(loss_fn)
    return [s.name for s in sdcguard.list_sites(grads, params, batch) if s.checked]


def detection_run(protected, state, batch, sites, rng, args) -> dict:
    """Steps until ABFT first detects the recurring fault (None: not within --max-steps)."""
    low, high = EXPONENT_BITS[args.dtype]
    low = high - 1 if args.bits == "top" else low
    first_fault = None
    faulty_plain_accepted = faulty_plain_refused = 0
    for step in range(args.max_steps):
        faults = []
        if rng.random() < args.rate:
            site = sites[rng.integers(len(sites))]
            bit = int(rng.integers(low, high))
            seed = int(rng.integers(2**31 - 1))
            faults = [Fault(site=site, kind="bitflip", bit=bit, seed=seed, step=step)]
            first_fault = step if first_fault is None else first_fault
        plan = FaultPlan.from_faults(faults, capacity=1)
        state, out = protected(state, batch, plan)
        detected = int(out.counts[0]) > 0
        if detected:
            return {
                "first_fault": first_fault,
                "detected_at": step,
                "steps_to_detection": step - first_fault,
                "corrupted_updates_applied": faulty_plain_accepted,
                "corrupted_updates_refused": faulty_plain_refused,
            }
        if faults and not bool(out.checked):
            if bool(out.accepted):
                faulty_plain_accepted += 1
            else:
                faulty_plain_refused += 1
    return {
        "first_fault": first_fault,
        "detected_at": None,
        "steps_to_detection": None,
        "corrupted_updates_applied": faulty_plain_accepted,
        "corrupted_updates_refused": faulty_plain_refused,
    }


def detection_campaign(args, loss_fn, params, batch) -> dict:
    sites = fault_sites(loss_fn, params, batch)
    results = {}
    for k in args.every:
        runs = []
        protected = make(loss_fn, k, args.seed)  # one schedule; the faults' times are random
        for trial in range(args.trials):
            rng = np.random.default_rng([args.seed, trial])  # the same faults for every k
            runs.append(detection_run(protected, protected.init(params), batch, sites, rng, args))
        found = [r["steps_to_detection"] for r in runs if r["steps_to_detection"] is not None]
        applied = [r["corrupted_updates_applied"] for r in runs]
        refused = [r["corrupted_updates_refused"] for r in runs]
        results[f"every={k}"] = {
            "runs": runs,
            "detected": len(found),
            "median_steps": float(np.median(found)) if found else None,
            "mean_steps": float(np.mean(found)) if found else None,
            "p90_steps": float(np.percentile(found, 90)) if found else None,
            "mean_corrupted_updates_applied": float(np.mean(applied)),
            "mean_corrupted_updates_refused": float(np.mean(refused)),
        }
    return {"sites": sites, "by_every": results}


def _num(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> None:
    args = parse_args(argv)
    loss_fn, params, batch = workload(args)
    timing = time_programs(args, loss_fn, params, batch)
    campaign = detection_campaign(args, loss_fn, params, batch)
    checked = 1 + timing["checked"]["overhead"]
    header = (
        f"{'k':>3} | {'step / plain (measured)':>23} | {'predicted':>9} | {'detected':>8} | "
        f"{'steps to detection: median':>26} | {'mean':>6} | {'p90':>6} | "
        "corrupted updates applied / refused"
    )
    print(
        f"MLP {args.layers} x {args.width}, batch {args.batch_size}, {args.dtype}; "
        f"checked / plain = {checked:.3f}; fault rate {args.rate}/step, {args.trials} runs per k"
    )
    print(header)
    print("-" * len(header))
    rows = []
    for k in args.every:
        t, c = timing[f"every={k}"], campaign["by_every"][f"every={k}"]
        row = {
            "every": k,
            "measured": 1 + t["overhead"],
            "measured_iqr": [1 + q for q in t["overhead_iqr"]],
            "predicted": checked / k + (k - 1) / k,
            "detected": f"{c['detected']}/{args.trials}",
            "median_steps": c["median_steps"],
            "mean_steps": c["mean_steps"],
            "p90_steps": c["p90_steps"],
            "corrupted_updates_applied": c["mean_corrupted_updates_applied"],
            "corrupted_updates_refused": c["mean_corrupted_updates_refused"],
        }
        rows.append(row)
        print(
            f"{k:>3} | {row['measured']:>14.3f} ({row['measured_iqr'][0]:.2f}-"
            f"{row['measured_iqr'][1]:.2f}) | {row['predicted']:>9.3f} | {row['detected']:>8} | "
            f"{_num(row['median_steps']):>26} | {_num(row['mean_steps']):>6} | "
            f"{_num(row['p90_steps']):>6} | {row['corrupted_updates_applied']:.2f} / "
            f"{row['corrupted_updates_refused']:.2f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "commit": commit(),
        "jax": jax.__version__,
        "platform": platform.platform(),
        "device": str(jax.devices()[0]),
        "timing": timing,
        "table": rows,
        "campaign": campaign,
    }
    args.out.write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
