"""GPU kernels against cuBLAS (and, later, cuDNN): the checked Hopper GEMM at the LM's shapes.

On a GPU (at most ~5 minutes on an H100 or H200), bf16, per GEMM shape ``M x N x K`` (two
square-ish ones and the GEMMs of a d-1024 LM step, forward and backward, :data:`GEMM_SHAPES`):

- JAX's unmodified Hopper GEMM (``jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu``) and
  ``sdcguard``'s checked GEMM unchecked / checked / detect-only, each against cuBLAS
  (``jnp.dot``); checked and detect-only again with the checksum GEMM separate
  (``checksum_gemm="separate"``: the expected row sums as an XLA GEMM before the kernel) and
  with the rows' bounds from the ``A`` panels in shared memory (``row_bounds="fused"``: no
  pass over ``A`` before the kernel);
- each part of the checked GEMM as a compiled function of its own, on the outputs of the part
  before it: the passes before the kernel over ``B`` (padding, the checksum operand) and over
  ``A`` (padding, the per-row thresholds), both together, the detection-only kernel alone (what
  a clean call runs; the correcting kernel runs only after a detection), and what follows it
  on a clean call (``matmul.locate_if_flagged``: the predicate and the conditional);
- ratios as the median over interleaved rounds (drift hits every variant alike), with the
  device kind; each variant's compile time and first run (a kernel compiled at load time);
- an INF injected into the accumulator of the checked GEMM, corrected on the GPU.

``--trace DIR`` profiles every variant of one shape (``--trace-shape``) with ``jax.profiler``
and prints where its device time goes (``scripts/trace_summary.py``).

The cases are data (:class:`Case`, built by :func:`gemm_cases`; :func:`attention_cases` is
where attention kernels go); :func:`run_cases` times any list.

On a machine without a GPU it says so and exits 0; ``--force`` runs the same code there at
``--size tiny``, the kernels in Mosaic GPU's interpret mode (slow: seconds per call).

Usage:
  python scripts/bench_gpu_kernels.py [--rounds 7] [--inner 10] [--out runs/bench_gpu_kernels.json]
  python scripts/bench_gpu_kernels.py --trace runs/trace_gemm --trace-shape 8192x4096x1024
  python scripts/bench_gpu_kernels.py --force      # no GPU: tiny shapes, interpreted kernels
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

BUDGET_S = 270.0  # stop starting new cases after this; the whole run stays under 5 minutes


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    """One benchmark case: variants of one computation timed against a baseline.

    Attributes:
      name: what is computed (e.g. ``"gemm 8192x1024x4096"``).
      baseline: the variant the others are divided by.
      variants: name -> ``() -> outputs``, each a compiled function closed over its inputs
        (a :class:`Compiled` reports its compile time and HLO too).
      flops: floating-point operations of one call (for TFLOP/s), or 0.
    """

    name: str
    baseline: str
    variants: dict[str, Callable[[], object]]
    flops: float = 0.0


class Compiled:
    """``jax.jit(fn)`` on fixed arguments, compiled ahead of time at its first call.

    Attributes (after the first call): ``compile_s`` (lowering and XLA's compilation),
    ``first_run_s`` (the first run, to its result: a kernel compiled when the executable is
    loaded is in it), ``hlo`` (the compiled HLO text, for a trace's op names).
    """

    def __init__(self, fn: Callable, *args):
        self.fn, self.args = fn, args
        self.executable = self.compile_s = self.first_run_s = self.hlo = None

    def __call__(self):
        if self.executable is not None:
            return self.executable(*self.args)
        start = time.perf_counter()
        self.executable = jax.jit(self.fn).lower(*self.args).compile()
        self.compile_s = time.perf_counter() - start
        self.hlo = self.executable.as_text()
        start = time.perf_counter()
        out = _block(self.executable(*self.args))
        self.first_run_s = time.perf_counter() - start
        return out


def _block(x):
    return jax.tree_util.tree_map(lambda y: y.block_until_ready(), x)


def time_case(case: Case, *, rounds: int, inner: int, warmup: int = 1) -> dict:
    """Median seconds per call of every variant and median ratio to the baseline.

    Each variant is called once (compiled and run), then ``warmup`` more times; each round runs
    every variant ``inner`` times back to back; the ratio of a round is taken within the
    round, and the median over rounds is reported. Each variant is printed as it is compiled.
    """
    clean_counts = {}
    for name, fn in case.variants.items():  # compile and warm up
        start = time.perf_counter()
        for _ in range(1 + warmup):
            out = _block(fn())
        print(f"  {case.name}: {name} compiled and run in {time.perf_counter() - start:.1f} s")
        clean_counts[name] = counts_of(out)
        if clean_counts[name] is not None and any(clean_counts[name]):
            print(f"  {case.name}: {name}: ALARMS ON CLEAN DATA {clean_counts[name]}", flush=True)
    per_round = {name: [] for name in case.variants}
    for _ in range(rounds):
        for name, fn in case.variants.items():
            t0 = time.perf_counter()
            for _ in range(inner):
                out = fn()
            _block(out)
            per_round[name].append((time.perf_counter() - t0) / inner)
    base = per_round[case.baseline]
    return {
        name: {
            "ms": 1e3 * statistics.median(ts),
            "ratio": statistics.median(t / b for t, b in zip(ts, base, strict=True)),
            "tflops": case.flops / statistics.median(ts) / 1e12 if case.flops else None,
            "compile_s": getattr(case.variants[name], "compile_s", None),
            "first_run_s": getattr(case.variants[name], "first_run_s", None),
            "clean_counts": clean_counts[name],
        }
        for name, ts in per_round.items()
    }


def counts_of(out) -> list[int] | None:
    """The counters of a checked GEMM's output ``(c, counts)`` (its operands are clean: any
    count is a false alarm), or None for an output without them."""
    if not (isinstance(out, tuple) and len(out) == 2):
        return None
    counts = out[1]
    if getattr(counts, "shape", None) != (4,) or not jnp.issubdtype(counts.dtype, jnp.integer):
        return None
    return np.asarray(counts).tolist()


def run_cases(
    cases: list[Case | Callable[[], Case]],
    *,
    rounds: int,
    inner: int,
    device: str,
    start: float,
    warmup: int = 1,
    device_time: Path | None = None,
) -> list:
    """Times each case in turn (until the time budget is spent); one row per variant.

    A case may be a function that builds it (its inputs then exist only while it is timed).
    Each case's rows are printed as soon as it is timed. With ``device_time`` (a folder), each
    variant is also profiled, and its row gets the device time of its kernels (``device_ms``,
    ``device_ratio`` to the baseline's): what the GPU spent, without the cost of launching an
    executable from Python, which dominates calls of under about 0.1 ms.
    """
    rows = []
    for case in cases:
        if time.perf_counter() - start > BUDGET_S:
            print(f"skipped (time budget spent): {getattr(case, 'name', case)}")
            continue
        try:
            case = case if isinstance(case, Case) else case()
            timings = time_case(case, rounds=rounds, inner=inner, warmup=warmup)
            if device_time is not None:
                traces = trace_case(case, device_time / _file_name(case.name), calls=3)
                base = traces[case.baseline]["device_ms_per_call"]
                for variant, t in timings.items():
                    t["device_ms"] = traces[variant]["device_ms_per_call"]
                    t["device_ratio"] = t["device_ms"] / base if base else None
        except Exception as err:  # a variant that does not compile here is reported, not fatal
            name = getattr(case, "name", str(case))
            print(f"{name}: failed: {type(err).__name__}: {str(err)[:300]}")
            rows.append({"case": name, "device": device, "error": str(err)[:1000]})
            continue
        for variant, t in timings.items():
            rows.append(
                {
                    "case": case.name,
                    "variant": variant,
                    "baseline": case.baseline,
                    "device": device,
                    **t,
                }
            )
            on_device = ""
            if t.get("device_ratio") is not None:
                on_device = f"; device {t['device_ms']:.3f} ms, {t['device_ratio']:.3f} x"
            print(
                f"{case.name}: {variant}: {t['ms']:.3f} ms, {t['ratio']:.3f} x {case.baseline}"
                f"{on_device}",
                flush=True,
            )
        parts = sum_of_parts(rows, case.name)
        if parts:
            rows.append(parts)
            print(f"{case.name}: {parts['variant']}: {parts['ratio']:.3f} x {case.baseline}")
    return rows


# --- GEMM cases --------------------------------------------------------------------------------

TOKENS, D_MODEL, D_MLP, VOCAB = 8192, 1024, 4096, 32768

# size -> [(name, M, N, K)]
GEMM_SHAPES = {
    "lm": [
        ("8192x1024x4096", 8192, 1024, 4096),
        ("8192x4096x1024", 8192, 4096, 1024),
        ("lm qkv projection", TOKENS, 3 * D_MODEL, D_MODEL),
        ("lm attention output", TOKENS, D_MODEL, D_MODEL),
        ("lm logits", TOKENS, VOCAB, D_MODEL),
        ("lm logits grad_lhs", TOKENS, D_MODEL, VOCAB),
        ("lm logits grad_rhs", D_MODEL, VOCAB, TOKENS),
        ("lm mlp grad_rhs", D_MODEL, D_MLP, TOKENS),
        # One head's attention scores: its K (the head dim) is one pipeline stage short of
        # the default depth (clean tiles alarmed there on an H200, docs/pallas.md).
        ("lm attention scores", 1024, 1024, 128),
    ],
    # One tile and one K panel: interpreted, a kernel call takes seconds.
    "tiny": [("tiny", 128, 64, 64)],
}
# The parts of the checked GEMM, each timed alone (the kernel with correct=True).
STAGES = ("before: over B", "before: over A", "before: A and B", "kernel", "after")
PARTS = ("before: A and B", "kernel", "after")
# What a GEMM case times (:func:`gemm_case`), against cuBLAS.
GEMM_VARIANTS = (
    "jax_hopper",
    "unchecked",
    "checked",
    "detect_only",
    "checked, separate checksum GEMM",
    "detect_only, separate checksum GEMM",
    "checked, row bounds in the kernel",
    "detect_only, row bounds in the kernel",
    *(f"checked: {stage}" for stage in STAGES),
)


def block_sizes_for(size: str):
    """The kernel's tiles: the default, or the smallest for the interpreter."""
    from sdcguard.protection.pallas import BlockSizes

    if size == "tiny":
        return BlockSizes(tile_m=64, tile_n=64, max_concurrent_steps=2)
    return BlockSizes()


def _jax_hopper_gemm():
    """JAX's Hopper GEMM, unmodified, with a tile configuration from its own tuning space."""
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hopper

    config = hopper.TuningConfig(
        tile_m=128,
        tile_n=128,
        tile_k=64,
        max_concurrent_steps=4,
        grid_minor_dim=hopper.MatmulDimension.N,
        grid_tile_width=8,
        wg_dimension=hopper.MatmulDimension.N,
    )
    return lambda a, b: hopper.matmul(a, b, None, config)


def stage_variants(a, b, block_sizes) -> dict[str, Compiled]:
    """Each part of the checked GEMM (:data:`STAGES`) compiled alone, on the outputs of the
    part before it (computed here, once).

    A part returns only what it makes: an operand it passes on unchanged (``A`` or ``B`` that
    nothing pads, a clean call's ``C``) would be a copy, input to output, that the whole call
    does not make (compiled for an H200, the pass after the kernel at 8192 x 1024 x 4096 moved
    136 MB returning ``C`` and 2 MB without it).
    """
    from sdcguard import ABFTConfig
    from sdcguard.protection.pallas import matmul, matmul_mgpu, resolve_interpret

    a3, b3 = a[None], b[None]  # as checked_matmul batches 2-D operands
    bs = block_sizes
    transposed = not resolve_interpret(None)  # Bc's layout for the compiled kernel
    settings = matmul_mgpu.KernelSettings(
        out_dtype=a.dtype, block_sizes=bs, near_inf=ABFTConfig().near_inf
    )
    changed = lambda x, x_p: None if x_p.shape == x.shape else x_p  # padded, or None

    def over_b(b):
        b_p, *checksums = matmul.pass_over_b(
            b, a_shape=a3.shape, check=True, block_sizes=bs, transposed=transposed
        )
        return changed(b, b_p), *checksums

    def over_a(a, scales, magnitudes):
        a_p, params = matmul.pass_over_a(a, scales, magnitudes, b_shape=b3.shape, settings=settings)
        return changed(a, a_p), params

    def before(a, b):
        b_p, bc, scales, magnitudes = over_b(b)
        a_p, params = over_a(a, scales, magnitudes)
        return a_p, b_p, bc, params

    detecting = dataclasses.replace(settings, correct=False)
    # What a clean correcting call runs: the detection-only kernel, then the predicate on its
    # statuses and the conditional whose branch (the correcting kernel, the pass after it)
    # runs only when a tile flagged.
    kernel = functools.partial(matmul.run_kernel, settings=detecting)

    def after(a, b, a_p, b_p, bc, params, c, status):
        relaunch = lambda s: matmul.run_kernel(a_p, b_p, bc, params, settings=s)
        _, counts = matmul.locate_if_flagged(
            relaunch, a, b, c, status, settings=settings, max_recomputed=16, max_rerun_tiles=64
        )
        return None, counts

    variants = {"before: over B": Compiled(over_b, b3)}
    _, _, scales, magnitudes = variants["before: over B"]()
    variants["before: over A"] = Compiled(over_a, a3, scales, magnitudes)
    variants["before: A and B"] = Compiled(before, a3, b3)
    a_p, b_p, bc, params = variants["before: A and B"]()
    prepared = (a3 if a_p is None else a_p, b3 if b_p is None else b_p, bc, params)
    variants["kernel"] = Compiled(kernel, *prepared)
    c, status = variants["kernel"]()
    variants["after"] = Compiled(after, a3, b3, *prepared, c, status)
    return variants


def gemm_case(
    name: str, m: int, n: int, k: int, *, size: str, dtype=jnp.bfloat16, variants=None
) -> Case:
    """One GEMM shape: cuBLAS, JAX's Hopper GEMM (not at ``tiny``), the checked GEMM several
    ways and its parts (``variants``: only these, beside cuBLAS; None: all)."""
    from sdcguard.protection.pallas import matmul

    bs = block_sizes_for(size)
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (m, k), jnp.float32).astype(dtype)
    b = jax.random.normal(kb, (k, n), jnp.float32).astype(dtype)
    fns = {"cublas": jnp.dot}
    if size != "tiny":  # its tiles are larger than the tiny GEMM
        fns["jax_hopper"] = _jax_hopper_gemm()
    fns |= {
        "unchecked": functools.partial(matmul.checked_matmul, check=False, block_sizes=bs),
        "checked": functools.partial(matmul.checked_matmul, block_sizes=bs),
        "detect_only": functools.partial(matmul.checked_matmul, correct=False, block_sizes=bs),
        # The expected row sums as an XLA GEMM before the kernel, not a narrow WGMMA in its
        # main loop: which is faster is for a GPU to say.
        "checked, separate checksum GEMM": functools.partial(
            matmul.checked_matmul, block_sizes=bs, checksum_gemm="separate"
        ),
        "detect_only, separate checksum GEMM": functools.partial(
            matmul.checked_matmul, correct=False, block_sizes=bs, checksum_gemm="separate"
        ),
        # The rows' bounds from the A panels in shared memory, not an XLA pass over A.
        "checked, row bounds in the kernel": functools.partial(
            matmul.checked_matmul, block_sizes=bs, row_bounds="fused"
        ),
        "detect_only, row bounds in the kernel": functools.partial(
            matmul.checked_matmul, correct=False, block_sizes=bs, row_bounds="fused"
        ),
    }
    assert set(fns) <= {"cublas", *GEMM_VARIANTS}, set(fns)
    wanted = lambda v: variants is None or v == "cublas" or v in variants
    compiled = {v: Compiled(f, a, b) for v, f in fns.items() if wanted(v)}
    if any(wanted(f"checked: {s}") for s in STAGES):
        stages = stage_variants(a, b, bs).items()
        compiled |= {f"checked: {s}": v for s, v in stages if wanted(f"checked: {s}")}
    return Case(
        name=f"gemm {name} ({m}x{n}x{k})",
        baseline="cublas",
        variants=compiled,
        flops=2.0 * m * n * k,
    )


def gemm_cases(size: str = "lm", dtype=jnp.bfloat16, variants=None) -> list[Callable[[], Case]]:
    """The GEMM cases, each built when it is timed (``variants``: as for :func:`gemm_case`)."""
    return [
        functools.partial(gemm_case, name, m, n, k, size=size, dtype=dtype, variants=variants)
        for name, m, n, k in GEMM_SHAPES[size]
    ]


def sum_of_parts(rows: list[dict], case: str) -> dict | None:
    """The checked GEMM's parts added up (medians and median ratios summed), against the whole."""
    got = {r["variant"]: r for r in rows if r.get("case") == case and "variant" in r}
    parts = [got.get(f"checked: {p}") for p in PARTS]
    if any(p is None for p in parts):
        return None
    return {
        "case": case,
        "variant": "checked: sum of parts",
        "baseline": parts[0]["baseline"],
        "device": parts[0]["device"],
        "ms": sum(p["ms"] for p in parts),
        "ratio": sum(p["ratio"] for p in parts),
        "tflops": None,
        "compile_s": None,
        "first_run_s": None,
    }


def fault_corrected(size: str = "lm", dtype=jnp.bfloat16) -> dict:
    """An INF injected into the checked GEMM's accumulator (8192x1024x4096; tiny), corrected,
    with the rows' bounds from a pass over ``A`` and (under ``"row bounds in the kernel"``) from
    the kernel's shared memory; ``ok`` when both are."""
    from sdcguard.fault_model import Fault, FaultPlan
    from sdcguard.protection.pallas import matmul

    m, n, k = (8192, 1024, 4096) if size != "tiny" else GEMM_SHAPES["tiny"][0][1:]
    bs = block_sizes_for(size)
    ka, kb = jax.random.split(jax.random.key(1))
    a = jax.random.normal(ka, (m, k), jnp.float32).astype(dtype)
    b = jax.random.normal(kb, (k, n), jnp.float32).astype(dtype)
    index = (m // 2 + 3) * n + 777 % n
    plan = FaultPlan.from_faults([Fault(site="bench/gemm:out", kind="inf", index=index)])
    clean = jnp.dot(a, b, preferred_element_type=jnp.float32).astype(dtype)
    want = float(clean.reshape(-1)[index])

    def corrected(row_bounds: str) -> dict:
        run = jax.jit(
            lambda a, b, p: matmul.checked_matmul(
                a, b, plan=p, site="bench/gemm:out", block_sizes=bs, row_bounds=row_bounds
            )
        )
        c, counts = _block(run(a, b, plan))
        got = float(c.reshape(-1)[index])
        worst = float(jnp.max(jnp.abs(c.astype(jnp.float32) - clean.astype(jnp.float32))))
        counts = np.asarray(counts).tolist()
        return {
            "counts": counts,
            "corrected_value": got,
            "clean_value": want,
            "max_abs_difference_to_cublas": worst,
            "ok": counts == [1, 1, 0, 0] and abs(got - want) <= 2**-6 * abs(want),
        }

    separate, fused = corrected("separate"), corrected("fused")
    return {
        "shape": [m, n, k],
        **separate,
        "row bounds in the kernel": fused,
        "ok": separate["ok"] and fused["ok"],
    }


# --- Attention cases ----------------------------------------------------------------------------


def attention_cases(dtype=jnp.bfloat16) -> list[Case]:
    """Attention cases (fwd+bwd, ``baseline="cudnn"``), added with their kernel."""
    del dtype
    return []


# --- Trace ---------------------------------------------------------------------------------------


def trace_case(case: Case, trace_dir: Path, *, calls: int) -> dict:
    """Every variant of ``case`` profiled (``calls`` calls each): where its device time goes."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import trace_summary

    traces = {}
    for name, fn in case.variants.items():
        if getattr(fn, "hlo", None) is None:
            fn()
        where = trace_dir / _file_name(name)
        traces[name] = trace_summary.profile(fn, fn.hlo, where, calls=calls)
        t = traces[name]
        print(
            f"trace {case.name}: {name}: {t['device_ms_per_call']:.3f} ms of device time, "
            f"{t['kernels_per_call']:g} kernels per call"
        )
        for op in t["top"][:5]:
            print(f"    {op['ms_per_call']:.3f} ms  {op['hlo_op']}  {op['op_name'][-80:]}")
    return traces


def _file_name(name: str) -> str:
    return name.replace(" ", "_").replace(":", "").replace(",", "")


# --- Report ------------------------------------------------------------------------------------


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def print_table(rows: list[dict], device: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"GPU kernels on {device} (median of interleaved rounds)")
    columns = (
        "case",
        "variant",
        "ms",
        "÷ baseline",
        "device ÷ baseline",
        "TFLOP/s",
        "compile s",
        "1st run s",
    )
    for col in columns:
        table.add_column(col, justify="left" if col in ("case", "variant") else "right")
    seconds = lambda s: "" if s is None else f"{s:.2f}"
    for r in rows:
        if "error" in r:
            table.add_row(r["case"], "failed", "", "", "", "", "", "")
            continue
        tflops = "" if r["tflops"] is None else f"{r['tflops']:.0f}"
        table.add_row(
            r["case"],
            r["variant"],
            f"{r['ms']:.3f}",
            f"{r['ratio']:.3f}",
            "" if r.get("device_ratio") is None else f"{r['device_ratio']:.3f}",
            tflops,
            seconds(r.get("compile_s")),
            seconds(r.get("first_run_s")),
        )
    Console(width=max(Console().width, 120)).print(table)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=None, help="default 7 (tiny: 1)")
    parser.add_argument("--inner", type=int, default=None, help="default 10 (tiny: 1)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench_gpu_kernels.json"))
    parser.add_argument("--size", choices=sorted(GEMM_SHAPES), default=None)
    parser.add_argument(
        "--force",
        action="store_true",
        help="run without a GPU (--size tiny; the kernels in Mosaic GPU interpret mode)",
    )
    parser.add_argument(
        "--trace", type=Path, default=None, help="profile every variant of one shape into DIR"
    )
    parser.add_argument("--trace-shape", default=None, help="the shape --trace profiles")
    parser.add_argument(
        "--shapes", nargs="+", default=None, metavar="NAME", help="time only these shapes"
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        default=None,
        metavar="NAME",
        help="time only these variants beside cuBLAS (e.g. 'detect_only' 'checked: kernel')",
    )
    parser.add_argument(
        "--device-time",
        type=Path,
        default=None,
        metavar="DIR",
        help="also profile every variant into DIR and report its kernels' device time",
    )
    args = parser.parse_args(argv)
    unknown = sorted(set(args.variants or ()) - set(GEMM_VARIANTS))
    if unknown:
        parser.error(f"--variants {unknown}: not variants; use some of {list(GEMM_VARIANTS)}")
    if args.force:
        # The interpreter's warpgroup threads block in XLA:CPU's pool: it needs four threads.
        os.environ.setdefault("PJRT_NPROC", "4")
    if jax.default_backend() != "gpu" and not args.force:
        print(
            f"bench_gpu_kernels: no GPU found (JAX backend: {jax.default_backend()}); "
            "nothing timed."
        )
        return 0
    size = args.size or ("lm" if jax.default_backend() == "gpu" else "tiny")
    tiny = size == "tiny"
    rounds = args.rounds or (1 if tiny else 7)
    inner = args.inner or (1 if tiny else 10)
    shapes = [name for name, *_ in GEMM_SHAPES[size]]
    unknown = sorted(set(args.shapes or ()) - set(shapes))
    if unknown:
        parser.error(f"--shapes {unknown}: not shapes of size {size!r}; use some of {shapes}")
    timed = args.shapes or shapes
    trace_shape = args.trace_shape or timed[0]
    if args.trace is not None and trace_shape not in timed:
        parser.error(f"--trace-shape {trace_shape!r} is not one of {shapes}")
    start = time.perf_counter()
    device = jax.devices()[0].device_kind
    print(f"bench_gpu_kernels on {device}, size {size}, jax {jax.__version__}", flush=True)
    report = {
        "device": device,
        "jax": jax.__version__,
        "commit": _commit(),
        "command": " ".join(["python", *sys.argv]),
        "size": size,
        "rounds": rounds,
        "inner": inner,
    }
    fault = fault_corrected(size)
    print(f"injected INF on {device}: {fault}", flush=True)
    report["fault"] = {"device": device, **fault}
    builders = dict(zip(shapes, gemm_cases(size, variants=args.variants), strict=True))
    builders = {name: builders[name] for name in timed}
    if args.trace is not None:  # built once: timed, then traced
        builders[trace_shape] = functools.cache(builders[trace_shape])
    rows = run_cases(
        [*builders.values(), *attention_cases()],
        rounds=rounds,
        inner=inner,
        device=device,
        start=start,
        warmup=0 if tiny else 1,
        device_time=args.device_time,
    )
    print_table(rows, device)
    report["rows"] = rows
    if args.trace is not None:
        case = builders[trace_shape]()
        report["trace"] = {
            "case": case.name,
            "variants": trace_case(case, args.trace, calls=1 if tiny else 2),
        }
    report["seconds"] = time.perf_counter() - start
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out} ({report['seconds']:.0f} s)")
    return 0 if fault["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
