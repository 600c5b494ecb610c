"""What ``sdcguard.checked`` costs on a GPU: a d-1024 LM step and single GEMMs, checked vs plain.

One command, at most about 5 minutes on an H100 or H200:

    PYTHONPATH=$PWD python scripts/bench_gpu.py --out runs/bench_gpu.json

It measures, side by side in one process (interleaved rounds, medians of per-round ratios):

- the Adam step of a Flax-example LM (4 layers, d 1024, MLP 4096, seq 1024, batch 8, vocab
  32768) in bf16 compute: plain, every GEMM detect-only, in place, recompute on detection,
  attention only (in place); in fp32 (TF32 on the GPU): plain, detect-only, in place; and
  each variant's compile time (``--variants "detect only, pallas" "in place, pallas"`` adds the
  step checked by the Mosaic GPU kernels, not run by default);
- one GEMM at 8192x1024x4096 and 8192x4096x1024 (bf16): ``jnp.dot`` vs checked detect-only and
  in place;
- that clean steps raise no alarm, and that an INF injected at an MLP forward GEMM and at an
  MLP backward GEMM of the bf16 step is corrected.

``--loop NAME...`` also times those variants as a training loop does, the state donated and fed
back (``"<name>, as a training loop"``; read them against ``"plain, as a training loop"``).

``--trace DIR`` also profiles two steps of each variant (``jax.profiler``) and prints where the
device time goes: the kernels and the host's launch calls per step, and the costliest HLO
instructions with the JAX operations they came from (``scripts/trace_summary.py``).

Each figure is printed with the device kind it was measured on. Without a GPU it says so and
exits 0 (``--force`` runs the same code on whatever backend there is, at ``--size tiny``).
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import sys
import time
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import trace_summary
from rich.console import Console
from rich.table import Table
from timing import interleaved, overheads, per_call

import sdcguard
from sdcguard import ABFTConfig, Fault, FaultPlan

# name -> (layers, d, heads, mlp, seq, batch, vocab)
SIZES = {
    "d1024": (4, 1024, 8, 4096, 1024, 8, 32768),
    "tiny": (2, 64, 2, 128, 32, 2, 256),
}
GEMM_SHAPES = {"d1024": [(8192, 1024, 4096), (8192, 4096, 1024)], "tiny": [(256, 64, 128)]}
# name -> what is checked ("in place" and "recompute" take ABFTConfig's default repair for the
# backend: a cond on a GPU).
VARIANTS = {
    "plain": None,
    "detect only": ABFTConfig(correct=False),
    "in place": ABFTConfig(),
    "in place, branch-free": ABFTConfig(repair="branch_free"),
    "in place, cond": ABFTConfig(repair="cond"),
    # A cond per GEMM, not per group of GEMMs that nothing reads between (the default).
    "in place, a cond per GEMM": ABFTConfig(group_repairs=False),
    "in place, while": ABFTConfig(repair="while"),
    "recompute": ABFTConfig(recompute=True),
    "recompute, while": ABFTConfig(recompute=True, repair="while"),
    # The same two steps with XLA:GPU told to record conditionals and loops in its CUDA graphs.
    "in place, graph conditionals": ABFTConfig(),
    "recompute, graph conditionals": ABFTConfig(recompute=True),
    "attention only, in place": ABFTConfig(include=("**attn**",), allow_unmatched=True),
    # The Mosaic GPU kernels (issue 36): compile time and step time of the pallas step.
    "detect only, pallas": ABFTConfig(correct=False, implementation="pallas"),
    "in place, pallas": ABFTConfig(implementation="pallas"),
}
BF16_VARIANTS = (
    "plain",
    "detect only",
    "in place",
    "in place, branch-free",
    "in place, cond",
    "recompute",
    "recompute, while",
    "attention only, in place",
)
# fp32 (TF32) is timed for the variants the targets name.
FP32_VARIANTS = ("plain", "detect only", "in place")
# Command buffers off: the profiler then attributes device time to each HLO instruction
# (inside a CUDA graph nearly all of it is one command_buffer instruction).
NO_GRAPHS = {"xla_gpu_enable_command_buffer": ""}
# XLA's command buffer kinds with CONDITIONAL and WHILE added: a cond's predicate is then read
# by the GPU inside the graph (a conditional node), not by the host between graphs.
GRAPH_CONDITIONALS = {
    "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE"
}
COMPILE_OPTIONS = {
    "in place, graph conditionals": GRAPH_CONDITIONALS,
    "recompute, graph conditionals": GRAPH_CONDITIONALS,
}


class Block(nn.Module):
    heads: int
    mlp: int
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        y = nn.LayerNorm(dtype=self.dtype)(x)
        y = nn.MultiHeadDotProductAttention(
            num_heads=self.heads, dtype=self.dtype, deterministic=True, name="attn"
        )(y, y, mask=mask)
        x = x + y
        h = nn.Dense(self.mlp, dtype=self.dtype, name="mlp_in")(nn.LayerNorm(dtype=self.dtype)(x))
        return x + nn.Dense(x.shape[-1], dtype=self.dtype, name="mlp_out")(nn.gelu(h))


class LM(nn.Module):
    """A decoder LM as Flax's examples write one, with ``dtype`` compute and fp32 parameters."""

    layers: int
    d: int
    heads: int
    mlp: int
    vocab: int
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.d, dtype=self.dtype, name="embed")(tokens)
        for i in range(self.layers):
            x = Block(self.heads, self.mlp, self.dtype, name=f"block_{i}")(x)
        x = nn.LayerNorm(dtype=self.dtype)(x)
        return nn.Dense(self.vocab, dtype=self.dtype, name="head")(x)


