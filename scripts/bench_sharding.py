"""Collectives that the checks add to a sharded training step, counted in the compiled HLO.

Two models on 8 host devices, on an 8x1 and a 4x2 (data x model) mesh, in every way JAX shards
a step: ``jit`` with ``NamedSharding`` inputs on automatic axes (XLA's propagation), ``jit`` on
explicit axes (sharding in the types; the default of ``jax.make_mesh``), ``jax.shard_map`` and
``jax.pmap``. Each step is compiled plain and protected, and the collectives (all-reduce,
all-gather, reduce-scatter, all-to-all, collective-permute) of the compiled HLO are counted. A
check that runs where its data is adds one collective: the reduction of the step's counters.

* ``mlp``: a 3-layer tanh MLP, plain JAX; under ``jit`` its weights are sharded over ``model``
  (column, row, column parallel), protected by ``sdcguard.checked``.
* ``lm``: a Flax-example-style transformer LM (embedding as a one-hot GEMM, so that explicit
  axes need no gather rule), MLP kernels sharded over ``model`` by logical axis rules under
  automatic ``jit`` (explicit ``jit``: data parallel, since Flax's layers take no output
  shardings); protected by ``sdcguard.checked`` and by the linen drop-ins
  (``sdcguard.linen.protect()``, counters from the ``'sdc'`` collection and the sinks'
  gradients).

Also checks that the loss is the unsharded run's, and injects one INF into one GEMM output: under
``jit`` it hits the one device that computes that element; under ``shard_map`` / ``pmap`` each
device gets its own fault plan and only device 0's holds the fault (``sdcguard.checked`` around a
``shard_map`` reads one plan for all devices: the fault is then on every shard). Every detection
must be corrected, and the loss and new parameters equal the clean step's.

Usage:
  python scripts/bench_sharding.py [--out runs/bench_sharding.json] [--models mlp,lm]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import contextlib
import json
import re
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from rich.console import Console
from rich.table import Table

import sdcguard
from sdcguard import linen as sl
from sdcguard.fault_model import Fault, FaultPlan
from sdcguard.protection import total

# An instruction of the compiled HLO whose op is a collective (``... f32[8]{0} all-reduce(``),
# not a mention of one as an operand (``get-tuple-element(%all-reduce)``).
COLLECTIVE = re.compile(
    r"[\]})] (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(-start)?\("
)
# float32 losses of the same step summed in another order (tests/tolerances.py).
RTOL, ATOL = 1e-5, 1e-5
WAYS = ("jit-auto", "jit-explicit", "shard_map", "pmap")
AXES = ("data", "model")


def collectives(compiled_text: str) -> int:
    """Collective instructions in a compiled HLO text."""
    return len(COLLECTIVE.findall(compiled_text))


# --- Models --------------------------------------------------------------------------------------


def mlp_loss(params, x, y, out_shardings=None):
    outs = out_shardings or [None] * len(params)
    for w, o in zip(params, outs, strict=True):
        x = jnp.tanh(x @ w if o is None else jnp.matmul(x, w, out_sharding=o))
    return jnp.mean((x - y) ** 2)


def mlp_problem(width=64, batch=64, layers=3):
    keys = jax.random.split(jax.random.key(0), layers + 2)
    params = [jax.random.normal(k, (width, width)) / np.sqrt(width) for k in keys[:layers]]
    x = jax.random.normal(keys[-2], (batch, width))
    y = jax.random.normal(keys[-1], (batch, width))
    return params, (x, y)


class MlpBlock(nn.Module):
    mlp_dim: int

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        kernel = nn.with_logical_partitioning(nn.initializers.xavier_uniform(), ("embed", "mlp"))
        h = nn.gelu(nn.Dense(self.mlp_dim, kernel_init=kernel, name="wi")(x))
        kernel = nn.with_logical_partitioning(nn.initializers.xavier_uniform(), ("mlp", "embed"))
        return nn.Dense(d, kernel_init=kernel, name="wo")(h)


class Block(nn.Module):
    heads: int
    mlp_dim: int

    @nn.compact
    def __call__(self, x):
        y = nn.LayerNorm()(x)
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + nn.SelfAttention(num_heads=self.heads, deterministic=True, name="attn")(y, mask)
        return x + MlpBlock(self.mlp_dim, name="mlp")(nn.LayerNorm()(x))


class TransformerLM(nn.Module):
    vocab: int = 32
    d: int = 32
    heads: int = 4
    mlp_dim: int = 64
    layers: int = 2

    @nn.compact
    def __call__(self, tokens):
        table = self.param("embed", nn.initializers.normal(1.0), (self.vocab, self.d))
        x = jax.nn.one_hot(tokens, self.vocab) @ table
        for i in range(self.layers):
            x = Block(self.heads, self.mlp_dim, name=f"block_{i}")(x)
        return nn.DenseGeneral(self.vocab, name="head")(nn.LayerNorm()(x))


LM = TransformerLM()
LOGICAL_RULES = (("embed", None), ("mlp", "model"))


def lm_problem(batch=16, length=9):
    tokens = jax.random.randint(jax.random.key(0), (batch, length), 0, LM.vocab)
    boxed = LM.init(jax.random.key(1), tokens[:, :-1])
    with sl.protect():
        sinks = sl.init_sinks(LM, tokens[:, :-1])
    return nn.unbox(boxed)["params"], sinks, tokens, nn.get_partition_spec(boxed)["params"]


def lm_loss(params, tokens, sinks=None):
    """Next-token cross-entropy and the drop-ins' counters (zeros without ``sinks``)."""
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def loss_fn(p, s):
        variables = {"params": p} if s is None else {"params": p, "sdc_grad": s}
        logits, state = LM.apply(variables, inputs, mutable=["sdc"] if s is not None else [])
        logp = jax.nn.log_softmax(logits)
        nll = -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))
        return nll, state

    if sinks is None:
        loss, grads = jax.value_and_grad(lambda p: loss_fn(p, None)[0])(params)
        zeros = jnp.zeros((4,), jnp.int32)
        return loss, grads, (zeros, zeros)
    (loss, state), (grads, sink_grads) = jax.value_and_grad(loss_fn, (0, 1), has_aux=True)(
        params, sinks
    )
    return loss, grads, (sl.total_counts(state.get("sdc", {})), sl.total_counts({}, sink_grads))


