"""The checked step compiled for an H200 on a machine without one: the kernels of each check.

XLA:GPU compiles without a GPU when it is given the target's description (a deviceless
topology). The fusions it makes are the ones a GPU runs; the configurations XLA gives GEMMs and
fusions are assigned without being measured (GEMM tilings differ; reductions and elementwise
fusions do not), and the Mosaic GPU kernels go through ``ptxas`` as on a GPU. This counts the
kernels each check adds, per site and per kind, and those inside conditionals (compiled, run
when a branch is taken), so that a change to the checks can be judged before a GPU session.

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
import math
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


def lower_for(device, fn, args):
    """``fn`` traced and lowered for ``device``; its checks traced as on a GPU (the Mosaic GPU
    kernels of ``implementation="pallas"`` compiled for a Hopper GPU, not interpreted)."""
    from sdcguard.protection import pallas

    sharding = jax.sharding.SingleDeviceSharding(device)
    specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), args)
    with (
        mock.patch("jax.default_backend", return_value="gpu"),
        pallas.as_h100(),
        pallas.interpret_mode(False),
    ):
        return jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",))


def compile_for(device, fn, args):
    """``fn`` lowered (:func:`lower_for`) and compiled for ``device``."""
    return lower_for(device, fn, args).compile()


_ARRAY = re.compile(r"\b(pred|bf16|[suf]\d+)\[([\d,]*)\]")
_OPERANDS = re.compile(r"%([\w.\-]+)")
# Kernels that compute a GEMM: XLA:GPU's Triton GEMM fusions, and custom calls (cuBLAS, the
# Mosaic GPU kernels of ``implementation="pallas"``).
_GEMM_KINDS = ("gemm_fusion", "custom-call")
# The site suffixes of a GEMM's two gradient GEMMs.
_GRADIENTS = (".grad_lhs", ".grad_rhs")
# Control flow runs kernels of its own (counted in its computations), not one of its own.
_CONTROL_FLOW = {"conditional", "while", "call"}


def array_bytes(hlo_type: str) -> int:
    """Bytes of the arrays in an HLO type (``bf16[8,4]{1,0}``, or a tuple of them)."""
    total = 0
    for dtype, dims in _ARRAY.findall(hlo_type):
        bits = {"pred": 8, "bf16": 16}.get(dtype) or int(dtype[1:])
        total += math.prod(int(d) for d in dims.split(",") if d) * bits // 8
    return total


def _kind(name: str, op: str) -> str:
    """A kernel's kind: a fusion's name without its number (``loop_not_fusion``), else its op."""
    return name.rsplit(".", 1)[0] if op == "fusion" else op


def kernels(hlo: str) -> list[dict]:
    """The entry computation's kernel-launching instructions.

    Each as ``{"name", "kind", "site", "reads", "writes", "operands"}``: the check site it runs
    for (None: the step's own), the bytes of its operands and of its result, and its operands
    (``{name: bytes}``). The bytes bound what the kernel moves: an operand it only slices counts
    whole, and a fusion that also writes a tensor the step needs (a check's reduction fused
    with a ``convert`` the GEMM reads) counts that output to the check.
    """
    entry = hlo[hlo.index("\nENTRY") :].split("\n")[1:]
    types, out = {}, []
    for line in entry:
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        name, hlo_type, op = m.groups()
        types[name] = hlo_type
        if op in _NO_KERNEL:
            continue
        op_name = re.search(r'op_name="([^"]*)"', line)
        site = _CHECK.search(op_name.group(1)) if op_name else None
        kind = _kind(name, op)
        args = line[m.end() :].split(")", 1)[0]
        operands = {x: array_bytes(types[x]) for x in _OPERANDS.findall(args) if x in types}
        moves = op not in _CONTROL_FLOW
        out.append(
            {
                "name": name,
                "kind": kind,
                "site": site.group(1) if site else None,
                "reads": sum(operands.values()) if moves else 0,
                "writes": array_bytes(hlo_type) if moves else 0,
                "operands": operands,
            }
        )
    return out


def inventory(hlo: str, *, top: int = 8) -> dict:
    """Kernels in all, the checks' kernels per site and per kind, and the bytes they move.

    ``total_bytes`` sums the reads and writes of every kernel (:func:`kernels` says what the
    bytes bound): the variant's minus the plain step's is what the checks add.
    ``per_direction`` sums the checks' kernels of forward and of each gradient GEMM.
    ``check_bytes`` and ``step_bytes`` split it between the checks' kernels and the step's
    own, so a check fused with the step's work counts that work too.
    ``gemm_outputs_checked_bytes`` is the size of the GEMM outputs the checks read: the least
    that checks which read each output once can add. ``branch_kernels`` counts the kernels
    inside conditionals, which ``kernels`` leaves out (:func:`branch_kernels`), and
    ``branch_copies`` the copies among them; ``clean_branch_kernels`` those a clean step runs
    (:func:`clean_branch_kernels`). ``reread`` lists the ``top`` largest
    tensors that several check kernels read, each read beyond the first a pass that a shared
    reduction could save.
    """
    ks, inside = kernels(hlo), branch_kernels(hlo)
    checks = [k for k in ks if k["site"]]
    per_site = collections.Counter(k["site"] for k in checks)
    per_direction = collections.defaultdict(lambda: {"checks": 0, "kernels": 0})
    for site, n in per_site.items():
        direction = site.rsplit(".", 1)[-1] if site.endswith(_GRADIENTS) else "forward"
        per_direction[direction]["checks"] += 1
        per_direction[direction]["kernels"] += n
    site_bytes = collections.Counter()
    readers = collections.defaultdict(list)
    sizes = {}
    for k in checks:
        site_bytes[k["site"]] += k["reads"] + k["writes"]
        for x, size in k["operands"].items():
            readers[x].append(k["site"])
            sizes[x] = size
    shared = sorted(
        ((x, sites) for x, sites in readers.items() if len(sites) > 1),
        key=lambda item: -(len(item[1]) - 1) * sizes[item[0]],
    )
    gemms = {k["name"] for k in ks if k["kind"].startswith(_GEMM_KINDS)}
    return {
        "kernels": len(ks),
        "check_kernels": len(checks),
        "sites": len(per_site),
        "per_site": dict(per_site),
        "per_direction": dict(per_direction),
        "per_kind": dict(collections.Counter(k["kind"] for k in checks).most_common()),
        "total_bytes": sum(k["reads"] + k["writes"] for k in ks),
        "gemm_outputs_checked_bytes": sum(sizes[x] for x in readers if x in gemms),
        "branch_copies": branch_copies(hlo, inside),
        "branch_kernels": inside["kernels"],
        "clean_branch_kernels": clean_branch_kernels(hlo)["kernels"],
        "check_bytes": sum(site_bytes.values()),
        "step_bytes": sum(k["reads"] + k["writes"] for k in ks if not k["site"]),
        "per_site_bytes": dict(site_bytes.most_common()),
        "reread_bytes": sum((len(sites) - 1) * sizes[x] for x, sites in shared),
        "reread": [
            {"tensor": x, "bytes": sizes[x], "sites": sorted(sites)} for x, sites in shared[:top]
        ],
    }


def _computations(hlo: str) -> dict[str, list[str]]:
    """Each computation's instruction lines, by name."""
    out, lines = {}, None
    for line in hlo.split("\n"):
        header = re.match(r"^(?:ENTRY )?%([\w.\-]+) .*\{$", line)
        if header:
            out[header.group(1)] = lines = []
        elif lines is not None:
            lines.append(line)
    return out


def _branches(lines: list[str]) -> list[str]:
    """The branch computations of the conditionals among ``lines``."""
    found = []
    for line in lines:
        if " conditional(" in line:
            found += re.findall(r"(?:true|false)_computation=%([\w.\-]+)", line)
            listed = re.search(r"branch_computations=\{([^}]*)\}", line)
            if listed:
                found += [x.strip().lstrip("%") for x in listed.group(1).split(",")]
    return found


def branch_kernels(hlo: str) -> dict:
    """The kernels inside the branches of conditionals (the entry's, and those nested in them).

    :func:`kernels` counts a conditional once; the kernels its branches launch are compiled all
    the same (XLA:GPU's compile time grows with them) and run when the branch is taken. A
    branch that returns its operand unchanged compiles to a copy of it when XLA gives the
    conditional's output a buffer of its own: such copies run on every call that takes the
    branch (a clean step, for the repair's and recomputation's conditionals).

    Returns:
      ``{"kernels": n, "per_kind": {kind: n}, "copies": n, "copy_bytes": written}``.
    """
    computations = _computations(hlo)
    entry = hlo[hlo.index("\nENTRY") :].split("\n")[1:]
    pending, seen = _branches(entry), set()
    kinds, copies, written = collections.Counter(), 0, 0
    while pending:
        name = pending.pop()
        if name in seen or name not in computations:
            continue
        seen.add(name)
        pending += _branches(computations[name])
        for line in computations[name]:
            m = _INSTRUCTION.match(line)
            if not m or m.group(3) in _NO_KERNEL:
                continue
            instruction, hlo_type, op = m.groups()
            kinds[_kind(instruction, op)] += 1
            if op == "copy":
                copies += 1
                written += array_bytes(hlo_type)
    return {
        "kernels": sum(kinds.values()),
        "per_kind": dict(kinds.most_common()),
        "copies": copies,
        "copy_bytes": written,
    }


def _clean_branch(line: str) -> str | None:
    """The branch a conditional's line takes when nothing flagged: ``false_computation``, or
    branch 0 of an indexed one (``lax.cond`` and ``indexed_cond`` put the clean branch there)."""
    found = re.search(r"false_computation=%([\w.\-]+)", line)
    if found:
        return found.group(1)
    listed = re.search(r"branch_computations=\{([^}]*)\}", line)
    return listed.group(1).split(",")[0].strip().lstrip("%") if listed else None


def clean_branch_kernels(hlo: str) -> dict:
    """The kernels a clean step runs inside conditionals: the clean branch of each of the
    entry's conditionals (:func:`_clean_branch`), and of the conditionals nested in it, counted
    once per conditional (each runs).

    Returns:
      ``{"kernels": n, "per_kind": {kind: n}}``.
    """
    computations = _computations(hlo)
    entry = hlo[hlo.index("\nENTRY") :].split("\n")[1:]
    pending = [_clean_branch(line) for line in entry if " conditional(" in line]
    kinds = collections.Counter()
    while pending:
        lines = computations.get(pending.pop(), [])
        for line in lines:
            m = _INSTRUCTION.match(line)
            if not m or m.group(3) in _NO_KERNEL:
                continue
            if m.group(3) == "conditional":
                pending.append(_clean_branch(line))
                continue
            kinds[_kind(m.group(1), m.group(3))] += 1
    return {"kernels": sum(kinds.values()), "per_kind": dict(kinds.most_common())}


def branch_copies(hlo: str, inside: dict | None = None) -> dict:
    """The copies inside the branches of conditionals (:func:`branch_kernels`, or ``inside``,
    what it returned for ``hlo``).

    Returns:
      ``{"copies": n, "bytes": written}``.
    """
    inside = branch_kernels(hlo) if inside is None else inside
    return {"copies": inside["copies"], "bytes": inside["copy_bytes"]}


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


def mosaic_gemm_inventory(device, m: int, k: int, n: int) -> dict:
    """The Mosaic checked GEMM (``checked_matmul``, ``[1, m, k] x [1, k, n]`` bf16) compiled
    for an H200, detection only and correcting.

    Per variant (detection only and correcting, each with the rows' bounds from an XLA pass
    over ``A`` and from the kernel's shared memory, ``row_bounds="fused"``): the kernels a
    clean call launches (the entry computation's; a conditional, whose branches run only when
    a tile flagged, counts as one), per kind, the bytes they move (the Mosaic kernel's
    operands and outputs included), and the copies in the conditionals' branches
    (:func:`branch_copies`: a copy there runs on every clean call).
    """
    import functools

    import jax.numpy as jnp

    from sdcguard.protection.pallas import matmul

    operands = (
        jax.ShapeDtypeStruct((1, m, k), jnp.bfloat16),
        jax.ShapeDtypeStruct((1, k, n), jnp.bfloat16),
    )
    out = {}
    for name, correct in (("detect only", False), ("correcting", True)):
        for suffix, row_bounds in (("", "separate"), (", row bounds in the kernel", "fused")):
            fn = functools.partial(
                matmul.checked_matmul, correct=correct, row_bounds=row_bounds, interpret=False
            )
            hlo = compile_for(device, fn, operands).as_text()
            ks, inside = kernels(hlo), branch_kernels(hlo)
            out[name + suffix] = {
                "kernels": len(ks),
                "per_kind": dict(collections.Counter(k["kind"] for k in ks)),
                "bytes": sum(k["reads"] + k["writes"] for k in ks),
                "branch_copies": branch_copies(hlo, inside),
                "branch_kernels": inside["kernels"],
            }
    return out


def flash_compile(device, seq: int, lowering: str) -> dict:
    """The Mosaic GPU flash attention kernels (forward, dQ, dK/dV) compiled for an H200 under
    Mosaic GPU's ``lowering`` semantics: bf16, B 1, H 4, D 128, causal, with a fault plan.

    Returns the compile time and the Mosaic GPU kernels in the compiled program. With
    ``MOSAIC_GPU_DUMP_PTXAS=1`` in the environment, ``ptxas`` prints each kernel's registers
    and spills (to stderr, from outside Python).
    """
    import jax.numpy as jnp

    from sdcguard import fault_model
    from sdcguard.protection.pallas import flash

    q = jax.ShapeDtypeStruct((1, seq, 4, 128), jnp.bfloat16)
    plan = fault_model.FaultPlan.from_faults(
        [fault_model.Fault(site="attn:scores", kind="nan", index=3)]
    )

    def loss(q, k, v):
        out, _ = flash.flash_attention(
            q, k, v, causal=True, plan=plan, interpret=False, kernel="mosaic",
            mosaic_lowering=lowering,
        )  # fmt: skip
        return jnp.sum(out.astype(jnp.float32))

    start = time.perf_counter()
    hlo = compile_for(device, jax.grad(loss, argnums=(0, 1, 2)), (q, q, q)).as_text()
    names = sorted(set(re.findall(r"checked_flash_attention_\w+_mgpu", hlo)))
    return {"compile_s": round(time.perf_counter() - start, 1), "mosaic_kernels": names}


def fusion_probes(device) -> dict:
    """What XLA:GPU fuses, on small programs shaped like a check's vector work, for ``device``.

    Each probe is compiled for ``device`` and counted as :func:`kernels` counts a step: a
    check's kernel count is bounded by these rules, whatever jnp formulation it takes
    (docs/performance.md, "What bounds a check's kernels on XLA:GPU").

    Returns:
      ``{probe: {"kernels": n, "per_kind": {...}, "what": description}}``.
    """
    import jax.numpy as jnp

    f32 = jnp.float32
    sites = 99

    def verdict(r, s, m):
        # A check's verdict: the rows' comparison reduced to one flag per matrix.
        return jnp.any(~(jnp.abs(s - r) <= m))

    def rows_then_verdict(c, r, m):
        # The row sums of C, then the comparison: elementwise work after a reduction.
        return ~(jnp.abs(jnp.sum(c.astype(f32), axis=-1) - r) <= m)

    def counters(xs, *, stacked):
        # Each site's flag from a reduction of its own, then [4] counters as reports hold them.
        flags = [jnp.any(x > 1).astype(jnp.int32) for x in xs]
        if stacked:
            d = jnp.stack(flags)
            return jnp.stack([d, 0 * d, d, 0 * d], axis=1)
        return [jnp.stack([d, 0 * d, d, 0 * d]) for d in flags]

    def scaled(v, w, s):
        return v * s, w * s

    def vec(*shape, dtype=f32):
        return jax.ShapeDtypeStruct(shape, dtype)

    def scalar(dtype):
        return jax.ShapeDtypeStruct((), dtype)

    probes = {
        "verdict of 8192 rows": (
            verdict,
            (vec(8, 1024),) * 3,
            "a reduction to one flag of 8192 rows: its elementwise comparison a kernel of its own",
        ),
        "verdict of 65536 rows": (
            verdict,
            (vec(64, 1024),) * 3,
            "the same over 65536 rows: a two-stage reduction, the comparison fused into the first",
        ),
        "row sums then comparison": (
            rows_then_verdict,
            (vec(8192, 4096, dtype=jnp.bfloat16), vec(8192), vec(8192)),
            "elementwise work after a row reduction: no epilogue fusion",
        ),
        "per-site counters": (
            lambda *xs: counters(xs, stacked=False),
            (vec(8, 1024),) * sites,
            f"{sites} sites' flags, each reduced, as {sites} [4] outputs: one kernel per output",
        ),
        "stacked counters": (
            lambda *xs: counters(xs, stacked=True),
            (vec(8, 1024),) * sites,
            f"the same flags as one [{sites}, 4] output: a few kernels in all",
        ),
        "two scalings of one scale": (
            scaled,
            (vec(4096), vec(4096), scalar(f32)),
            "two elementwise products with one scalar: two kernels (no sibling fusion)",
        ),
    }
    out = {}
    for name, (fn, specs, what) in probes.items():
        ks = kernels(compile_for(device, fn, specs).as_text())
        out[name] = {
            "kernels": len(ks),
            "per_kind": dict(collections.Counter(k["kind"] for k in ks)),
            "what": what,
        }
    return out


def _traffic(inv: dict, plain: dict | None) -> str:
    """One line on the bytes a variant's kernels move (:func:`inventory`)."""
    gb = 1e9
    line = f"kernels move {inv['total_bytes'] / gb:.2f} GB"
    if plain is not None and inv["check_kernels"]:
        added = inv["total_bytes"] - plain["total_bytes"]
        line += (
            f", {added / gb:.2f} GB more than plain; the checked GEMMs' outputs are "
            f"{inv['gemm_outputs_checked_bytes'] / gb:.2f} GB"
        )
    if inv["branch_copies"]["copies"]:
        copies = inv["branch_copies"]
        line += f"; {copies['copies']} copies ({copies['bytes'] / gb:.2f} GB) in conditionals"
    if inv["reread"]:
        line += f"; tensors read by several checks: {inv['reread_bytes'] / gb:.2f} GB again"
        line += ", the largest " + ", ".join(
            f"{r['tensor']} ({r['bytes'] / gb:.2f} GB: {' & '.join(r['sites'])})"
            for r in inv["reread"][:3]
        )
    return line


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
    parser.add_argument(
        "--mosaic-gemm",
        nargs="+",
        default=None,
        metavar="MxKxN",
        help="inventory the Mosaic checked GEMM (detect only, correcting) at these shapes",
    )
    parser.add_argument(
        "--flash",
        nargs="+",
        default=None,
        metavar="LOWERING",
        help="compile the Mosaic flash kernels under these lowering semantics (warpgroup, lane)",
    )
    parser.add_argument(
        "--fusion-probes",
        action="store_true",
        help="count the kernels of small programs that show what XLA:GPU fuses (fusion_probes)",
    )
    args = parser.parse_args()
    device = gpu_device()
    if args.fusion_probes:
        probes = fusion_probes(device)
        for name, probe in probes.items():
            print(f"{name}: {probe['kernels']} kernels {probe['per_kind']}; {probe['what']}")
        if args.out:
            args.out.write_text(json.dumps(probes, indent=2))
        return 0
    if args.flash:
        flashes = {lowering: flash_compile(device, 1024, lowering) for lowering in args.flash}
        for lowering, result in flashes.items():
            print(f"flash attention, {lowering} semantics: {result}", flush=True)
        if args.out:
            args.out.write_text(json.dumps(flashes, indent=2))
        return 0
    if args.mosaic_gemm:
        gemms = {}
        for shape in args.mosaic_gemm:
            m, k, n = (int(x) for x in shape.split("x"))
            gemms[shape] = mosaic_gemm_inventory(device, m, k, n)
            for name, inv in gemms[shape].items():
                print(
                    f"checked GEMM {shape}, {name}: {inv['kernels']} kernels on a clean call "
                    f"moving {inv['bytes'] / 1e6:.1f} MB, copies in conditionals "
                    f"{inv['branch_copies']}; {inv['per_kind']}",
                    flush=True,
                )
        if args.out:
            args.out.write_text(json.dumps(gemms, indent=2))
        return 0
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
        lowered = lower_for(device, fn, step_args)
        lowered_at = time.perf_counter()
        hlo = lowered.compile().as_text()
        seconds = time.perf_counter() - start
        inv = result[name] = {
            **inventory(hlo),
            "compile_s": round(seconds, 1),
            "lower_s": round(lowered_at - start, 1),
        }
        per = inv["check_kernels"] / max(inv["sites"], 1)
        print(
            f"{name}: {inv['kernels']} kernels and {inv['branch_kernels']} more inside "
            f"conditionals ({inv['clean_branch_kernels']} run on a clean step); compiled in "
            f"{seconds:.1f} s ({inv['lower_s']:.1f} s of it tracing and lowering; XLA assigns "
            f"GEMM and fusion configurations without measuring them); "
            f"checks {inv['check_kernels']} over {inv['sites']} sites ({per:.2f} per check); "
            f"{inv['per_kind']}",
            flush=True,
        )
        print(f"  {_traffic(inv, result.get('plain'))}", flush=True)
        directions = ", ".join(
            f"{d} {x['kernels'] / x['checks']:.2f}" for d, x in sorted(inv["per_direction"].items())
        )
        if directions:
            print(f"  kernels per check: {directions}", flush=True)
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