def lm_step(size: str, dtype):
    layers, d, heads, mlp, seq, batch, vocab = SIZES[size]
    model = LM(layers, d, heads, mlp, vocab, dtype)
    tokens = jax.random.randint(jax.random.key(0), (batch, seq + 1), 0, vocab)
    params = jax.jit(model.init)(jax.random.key(1), tokens[:, :-1])["params"]
    tx = optax.adam(1e-4)

    def step(params, opt_state, tokens):
        def loss_fn(p):
            logits = model.apply({"params": p}, tokens[:, :-1]).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, (params, tx.init(params), tokens)


def compiled(fn, args, options=None):
    """``(callable, compile seconds, HLO text)``: lowering and XLA's compilation, timed together."""
    start = time.perf_counter()
    c = jax.jit(fn).lower(*args).compile(compiler_options=options)
    seconds = time.perf_counter() - start
    return (lambda: c(*args)), seconds, c.as_text()


class TrainingLoop:
    """A step run as a training loop runs it: parameters and optimizer state donated and fed
    back, so each call writes into the last call's buffers.

    :func:`compiled` calls a step on the same arguments every time, and each call's outputs
    (the whole new state) are new buffers; a user's loop donates its state. On a GPU the step
    runs as CUDA graphs recorded for buffers' addresses, so whether they stay put from step to
    step may change what a step costs on the host; timing both shows whether it does.

    Args:
      fn: ``step(params, opt_state, tokens)`` or :func:`sdcguard.checked` of it.
      args: ``(params, opt_state, tokens)``; the loop works on its own copy of the state.
      options: XLA compiler options, as for :func:`compiled`.

    Example:
      >>> loop = TrainingLoop(step, args); out = loop(); out = loop()  # two steps
    """

    def __init__(self, fn, args, options=None):
        params, opt_state, self.tokens = args
        self.state = jax.tree.map(jnp.copy, (params, opt_state))
        start = time.perf_counter()
        self.executable = (
            jax.jit(fn, donate_argnums=(0, 1))
            .lower(*self.state, self.tokens)
            .compile(compiler_options=options)
        )
        self.compile_s = time.perf_counter() - start

    def __call__(self):
        out = self.executable(*self.state, self.tokens)
        step_out = out[0] if isinstance(out[0], tuple) else out  # checked: (outputs, report)
        self.state = step_out[:2]
        return out