# --- Steps, each way -----------------------------------------------------------------------------


def sgd(params, grads):
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def make_step(model: str, protection: str, *, axis_name=None, out_shardings=None):
    """``step(params, sinks, batch) -> (params, loss, counts)``; ``protection`` is ``plain``,
    ``linen`` (drop-ins) or ``checked`` (applied by the caller around the step)."""

    def step(params, sinks, batch):
        if model == "mlp":
            loss, grads = jax.value_and_grad(mlp_loss)(params, *batch, out_shardings)
            counts = jnp.zeros((4,), jnp.int32)
        elif protection == "linen":
            with sl.protect():
                loss, grads, (forward, backward) = lm_loss(params, batch, sinks)
        else:
            loss, grads, (forward, backward) = lm_loss(params, batch)
        if model == "lm":
            if axis_name is not None and protection == "linen":
                # The forward counters are each device's own: one psum. The backward ones are
                # the gradient of sinks passed in replicated, which shard_map (check_vma) has
                # already summed over the devices, as for any replicated input; pmap has not.
                forward = jax.lax.psum(forward, axis_name)
                if axis_name == "data":  # pmap
                    backward = jax.lax.psum(backward, axis_name)
            counts = forward + backward
        if axis_name is not None:
            loss, grads = jax.lax.pmean((loss, grads), axis_name)
        return sgd(params, grads), loss, counts

    return step


