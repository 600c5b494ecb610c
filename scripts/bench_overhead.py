"""ABFT overhead on the reference GPT: training step and attention alone, protected/unprotected.

Every variant is compiled first, then timed in interleaved rounds (A, B, C, C, B, A, ...) in one
process; an overhead is the median over rounds of the per-round ratio to the unprotected step
(with its interquartile range), the reported time the median over rounds.

    python scripts/bench_overhead.py                 # bench-size GPT (d_model 256, seq 256)
    python scripts/bench_overhead.py --size default  # the tiny default GPT
    python scripts/bench_overhead.py --per-site      # each site alone, and fwd vs fwd+bwd
    python scripts/bench_overhead.py --step-only --rounds 41  # more rounds of the step alone
    python scripts/bench_overhead.py --whole-step    # every GEMM checked by sdcguard.checked

``--whole-step`` times whole training steps under :func:`sdcguard.checked` (every GEMM, forward
and backward, in place (the backend's default repair, branch-free and cond) / detect only /
recompute on detection; attention only; and each site class alone: attention, projections, MLP,
head) on the reference GPT (``--size``) and on a linen LM written the way Flax's examples write
one (4 layers, d 256, MLP 1024, seq 256), that LM also with its attention layers swapped for the
drop-ins (``linen.protect``). ``--models lm`` and ``--variants NAME ...`` narrow it:

    python scripts/bench_overhead.py --whole-step --models lm --rounds 11

The drop-ins' checks by direction and site class (:data:`DROP_IN_PARTS`) run only when named:

    python scripts/bench_overhead.py --whole-step --models lm --variants \\
        "drop-in attention (linen.protect), in place" "drop-ins, forward checks only" ...
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from rich.console import Console
from rich.table import Table
from timing import interleaved, overheads, per_call

import sdcguard
from sdcguard import linen as sl
from sdcguard.fault_model import FaultPlan
from sdcguard.models import ByteBatches, GPTConfig
from sdcguard.protection import ABFTConfig
from sdcguard.training import TrainConfig, make_train_step

SIZES = {
    "default": GPTConfig(),
    "bench": GPTConfig(num_layers=2, d_model=256, num_heads=4, seq_len=256),
}
VARIANTS = {
    "unprotected": None,
    "forward checked": ABFTConfig(backward=False),
    "forward+backward checked": ABFTConfig(),
    # The same checks with no repair loops: what the in-place repair costs on a clean step.
    "forward+backward, detect only": ABFTConfig(correct=False),
}
# Training step only: detection-only checks, the step recomputed with in-place repair when one
# fires (sdcguard.training.TrainConfig.repair).
TRAIN_VARIANTS = {
    **VARIANTS,
    "forward+backward, recompute on detection": (ABFTConfig(), "recompute"),
}
# --per-site: where the forward overhead goes.
PER_SITE_VARIANTS = {
    "unprotected": None,
    "layers swapped, no checks": ABFTConfig(sites=()),
    "projections (fwd)": ABFTConfig(sites=("query", "key", "value", "out"), backward=False),
    "scores (fwd)": ABFTConfig(sites=("scores",), backward=False),
    "probs": ABFTConfig(sites=("probs",), backward=False),
    "context (fwd)": ABFTConfig(sites=("context",), backward=False),
    # Where the backward checks' cost goes: compare each with its forward-only row.
    "projections (fwd+bwd)": ABFTConfig(sites=("query", "key", "value", "out")),
    "scores, probs, context (fwd)": ABFTConfig(
        sites=("scores", "probs", "context"), backward=False
    ),
    "scores, probs, context (fwd+bwd)": ABFTConfig(sites=("scores", "probs", "context")),
}


def train_step_fns(model: GPTConfig, batch_size: int, variants: dict = TRAIN_VARIANTS) -> dict:
    """Compiled steps; a variant is an ABFTConfig (or None), or ``(ABFTConfig, repair)``."""
    batch = ByteBatches(batch_size=batch_size, seq_len=model.seq_len).batch(0)
    plan = FaultPlan.none()
    fns = {}
    for name, variant in variants.items():
        abft, repair = variant if isinstance(variant, tuple) else (variant, "in_place")
        config = TrainConfig(model=model, batch_size=batch_size, abft=abft, repair=repair)
        state, step = make_train_step(config)
        compiled = step.lower(state, batch, plan).compile()
        fns[name] = lambda c=compiled, s=state: c(s, batch, plan)[1].loss
    return fns


def attention_fns(model: GPTConfig, batch_size: int) -> dict:
    x = jax.random.normal(jax.random.key(0), (batch_size, model.seq_len, model.d_model))
    mask = nn.make_causal_mask(jnp.ones((batch_size, model.seq_len)))
    layer = nn.MultiHeadDotProductAttention(num_heads=model.num_heads)
    params = layer.init(jax.random.key(1), x, mask=mask)["params"]
    with sl.protect(ABFTConfig(sites=())):
        sinks = sl.init_sinks(layer, x, mask=mask)
    fns = {}
    for name, abft in VARIANTS.items():

        def loss(params, sinks, x, abft=abft):
            if abft is None:
                return jnp.sum(layer.apply({"params": params}, x, mask=mask) ** 2), {}
            # The counters are outputs, forward ('sdc') and backward (the sinks' gradient), as
            # in a training step: a check whose result nobody reads would be compiled away.
            with sl.protect(abft):
                out, sdc = layer.apply(
                    {"params": params, "sdc_grad": sinks}, x, mask=mask, mutable=["sdc"]
                )
            return jnp.sum(out**2), sdc

        grad_fn = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
        compiled = jax.jit(grad_fn).lower(params, sinks, x).compile()
        fns[name] = lambda c=compiled: c(params, sinks, x)[0][0]
    return fns


# --whole-step: sdcguard.checked over the whole step; each class alone by its site names.
WHOLE_STEP_VARIANTS = {
    "unprotected": None,
    "every GEMM, in place": ABFTConfig(),
    "every GEMM, in place, branch-free": ABFTConfig(repair="branch_free"),
    "every GEMM, in place, cond": ABFTConfig(repair="cond"),
    "every GEMM, in place, a cond per GEMM": ABFTConfig(group_repairs=False),
    "every GEMM, detect only": ABFTConfig(correct=False),
    "every GEMM, recompute on detection": ABFTConfig(recompute=True),
    "every GEMM, recompute on detection, cond": ABFTConfig(recompute=True, repair="cond"),
    "attention only (scores, context), in place": ABFTConfig(include=("**attn:*",)),
    "class: attention (scores, context)": ABFTConfig(include=("**attn:*",), correct=False),
    "class: projections (q, k, v, out)": ABFTConfig(
        include=tuple(f"**attn/{p}:*" for p in ("query", "key", "value", "out")), correct=False
    ),
    "class: MLP": ABFTConfig(include=("**mlp/**",), correct=False),
    # The GPT reads its embedding as the head, the LM has a Dense head: each model has one.
    "class: head": ABFTConfig(
        include=("**head**", "**embed:attend*"), correct=False, allow_unmatched=True
    ),
}


# --whole-step, the Flax-example LM only: its attention layers swapped for the drop-ins
# (linen.protect), every attention GEMM checked, forward and backward.
DROP_IN_VARIANTS = {
    "drop-in attention (linen.protect), in place": ABFTConfig(),
    "drop-in attention (linen.protect), in place, branch-free": ABFTConfig(repair="branch_free"),
    "drop-in attention (linen.protect), in place, cond": ABFTConfig(repair="cond"),
    "drop-in attention (linen.protect), in place, a cond per GEMM": ABFTConfig(group_repairs=False),
    "drop-in attention (linen.protect), detect only": ABFTConfig(correct=False),
}

# Where the drop-ins' cost lies: their checks by direction and site class, in place. Run only
# when named (--variants), to keep the default run's length.
_PROJECTIONS = ("query", "key", "value", "out")
DROP_IN_PARTS = {
    "drop-ins, nothing checked": ABFTConfig(sites=()),
    "drop-ins, forward checks only": ABFTConfig(backward=False),
    "drop-ins, backward checks only": ABFTConfig(forward=False),
    "drop-ins, backward checks only, detect only": ABFTConfig(forward=False, correct=False),
    "drop-ins, backward: scores": ABFTConfig(sites=("scores",), forward=False),
    "drop-ins, backward: context": ABFTConfig(sites=("context",), forward=False),
    "drop-ins, backward: scores and context": ABFTConfig(
        sites=("scores", "context"), forward=False
    ),
    "drop-ins, backward: projections": ABFTConfig(sites=_PROJECTIONS, forward=False),
}


class MlpBlock(nn.Module):
    mlp_dim: int

    @nn.compact
    def __call__(self, x):
        kernel = nn.with_logical_partitioning(nn.initializers.xavier_uniform(), ("embed", "mlp"))
        h = nn.gelu(nn.Dense(self.mlp_dim, kernel_init=kernel, name="wi")(x))
        kernel = nn.with_logical_partitioning(nn.initializers.xavier_uniform(), ("mlp", "embed"))
        return nn.Dense(x.shape[-1], kernel_init=kernel, name="wo")(h)


class Block(nn.Module):
    heads: int
    mlp_dim: int

    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + nn.SelfAttention(num_heads=self.heads, deterministic=True, name="attn")(
            nn.LayerNorm()(x), mask=mask
        )
        return x + MlpBlock(self.mlp_dim, name="mlp")(nn.LayerNorm()(x))


class FlaxExampleLM(nn.Module):
    """A decoder LM as Flax's examples write one (Dense, SelfAttention, Embed, a Dense head)."""

    vocab: int = 256
    d: int = 256
    heads: int = 4
    mlp_dim: int = 1024
    layers: int = 4

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.d, name="embed")(tokens)
        for i in range(self.layers):
            x = Block(self.heads, self.mlp_dim, name=f"block_{i}")(x)
        return nn.DenseGeneral(self.vocab, name="head")(nn.LayerNorm()(x))


