"""What recovery costs on the reference GPT: snapshot overhead, and one fault three ways.

1. Snapshot overhead per step: :func:`sdcguard.recovery.train_with_recovery` with an
   in-memory snapshot every k = 1 and k = 10 steps, against the same loop without periodic
   snapshots and against a bare ``for`` loop.
2. Recovery cost of one fault, side by side:
   - ABFT in place: a protected training step with an injected INF in the attention scores,
     minus a clean unprotected step (``sdcguard.training.make_train_step``);
   - in-memory rollback: restoring a snapshot plus recomputing the steps since it was taken
     (on average half the snapshot interval);
   - Orbax: restoring a checkpoint from disk plus recomputing the steps since it was saved (on
     average half the checkpoint interval).
   ATTNChecker's "up to 49x" compares ABFT's per-step overhead with a per-step checkpoint
   save + reload; that ratio is reported too ("orbax save + restore").

Everything is timed interleaved in one process; each number is a median over repeats.

Usage:
  python scripts/bench_recovery.py
  python scripts/bench_recovery.py --checkpoint-every 100 1000 --out runs/bench_recovery.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
from rich.console import Console
from rich.table import Table

from sdcguard.fault_model import Fault, FaultPlan
from sdcguard.guard import refuse_corrupted
from sdcguard.models import ByteBatches, GPTConfig
from sdcguard.protection import ABFTConfig, Counts
from sdcguard.recovery import (
    CheckpointTier,
    RecoveryConfig,
    SnapshotRing,
    TrainState,
    train_with_recovery,
)
from sdcguard.training import TrainConfig, make_train_step


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=20, help="steps per timed repeat")
    p.add_argument("--repeats", type=int, default=11)
    p.add_argument("--snapshot-every", type=int, default=10, help="interval of the rollback tier")
    p.add_argument(
        "--checkpoint-every",
        type=int,
        nargs="+",
        default=[100, 500, 1000],
        help="intervals of the Orbax tier to compare (steps)",
    )
    p.add_argument("--out", type=Path, default=Path("runs/bench_recovery.json"))
    args = p.parse_args(argv)
    if args.steps < 2 or args.repeats < 3:
        p.error("--steps must be >= 2 and --repeats >= 3")
    return args


def timed(fn) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def interleaved(variants: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each zero-argument callable, run in alternating order per repeat."""
    for fn in variants.values():
        timed(fn)  # compile and warm up
    samples = {name: [] for name in variants}
    for r in range(repeats):
        names = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in names:
            samples[name].append(timed(variants[name]))
    return {name: statistics.median(v) for name, v in samples.items()}


# --- 1. Snapshot overhead ----------------------------------------------------------------------


def guarded_step():
    """A reference-GPT step over a TrainState whose optimizer is the guard (no ABFT layers)."""
    state, step = make_train_step(
        TrainConfig(abft=None), optimizer=refuse_corrupted(optax.adam(3e-3))
    )
    plan = FaultPlan.none()

    def step_fn(s: TrainState, batch) -> TrainState:
        return step(s, batch, plan)[0]

    return state, step_fn


def snapshot_overhead(args, batches) -> dict:
    state, step_fn = guarded_step()
    n = args.steps

    def bare():
        s = state
        for i in range(n):
            s = step_fn(s, batches[i])
        return s

    def loop(every):
        def run():
            ring = SnapshotRing(keep=2)
            config = RecoveryConfig(snapshot_every=every, keep_snapshots=2)
            report = train_with_recovery(
                step_fn, state, batches.__getitem__, num_batches=n, config=config, snapshots=ring
            )
            ring.close()
            return report.state

        return run

    med = interleaved(
        {"bare loop": bare, "no snapshots": loop(None), "k=10": loop(10), "k=1": loop(1)},
        args.repeats,
    )
    return {name: t / n for name, t in med.items()}


# --- 2. Recovery cost of one fault -------------------------------------------------------------


def abft_fault_cost(args, batches) -> dict:
    plain_state, plain_step = make_train_step(TrainConfig(abft=None))
    prot_state, prot_step = make_train_step(TrainConfig(abft=ABFTConfig()))
    site = "decoder/block_0/attn:scores"
    fault = FaultPlan.from_faults([Fault(site=site, kind="inf", index=17, step=-1)])
    clean = FaultPlan.none()
    _, out = prot_step(prot_state, batches[0], fault)
    counts = Counts(*(int(c) for c in out.counts))
    detected, corrected, uncorrectable = counts.detected, counts.corrected, counts.uncorrectable
    if not (corrected >= 1 and uncorrectable == 0):
        raise RuntimeError(f"the injected fault was not corrected: counts {out.counts}")

    def steps(step, state, plan):
        def run():
            s = state
            for i in range(args.steps):
                s, _ = step(s, batches[i], plan)
            return s

        return run

    med = interleaved(
        {
            "unprotected, clean": steps(plain_step, plain_state, clean),
            "protected, clean": steps(prot_step, prot_state, clean),
            "protected, fault every step": steps(prot_step, prot_state, fault),
        },
        args.repeats,
    )
    per_step = {name: t / args.steps for name, t in med.items()}
    return {
        "per_step_s": per_step,
        "fault": {"site": site, "kind": "inf", "counts": [detected, corrected, uncorrectable]},
        "cost_per_fault_s": per_step["protected, fault every step"]
        - per_step["unprotected, clean"],
        # The part due to the fault alone (locate + correct), without ABFT's always-on checks.
        "correction_only_s": per_step["protected, fault every step"] - per_step["protected, clean"],
        "measured_with": "sdcguard.training.make_train_step (full protected training step)",
    }


