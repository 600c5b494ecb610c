"""The checked step compiled for an H200 on a machine without one: the kernels of each check.

XLA:GPU compiles without a GPU when it is given the target's description (a deviceless
topology). The fusions it makes are the ones a GPU runs, less autotuning (GEMM tilings differ;
reductions and elementwise fusions do not). This counts the kernels each check adds, per site
and per kind, so that a change to the checks can be judged before a GPU session.

Needs JAX's CUDA plugin (``pip install "jax[cuda13]"``); no GPU, no driver. Run as:

  JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 python scripts/gpu_compile_offline.py \\
      --variants "detect only" "in place" --hlo runs/offline_hlo

The plugin's version check needs a driver, hence the variable. The checks are traced as they
would be on a GPU (``jax.default_backend()`` reads ``"gpu"`` while they are traced).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import sys
import time
from pathlib import Path
from unittest import mock

import jax

import sdcguard

# An H200 as XLA:GPU's cost model sees it (NVIDIA's published figures; the fields of
# stream_executor.GpuTargetConfigProto).
H200 = """gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132
  fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: 4800000000000 l2_cache_size: 52428800
  clock_rate_ghz: 1.98 device_memory_size: 151397597184 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 feature_extension: ACCELERATED_FEATURES }
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
  thread_dim_limit_x: 1024 thread_dim_limit_y: 1024 thread_dim_limit_z: 64
  device_vendor: "NVIDIA Corporation" platform_version: "Compute Capability 9.0a"
  device_address_bits: 64 name: "NVIDIA H200 141GB HBM3e"
  driver_version: "13.0.0" runtime_version: "13.0.0" compile_time_toolkit_version: "13.0.0"
  dnn_version: "9.10.0"
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 patch: 0 }
device_description_str: "NVIDIA H200 141GB HBM3e"
"""

# Instructions of an entry computation that launch nothing.
_NO_KERNEL = {"get-tuple-element", "parameter", "tuple", "bitcast", "constant", "after-all"}
_INSTRUCTION = re.compile(r"\s+(?:ROOT )?%(\S+) = (.*?) ([a-z][\w-]*)\(")
_CHECK = re.compile(r"sdcguard_check\[([^\]]*)\]")


def gpu_device():
    """A compile-only H200 (JAX's CUDA plugin, no GPU needed)."""
    from jax.experimental import topologies

    topology = topologies.get_topology_desc("h200", "cuda", target_config=H200, topology="1x1x1")
    return topology.devices[0]


def compile_for(device, fn, args):
    """``fn`` lowered and compiled for ``device``; its checks traced as on a GPU (the Mosaic GPU
    kernels of ``implementation="pallas"`` compiled for a Hopper GPU, not interpreted)."""
    from sdcguard.protection import pallas

    sharding = jax.sharding.SingleDeviceSharding(device)
    specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), args)
    with (
        mock.patch("jax.default_backend", return_value="gpu"),
        pallas.as_h100(),
        pallas.interpret_mode(False),
    ):
        lowered = jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",))
    return lowered.compile()


def kernels(hlo: str) -> list[dict]:
    """The entry computation's kernel-launching instructions: name, kind, check site or None."""
    entry = hlo[hlo.index("\nENTRY") :].split("\n")[1:]
    out = []
    for line in entry:
        m = _INSTRUCTION.match(line)
        if not m or m.group(3) in _NO_KERNEL:
            continue
        name, _, op = m.groups()
        op_name = re.search(r'op_name="([^"]*)"', line)
        site = _CHECK.search(op_name.group(1)) if op_name else None
        kind = name.rsplit(".", 1)[0] if op == "fusion" else op
        out.append({"name": name, "kind": kind, "site": site.group(1) if site else None})
    return out


