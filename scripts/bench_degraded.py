"""What degraded mode (MeCeFO) costs and what it does to training, on 8 simulated devices.

1. Work of the neighbour: XLA's cost analysis (flops, bytes accessed) of each role's compiled
   work (:func:`sdcguard.degraded.replica_work`: a normal replica's micro-batch; the
   neighbour's two), for the approximations on both of the neighbour's micro-batches
   (``scope='both'``, the default), on the taken-over one only, and an exact takeover.
2. Step time, side by side: the normal and the neighbour role on one device, interleaved,
   median of per-round ratios (``scripts/timing.py``); and the whole 8-replica step with all
   replicas in against one out. The 8 simulated devices share this machine's cores, so the
   whole step's time follows the total work of all replicas, not the slowest one: the role
   ratio is the figure that stands for a cluster.
3. Convergence: the reference GPT trained on the same data fault-free, with one replica out for
   a stretch (each scope), and with a replica whose gradients go wrong from a step on (the
   update guard quarantines it). Loss on held-out batches at the end.

XLA:CPU folds ``jax.checkpoint``'s optimization barrier away (pass ``cse_barrier_expander``)
and merges the FFN's recomputation back into the forward pass. This script disables that pass
so the recomputation (approximation ii) is real and counted; ``--merge-remat`` keeps XLA's
default.

Usage:
  python scripts/bench_degraded.py
  python scripts/bench_degraded.py --steps 300 --out-from 50 --out-until 250 --rounds 21
"""

from __future__ import annotations

import argparse
import os
import sys

EIGHT = "--xla_force_host_platform_device_count=8"
KEEP_REMAT = "--xla_disable_hlo_passes=cse_barrier_expander"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=300, help="training steps per run")
    p.add_argument("--out-from", type=int, default=50, help="step at which replica 3 is lost")
    p.add_argument("--out-until", type=int, default=250, help="step at which it is readmitted")
    p.add_argument("--fault-from", type=int, default=50, help="replica 5 corrupts from here")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--rounds", type=int, default=21, help="interleaved timing rounds")
    p.add_argument("--calls", type=int, default=10, help="calls per timing round")
    p.add_argument("--merge-remat", action="store_true", help="keep XLA:CPU's default passes")
    p.add_argument("--skip-training", action="store_true", help="costs and timings only")
    p.add_argument("--out", default="runs/bench_degraded.json")
    args = p.parse_args(argv)
    if not 0 <= args.out_from < args.out_until <= args.steps:
        p.error("need 0 <= --out-from < --out-until <= --steps")
    return args


ARGS = parse_args(sys.argv[1:] if __name__ == "__main__" else [])
_flags = [os.environ.get("XLA_FLAGS", ""), EIGHT] + ([] if ARGS.merge_remat else [KEEP_REMAT])
os.environ["XLA_FLAGS"] = " ".join(f for f in _flags if f)

import json  # noqa: E402
import platform  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from timing import interleaved, overheads, per_call  # noqa: E402

from sdcguard.degraded import (  # noqa: E402
    DegradedConfig,
    DegradedTrainer,
    GPTWorkload,
    MeCeFO,
    ReplicaFault,
    make_degraded_step,
    replica_work,
)
from sdcguard.models import GPT, ByteBatches, GPTConfig, init_params, lm_loss  # noqa: E402

SIZES = {
    "tiny (d 64, seq 64)": GPTConfig(),
    "d 256, seq 256": GPTConfig(d_model=256, seq_len=256, num_heads=4),
}
SCOPES = {
    "MeCeFO, both micro-batches": MeCeFO(),
    "MeCeFO, taken-over only": MeCeFO(scope="taken_over"),
    "exact takeover": MeCeFO.exact(),
}


def role_inputs(config: DegradedConfig, workload: GPTWorkload):
    params = init_params(GPT(workload.model), config.seed)
    data = ByteBatches(batch_size=config.micro_batch, seq_len=workload.model.seq_len)
    own, taken = jnp.asarray(data.batch(0)), jnp.asarray(data.batch(1))
    return params, own, taken, jax.random.key(0)


def compiled_role(config: DegradedConfig, workload: GPTWorkload, role: str):
    inputs = role_inputs(config, workload)
    compiled = jax.jit(replica_work(workload)[role]).lower(*inputs).compile()
    return compiled, inputs


def costs(args) -> dict:
    """Per model size and scope: neighbour ÷ normal in flops and bytes accessed."""
    out = {}
    for size, model in SIZES.items():
        config = DegradedConfig(micro_batch=args.micro_batch)
        normal, _ = compiled_role(config, GPTWorkload(model=model), "normal")
        base = normal.cost_analysis()
        out[size] = {"normal": {"flops": base["flops"], "bytes": base["bytes accessed"]}}
        for name, approx in SCOPES.items():
            workload = GPTWorkload(model=model, approximations=approx)
            analysis = compiled_role(config, workload, "neighbour")[0].cost_analysis()
            out[size][name] = {
                "flops": analysis["flops"],
                "bytes": analysis["bytes accessed"],
                "flops_ratio": analysis["flops"] / base["flops"],
                "bytes_ratio": analysis["bytes accessed"] / base["bytes accessed"],
            }
    return out


def role_times(args) -> dict:
    """Normal vs neighbour on one device, interleaved: per size, the per-round ratio."""
    out = {}
    for size, model in SIZES.items():
        config = DegradedConfig(micro_batch=args.micro_batch)
        timers = {}
        for role in ("normal", "neighbour"):
            compiled, inputs = compiled_role(config, GPTWorkload(model=model), role)
            jax.block_until_ready(compiled(*inputs))
            timers[role] = per_call(lambda c=compiled, i=inputs: c(*i), args.calls)
        summary = overheads(interleaved(timers, args.rounds), base="normal")
        out[size] = summary
    return out