def restore_costs(args, batches) -> dict:
    state, step_fn = guarded_step()
    state = step_fn(state, batches[0])
    ring = SnapshotRing(keep=1)
    ring.take(state, step=1)
    ring.wait()
    with tempfile.TemporaryDirectory(prefix="sdcguard-bench-") as directory:
        tier = CheckpointTier(directory, keep=1)
        tier.save(1, state)
        tier.wait()
        saved = iter(range(2, 10**9))

        def save():
            tier.save(next(saved), state)
            tier.wait()
            return state.step

        med = interleaved(
            {
                "snapshot restore": lambda: ring.restore()[0],
                "orbax restore": lambda: tier.restore(like=state)[0],
                "orbax save": save,
            },
            args.repeats,
        )
        tier.close()
    ring.close()
    return med


def environment() -> dict:
    return {
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "command": " ".join(["python", *sys.argv]),
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    config = GPTConfig()
    data = ByteBatches(batch_size=8, seq_len=config.seq_len, seed=0)
    batches = [jnp.asarray(data.batch(i)) for i in range(args.steps)]
    console = Console()

    overhead = snapshot_overhead(args, batches)
    abft = abft_fault_cost(args, batches)
    restore = restore_costs(args, batches)
    step_s = abft["per_step_s"]["unprotected, clean"]
    k = args.snapshot_every
    recovery = {
        "abft in place": abft["cost_per_fault_s"],
        f"in-memory rollback (restore + {k / 2:g} steps)": restore["snapshot restore"]
        + k / 2 * step_s,
        "orbax save + restore (ATTNChecker's per-step comparison)": restore["orbax save"]
        + restore["orbax restore"],
    }
    for c in args.checkpoint_every:
        # A fault lands on average half-way through a checkpoint interval.
        recovery[f"orbax restore + {c / 2:g} steps (interval {c})"] = (
            restore["orbax restore"] + c / 2 * step_s
        )
    abft_cost = recovery["abft in place"]

    table = Table(title="Snapshot overhead per step (reference GPT, guarded adam)")
    table.add_column("loop")
    table.add_column("ms / step", justify="right")
    table.add_column("vs no snapshots", justify="right")
    for name, t in overhead.items():
        table.add_row(name, f"{1e3 * t:.3f}", f"{t / overhead['no snapshots']:.4f}")
    console.print(table)

    table = Table(title="Recovery cost of one fault")
    table.add_column("method")
    table.add_column("ms", justify="right")
    table.add_column("x ABFT", justify="right")
    for name, t in recovery.items():
        table.add_row(name, f"{1e3 * t:.3f}", f"{t / abft_cost:.1f}")
    console.print(table)
    console.print(
        f"ABFT cost = protected step with an INF injected at {abft['fault']['site']} every step "
        f"(counts {abft['fault']['counts']}) minus a clean unprotected step; "
        f"{abft['measured_with']}. Steps: unprotected {1e3 * step_s:.3f} ms, protected clean "
        f"{1e3 * abft['per_step_s']['protected, clean']:.3f} ms, protected with the fault "
        f"{1e3 * abft['per_step_s']['protected, fault every step']:.3f} ms (correction alone "
        f"{1e3 * abft['correction_only_s']:.3f} ms). Restores: snapshot "
        f"{1e3 * restore['snapshot restore']:.3f} ms, "
        f"Orbax {1e3 * restore['orbax restore']:.3f} ms "
        f"(save {1e3 * restore['orbax save']:.3f} ms)."
    )
    result = {
        "benchmark": "recovery_cost",
        "snapshot_overhead_s_per_step": overhead,
        "snapshot_overhead_ratio": {
            name: t / overhead["no snapshots"] for name, t in overhead.items()
        },
        "abft": abft,
        "restore_s": restore,
        "recovery_s": recovery,
        "ratio_to_abft": {name: t / abft_cost for name, t in recovery.items()},
        "snapshot_every": k,
        "checkpoint_every": args.checkpoint_every,
        "steps_per_repeat": args.steps,
        "repeats": args.repeats,
        "environment": environment(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