def _compiled(step, args, variants: dict) -> dict:
    fns = {}
    for name, abft in variants.items():
        if abft is not None:  # a pattern that selects nothing would time the plain step
            checked = [s for s in sdcguard.list_sites(step, *args, config=abft) if s.checked]
            if not checked:
                raise SystemExit(f"variant {name!r} selects no GEMM site")
        fn = step if abft is None else sdcguard.checked(step, abft)
        compiled = jax.jit(fn).lower(*args).compile()
        # The report is an output: a check whose result nobody reads would be compiled away.
        fns[name] = lambda c=compiled: c(*args)
    return fns


def whole_step_gpt_fns(model: GPTConfig, batch_size: int, variants=None) -> dict:
    """The reference GPT's Adam step (loss, gradients, update) as one function."""
    config = TrainConfig(model=model, batch_size=batch_size, abft=None)
    state, _ = make_train_step(config)
    from sdcguard.models import GPT, lm_loss

    net, tx = GPT(model), optax.adam(config.learning_rate)
    batch = jnp.asarray(ByteBatches(batch_size=batch_size, seq_len=model.seq_len).batch(0))

    def step(params, opt_state, batch):
        def loss_fn(p):
            return lm_loss(net.apply({"params": p}, batch[:, :-1]), batch[:, 1:])

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return _compiled(
        step, (state.params, state.opt_state, batch), _selected(WHOLE_STEP_VARIANTS, variants)
    )