def whole_step_times(args) -> dict:
    """The 8-replica step, all in vs replica 3 out, interleaved (shared cores: total work)."""
    config = DegradedConfig(micro_batch=args.micro_batch)
    state, step = make_degraded_step(config, GPTWorkload())
    data = ByteBatches(batch_size=config.global_batch, seq_len=GPTConfig().seq_len)
    batch = jnp.asarray(data.batch(0)).reshape(config.replicas, config.micro_batch, -1)
    fault = ReplicaFault.none()
    masks = {"all in": np.zeros(8, bool), "replica 3 out": np.eye(8, dtype=bool)[3]}
    timers = {}
    for name, mask in masks.items():
        jax.block_until_ready(step(state, batch, mask, fault))
        timers[name] = per_call(lambda m=mask: step(state, batch, m, fault), args.calls)
    return overheads(interleaved(timers, args.rounds), base="all in")


def training(args) -> dict:
    """Held-out loss after the same data: fault-free, one replica out, a quarantined replica."""
    held_out = ByteBatches(batch_size=64, seq_len=GPTConfig().seq_len, seed=99)
    model = GPT(GPTConfig())
    evaluate = jax.jit(lambda p, x: lm_loss(model.apply({"params": p}, x[:, :-1]), x[:, 1:]))
    runs = {"fault-free": ("none", MeCeFO())}
    runs.update({f"replica 3 out, {name}": ("out", a) for name, a in SCOPES.items()})
    runs["replica 5 corrupts, guard quarantines it"] = ("fault", MeCeFO())
    compiled = {}
    out = {}
    for name, (kind, approx) in runs.items():
        config = DegradedConfig(micro_batch=args.micro_batch)
        if approx not in compiled:
            compiled[approx] = make_degraded_step(config, GPTWorkload(approximations=approx))
        trainer = DegradedTrainer(config, compiled=compiled[approx])
        data = ByteBatches(batch_size=config.global_batch, seq_len=GPTConfig().seq_len)
        start = time.perf_counter()
        for i in range(args.steps):
            if kind == "out" and i == args.out_from:
                trainer.lose(3)
            if kind == "out" and i == args.out_until:
                trainer.readmit(3)
            fault = ReplicaFault.on(5) if kind == "fault" and i >= args.fault_from else None
            trainer.step(data.batch(i), fault=fault)
        params = trainer.params()
        loss = float(np.mean([evaluate(params, held_out.batch(j)) for j in range(8)]))
        out[name] = {
            "held_out_loss": loss,
            "train_loss_last10": float(np.mean(trainer.report.losses[-10:])),
            "steps_with_a_replica_out": sum(1 for k in trainer.report.out_replicas if k),
            "events": [e._asdict() for e in trainer.report.events],
            "refused": trainer.report.refused,
            "steps_run": trainer.report.steps_run,
            "seconds": time.perf_counter() - start,
        }
    clean = out["fault-free"]["held_out_loss"]
    for result in out.values():
        result["vs_fault_free"] = result["held_out_loss"] / clean - 1
    return out


def main() -> None:
    args = ARGS
    console = Console()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    results = {
        "command": " ".join(["python", "scripts/bench_degraded.py", *sys.argv[1:]]),
        "commit": commit,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "xla_flags": os.environ["XLA_FLAGS"],
        "recompute_kept": not args.merge_remat,
    }
    results["costs"] = costs(args)
    table = Table(title="Neighbour's work ÷ a normal replica's (XLA cost analysis)")
    for column in ("model", "approximations", "flops", "bytes accessed"):
        table.add_column(column)
    for size, rows in results["costs"].items():
        for name in SCOPES:
            r = rows[name]
            table.add_row(size, name, f"{r['flops_ratio']:.3f}", f"{r['bytes_ratio']:.3f}")
    console.print(table)

    results["role_times"] = role_times(args)
    results["whole_step_times"] = whole_step_times(args)
    table = Table(title="Step time, interleaved (median of per-round ratios, IQR)")
    for column in ("what", "base", "median s", "ratio"):
        table.add_column(column)
    for size, summary in results["role_times"].items():
        s = summary["neighbour"]
        lo, hi = s["overhead_iqr"]
        table.add_row(
            f"neighbour role, {size}",
            f"{summary['normal']['median_s'] * 1e3:.2f} ms",
            f"{s['median_s'] * 1e3:.2f} ms",
            f"{1 + s['overhead']:.3f} ({1 + lo:.3f}-{1 + hi:.3f})",
        )
    s = results["whole_step_times"]["replica 3 out"]
    lo, hi = s["overhead_iqr"]
    table.add_row(
        "8-replica step, replica 3 out (total work)",
        f"{results['whole_step_times']['all in']['median_s'] * 1e3:.2f} ms",
        f"{s['median_s'] * 1e3:.2f} ms",
        f"{1 + s['overhead']:.3f} ({1 + lo:.3f}-{1 + hi:.3f})",
    )
    console.print(table)

    if not args.skip_training:
        results["training"] = training(args)
        table = Table(title=f"Reference GPT, 8 replicas, {args.steps} steps, same data")
        for column in ("run", "held-out loss", "vs fault-free", "steps out", "events"):
            table.add_column(column)
        for name, r in results["training"].items():
            events = ", ".join(f"{e['kind']} {e['replica']}@{e['step']}" for e in r["events"])
            table.add_row(
                name,
                f"{r['held_out_loss']:.4f}",
                f"{100 * r['vs_fault_free']:+.2f}%",
                str(r["steps_with_a_replica_out"]),
                events or "-",
            )
        console.print(table)

    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, default=str))
    console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
