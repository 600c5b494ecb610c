"""Row-checksum products of every attention GEMM: a matrix-vector ``dot`` vs a fused reduction.

The row checksum of ``C = A·B`` needs ``A(Be)`` and a magnitude of ``A``'s rows. XLA on the CPU runs
the product fastest as a ``dot`` for some layouts of ``A`` and as an elementwise product and
reduction for others; ``sdcguard.protection`` picks one from the layout. This script times both
for the bench GPT's 12 attention GEMMs (forward and both gradients of the query projection, the
output projection, scores and context), interleaved in one process, and marks the one the library
picks. The magnitude is the general one everywhere (for the context's non-negative probabilities the
library takes a second product instead, in the same formulation).

    python scripts/bench_checksum_products.py
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import jax
import numpy as np
from rich.console import Console
from rich.table import Table
from timing import interleaved, per_call

from sdcguard.protection import _checksums as checksums

GEMMS = {
    "query projection": "bqD,Dhd->bqhd",
    "out projection": "bqhd,hdD->bqD",
    "scores": "bqhd,bkhd->bhqk",
    "context": "bhqk,bkhd->bqhd",
}
DIMS = {"b": 8, "q": 256, "k": 256, "h": 4, "d": 64, "D": 256}  # the bench GPT


def row_products(ct: checksums.Contraction, x, other, *, as_dot: bool):
    """``A(Be)`` and its magnitude for the rows of ``ct`` (the clean-path checksum work)."""
    return checksums._contract_with_line_sums(
        x, ct.lhs, other, ct.rhs, ct, ct.rhs_free, as_dot=as_dot
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("runs/bench_checksum_products.json"))
    args = parser.parse_args()
    console = Console()
    timers, chosen, layouts = {}, {}, {}
    key_a, key_b = jax.random.split(jax.random.key(0))
    for name, spec in GEMMS.items():
        lhs, rhs = spec.split("->")[0].split(",")
        forward = checksums.Contraction.parse(spec, len(lhs), len(rhs))
        for which, ct in (
            ("forward", forward),
            ("grad_lhs", forward.grad_lhs()),
            ("grad_rhs", forward.grad_rhs()),
        ):
            ct = ct.in_dot_order()  # the order the library checks in
            a = jax.random.normal(key_a, [DIMS[c] for c in ct.lhs])
            b = jax.random.normal(key_b, [DIMS[c] for c in ct.rhs])
            gemm = f"{name} {which}"
            layouts[gemm] = f"{ct.lhs}, contracted {ct.contracted}"
            chosen[gemm] = "dot" if checksums.products_as_dot(ct.lhs, ct) else "reduction"
            for how, as_dot in (("dot", True), ("reduction", False)):
                fn = functools.partial(row_products, ct, as_dot=as_dot)
                compiled = jax.jit(fn).lower(a, b).compile()
                timers[(gemm, how)] = per_call(lambda c=compiled, a=a, b=b: c(a, b), args.calls)
    with console.status(f"timing {len(timers)} variants, {args.rounds} interleaved rounds"):
        seconds = interleaved(timers, args.rounds)
    table = Table(title=f"Row-checksum products, bench GPT {DIMS}, {jax.default_backend()}")
    for col in ("GEMM", "A's layout", "dot ms", "reduction ms", "dot ÷ reduction", "library"):
        table.add_column(col, justify="left" if col in ("GEMM", "A's layout") else "right")
    results = {}
    for gemm in layouts:
        dot, red = (float(np.median(seconds[(gemm, how)])) for how in ("dot", "reduction"))
        results[gemm] = {
            "layout": layouts[gemm],
            "dot_s": dot,
            "reduction_s": red,
            "library": chosen[gemm],
        }
        table.add_row(
            gemm,
            layouts[gemm],
            f"{dot * 1e3:.3f}",
            f"{red * 1e3:.3f}",
            f"{dot / red:.2f}",
            chosen[gemm],
        )
    console.print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "backend": jax.default_backend(),
        "dims": DIMS,
        "rounds": args.rounds,
        "command": " ".join(["python", *sys.argv]),
        "results": results,
    }
    args.out.write_text(json.dumps(payload, indent=1))
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