def problem(model):
    if model == "mlp":
        params, batch = mlp_problem()
        return params, None, batch, [P(None, "model"), P("model", None), P(None, "model")]
    params, sinks, tokens, logical = lm_problem()
    return params, sinks, tokens, nn.logical_to_mesh(logical, LOGICAL_RULES)


def _put(tree, mesh, spec):
    return jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, spec)), tree)


def build(model, protection, way, mesh_shape):
    """``(fn, args, mesh context, pmapped)``: the step of ``way`` (not jitted: a fault run traces
    it again) and its inputs."""
    params, sinks, batch, param_specs = problem(model)
    sinks = sinks if protection == "linen" else None
    n = int(np.prod(mesh_shape))
    if way == "pmap":
        split = jax.tree.map(lambda x: x.reshape(n, -1, *x.shape[1:]), batch)
        step = make_step(model, protection, axis_name="data")
        wrapped = sdcguard.checked(step) if protection == "checked" else step
        fn = jax.pmap(wrapped, axis_name="data", in_axes=(None, None, 0))
        return fn, (params, sinks, split), contextlib.nullcontext(), True
    kind = AxisType.Explicit if way == "jit-explicit" else AxisType.Auto
    mesh = jax.make_mesh(mesh_shape, AXES, axis_types=(kind, kind))
    if way == "shard_map":
        step = make_step(model, protection, axis_name=AXES)
        fn = jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P(AXES)), out_specs=(P(), P(), P()))
        fn = sdcguard.checked(fn) if protection == "checked" else fn
        args = (_put(params, mesh, P()), _put(sinks, mesh, P()), _put(batch, mesh, P(AXES)))
        return fn, args, contextlib.nullcontext(), False
    if way == "jit-auto":
        params = jax.tree.map(
            lambda x, s: jax.device_put(x, NamedSharding(mesh, s)),
            params,
            param_specs,
            is_leaf=lambda x: isinstance(x, P),
        )
        step = make_step(model, protection)
    else:
        # Explicit axes: the sharding of every value is in its type, and a GEMM whose
        # contraction is sharded on both sides needs an output sharding. The MLP gives one per
        # layer; the LM's Flax layers take none, so its weights stay replicated.
        if model == "mlp":
            params = [
                jax.device_put(x, NamedSharding(mesh, s))
                for x, s in zip(params, param_specs, strict=True)
            ]
            outs = [P("data", "model"), P("data", None), P("data", None)]
            outs = [NamedSharding(mesh, s) for s in outs]
            step = make_step(model, protection, out_shardings=outs)
        else:
            params = _put(params, mesh, P())
            step = make_step(model, protection)
    fn = sdcguard.checked(step) if protection == "checked" else step
    args = (params, _put(sinks, mesh, P()), _put(batch, mesh, P("data")))
    ctx = jax.set_mesh(mesh) if way == "jit-explicit" else contextlib.nullcontext()
    return fn, args, ctx, False


def fault_site(model, protection, sites=()):
    """The site of the one INF: a GEMM output of the first MLP (forward) or the value
    projection; under ``checked``, the reported site of that name (wrappers add a prefix)."""
    if protection == "linen":
        return "block_0/attn:value"
    suffix = "mlp_loss:dot_general_1" if model == "mlp" else "block_0/mlp/wi:dot_general"
    return next(s for s in sites if s.endswith(suffix))


def _unpack(out, protection, pmapped):
    """``(params, loss, counts [4])`` of a step's output (``checked``: with its report; under
    ``pmap`` its report has a row per device, the drop-ins' counters are already summed)."""
    if protection == "checked":
        (params, loss, _), report = out
        counts = np.asarray(total(report)).reshape(-1, 4).sum(0) if pmapped else total(report)
    else:
        params, loss, counts = out
        counts = counts[0] if pmapped else counts
    return params, loss, np.asarray(counts)


def _first(x, pmapped):
    return jax.tree.map(lambda v: np.asarray(v[0] if pmapped else v), x)


