"""Which part of the Mosaic GPU flash attention kernel fails on a GPU, one process per probe.

The kernel stopped with ``CUDA_ERROR_ILLEGAL_ADDRESS`` on an H200 with jax 0.11.2 (at 17dd4d4),
and such an error poisons the process that hit it. So each probe runs in a child process of its
own: first the configuration that failed, then from the smallest (JAX's own FlashAttention-3
kernel, which ours follows) to the whole checked kernel, forward and backward; the first that
fails says which feature to look at. Each prints one JSON line: what it ran, its exit status,
its counters and its largest difference to the reference attention.

On a GPU (about 2 minutes, most of it compiling), bf16 (JAX's kernel fp16), B 1, T 256, H 1,
head_dim 128:

    python scripts/gpu_flash_probe.py --out runs/gpu_flash_probe.json

Each probe of ``sdcguard``'s kernel runs under each of Mosaic GPU's lowering semantics
(``--lowerings``, default ``warpgroup lane``: the Lane lowering is the one that failed, the
Warpgroup one is the kernels' default since it lowers on every JAX): first the configuration
that failed under each, then the rest under the first, then under the second.

``--sanitize`` runs the first probe that fails again under ``compute-sanitizer --tool memcheck``
(where it is installed), which names the faulting access.

Without a GPU it says so and exits 0; ``--force`` runs the probes of ``sdcguard``'s kernel in
Mosaic GPU's interpret mode on the CPU (head_dim 64; JAX's kernel is skipped there).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

JAX_KERNEL = "jax's kernel"
LOWERINGS = ("warpgroup", "lane")  # sdcguard.protection.pallas.flash_mgpu.LOWERINGS
# name -> (causal, checked, fault, backward). First the configuration that failed on the H200
# (does it still?), then from the smallest up, each adding one thing to the one before it.
PROBES = {
    "checked, causal, a NaN": (True, True, True, False),
    JAX_KERNEL: (True, False, False, False),
    "unchecked": (True, False, False, False),
    "checked, full": (False, True, False, False),
    "checked, causal": (True, True, False, False),
    "checked, causal, backward": (True, True, False, True),
}
LIMIT_S = 100  # per probe (a compilation and two calls): a hang counts as a failure


def operands(head_dim: int, dtype=jnp.bfloat16):
    keys = jax.random.split(jax.random.key(0), 3)
    return [jax.random.normal(k, (1, 256, 1, head_dim), jnp.float32).astype(dtype) for k in keys]


def run_probe(name: str, head_dim: int, lowering: str = "warpgroup") -> dict:
    """One probe, in this process: its counters and its largest difference to the reference
    (``lowering``: Mosaic GPU's lowering semantics for ``sdcguard``'s kernel)."""
    from sdcguard import ABFTConfig
    from sdcguard.fault_model import Fault, FaultPlan
    from sdcguard.protection.pallas import flash as fa

    causal, checked, fault, backward = PROBES[name]
    # JAX's kernel in fp16: jax 0.11.2's lowers only that (its output scratch is fp16).
    q, k, v = operands(head_dim, jnp.float16 if name == JAX_KERNEL else jnp.bfloat16)
    scale = 1.0 / np.sqrt(head_dim)
    reference = fa.attention_reference(q, k, v, causal=causal, sm_scale=scale)
    if name == JAX_KERNEL:
        from jax.experimental.pallas.ops.gpu import attention_mgpu

        config = attention_mgpu.TuningConfig(
            block_q=64, block_kv=64, max_concurrent_steps=2, causal=causal
        )
        out = jax.jit(lambda q, k, v: attention_mgpu.attention(q, k, v, config))(q, k, v)
        diff = float(jnp.max(jnp.abs(out.astype(jnp.float32) - reference.astype(jnp.float32))))
        return {"max_abs_diff": diff}
    config = ABFTConfig() if checked else ABFTConfig(sites=())
    t = q.shape[1]
    faults = [Fault(site="attn:scores", kind="nan", index=(t + 1) * (t // 2))] if fault else []
    plan = FaultPlan.from_faults(faults, capacity=1)

    def loss(q, k, v, sink):
        out, counts = fa.flash_attention(
            q, k, v, causal=causal, sm_scale=scale, config=config, plan=plan, sink=sink,
            kernel="mosaic", mosaic_lowering=lowering,
        )  # fmt: skip
        return jnp.sum(out.astype(jnp.float32)), (out, counts)

    sink = fa.zero_core_sink()
    if backward:
        grads, (out, counts) = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
            q, k, v, sink
        )
        result = {"backward_counts": np.asarray(grads[3]).reshape(-1, 4).sum(0).tolist()}
    else:
        _, (out, counts) = jax.jit(loss)(q, k, v, sink)
        result = {}
    diff = float(jnp.max(jnp.abs(out.astype(jnp.float32) - reference.astype(jnp.float32))))
    return {**result, "counts": np.asarray(counts).tolist(), "max_abs_diff": diff}


def schedule(names: list[str], lowerings: list[str]) -> list[tuple[str, str | None]]:
    """``(probe, lowering)`` in the order they run: the first probe under each lowering, JAX's
    own kernel once (its lowering is its own: None), then the others under each lowering in
    turn.

    Example:
      >>> schedule(["a NaN", JAX_KERNEL, "unchecked", "full"], ["warpgroup", "lane"])[2:]
      [("jax's kernel", None), ('unchecked', 'warpgroup'), ('full', 'warpgroup'), \
('unchecked', 'lane'), ('full', 'lane')]
    """
    first, *rest = names
    runs = [(first, None) if first == JAX_KERNEL else (first, lw) for lw in lowerings]
    if JAX_KERNEL in rest:
        runs.append((JAX_KERNEL, None))
    rest = [n for n in rest if n != JAX_KERNEL]
    runs += [(n, lw) for lw in lowerings for n in rest]
    return list(dict.fromkeys(runs))


def probe_in_child(
    name: str, *, force: bool, head_dim: int, lowering: str | None = None, wrapper=()
) -> dict:
    """``name`` run by a child process of this script under ``lowering``: its JSON line, or how
    it failed. ``wrapper``: a command the child runs under (``compute-sanitizer ...``)."""
    args = [*wrapper, sys.executable, __file__, "--one", name, "--head-dim", str(head_dim)]
    if lowering is not None:
        args += ["--lowering", lowering]
    env = {**os.environ}
    if force:
        args.append("--force")
        env.setdefault("PJRT_NPROC", "4")  # the interpreter's warpgroups need four threads
    start = time.perf_counter()
    which = {"probe": name, "lowering": lowering}
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=LIMIT_S, env=env)
    except subprocess.TimeoutExpired:
        return {**which, "ok": False, "error": f"no result in {LIMIT_S} s"}
    seconds = round(time.perf_counter() - start, 1)
    lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr + done.stdout).strip().splitlines()[-(30 if wrapper else 6) :]
        return {**which, "ok": False, "exit": done.returncode, "error": tail, "s": seconds}
    return {**which, "ok": True, "s": seconds, **json.loads(lines[-1])}


def sanitized(result: dict, *, force: bool, head_dim: int) -> dict:
    """A failed probe run again under ``compute-sanitizer --tool memcheck``, which names the
    faulting access (its output's tail), or why it could not be."""
    tool = shutil.which("compute-sanitizer")
    if tool is None:
        return {"probe": result["probe"], "error": "compute-sanitizer not found on PATH"}
    wrapper = (tool, "--tool", "memcheck", "--print-limit", "4")
    return probe_in_child(
        result["probe"],
        force=force,
        head_dim=head_dim,
        lowering=result.get("lowering"),
        wrapper=wrapper,
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/gpu_flash_probe.json"))
    parser.add_argument("--force", action="store_true", help="run without a GPU (interpreted)")
    parser.add_argument("--probes", nargs="+", choices=list(PROBES), default=None)
    parser.add_argument(
        "--sanitize",
        action="store_true",
        help="run the first probe that fails again under compute-sanitizer (slow)",
    )
    parser.add_argument(
        "--lowerings",
        nargs="+",
        choices=LOWERINGS,
        default=list(LOWERINGS),
        help="Mosaic GPU lowering semantics to run sdcguard's kernel under, in this order",
    )
    parser.add_argument("--one", choices=list(PROBES), default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--lowering", choices=LOWERINGS, default="warpgroup", help=argparse.SUPPRESS
    )
    parser.add_argument("--head-dim", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu and not args.force:
        print(f"gpu_flash_probe: no GPU found (JAX backend: {jax.default_backend()}); nothing run")
        return 0
    head_dim = args.head_dim or (128 if on_gpu else 64)
    if args.one is not None:  # a child: one probe, one JSON line
        if on_gpu:
            result = run_probe(args.one, head_dim, args.lowering)
        else:
            from sdcguard.protection import pallas

            with pallas.gpu_interpret_mode():
                result = run_probe(args.one, head_dim, args.lowering)
        print(json.dumps(result))
        return 0
    names = args.probes or [n for n in PROBES if on_gpu or n != JAX_KERNEL]
    device = jax.devices()[0].device_kind
    report = {"device": device, "jax": jax.__version__, "head_dim": head_dim, "probes": []}
    print(f"gpu_flash_probe on {device}, jax {jax.__version__}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for name, lowering in schedule(names, args.lowerings):
        result = probe_in_child(name, force=args.force, head_dim=head_dim, lowering=lowering)
        report["probes"].append(result)
        print(json.dumps(result), flush=True)
        args.out.write_text(json.dumps(report, indent=2))
    failed = [r for r in report["probes"] if not r["ok"]]
    if args.sanitize and failed:
        report["sanitizer"] = sanitized(failed[0], force=args.force, head_dim=head_dim)
        print(json.dumps(report["sanitizer"]), flush=True)
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
