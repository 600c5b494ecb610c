"""How far the ABFT threshold sits above the actual round-off, on the reference GPT's GEMMs.

For every GEMM of one attention layer of the reference GPT (real activations of a training
batch, forward and backward), fp32 and bf16, compares the checksum deviation of the clean result
with the threshold of the tolerance model: the ratio threshold/deviation must exceed 1 on every
line (no false alarm) and its median says how much sensitivity the worst-case bound costs.
Also reports the smallest single-element relative error that is detected.

    python scripts/bench_tolerance.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from rich.console import Console
from rich.table import Table

from sdcguard.models import GPT, ByteBatches, GPTConfig, init_params
from sdcguard.protection import Contraction, line_checksums

GEMMS = {  # site: einsum spec with the shapes of the reference GPT's attention
    "query": "btf,fhd->bthd",
    "scores": "bqhd,bkhd->bhqk",
    "context": "bhqk,bkhd->bqhd",
    "out": "bthd,hdf->btf",
}


def operands(config: GPTConfig, dtype) -> dict[str, tuple[jax.Array, jax.Array]]:
    """Real operands of the first attention layer for one training batch."""
    model = GPT(config)
    params = init_params(model, 0)
    tokens = ByteBatches(seq_len=config.seq_len).batch(0)[:, :-1]
    _, state = model.apply(
        {"params": params}, tokens, capture_intermediates=True, mutable=["intermediates"]
    )
    x = state["intermediates"]["decoder"]["block_0"]["ln_attn"]["__call__"][0]
    attn = params["decoder"]["block_0"]["attn"]
    q = jnp.einsum(GEMMS["query"], x, attn["query"]["kernel"])
    k = jnp.einsum(GEMMS["query"], x, attn["key"]["kernel"])
    v = jnp.einsum(GEMMS["query"], x, attn["value"]["kernel"])
    probs = jax.nn.softmax(jnp.einsum(GEMMS["scores"], q / 4.0, k), axis=-1)
    ctx = jnp.einsum(GEMMS["context"], probs, v)
    ops = {
        "query": (x, attn["query"]["kernel"]),
        "scores": (q / 4.0, k),
        "context": (probs, v),
        "out": (ctx, attn["out"]["kernel"]),
    }
    return {s: (a.astype(dtype), b.astype(dtype)) for s, (a, b) in ops.items()}


def smallest_detected(c, a, b, ct, rows) -> float:
    """Smallest relative change of one element (the largest of C) that flags its row."""
    flat = np.asarray(c, np.float32).reshape(-1)
    i = int(np.argmax(np.abs(flat)))
    for rel in 10.0 ** np.arange(-7, 3, 0.25):
        bumped = flat.copy()
        bumped[i] *= 1 + rel
        cb = jnp.asarray(bumped.reshape(c.shape)).astype(c.dtype)
        if not np.array_equal(np.asarray(cb), np.asarray(c)):
            lc = line_checksums(cb, a, b, ct, "row")
            if np.any(~(np.asarray(lc.deviation) <= np.asarray(lc.threshold))):
                return float(rel)
    return float("inf")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench_tolerance.json"))
    args = parser.parse_args()
    config = GPTConfig()
    rows = []
    for dtype in (jnp.float32, jnp.bfloat16):
        for site, (a, b) in operands(config, dtype).items():
            ct = Contraction.parse(GEMMS[site], a.ndim, b.ndim)
            c = jnp.einsum(GEMMS[site], a, b)
            for side in ("row", "col"):
                lc = line_checksums(c, a, b, ct, side)
                dev, thr = np.asarray(lc.deviation), np.asarray(lc.threshold)
                ratio = thr / np.maximum(dev, np.finfo(np.float32).tiny)
                rows.append(
                    {
                        "dtype": jnp.dtype(dtype).name,
                        "site": site,
                        "side": side,
                        "lines": int(dev.size),
                        "false_alarms": int(np.sum(~(dev <= thr))),
                        "min_ratio": float(ratio.min()),
                        "median_ratio": float(np.median(ratio)),
                        "smallest_detected_rel_error": smallest_detected(c, a, b, ct, None)
                        if side == "row"
                        else None,
                    }
                )
    table = Table(
        title="threshold / clean deviation (min, median); detects: smallest relative error "
        "of the largest element that flags its row"
    )
    for col in ("dtype", "site", "side", "lines", "alarms", "min", "median", "detects"):
        table.add_column(col, justify="right")
    for r in rows:
        det = r["smallest_detected_rel_error"]
        table.add_row(
            r["dtype"],
            r["site"],
            r["side"],
            str(r["lines"]),
            str(r["false_alarms"]),
            f"{r['min_ratio']:.3g}",
            f"{r['median_ratio']:.3g}",
            "" if det is None else f"{det:.2g}",
        )
    Console().print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
