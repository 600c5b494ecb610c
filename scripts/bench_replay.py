"""Cost of deterministic replay on the reference GPT.

1. Recording a step with full capture vs the plain training step, side by side in one
   process, interleaved, median of repeats:
   * ``capture``: the lock-step capture program (forward+backward with every submodule's
     inputs, outputs and their cotangents tapped), on the device;
   * ``capture+write``: the same, plus moving every captured tensor to the host and streaming
     it into a trace on disk.
2. Wall time of a full ``sdcguard compare`` (local vs local, all levels, the task's 3 steps):
   cold (a fresh process: start-up and compilation included) and warm (programs compiled).
3. Wall time of ``sdcguard scan`` over five local nodes (each a process started through a
   launcher, as ``ssh {node}`` would: start-up and compilation included), all levels, the
   task's 3 steps, ``--jobs 5``: five healthy nodes (exit 0), and five with one made to
   corrupt silently by ``tests/helpers/replay_launcher.py`` (exit 1: the suspect is rerun
   lock-stepped to a majority node). Next to them, in the same run, one node alone
   (``sdcguard record`` in a fresh process), interleaved, median of ``--scan-repeats``.

Usage:
  python scripts/bench_replay.py [--repeats 20] [--scan-repeats 2] [--only capture,compare,scan]
                                 [--json runs/bench_replay.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from sdcguard.replay import configure

configure()  # before JAX starts its backend

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from sdcguard.replay import (  # noqa: E402
    CompareOptions,
    RecordOptions,
    TraceWriter,
    _capture as capture,
    compare_nodes,
    reference_task,
)


def _plain_step(task):
    @jax.jit
    def step(params, opt_state, batch):
        def loss_fn(p):
            return task.loss(task.model.apply({"params": p}, *task.model_inputs(batch)), batch)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = task.optimizer.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, updates), opt_state

    return step


def _time(fn) -> float:
    t = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t


def bench_capture(repeats: int) -> dict:
    task = reference_task()
    params = task.init_params()
    opt_state = task.optimizer.init(params)
    batch = task.batch(0)
    plain = _plain_step(task)
    programs = capture.Programs(task)
    sinks, fwd, bwd, use_ref = programs.capture_args(params, batch)
    plan = capture.padded_plan()
    args = (params, batch, plan, sinks, fwd, bwd, use_ref)
    scratch = tempfile.mkdtemp(prefix="bench-replay-")

    def run_plain():
        return plain(params, opt_state, batch)

    def run_capture():
        return programs.capture(*args)

    def run_capture_write():
        loss, f, b, g = programs.capture(*args)
        writer = TraceWriter(os.path.join(scratch, "t"))
        writer.add("loss", np.asarray(loss))
        for name, x in f.items():
            writer.add(f"fwd/{name}", np.asarray(x))
        for name, x in b.items():
            writer.add(f"bwd/{name}", np.asarray(x))
        for name, x in capture.flatten_params(g).items():
            writer.add(f"grad/{name}", np.asarray(x))
        writer.finish({})
        return loss

    fns = {"plain step": run_plain, "capture": run_capture, "capture+write": run_capture_write}
    for fn in fns.values():  # compile and warm up
        fn()
        fn()
    times = {k: [] for k in fns}
    for _ in range(repeats):  # interleaved: drift in machine load hits all alike
        for k, fn in fns.items():
            times[k].append(_time(fn))
    shutil.rmtree(scratch, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    taps = programs.taps(params, batch)
    captured = sum(int(np.prod(t.shape)) * (2 if t.differentiable else 1) for t in taps)
    return {
        "median_s": med,
        "ratio_vs_plain": {k: med[k] / med["plain step"] for k in med},
        "repeats": repeats,
        "taps": len(taps),
        "captured_elements": captured,
    }


def bench_compare() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    argv = [sys.executable, "-m", "sdcguard", "compare"]
    t = time.perf_counter()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True)
    cold = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(f"compare failed ({proc.returncode}): {proc.stderr[-2000:]}")
    options = CompareOptions(record=RecordOptions())
    compare_nodes(options)  # compile
    t = time.perf_counter()
    comparison = compare_nodes(options)
    warm = time.perf_counter() - t
    return {
        "cold_process_s": cold,
        "warm_s": warm,
        "identical": comparison.identical,
        "tensors_compared": len(comparison.rows),
        "command": "sdcguard compare",
    }


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NODES = ("n1", "n2", "n3", "n4", "n5")


def _timed(argv, env, expect: int) -> float:
    """Wall time of a command, which must exit with ``expect``."""
    t = time.perf_counter()
    proc = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - t
    if proc.returncode != expect:
        raise RuntimeError(f"{argv[3]} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return seconds


def bench_scan(repeats: int) -> dict:
    python = sys.executable
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
    command = [python, "-m", "sdcguard"]
    launcher = f"{python} {os.path.join(ROOT, 'tests', 'helpers', 'replay_launcher.py')} {{node}}"
    scratch = tempfile.mkdtemp(prefix="bench-scan-")
    scan = [
        *command,
        *("scan", "--nodes", ",".join(NODES), "--jobs", str(len(NODES))),
        *("--launcher", launcher, "--remote-command", shlex.join(command)),
    ]
    runs = {
        "one node (record)": ([*command, "record", "--out", os.path.join(scratch, "t")], env, 0),
        "scan, 5 healthy nodes": ([*scan, "--json", os.path.join(scratch, "h.json")], env, 0),
        "scan, 5 nodes, n3 corrupt": (
            [*scan, "--json", os.path.join(scratch, "c.json")],
            {**env, "SDCGUARD_TEST_CORRUPT_NODES": "n3"},
            1,
        ),
    }
    times = {k: [] for k in runs}
    for _ in range(repeats):  # interleaved
        for name, (argv, run_env, expect) in runs.items():
            times[name].append(_timed(argv, run_env, expect))
    with open(os.path.join(scratch, "c.json")) as f:
        corrupt = json.load(f)
    with open(os.path.join(scratch, "h.json")) as f:
        healthy = json.load(f)
    shutil.rmtree(scratch, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    one = med["one node (record)"]
    return {
        "median_s": med,
        "ratio_vs_one_node": {k: v / one for k, v in med.items()},
        "repeats": repeats,
        "cpus": os.cpu_count(),
        "healthy_status": healthy["status"],
        "corrupt_status": corrupt["status"],
        "corrupt_suspects": [s["node"] for s in corrupt["suspects"]],
        "corrupt_first_divergence": corrupt["suspects"][0]["first_divergence"],
        "node_seconds_healthy": [n["seconds"] for n in healthy["nodes"]],
        "command": shlex.join(scan).replace(python, "python"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--scan-repeats", type=int, default=2)
    parser.add_argument("--only", default="capture,compare,scan")
    parser.add_argument("--json", default="runs/bench_replay.json")
    args = parser.parse_args()
    only = set(args.only.split(","))
    device = jax.devices()[0]
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True)
    result = {
        "device": f"{device.platform}:{device.device_kind}",
        "jax": jax.__version__,
        "commit": head.stdout.decode().strip(),
    }
    if "capture" in only:
        result["record_step"] = bench_capture(args.repeats)
        r = result["record_step"]
        print(
            f"reference GPT on {result['device']} ({r['taps']} taps, "
            f"{r['captured_elements']:,} captured elements per step)"
        )
        print(f"{'':<18}{'median ms':>12}{'x plain':>10}")
        for k, v in r["median_s"].items():
            print(f"{k:<18}{v * 1e3:>12.2f}{r['ratio_vs_plain'][k]:>10.2f}")
    if "compare" in only:
        result["compare"] = bench_compare()
        c = result["compare"]
        print(
            f"sdcguard compare (local vs local, all levels, 3 steps, {c['tensors_compared']} "
            f"tensors): cold process {c['cold_process_s']:.1f} s, warm {c['warm_s']:.2f} s, "
            f"identical={c['identical']}"
        )
    if "scan" in only:
        result["scan"] = s = bench_scan(args.scan_repeats)
        print(
            f"sdcguard scan, reference GPT, all levels, 3 steps, --jobs 5, {s['cpus']} CPUs "
            f"(median of {s['repeats']}, interleaved):"
        )
        print(f"{'':<28}{'median s':>10}{'x one node':>12}")
        for k, v in s["median_s"].items():
            print(f"{k:<28}{v:>10.1f}{s['ratio_vs_one_node'][k]:>12.2f}")
        first = s["corrupt_first_divergence"]
        print(
            f"healthy: {s['healthy_status']}; corrupt: {s['corrupt_status']}, suspects "
            f"{s['corrupt_suspects']}, first divergence {first['level']} level "
            f"{first['name']} in {first['module']}"
        )
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
