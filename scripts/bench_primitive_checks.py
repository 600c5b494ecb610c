"""What checking grouped GEMMs and convolutions costs: a training step's time ÷ the plain step's.

Three linen models, their loss and gradients (``jax.value_and_grad``) under ``sdcguard.checked``:
a mixture-of-experts MLP (top-1 routing, tokens sorted by expert, one ``jax.lax.ragged_dot``
per expert weight), a small convolutional network (a 3x3 convolution, a strided one, a
grouped one, a linear head) and a MobileNet-style one (depthwise 3x3 and pointwise 1x1
convolutions). Each is timed plain, with every GEMM checked in place and detect
only, interleaved in one process (``timing.py``); the ratios are medians of per-round ratios.

    python scripts/bench_primitive_checks.py --out runs/bench_primitive_checks.json
    python scripts/bench_primitive_checks.py --size tiny --rounds 1   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))  # timing.py, beside this script

from timing import interleaved, overheads, per_call

import sdcguard
from sdcguard.protection import ABFTConfig

SIZES = {
    # tokens, d, hidden, experts / batch, image side, channels
    "tiny": {"moe": (64, 16, 32, 4), "conv": (2, 8, 8), "depthwise": (2, 8, 8)},
    "bench": {"moe": (1024, 128, 512, 8), "conv": (16, 32, 32), "depthwise": (16, 32, 64)},
}
VARIANTS = {
    "plain": None,
    "checked, in place": ABFTConfig(),
    "checked, detect only": ABFTConfig(correct=False),
}


class MoE(nn.Module):
    experts: int
    hidden: int
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):  # [tokens, d]
        d = x.shape[-1]
        init = nn.initializers.lecun_normal()
        wi = self.param("wi", init, (self.experts, d, self.hidden)).astype(self.dtype)
        wo = self.param("wo", init, (self.experts, self.hidden, d)).astype(self.dtype)
        expert = jnp.argmax(nn.Dense(self.experts, dtype=self.dtype, name="router")(x), axis=-1)
        order = jnp.argsort(expert)
        sizes = jnp.bincount(expert, length=self.experts).astype(jnp.int32)
        h = nn.gelu(jax.lax.ragged_dot(x[order], wi, sizes))
        return x + jnp.zeros_like(x).at[order].set(jax.lax.ragged_dot(h, wo, sizes))


class ConvNet(nn.Module):
    channels: int
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):  # [batch, side, side, 3]
        c = self.channels
        x = nn.relu(nn.Conv(c, (3, 3), dtype=self.dtype, name="conv_in")(x))
        x = nn.relu(nn.Conv(2 * c, (3, 3), strides=2, dtype=self.dtype, name="down")(x))
        x = x + nn.relu(
            nn.Conv(2 * c, (3, 3), feature_group_count=4, dtype=self.dtype, name="grouped")(x)
        )
        return nn.Dense(10, dtype=self.dtype, name="head")(x.mean(axis=(1, 2)))


class DepthwiseNet(nn.Module):
    channels: int
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):  # [batch, side, side, 3]
        c = self.channels
        x = nn.relu(nn.Conv(c, (3, 3), dtype=self.dtype, name="conv_in")(x))
        for i in range(2):
            h = nn.Conv(c, (3, 3), feature_group_count=c, dtype=self.dtype, name=f"dw_{i}")(x)
            x = x + nn.Conv(c, (1, 1), dtype=self.dtype, name=f"pw_{i}")(nn.relu(h))
        return nn.Dense(10, dtype=self.dtype, name="head")(x.mean(axis=(1, 2)))


MODELS = ("moe", "conv", "depthwise")


def model_and_batch(kind: str, size: str, dtype):
    if kind == "moe":
        tokens, d, hidden, experts = SIZES[size]["moe"]
        model = MoE(experts, hidden, dtype)
        x = jax.random.normal(jax.random.key(1), (tokens, d))
    else:
        batch, side, channels = SIZES[size][kind]
        model = (ConvNet if kind == "conv" else DepthwiseNet)(channels, dtype)
        x = jax.random.normal(jax.random.key(1), (batch, side, side, 3))
    params = model.init(jax.random.key(0), x)
    return model, params, x.astype(dtype)


def step_fns(kind: str, size: str, dtype) -> dict:
    """Each variant's compiled step, a zero-argument callable."""
    model, params, x = model_and_batch(kind, size, dtype)

    def loss(params, x):
        return jnp.mean(model.apply(params, x).astype(jnp.float32) ** 2)

    step = jax.value_and_grad(loss)
    fns = {}
    for name, config in VARIANTS.items():
        fn = step if config is None else sdcguard.checked(step, config)
        compiled = jax.jit(fn).lower(params, x).compile()
        fns[name] = lambda c=compiled: c(params, x)
    return fns


def commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=list(SIZES), default="bench")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--inner", type=int, default=3, help="steps per timing")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    dtype = jnp.dtype(args.dtype)
    results = {}
    for kind in args.models:
        fns = step_fns(kind, args.size, dtype)
        for fn in fns.values():
            jax.block_until_ready(fn())  # a first call, untimed
        timers = {name: per_call(fn, args.inner) for name, fn in fns.items()}
        results[kind] = overheads(interleaved(timers, args.rounds), base="plain")
        for name, r in results[kind].items():
            q1, q3 = r["overhead_iqr"]
            print(
                f"{kind:9s} {name:22s} {r['median_s'] * 1e3:9.2f} ms  "
                f"x{1 + r['overhead']:.3f} (IQR x{1 + q1:.3f}..x{1 + q3:.3f})"
            )
    report = {
        "command": " ".join(
            ["python", "scripts/bench_primitive_checks.py", *(argv or sys.argv[1:])]
        ),
        "commit": commit(),
        "jax": jax.__version__,
        "device": jax.devices()[0].device_kind,
        "size": args.size,
        "sizes": {kind: SIZES[args.size][kind] for kind in args.models},
        "dtype": args.dtype,
        "rounds": args.rounds,
        "results": results,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