def whole_step_linen_lm_fns(model: GPTConfig, batch_size: int, variants=None) -> dict:
    """The Flax-example LM (4 layers, d 256, MLP 1024, seq 256), Adam: under ``checked``, and
    with its attention layers swapped for the drop-ins."""
    del model
    net, tx = FlaxExampleLM(), optax.adam(1e-3)
    tokens = jax.random.randint(jax.random.key(0), (batch_size, 257), 0, 256)
    params = nn.unbox(net.init(jax.random.key(1), tokens[:, :-1]))["params"]
    opt_state = tx.init(params)

    def step(params, opt_state, tokens):
        def loss_fn(p):
            logits = net.apply({"params": p}, tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    fns = _compiled(step, (params, opt_state, tokens), _selected(WHOLE_STEP_VARIANTS, variants))
    with sl.protect(ABFTConfig(sites=())):
        sinks = sl.init_sinks(net, tokens[:, :-1])
    drop_ins = _selected(DROP_IN_VARIANTS, variants)
    drop_ins |= {k: v for k, v in DROP_IN_PARTS.items() if variants and k in variants}
    for name, abft in drop_ins.items():

        def drop_in_step(params, opt_state, tokens, abft=abft):
            def loss_fn(p, sinks):
                with sl.protect(abft):
                    logits, sdc = net.apply(
                        {"params": p, "sdc_grad": sinks}, tokens[:, :-1], mutable=["sdc"]
                    )
                loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
                return loss.mean(), sdc

            (loss, sdc), (grads, backward) = jax.value_and_grad(
                loss_fn, argnums=(0, 1), has_aux=True
            )(params, sinks)
            updates, opt_state = tx.update(grads, opt_state, params)
            # The counters are outputs: a check whose result nobody reads is compiled away.
            return optax.apply_updates(params, updates), opt_state, loss, sdc, backward

        compiled = jax.jit(drop_in_step).lower(params, opt_state, tokens).compile()
        fns[name] = lambda c=compiled: c(params, opt_state, tokens)
    return fns


def _selected(variants: dict, names) -> dict:
    """``variants`` restricted to ``names`` (None: all), the unprotected baseline always."""
    if names is None:
        return variants
    return {k: v for k, v in variants.items() if k in names or v is None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="bench")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--inner", type=int, default=3)
    parser.add_argument(
        "--per-site", action="store_true", help="training step only, one protected site at a time"
    )
    parser.add_argument(
        "--step-only", action="store_true", help="time the training step, not attention alone"
    )
    parser.add_argument(
        "--whole-step",
        action="store_true",
        help="whole training steps under sdcguard.checked: the GPT and a Flax-example LM",
    )
    parser.add_argument(
        "--models",
        nargs="+",
        choices=("gpt", "lm"),
        default=("gpt", "lm"),
        help="with --whole-step: the reference GPT, the Flax-example LM, or both",
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=[*WHOLE_STEP_VARIANTS, *DROP_IN_VARIANTS, *DROP_IN_PARTS],
        default=None,
        metavar="NAME",
        help="with --whole-step: only these variants (and the unprotected step)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    model = SIZES[args.size]
    console = Console()
    results = {}
    workloads = [("training step", train_step_fns), ("attention fwd+bwd", attention_fns)]
    if args.step_only:
        workloads = workloads[:1]
    if args.per_site:
        workloads = [
            ("training step", lambda m, b: train_step_fns(m, b, PER_SITE_VARIANTS)),
        ]
    if args.whole_step:
        chosen = {
            "gpt": (f"{args.size} GPT step, every GEMM", whole_step_gpt_fns),
            "lm": ("Flax-example LM step (4 x d256, MLP 1024)", whole_step_linen_lm_fns),
        }
        workloads = [
            (what, functools.partial(make, variants=args.variants))
            for what, make in (chosen[m] for m in args.models)
        ]
    default_out = (
        "runs/bench_overhead_whole_step.json"
        if args.whole_step
        else "runs/bench_overhead_per_site.json"
        if args.per_site
        else "runs/bench_overhead.json"
    )
    out = args.out or Path(default_out)
    for what, make in workloads:
        with console.status(f"compiling {what} variants"):
            fns = make(model, args.batch_size)
        with console.status(f"timing {what} ({args.rounds} interleaved rounds)"):
            timers = {name: per_call(fn, args.inner) for name, fn in fns.items()}
            results[what] = overheads(interleaved(timers, args.rounds), base="unprotected")
    table = Table(
        title=f"ABFT overhead, {args.size} GPT {model}, batch {args.batch_size}, "
        f"{jax.default_backend()}"
    )
    columns = ("workload", "variant", "median ms", "overhead", "IQR", "fastest ms", "fastest")
    for col in columns:
        table.add_column(col, justify="left" if col in ("workload", "variant") else "right")
    for what, summary in results.items():
        for name, r in summary.items():
            q1, q3 = r["overhead_iqr"]
            table.add_row(
                what,
                name,
                f"{r['median_s'] * 1e3:.2f}",
                f"{r['overhead'] * 100:+.1f}%",
                f"{q1 * 100:+.1f}..{q3 * 100:+.1f}%",
                f"{r['min_s'] * 1e3:.2f}",
                f"{r['overhead_of_fastest'] * 100:+.1f}%",
            )
    console.print(table)
    console.print(
        "overhead: median over rounds of the per-round ratio to unprotected; "
        "fastest: ratio of each variant's fastest round"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "size": args.size,
        "model": repr(model),
        "batch_size": args.batch_size,
        "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
        "rounds": args.rounds,
        "inner": args.inner,
        "command": " ".join(["python", *sys.argv]),
        "results": results,
    }
    out.write_text(json.dumps(payload, indent=1))
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