def measure_one(model, protection, way, mesh_shape, unsharded_loss):
    raw, args, ctx, pmapped = build(model, protection, way, mesh_shape)
    plain_fn, plain_args, _, _ = build(model, "plain", way, mesh_shape)
    fn = raw if pmapped else jax.jit(raw)
    plain_fn = plain_fn if pmapped else jax.jit(plain_fn)
    with ctx:
        plain_n = collectives(plain_fn.lower(*plain_args).compile().as_text())
        checked_n = collectives(fn.lower(*args).compile().as_text())
        out = fn(*args)
        sites = list(out[1]) if protection == "checked" else []
        params, loss, counts = _unpack(out, protection, pmapped)
        params, loss = _first(params, pmapped), float(_first(loss, pmapped))
        site = fault_site(model, protection, sites)
        faulty, hit, error = None, None, None
        try:
            faulty_out = run_faulty(model, protection, way, mesh_shape, raw, args, site)
            f_params, f_loss, f_counts = _unpack(faulty_out, protection, pmapped)
            f_params, f_loss = _first(f_params, pmapped), float(_first(f_loss, pmapped))
            same = np.isclose(f_loss, loss, rtol=RTOL, atol=ATOL) and all(
                np.allclose(a, b, rtol=RTOL, atol=ATOL)
                for a, b in zip(jax.tree.leaves(f_params), jax.tree.leaves(params), strict=True)
            )
            faulty, hit = [int(c) for c in f_counts], bool(same)
        except Exception as e:  # reported in the table, not hidden
            error = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    return {
        "model": model,
        "protection": protection,
        "way": way,
        "mesh": f"{mesh_shape[0]}x{mesh_shape[1]}",
        "plain": plain_n,
        "protected": checked_n,
        "added": checked_n - plain_n,
        "clean_counts": [int(c) for c in np.asarray(counts)],
        "loss": loss,
        "loss_matches_unsharded": bool(np.isclose(loss, unsharded_loss, rtol=RTOL, atol=ATOL)),
        "fault_site": site,
        "fault_counts": faulty,
        "fault_corrected_same_step": hit,
        "fault_error": error,
    }


def run_faulty(model, protection, way, mesh_shape, fn, args, site):
    """The protected step with one INF at ``site`` (see the module docstring)."""
    fault = FaultPlan.from_faults([Fault(site=site, kind="inf", index=3)], capacity=2)
    n = int(np.prod(mesh_shape))
    per_device = way == "pmap" or (way == "shard_map" and protection == "linen")
    if not per_device:

        @jax.jit
        def run(plan, *args):
            with sdcguard.faults(plan):
                return fn(*args)

        return run(fault, *args)
    inert = FaultPlan.from_faults([], capacity=2)
    plans = jax.tree.map(lambda f, i: np.stack([f] + [i] * (n - 1)), fault, inert)
    step = make_step(model, protection, axis_name="data" if way == "pmap" else AXES)

    def planned(plan, params, sinks, batch):
        with sdcguard.faults(plan):
            return (sdcguard.checked(step) if protection == "checked" else step)(
                params, sinks, batch
            )

    if way == "pmap":
        mapped = jax.pmap(planned, axis_name="data", in_axes=(0, None, None, 0))
        return mapped(plans, *args)
    mesh = jax.make_mesh(mesh_shape, AXES, axis_types=(AxisType.Auto,) * 2)
    mapped = jax.shard_map(
        lambda plan, *a: planned(jax.tree.map(lambda x: x[0], plan), *a),
        mesh=mesh,
        in_specs=(P(AXES), P(), P(), P(AXES)),
        out_specs=(P(), P(), P()),
    )
    return jax.jit(mapped)(plans, *args)


