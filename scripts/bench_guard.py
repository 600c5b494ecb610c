"""The update guard on the reference GPT: its overhead, and its error rates on scripted spikes.

1. Overhead: guarded / unguarded training steps, and the step wrapped for triage
   (:func:`sdcguard.guard.with_triage`) on its clean path. All steps are compiled first, then
   timed interleaved in one process (the order alternates every repeat, so drift in machine
   load hits all alike); the result is the median over repeats of the per-step time, and the
   median of the per-repeat ratios.
2. Scenarios: scripted gradient-norm and loss sequences (steady training, a learning-rate
   warm-up, a warm-up with real 6-10x bursts, a curriculum switch) with faults injected at
   random steps (the gradients multiplied by 10, 100 or 1e4, or a NaN), a fault that does not
   recur when the step is recomputed. For the plain guard and the guard with triage: the
   false-refusal rate (clean steps refused or skipped) and the miss rate (faulty updates
   applied).

Usage:
  python scripts/bench_guard.py                       # default tiny GPT, all scenarios
  python scripts/bench_guard.py --d-model 256 --layers 4 --out runs/bench_guard_256.json
  python scripts/bench_guard.py --scenarios-only --trials 50
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from rich.console import Console
from rich.table import Table
from timing import interleaved, overheads, per_call

from sdcguard.guard import Triage, describe, find_guard_state, refuse_corrupted, with_triage
from sdcguard.models import GPT, ByteBatches, GPTConfig, init_params, lm_loss


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
    p.add_argument("--trials", type=int, default=20, help="runs per spike scenario")
    p.add_argument("--scenario-steps", type=int, default=300, help="steps per scenario run")
    p.add_argument("--scenarios-only", action="store_true", help="skip the overhead timing")
    p.add_argument("--out", type=Path, default=Path("runs/bench_guard.json"))
    args = p.parse_args(argv)
    if args.steps < 1 or args.repeats < 3:
        p.error("--steps must be >= 1 and --repeats >= 3")
    return args


def loss_fn(model: GPT, params, batch):
    return lm_loss(model.apply({"params": params}, batch[:, :-1]), batch[:, 1:])


def make_step(model: GPT, tx, *, guarded: bool, triage: bool = False):
    """A jitted ``step(params, opt_state, batch)``; the guarded one gets every extra input; with
    ``triage`` the step is wrapped by :func:`sdcguard.guard.with_triage`."""

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn, argnums=1)(model, params, batch)
        extra = {"loss": loss, "abft_uncorrectable": jnp.int32(0)} if guarded else {}
        updates, opt_state = tx.update(grads, opt_state, params, **extra)
        return optax.apply_updates(params, updates), opt_state

    return jax.jit(with_triage(step, state_argnum=1) if triage else step)


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
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    return {
        "commit": commit,
        "jax": jax.__version__,
        "optax": optax.__version__,
        "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "command": " ".join(["python", *sys.argv]),
    }


def overhead(args, console: Console) -> dict:
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
        "guarded + triage": (refuse_corrupted(optax.adam(3e-3)), "triage"),
        # A reference for the cost of any global decision: every parameter update waits for
        # the norm of all gradients (the bound is never reached, so updates are unchanged).
        "adam after clip_by_global_norm": (
            optax.chain(optax.clip_by_global_norm(1e30), optax.adam(3e-3)),
            False,
        ),
    }
    steps, carries = {}, {}
    for name, (tx, guarded) in variants.items():
        steps[name] = make_step(model, tx, guarded=bool(guarded), triage=guarded == "triage")
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
        name: update_seconds(tx, params, grads, guarded=bool(guarded), calls=args.update_calls)
        for name, (tx, guarded) in variants.items()
        if guarded != "triage"  # the same optimizer step as "guarded"
    }
    per_update = interleaved(updates, args.repeats)
    update_med = {name: statistics.median(v) for name, v in per_update.items()}
    guard_share = (update_med["guarded"] - update_med["unguarded"]) / med["unguarded"]
    # Time stolen by other tenants only ever adds: the fastest rounds are the least disturbed.
    update_min = {name: min(v) for name, v in per_update.items()}
    step_min = summary["unguarded"]["min_s"]
    guard_share_fastest = (update_min["guarded"] - update_min["unguarded"]) / step_min
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
        "guard_share_of_step_fastest_rounds": guard_share_fastest,
        "clip_share_of_step": (
            update_med["adam after clip_by_global_norm"] - update_med["unguarded"]
        )
        / med["unguarded"],
        "triage_ratio_to_guarded": summary["guarded + triage"]["median_s"] / med["guarded"],
        "triage_median_ratio": 1 + summary["guarded + triage"]["overhead"],
        "guard_state": describe(carries["guarded"][1]),
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
        f"{100 * guard_share:.2f}% of an unguarded step ({100 * guard_share_fastest:.2f}% "
        f"from the fastest rounds); the triage wrapper's clean path: "
        f"{result['triage_median_ratio']:.4f} x unguarded (median of ratios), "
        f"{result['triage_ratio_to_guarded']:.4f} x guarded (ratio of medians)"
    )
    return result


# --- Scripted spike scenarios ------------------------------------------------------------------

SCENARIOS = ("steady", "lr_warmup", "lr_warmup_bursts", "curriculum_switch")
FAULTS = ("x10", "x100", "x1e4", "nan")
_FAULT_SCALE = {"x10": 10.0, "x100": 100.0, "x1e4": 1e4, "nan": float("nan")}


def scenario(name: str, steps: int, seed: int):
    """Real gradient-norm scales and losses of one scripted run, float32 ``[steps]`` each."""
    rng = np.random.default_rng([seed, SCENARIOS.index(name)])
    i = np.arange(steps)
    noise = np.exp(0.3 * rng.normal(size=steps))
    loss = 2.0 + 0.05 * rng.normal(size=steps)
    if name == "steady":
        norm = noise
    else:
        # A learning-rate warm-up: gradient norms grow 50x over the first two thirds.
        ramp = np.minimum(i / (2 * steps / 3), 1.0)
        norm = 50.0**ramp * noise
        loss = loss + 3.0 * (1 - ramp)
    if name == "lr_warmup_bursts":
        bursts = rng.choice(np.arange(10, steps), size=steps // 25, replace=False)
        norm[bursts] *= rng.uniform(6, 10, size=bursts.size)
    if name == "curriculum_switch":
        # The data changes at mid-run: loss 3x and gradients 4x, then learned again.
        after = np.maximum(i - steps // 2, 0)
        switched = i >= steps // 2
        loss = np.where(switched, loss + 4.0 * np.exp(-after / 15), loss)
        norm = np.where(switched, norm * (1 + 3.0 * np.exp(-after / 15)), norm)
    return norm.astype(np.float32), loss.astype(np.float32)


def scenario_step(config_kwargs: dict | None = None):
    """The guarded step of the scripted runs, plain and triaged: ``step(state, direction,
    norm, loss, fault) -> state``; the gradient is ``fault * norm * direction``; a
    recomputation sees no fault (it did not recur)."""
    tx = refuse_corrupted(optax.sgd(1e-3), **(config_kwargs or {}))

    def step(opt_state, direction, norm, loss, fault):
        grads = {"w": fault * norm * direction}
        _, opt_state = tx.update(grads, opt_state, {"w": direction}, loss=loss)
        return opt_state

    def recur_not(args):
        return (*args[:4], jnp.float32(1.0))

    init = tx.init({"w": jnp.zeros(256)})
    return jax.jit(step), jax.jit(with_triage(step, recompute_args=recur_not)), init


def run_scenarios(args, console: Console) -> dict:
    plain, triaged, init = scenario_step()
    results = {}
    for name in SCENARIOS:
        for mode, step in (("guard", plain), ("guard + triage", triaged)):
            counts = dict.fromkeys(
                ("clean", "false_refusals", "faults", "missed", "recomputed", "rollbacks"), 0
            )
            per_fault = {k: [0, 0] for k in FAULTS}  # [injected, missed]
            for trial in range(args.trials):
                norm, loss = scenario(name, args.scenario_steps, trial)
                rng = np.random.default_rng([trial, 99])
                # One fault per ~30 steps, after the first three, of a random kind.
                at = rng.choice(
                    np.arange(3, args.scenario_steps), args.scenario_steps // 30, replace=False
                )
                kinds = {
                    int(s): FAULTS[k] for s, k in zip(at, rng.integers(0, 4, at.size), strict=True)
                }
                state = init
                directions = rng.normal(size=(args.scenario_steps, 256)).astype(np.float32)
                directions /= np.linalg.norm(directions, axis=1, keepdims=True)
                streak = 0
                for t in range(args.scenario_steps):
                    kind = kinds.get(t)
                    fault = np.float32(_FAULT_SCALE[kind]) if kind else np.float32(1)
                    state = step(state, directions[t], norm[t], loss[t], fault)
                    guard = find_guard_state(state)
                    reason, triage = int(guard.reason), int(guard.triage)
                    held = reason != 0 or triage == Triage.REAL_SKIPPED
                    counts["recomputed"] += triage != Triage.NONE
                    streak = streak + 1 if reason else 0
                    counts["rollbacks"] += streak == 3  # what max_consecutive=3 would ask
                    if kind:
                        counts["faults"] += 1
                        per_fault[kind][0] += 1
                        # Applied corrupt: accepted, and not the recomputation's result.
                        missed = not held and triage != Triage.SDC_CORRECTED
                        counts["missed"] += missed
                        per_fault[kind][1] += missed
                    else:
                        counts["clean"] += 1
                        counts["false_refusals"] += held
            counts["false_refusal_rate"] = counts["false_refusals"] / max(counts["clean"], 1)
            counts["miss_rate"] = counts["missed"] / max(counts["faults"], 1)
            counts["missed_by_fault"] = {k: f"{m}/{n}" for k, (n, m) in per_fault.items()}
            results[f"{name} / {mode}"] = counts

    table = Table(
        title=(
            f"Scripted spike scenarios: {args.trials} runs x {args.scenario_steps} steps each, "
            "one fault per ~30 steps (x10, x100, x1e4 or NaN on the gradients; not recurring)"
        )
    )
    for col in ("scenario / guard", "false refusals", "misses", "missed by fault", "recomputed"):
        table.add_column(col, justify="left" if col.startswith("s") else "right")
    for key, c in results.items():
        table.add_row(
            key,
            f"{c['false_refusals']}/{c['clean']} ({100 * c['false_refusal_rate']:.2f}%)",
            f"{c['missed']}/{c['faults']} ({100 * c['miss_rate']:.1f}%)",
            " ".join(f"{k}:{v}" for k, v in c["missed_by_fault"].items()),
            str(c["recomputed"]),
        )
    console.print(table)
    return results


def main(argv=None) -> dict:
    args = parse_args(argv)
    console = Console(width=150)
    result = {"benchmark": "guard", "environment": environment()}
    if not args.scenarios_only:
        result["overhead"] = overhead(args, console)
    result["scenarios"] = run_scenarios(args, console)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    console.print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
