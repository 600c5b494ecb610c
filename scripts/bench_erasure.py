"""What erasure-coded snapshots (REFT) cost against plain in-memory snapshots, on 8 devices.

The train state is a reference GPT with its Adam moments, every leaf sharded over 8 simulated
devices along its first axis where it divides (replicated otherwise), as a ZeRO/FSDP job holds
it. Side by side, interleaved, median over repeats:

- snapshot time: ``SnapshotRing.take`` + ``wait`` (the whole copy, fingerprints and, for the
  coded ring, the parity), plain against ``erasure=ErasureCode(tolerate=f)``;
- restore time: a plain snapshot, a coded one with every host, and a coded one after losing a
  host (decoded from the other 7 hosts' memory; nothing read from storage);
- memory: bytes kept, plain against coded (the shards plus parity).

Usage:
  python scripts/bench_erasure.py
  python scripts/bench_erasure.py --d-model 512 --layers 4 --repeats 15
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P
from rich.console import Console
from rich.table import Table

from sdcguard.models import GPT, GPTConfig, init_params
from sdcguard.recovery import ErasureCode, SnapshotRing, TrainState


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=11)
    p.add_argument("--out", type=Path, default=Path("runs/bench_erasure.json"))
    return p.parse_args(argv)


def sharded_state(args) -> TrainState:
    mesh = jax.make_mesh((8,), ("data",))
    config = GPTConfig(d_model=args.d_model, num_layers=args.layers, num_heads=4, seq_len=256)
    params = init_params(GPT(config), 0)
    opt_state = optax.adam(1e-3).init(params)

    def place(x):
        spec = P("data") if x.ndim and x.shape[0] % 8 == 0 else P()
        return jax.device_put(x, NamedSharding(mesh, spec))

    state = TrainState(np.int32(0), params, opt_state, jax.random.key(0))
    return jax.tree.map(place, state)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleaved(variants: dict, repeats: int) -> dict[str, float]:
    for fn in variants.values():
        fn()  # warm up
    samples = {name: [] for name in variants}
    for r in range(repeats):
        for name in list(variants) if r % 2 == 0 else list(reversed(variants)):
            samples[name].append(timed(variants[name]))
    return {name: statistics.median(v) for name, v in samples.items()}


def main(argv=None) -> None:
    args = parse_args(argv)
    console = Console()
    state = sharded_state(args)
    codes = {"plain": None, "coded, 1 host": ErasureCode(tolerate=1)}
    codes["coded, 2 hosts"] = ErasureCode(tolerate=2)
    rings = {name: SnapshotRing(keep=1, erasure=code) for name, code in codes.items()}

    def snapshot(ring):
        def run():
            ring.take(state, step=1)
            ring.wait()

        return run

    take_s = interleaved({name: snapshot(r) for name, r in rings.items()}, args.repeats)
    snaps = {name: r.latest() for name, r in rings.items()}
    for ring in rings.values():
        assert not ring.failures, ring.failures

    def restore(snap, lose=None):
        def run():
            if lose is not None:
                snap._memory[:] = kept[id(snap)]
                snap.lose(*lose)
            jax.block_until_ready(jax.tree.leaves(snap.restore()))

        return run

    kept = {id(s): [s.memory(h) for h in range(8)] for name, s in snaps.items() if name != "plain"}
    restore_s = interleaved(
        {
            "plain": restore(snaps["plain"]),
            "coded, all hosts": restore(snaps["coded, 1 host"]),
            "coded, host 3 lost": restore(snaps["coded, 1 host"], lose=(3,)),
            "coded (2), hosts 3 and 6 lost": restore(snaps["coded, 2 hosts"], lose=(3, 6)),
        },
        args.repeats,
    )
    for name in ("coded, 1 host", "coded, 2 hosts"):  # every host back
        snaps[name]._memory[:] = kept[id(snaps[name])]
    # The parity alone, all 8 hosts' stripes in this one thread; on a cluster each host encodes
    # its own stripes, in parallel (an eighth of this each).
    encode_s = interleaved(
        {name: snaps[name]._encode_parity for name in ("coded, 1 host", "coded, 2 hosts")},
        args.repeats,
    )
    plain_bytes = sum(x.nbytes for x in snaps["plain"].leaves)
    memory = {"plain": {"bytes": plain_bytes}}
    for name in ("coded, 1 host", "coded, 2 hosts"):
        snaps[name]._memory[:] = kept[id(snaps[name])]
        data, parity = snaps[name].nbytes()
        memory[name] = {"data": data, "parity": parity, "ratio": (data + parity) / plain_bytes}

    table = Table(
        title=f"Snapshots of a sharded GPT state ({plain_bytes / 2**20:.1f} MiB, 8 hosts)"
    )
    for column in ("variant", "take + wait", "vs plain", "memory", "vs plain"):
        table.add_column(column)
    for name in codes:
        mem = memory[name].get("data", plain_bytes) + memory[name].get("parity", 0)
        table.add_row(
            name,
            f"{take_s[name] * 1e3:.1f} ms",
            f"{take_s[name] / take_s['plain']:.2f}x",
            f"{mem / 2**20:.2f} MiB",
            f"{mem / plain_bytes:.3f}x",
        )
    console.print(table)
    for name, t in encode_s.items():
        console.print(
            f"{name}: parity of all 8 hosts {t * 1e3:.1f} ms here, "
            f"{t / 8 * 1e3:.1f} ms per host on a cluster"
        )
    table = Table(title="Restore (host memory to devices, verified)")
    for column in ("variant", "time", "vs plain"):
        table.add_column(column)
    for name, t in restore_s.items():
        table.add_row(name, f"{t * 1e3:.1f} ms", f"{t / restore_s['plain']:.2f}x")
    console.print(table)

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    results = {
        "command": " ".join(["python", "scripts/bench_erasure.py", *(argv or sys.argv[1:])]),
        "commit": commit,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "state_bytes": plain_bytes,
        "snapshot_s": take_s,
        "parity_encode_all_hosts_s": encode_s,
        "restore_s": restore_s,
        "memory": memory,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    console.print(f"wrote {args.out}")
    for ring in rings.values():
        ring.close()


if __name__ == "__main__":
    main()