# jax.pmap(sdcguard.checked(lm_step)) has stalled in an all-reduce rendezvous of the 8-device CPU
# simulation in some runs (devices waiting on others that never arrive), with or without
# sdcguard.protection._sharding; it runs in a child process with this limit, and a stall is
# reported as such.
STALL_LIMIT_S = 420


def measure_in_child(model, protection, way, mesh_shape) -> dict:
    """:func:`measure_one` in a child process that is stopped after ``STALL_LIMIT_S``."""
    import subprocess
    import sys

    spec = f"{model},{protection},{way},{mesh_shape[0]}x{mesh_shape[1]}"
    try:
        done = subprocess.run(
            [sys.executable, __file__, "--one", spec],
            capture_output=True,
            text=True,
            timeout=STALL_LIMIT_S,
        )
    except subprocess.TimeoutExpired:
        why = f"stalled: no result in {STALL_LIMIT_S} s (all-reduce rendezvous, CPU simulation)"
        return _not_run(model, protection, way, mesh_shape, why)
    if done.returncode != 0:
        return _not_run(model, protection, way, mesh_shape, done.stderr.strip()[-300:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def _not_run(model, protection, way, mesh_shape, why):
    return {
        "model": model,
        "protection": protection,
        "way": way,
        "mesh": f"{mesh_shape[0]}x{mesh_shape[1]}",
        "plain": None,
        "protected": None,
        "added": None,
        "clean_counts": None,
        "loss": None,
        "loss_matches_unsharded": None,
        "fault_site": None,
        "fault_counts": None,
        "fault_corrected_same_step": None,
        "fault_error": why,
    }


def unsharded(model):
    params, _, batch, _ = problem(model)
    return float(jax.jit(make_step(model, "plain"))(params, None, batch)[1])


def measure(models=("mlp", "lm"), meshes=((8, 1), (4, 2)), ways=WAYS) -> list[dict]:
    rows = []
    for model in models:
        reference = unsharded(model)
        protections = ("checked",) if model == "mlp" else ("checked", "linen")
        for mesh_shape in meshes:
            for way in ways:
                if way == "pmap" and mesh_shape != meshes[0]:
                    continue  # pmap has one axis: the 8 devices
                for protection in protections:
                    if (model, protection, way) == ("lm", "checked", "pmap"):
                        rows.append(measure_in_child(model, protection, way, mesh_shape))
                    else:
                        rows.append(measure_one(model, protection, way, mesh_shape, reference))
                    r = rows[-1]
                    print(
                        f"{model} {protection} {way} {r['mesh']}: {r['plain']} -> "
                        f"{r['protected']}, fault {r['fault_counts']} {r['fault_error'] or ''}",
                        flush=True,
                    )
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/bench_sharding.json", help="JSON results file")
    parser.add_argument("--models", default="mlp,lm", help="comma-separated: mlp, lm")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # model,protection,way,RxC: one row
    args = parser.parse_args(argv)
    if args.one:
        model, protection, way, mesh = args.one.split(",")
        mesh_shape = tuple(int(n) for n in mesh.split("x"))
        row = measure_one(model, protection, way, mesh_shape, unsharded(model))
        print(json.dumps(row))
        return
    rows = measure(tuple(args.models.split(",")))
    table = Table(title="collectives in the compiled step: plain vs protected (8 CPU devices)")
    for col in ("model", "protection", "way", "mesh", "plain", "protected", "added"):
        table.add_column(col)
    table.add_column("loss = unsharded")
    table.add_column("one INF: counts, step = clean")
    for r in rows:
        fault = r["fault_error"] or f"{r['fault_counts']} {r['fault_corrected_same_step']}"
        table.add_row(
            r["model"],
            r["protection"],
            r["way"],
            r["mesh"],
            *("-" if r[k] is None else str(r[k]) for k in ("plain", "protected", "added")),
            "-" if r["loss_matches_unsharded"] is None else str(r["loss_matches_unsharded"]),
            fault,
        )
    Console(width=160).print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"devices": jax.device_count(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