def inventory(hlo: str) -> dict:
    """Kernels in all, the checks' kernels, per site and per kind."""
    ks = kernels(hlo)
    checks = [k for k in ks if k["site"]]
    per_site = collections.Counter(k["site"] for k in checks)
    return {
        "kernels": len(ks),
        "check_kernels": len(checks),
        "sites": len(per_site),
        "per_site": dict(per_site),
        "per_kind": dict(collections.Counter(k["kind"] for k in checks).most_common()),
    }


def after_pass_inventory(device, m: int, k: int, n: int) -> dict:
    """The kernels of the Mosaic checked GEMM's pass after the kernel (``verify.pass_after``)
    for ``[1, m, k] x [1, k, n]`` bf16, per kind. ``C`` is donated, as the kernel's output is
    in a step (else XLA copies it before writing the recomputed elements)."""
    import functools

    import jax.numpy as jnp

    from sdcguard.protection.pallas import matmul_mgpu, verify

    bs = matmul_mgpu.BlockSizes()
    status_shape = (1, n // bs.tile_n, 2, m)
    args = (
        jnp.zeros((1, m, k), jnp.bfloat16),
        jnp.zeros((1, k, n), jnp.bfloat16),
        jnp.zeros((1, m, n), jnp.bfloat16),
        jnp.zeros(status_shape, jnp.float32),
    )
    after = functools.partial(verify.pass_after, check=True, max_recomputed=16, block_sizes=bs)
    sharding = jax.sharding.SingleDeviceSharding(device)
    specs = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding) for x in args]
    lowered = jax.jit(after, donate_argnums=2).trace(*specs).lower(lowering_platforms=("cuda",))
    ks = kernels(lowered.compile().as_text())
    return {"kernels": len(ks), "per_kind": dict(collections.Counter(k["kind"] for k in ks))}


def main() -> int:
    import bench_gpu  # scripts/ on the path

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(bench_gpu.SIZES), default="d1024")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--variants", nargs="+", default=["plain", "detect only", "in place"])
    parser.add_argument("--hlo", type=Path, default=None, help="write each variant's HLO here")
    parser.add_argument("--out", type=Path, default=None, help="write the inventory as JSON")
    parser.add_argument("--site", default=None, help="list the kernels of sites matching this")
    parser.add_argument(
        "--after-pass",
        nargs="+",
        default=None,
        metavar="MxKxN",
        help="inventory the Mosaic checked GEMM's pass after the kernel at these shapes instead",
    )
    args = parser.parse_args()
    device = gpu_device()
    if args.after_pass:
        after = {}
        for shape in args.after_pass:
            m, k, n = (int(x) for x in shape.split("x"))
            after[shape] = after_pass_inventory(device, m, k, n)
            print(f"pass after the kernel, {shape}: {after[shape]}", flush=True)
        if args.out:
            args.out.write_text(json.dumps(after, indent=2))
        return 0
    step, step_args = bench_gpu.lm_step(args.size, jax.numpy.dtype(args.dtype))
    result = {}
    for name in args.variants:
        config = bench_gpu.VARIANTS[name]
        fn = step if config is None else sdcguard.checked(step, config)
        start = time.perf_counter()
        hlo = compile_for(device, fn, step_args).as_text()
        seconds = time.perf_counter() - start
        inv = result[name] = {**inventory(hlo), "compile_s": round(seconds, 1)}
        per = inv["check_kernels"] / max(inv["sites"], 1)
        print(
            f"{name}: {inv['kernels']} kernels, compiled in {seconds:.1f} s (trace, lowering "
            f"and XLA; no autotuning); checks {inv['check_kernels']} over {inv['sites']} sites "
            f"({per:.2f} per check); {inv['per_kind']}",
            flush=True,
        )
        if args.site:
            for k in kernels(hlo):
                if k["site"] and re.search(args.site, k["site"]):
                    print(f"  {k['site']:45s} {k['name']}")
        if args.hlo:
            args.hlo.mkdir(parents=True, exist_ok=True)
            file = "".join(c if c.isalnum() else "_" for c in name)
            with gzip.open(args.hlo / f"{file}.hlo.txt.gz", "wt") as f:
                f.write(hlo)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