def bench_lm(
    size: str,
    dtype,
    rounds: int,
    variants,
    trace_dir: Path | None = None,
    attribute=(),
    inject=("in place",),
    into: dict | None = None,
    hlo_dir: Path | None = None,
    trace_top: int = 12,
    measured=None,
    loop=(),
) -> dict:
    """The step's variants timed; ``into`` is filled as each part is measured, and
    ``measured()`` (when given) is called after each part, to write it out: a run cut short,
    even by a kill during a compilation, keeps what it measured. ``hlo_dir``: each variant's
    optimized HLO is written there, gzipped (``<dtype>_<variant>.hlo.txt.gz``, each
    non-alphanumeric character an underscore): the kernels XLA fused, to read without a GPU.
    ``trace_top``: how many instructions and checks each profile keeps, costliest first.
    ``loop``: variants also timed as a :class:`TrainingLoop` (``"<name>, as a training
    loop"``), interleaved with the others: compare them with ``"plain, as a training loop"``."""
    result = {} if into is None else into
    measured = measured or (lambda: None)
    step, args = lm_step(size, dtype)
    defaults = FP32_VARIANTS if dtype == jnp.float32 else BF16_VARIANTS
    # Named variants run as named (the pallas ones only so); fp32 keeps to its own list.
    names = defaults if variants is None else ("plain", *(n for n in variants if n != "plain"))
    if dtype == jnp.float32:
        names = tuple(n for n in names if n in FP32_VARIANTS)
    fns, compile_s, hlo = {}, {}, {}
    result.update(dtype=jnp.dtype(dtype).name, compile_s=compile_s)
    for name in names:
        config = VARIANTS[name]
        fn = step if config is None else sdcguard.checked(step, config)
        fns[name], compile_s[name], hlo[name] = compiled(fn, args, COMPILE_OPTIONS.get(name))
        print(f"{jnp.dtype(dtype).name} {name}: compiled in {compile_s[name]:.1f} s", flush=True)
        if hlo_dir is not None:
            _write_hlo(hlo_dir, f"{jnp.dtype(dtype).name} {name}", hlo[name])
        measured()
    for name in (n for n in loop if n in names):
        config = VARIANTS[name]
        fn = step if config is None else sdcguard.checked(step, config)
        looped = TrainingLoop(fn, args, COMPILE_OPTIONS.get(name))
        fns[f"{name}, as a training loop"] = looped
        compile_s[f"{name}, as a training loop"] = looped.compile_s
        print(f"{jnp.dtype(dtype).name} {name}, as a training loop: compiled", flush=True)
        measured()
    alarms, alarm_sites, losses = {}, {}, {}
    for name in names:
        out = jax.block_until_ready(fns[name]())
        if VARIANTS[name] is not None:
            out, report = out
            alarms[name] = np.asarray(sdcguard.total(report)).tolist()
            alarm_sites[name] = sites_that_alarmed(report)
        losses[name] = float(out[2])
        sites = alarm_sites.get(name, {}).items()
        print(
            f"{jnp.dtype(dtype).name} {name}: ran, loss {losses[name]:.6f}, alarms "
            f"{alarms.get(name, '-')}" + "".join(f"\n  {site}: {c}" for site, c in sites),
            flush=True,
        )
    times = interleaved({n: per_call(f, 3) for n, f in fns.items()}, rounds)
    summary = overheads(times, base="plain")
    result.update(
        overheads=summary, clean_alarms=alarms, clean_alarm_sites=alarm_sites, clean_losses=losses
    )
    measured()
    for name, s in summary.items():
        print(
            f"{jnp.dtype(dtype).name} {name}: {s['median_s'] * 1e3:.2f} ms, {_ratio(s)}", flush=True
        )
    sites = sdcguard.list_sites(step, *args)
    result.update(checked_sites=sum(s.checked for s in sites), sites=len(sites))
    traces = result["traces"] = {}
    if trace_dir is not None:
        for name in names:  # as timed: how many kernels, graph launches and host syncs
            traces[name] = trace_summary.profile(
                fns[name], hlo[name], _where(trace_dir, dtype, name), top=trace_top
            )
            _print_trace(dtype, name, traces[name])
            measured()
        for name in (n for n in attribute if n in names):  # command buffers off: per instruction
            config = VARIANTS[name]
            fn = step if config is None else sdcguard.checked(step, config)
            run, _, text = compiled(fn, args, NO_GRAPHS)
            if hlo_dir is not None:
                _write_hlo(hlo_dir, f"{jnp.dtype(dtype).name} {name} no graphs", text)
            jax.block_until_ready(run())
            where = _where(trace_dir, dtype, name + " no graphs")
            traces[name + ", command buffers off"] = trace_summary.profile(
                run, text, where, top=trace_top
            )
            _print_trace(
                dtype, name + ", command buffers off", traces[name + ", command buffers off"]
            )
            measured()
    # Injected faults in the users' compute dtype, after the profiles (a run cut short keeps
    # them): one more compilation of each injected step.
    faults = result["faults"] = {}
    if dtype != jnp.float32:
        for name in (n for n in inject if n in names):
            faults[name] = corrected_faults(step, args, sites, VARIANTS[name])
            measured()
    return result


def sites_that_alarmed(report) -> dict[str, list[int]]:
    """``{site: [detected, corrected, uncorrectable, nonfinite_input]}`` of the report's sites
    that counted anything (summed over a scan's iterations), in the report's order."""
    counts = {site: np.asarray(c).reshape(-1, 4).sum(axis=0) for site, c in report.items()}
    return {site: c.tolist() for site, c in counts.items() if c.any()}


