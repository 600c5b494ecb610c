"""The protected attention layer with ``implementation='pallas'`` (fused flash-attention kernel
and the checked GEMM kernel) against ``'xla'`` and Flax's unprotected layer, on a GPU.

For each shape and dtype: the layer's forward+backward (value_and_grad of its parameters and
counter sinks, the counters read as outputs), every variant compiled first, then timed in
interleaved rounds; an overhead is the median over rounds of the per-round ratio to Flax's
unprotected layer. Before timing it checks, on the GPU, that both protected paths give Flax's
output, count nothing on the clean step, and detect and correct one NaN injected into the
scores and one into a backward GEMM (the counters of both paths are printed).

On a machine without a GPU it says so and exits 0 (the kernels would only be interpreted).

Usage:
  python scripts/bench_pallas_attention.py [--rounds 15] [--inner 5] [--out runs/x.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
from timing import interleaved, overheads, per_call

from sdcguard import linen as sl
from sdcguard.fault_model import Fault, FaultPlan, faults
from sdcguard.protection import ABFTConfig

# (batch, seq_len, d_model, heads): the bench GPT's attention, and a longer sequence.
SHAPES = {"bench-gpt": (8, 256, 256, 4), "long": (4, 1024, 512, 8)}
VARIANTS = {"unprotected": None, "xla": "xla", "pallas": "pallas"}


class Wrapped(nn.Module):
    """Flax's attention layer named ``attn`` (its sites: ``attn:scores`` ...)."""

    heads: int
    dtype: object

    @nn.compact
    def __call__(self, x, mask):
        layer = nn.MultiHeadDotProductAttention(num_heads=self.heads, dtype=self.dtype, name="attn")
        return layer(x, mask=mask)


def layer_fns(shape, dtype):
    b, t, d, h = shape
    x = jax.random.normal(jax.random.key(0), (b, t, d), jnp.float32).astype(dtype)
    mask = nn.make_causal_mask(jnp.ones((b, t), jnp.int32)).astype(bool)
    layer = Wrapped(h, dtype)  # the attention layer at the path "attn"
    params = layer.init(jax.random.key(1), x, mask=mask)["params"]
    with sl.protect(ABFTConfig(sites=())):
        sinks = sl.init_sinks(layer, x, mask=mask)
    fns, checks = {}, {}
    for name, impl in VARIANTS.items():

        def loss(params, sinks, plan, impl=impl):
            if impl is None:
                out = layer.apply({"params": params}, x, mask=mask)
                return jnp.sum(out.astype(jnp.float32) ** 2), (out, {})
            with faults(plan), sl.protect(ABFTConfig(implementation=impl)):
                out, state = layer.apply(
                    {"params": params, "sdc_grad": sinks}, x, mask=mask, mutable=["sdc"]
                )
            return jnp.sum(out.astype(jnp.float32) ** 2), (out, state["sdc"])

        grad_fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
        clean = FaultPlan.from_faults([], capacity=1)
        compiled = grad_fn.lower(params, sinks, clean).compile()
        fns[name] = lambda c=compiled, p=clean: c(params, sinks, p)[0][0]
        checks[name] = lambda plan, c=compiled: c(params, sinks, plan)
    return fns, checks


def counts_of(result) -> dict[str, list[int]]:
    (_, (_, sdc)), (_, sink_grads) = result
    counts = {**sl.site_counts(sdc), **sl.backward_site_counts(sink_grads)}
    return {k: v.tolist() for k, v in counts.items() if any(v)}


def check(checks, shape) -> dict:
    """Clean: the protected outputs are Flax's and nothing is counted. Faulted: corrected."""
    t = shape[1]
    ref = checks["unprotected"](FaultPlan.from_faults([], capacity=1))[0][1][0]
    report = {}
    plans = {
        "clean": [],
        "scores nan": [Fault(site="attn:scores", kind="nan", index=(t + 1) * (t // 2))],
        "context.grad_rhs inf": [Fault(site="attn:context.grad_rhs", kind="inf", index=7)],
    }
    for impl in ("xla", "pallas"):
        for name, fault_list in plans.items():
            result = checks[impl](FaultPlan.from_faults(fault_list, capacity=1))
            out = result[0][1][0]
            err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
            report[f"{impl} {name}"] = {"max_abs_diff_to_flax": err, "counts": counts_of(result)}
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--inner", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("runs/bench_pallas_attention.json"))
    args = parser.parse_args()
    if jax.default_backend() != "gpu":
        print("no GPU: the Pallas kernels would only be interpreted; nothing to time")
        return 0
    results = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "cases": {}}
    for shape_name, shape in SHAPES.items():
        for dtype in (jnp.float32, jnp.bfloat16):
            case = f"{shape_name} {jnp.dtype(dtype).name}"
            fns, checks = layer_fns(shape, dtype)
            checked = check(checks, shape)
            timers = {name: per_call(fn, args.inner) for name, fn in fns.items()}
            timing = overheads(interleaved(timers, args.rounds), base="unprotected")
            results["cases"][case] = {"shape": shape, "checks": checked, "timing": timing}
            print(f"\n{case}  (batch, seq, d_model, heads) = {shape}")
            for name, c in checked.items():
                print(
                    f"  {name:28s} max|out - flax| {c['max_abs_diff_to_flax']:.2e}  {c['counts']}"
                )
            for name, t in timing.items():
                print(
                    f"  {name:12s} {t['median_s'] * 1e3:8.3f} ms  overhead {t['overhead']:+.1%}"
                    f"  (IQR {t['overhead_iqr'][0]:+.1%} .. {t['overhead_iqr'][1]:+.1%})"
                )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
