"""Collectives that the checks add to a sharded training step, counted in the compiled HLO.

For each way of sharding a data-parallel (and data x model parallel) training step on 8 host
devices, compiles the plain step and the same step under ``sdcguard.checked`` and counts the
collectives (all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute) in the
compiled HLO text. A check that runs where its data is adds at most one collective: the one
reduction of the step's counters. Also checks that the losses are the unsharded step's and that
a fault on one shard is corrected there.

Usage:
  python scripts/bench_sharding.py [--out runs/bench_sharding.json]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from rich.console import Console
from rich.table import Table

import sdcguard
from sdcguard.inject import Fault, FaultPlan
from sdcguard.transform import total

# An instruction of the compiled HLO whose op is a collective (``... f32[8]{0} all-reduce(``),
# not a mention of one as an operand (``get-tuple-element(%all-reduce)``).
COLLECTIVE = re.compile(
    r"[\]})] (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(-start)?\("
)


def collectives(fn, *args) -> int:
    """Collectives in the compiled HLO of ``jax.jit(fn)(*args)``."""
    return len(COLLECTIVE.findall(jax.jit(fn).lower(*args).compile().as_text()))


def mlp_loss(params, x, y):
    for w in params:
        x = jnp.tanh(x @ w)
    return jnp.mean((x - y) ** 2)


def sgd_step(params, x, y, axis_name=None):
    loss, grads = jax.value_and_grad(mlp_loss)(params, x, y)
    if axis_name is not None:
        loss, grads = jax.lax.pmean((loss, grads), axis_name)
    return [p - 0.1 * g for p, g in zip(params, grads, strict=True)], loss


def problem(width=64, batch=64, layers=3):
    keys = jax.random.split(jax.random.key(0), layers + 2)
    params = [jax.random.normal(k, (width, width)) / np.sqrt(width) for k in keys[:layers]]
    x = jax.random.normal(keys[-2], (batch, width))
    y = jax.random.normal(keys[-1], (batch, width))
    return params, x, y


def shard_map_case(mesh_shape):
    """Data parallel over every device of the mesh, written with ``jax.shard_map``."""
    mesh = jax.make_mesh(mesh_shape, ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    axes = ("data", "model")
    step = jax.shard_map(
        lambda p, x, y: sgd_step(p, x, y, axis_name=axes),
        mesh=mesh,
        in_specs=(P(), P(axes), P(axes)),
        out_specs=(P(), P()),
    )
    return step, problem()


def pmap_case():
    params, x, y = problem()
    n = jax.device_count()
    xs, ys = x.reshape(n, -1, x.shape[-1]), y.reshape(n, -1, y.shape[-1])

    def step(params, x, y):
        return sgd_step(params, x, y, axis_name="data")

    return step, (params, xs, ys)


def measure() -> list[dict]:
    rows = []
    unsharded_loss = float(jax.jit(sgd_step)(*problem())[1])
    for mesh_shape in ((8, 1), (4, 2)):
        step, args = shard_map_case(mesh_shape)
        checked = sdcguard.checked(step)
        (_, loss), report = jax.jit(checked)(*args)
        site = next(iter(report))
        plan = FaultPlan.from_faults([Fault(site=site, kind="inf", index=3)], capacity=2)

        @jax.jit
        def faulty(plan, *args, checked=checked):
            with sdcguard.faults(plan):
                return checked(*args)

        (_, faulty_loss), faulty_report = faulty(plan, *args)
        rows.append(
            {
                "way": f"shard_map, mesh {mesh_shape[0]}x{mesh_shape[1]}",
                "plain": collectives(step, *args),
                "checked": collectives(checked, *args),
                "loss_matches_unsharded": bool(np.isclose(float(loss), unsharded_loss, rtol=1e-6)),
                "fault_on_one_shard": [int(c) for c in total(faulty_report)],
                "faulty_loss_matches": bool(np.isclose(float(faulty_loss), float(loss), rtol=1e-6)),
            }
        )
    step, args = pmap_case()
    plain = jax.pmap(step, axis_name="data", in_axes=(None, 0, 0))
    checked = jax.pmap(sdcguard.checked(step), axis_name="data", in_axes=(None, 0, 0))
    (_, loss), report = checked(*args)

    def count(mapped):
        return len(COLLECTIVE.findall(mapped.lower(*args).compile().as_text()))

    rows.append(
        {
            "way": "pmap (counters per device)",
            "plain": count(plain),
            "checked": count(checked),
            "loss_matches_unsharded": bool(np.isclose(float(loss[0]), unsharded_loss, rtol=1e-6)),
            "fault_on_one_shard": None,
            "faulty_loss_matches": None,
        }
    )
    # jit with NamedSharding (automatic partitioning): the checks are partitioned by XLA too.
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    params, x, y = problem()
    data = NamedSharding(mesh, P("data"))
    args = (jax.device_put(params, NamedSharding(mesh, P())), *jax.device_put((x, y), data))
    rows.append(
        {
            "way": "jit + NamedSharding, mesh 8 (auto)",
            "plain": collectives(sgd_step, *args),
            "checked": collectives(sdcguard.checked(sgd_step), *args),
            "loss_matches_unsharded": None,
            "fault_on_one_shard": None,
            "faulty_loss_matches": None,
        }
    )
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/bench_sharding.json", help="JSON results file")
    args = parser.parse_args(argv)
    rows = measure()
    table = Table(title="collectives in the compiled step: plain vs sdcguard.checked")
    for col in ("way", "plain", "checked", "added", "loss = unsharded", "fault on one shard"):
        table.add_column(col)
    for r in rows:
        table.add_row(
            r["way"],
            str(r["plain"]),
            str(r["checked"]),
            str(r["checked"] - r["plain"]),
            "-" if r["loss_matches_unsharded"] is None else str(r["loss_matches_unsharded"]),
            "-" if r["fault_on_one_shard"] is None else str(r["fault_on_one_shard"]),
        )
    Console().print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"devices": jax.device_count(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