def _write_hlo(folder: Path, name: str, text: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    file = "".join(c if c.isalnum() else "_" for c in name)
    with gzip.open(folder / f"{file}.hlo.txt.gz", "wt") as f:
        f.write(text)


def _print_trace(dtype, name: str, trace: dict) -> None:
    print(
        f"{jnp.dtype(dtype).name} {name}: profiled, {trace['device_ms_per_call']:.2f} ms device, "
        f"{trace['kernels_per_call']:g} kernels, launches {trace['launch_calls_per_call']}, "
        f"host waits {trace.get('host_waits_per_call')}; checks {trace['check_ms_per_call']:.2f} "
        f"ms device in {trace['check_kernels_per_call']:g} kernels, costliest "
        + ", ".join(f"{c['check']} {c['ms_per_call']:.3f}" for c in trace["top_checks"][:6]),
        flush=True,
    )


def _where(trace_dir: Path, dtype, name: str) -> Path:
    return trace_dir / f"{jnp.dtype(dtype).name}_{name.replace(' ', '_').replace(',', '')}"


def corrected_faults(step, args, sites, config) -> dict:
    """An INF at an MLP forward and at an MLP backward GEMM: the counters and the loss."""
    forward = next(s.name for s in sites if "mlp_in" in s.name and s.direction == "forward")
    backward = next(s.name for s in sites if "mlp_out" in s.name and s.direction == "grad_lhs")

    @jax.jit
    def run(plan, *args):
        with sdcguard.faults(plan):
            return sdcguard.checked(step, config)(*args)

    clean = run(FaultPlan.from_faults([], capacity=1), *args)[0][2]
    out = {}
    for site in (forward, backward):
        plan = FaultPlan.from_faults([Fault(site=site, kind="inf", index=7)])
        (_, _, loss), report = run(plan, *args)
        out[site] = {
            "counts": np.asarray(report[site]).tolist(),
            "loss": float(loss),
            "clean_loss": float(clean),
        }
    return out


def bench_gemms(size: str, rounds: int) -> dict:
    results = {}
    for m, k, n in GEMM_SHAPES[size]:
        keys = jax.random.split(jax.random.key(m + k + n))
        a = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
        b = jax.random.normal(keys[1], (k, n), jnp.bfloat16)

        def gemm(a, b):
            return jnp.dot(a, b)

        fns = {"jnp.dot": compiled(gemm, (a, b))[0]}
        for name in ("detect only", "in place"):
            fns[name] = compiled(sdcguard.checked(gemm, VARIANTS[name]), (a, b))[0]
        times = interleaved({name: per_call(f, 10) for name, f in fns.items()}, rounds)
        results[f"{m}x{k}x{n}"] = overheads(times, base="jnp.dot")
    return results


def _ratio(s: dict) -> str:
    """The median per-round ratio to the base, with its interquartile range."""
    q1, q3 = s["overhead_iqr"]
    return f"{1 + s['overhead']:.3f} ({1 + q1:.3f}-{1 + q3:.3f})"


def _trace_table(title: str, trace: dict) -> Table:
    launches = ", ".join(f"{k} {v:g}" for k, v in trace["launch_calls_per_call"].items()) or "-"
    waits = ", ".join(f"{k} {v:g}" for k, v in trace.get("host_waits_per_call", {}).items())
    table = Table(
        title=f"{title}: {trace['device_ms_per_call']:.2f} ms of device time, "
        f"{trace['kernels_per_call']:g} kernels per step; launch calls: {launches}; "
        f"host waits: {waits or '-'}"
    )
    for col in ("HLO instruction", "ms per step", "runs", "op_name"):
        table.add_column(col)
    for op in trace["top"][:12]:  # the JSON keeps all --trace-top of them
        table.add_row(
            op["hlo_op"],
            f"{op['ms_per_call']:.3f}",
            f"{op['runs_per_call']:g}",
            op["op_name"][-90:],
        )
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="d1024")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=list(VARIANTS),
        default=None,
        metavar="NAME",
        help="step variants to time (default: all but the pallas ones, whose step compiles "
        "Mosaic kernels: name them to run them)",
    )
    parser.add_argument("--no-gemms", action="store_true", help="skip the single GEMMs")
    parser.add_argument(
        "--loop",
        nargs="*",
        choices=list(VARIANTS),
        default=[],
        metavar="NAME",
        help="variants also timed as a training loop, their state donated and fed back "
        "(one more compilation each; name plain too, the loop's baseline)",
    )
    parser.add_argument(
        "--inject",
        nargs="*",
        default=["in place"],
        metavar="NAME",
        help="bf16 variants whose step gets two injected INFs (each one more compilation)",
    )
    parser.add_argument(
        "--attribute",
        nargs="*",
        default=["detect only", "in place"],
        metavar="NAME",
        help="with --trace: variants profiled again with command buffers off, so that device "
        "time is attributed to each HLO instruction",
    )
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path("runs/bench_gpu.json"))
    parser.add_argument("--force", action="store_true", help="run without a GPU (use --size tiny)")
    parser.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="also trace two steps of each variant into this folder and print where the "
        "device time goes (kernels, launches, the costliest HLO instructions)",
    )
    parser.add_argument(
        "--hlo",
        type=Path,
        default=None,
        metavar="DIR",
        help="write each compiled variant's optimized HLO into DIR (gzipped text)",
    )
    parser.add_argument(
        "--trace-top",
        type=int,
        default=12,
        metavar="N",
        help="with --trace: the N costliest instructions and checks kept per profile",
    )
    args = parser.parse_args()
    console = Console(width=max(Console().width, 140))
    device = jax.devices()[0]
    if device.platform != "gpu" and not args.force:
        console.print(f"no GPU found (JAX's device is {device.device_kind}): nothing measured")
        return 0
    result = {"device": device.device_kind, "jax": jax.__version__, "size": args.size}
    result["lm"], failed = [], []
    # The bf16 step first, then single GEMMs, then fp32: what the targets name comes first, and
    # each section is written out as soon as it is measured, so a run cut short keeps it.
    sections = [
        (
            "lm",
            functools.partial(
                bench_lm,
                args.size,
                jnp.dtype(d),
                args.rounds,
                args.variants,
                args.trace,
                args.attribute,
                args.inject,
                hlo_dir=args.hlo,
                trace_top=args.trace_top,
                loop=args.loop,
            ),
        )
        for d in args.dtypes
    ]
    if not args.no_gemms:
        sections.insert(1, ("gemm", functools.partial(bench_gemms, args.size, args.rounds)))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for key, measure in sections:
        start = time.perf_counter()
        partial = {}

        def write_partial(partial=partial):
            incomplete = {**partial, "incomplete": True}
            args.out.write_text(json.dumps({**result, "lm": [*result["lm"], incomplete]}, indent=2))

        try:
            value = measure(into=partial, measured=write_partial) if key == "lm" else measure()
        except (Exception, KeyboardInterrupt) as error:  # keep what was measured, say what not
            failed.append(f"{key}: {type(error).__name__}: {error}")
            console.print_exception(max_frames=8)
            if partial:
                result["lm"].append({**partial, "incomplete": True})
            result["failed"] = failed
            args.out.write_text(json.dumps(result, indent=2))
            if isinstance(error, KeyboardInterrupt):
                break
            continue
        if key == "lm":
            result["lm"].append(value)
        else:
            result[key] = value
        result["failed"] = failed
        args.out.write_text(json.dumps(result, indent=2))
        console.print(f"{key} measured in {time.perf_counter() - start:.0f} s, wrote {args.out}")

    table = Table(title=f"checked step / plain step on {device.device_kind} ({args.size})")
    for col in ("compute", "variant", "time", "ratio (IQR)", "compile", "clean alarms"):
        table.add_column(col)
    for lm in result["lm"]:
        for name, s in lm.get("overheads", {}).items():
            table.add_row(
                lm["dtype"],
                name,
                f"{s['median_s'] * 1e3:.2f} ms",
                _ratio(s),
                f"{lm['compile_s'][name]:.1f} s",
                str(lm.get("clean_alarms", {}).get(name, "-")),
            )
    console.print(table)
    gemms = Table(title=f"one bf16 GEMM, checked / jnp.dot, {device.device_kind}")
    for col in ("M x K x N", "variant", "time", "ratio (IQR)"):
        gemms.add_column(col)
    for shape, summary in result.get("gemm", {}).items():
        for name, s in summary.items():
            gemms.add_row(shape, name, f"{s['median_s'] * 1e3:.3f} ms", _ratio(s))
    console.print(gemms)
    for lm in result["lm"]:
        for variant, faults in lm.get("faults", {}).items():
            for site, f in faults.items():
                console.print(
                    f"{lm['dtype']} {variant}: INF at {site}: counts {f['counts']}, "
                    f"loss {f['loss']:.6f} (clean {f['clean_loss']:.6f})"
                )
    for lm in result["lm"]:
        for name, trace in lm.get("traces", {}).items():
            console.print(_trace_table(f"{lm['dtype']} {name}", trace))
    for failure in failed:
        console.print(f"[red]not measured[/red]: {failure}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
