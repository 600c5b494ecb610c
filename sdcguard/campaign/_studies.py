"""The campaign's studies beside the trials: error propagation and false positives."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sdcguard import fault_model as inject, training
from sdcguard.campaign._config import CampaignConfig
from sdcguard.campaign._trials import abft_config, make_fault, runner_for
from sdcguard.fault_model import ATTENTION_SITES, GEMM_SITES, FaultPlan
from sdcguard.models import ByteBatches
from sdcguard.protection import Counts, GemmSite
from sdcguard.training import TrainConfig

# --- Propagation inside one attention block (unprotected) -------------------------------------

PROPAGATION_TENSORS = ("query", "key", "value", "scores", "probs", "context", "out", "block")


def pattern(diff: np.ndarray, matrix_axes: tuple[int, int]) -> str:
    """Error pattern of a corrupted tensor: ``none``, ``0D``, ``1D`` (one row or column of one
    matrix) or ``2D`` (more, or several matrices). Matrices are the ``matrix_axes`` planes."""
    if not diff.any():
        return "none"
    diff = np.moveaxis(diff, matrix_axes, (-2, -1))
    mats = diff.reshape(-1, *diff.shape[-2:])
    touched = [m for m in mats if m.any()]
    if len(touched) > 1:
        return "2D"
    rows, cols = np.nonzero(touched[0])
    nr, nc = len(set(rows.tolist())), len(set(cols.tolist()))
    if nr == nc == 1:
        return "0D"
    return "1D" if nr == 1 or nc == 1 else "2D"


def _block_forward(x, w, plan, prefix, heads, causal=True):
    """One pre-LN attention block, residual and MLP, with injection at every attention site
    (the arithmetic of Flax's attention layer and :func:`protected_attention`); ``causal``:
    the decoder's mask, else the encoder's full attention."""

    def site(name, t):
        return inject.apply(t, plan, f"{prefix}:{name}")

    def ln(t):
        mu = t.mean(-1, keepdims=True)
        return (t - mu) / jnp.sqrt(((t - mu) ** 2).mean(-1, keepdims=True) + 1e-6)

    length, d = x.shape[1:]
    hd = d // heads
    h = ln(x)
    t = {}
    for n in ("query", "key", "value"):
        t[n] = site(n, jnp.einsum("bld,dhk->blhk", h, w[n]))
    q = t["query"] / jnp.sqrt(hd)
    t["scores"] = site("scores", jnp.einsum("bqhd,bkhd->bhqk", q, t["key"]))
    if causal:
        mask = jnp.tril(jnp.ones((length, length), bool))
        masked = jnp.where(mask, t["scores"], jnp.finfo(x.dtype).min)
    else:
        masked = t["scores"]
    t["probs"] = site("probs", jax.nn.softmax(masked, axis=-1))
    t["context"] = site("context", jnp.einsum("bhqk,bkhd->bqhd", t["probs"], t["value"]))
    t["out"] = site("out", jnp.einsum("blhk,hkd->bld", t["context"], w["out"]))
    r = x + t["out"]
    t["block"] = r + jax.nn.gelu(ln(r) @ w["fc_in"]) @ w["fc_out"]
    return t


# What each site's fault can reach, in execution order (itself included).
DOWNSTREAM = {
    "query": ("query", "scores", "probs", "context", "out", "block"),
    "key": ("key", "scores", "probs", "context", "out", "block"),
    "value": ("value", "context", "out", "block"),
    "scores": ("scores", "probs", "context", "out", "block"),
    "probs": ("probs", "context", "out", "block"),
    "context": ("context", "out", "block"),
    "out": ("out", "block"),
}
_MATRIX_AXES = {"scores": (2, 3), "probs": (2, 3), "out": (1, 2), "block": (1, 2)}


def propagation(config: CampaignConfig) -> dict[str, dict[str, dict[str, int]]]:
    """For faults at each forward attention site, the pattern in every downstream tensor.

    Returns ``{site: {tensor: {pattern: count}}}`` over ``propagation_trials`` x kinds faults.
    Per-head tensors ``[b, l, h, d]`` count as one ``[l, h*d]`` matrix per batch element.
    """
    m = config.model_config()
    d, heads = m.d_model, m.num_heads
    keys = jax.random.split(jax.random.key(config.seed), 7)
    dt = jnp.dtype(m.dtype)
    w = {
        n: (jax.random.normal(k, s) / np.sqrt(s[0])).astype(dt)
        for n, k, s in zip(
            ("query", "key", "value", "out", "fc_in", "fc_out"),
            keys[:6],
            [(d, heads, d // heads)] * 3
            + [(heads, d // heads, d), (d, m.mlp_ratio * d), (m.mlp_ratio * d, d)],
            strict=True,
        )
    }
    x = jax.random.normal(keys[6], (config.batch_size, m.seq_len, d)).astype(dt)
    prefix = f"{config.stack_name}/block_0/attn"
    causal = config.model_kind == "gpt"
    fwd = jax.jit(lambda x, plan: _block_forward(x, w, plan, prefix, heads, causal))
    clean = jax.device_get(fwd(x, FaultPlan.from_faults([], capacity=1)))
    out: dict[str, dict[str, dict[str, int]]] = {}
    for s in ATTENTION_SITES:
        site = f"{prefix}:{s}"
        tally: dict[str, dict[str, int]] = {}
        for kind in config.kinds:
            for trial in range(config.propagation_trials):
                plan = FaultPlan.from_faults([make_fault(config, site, kind, trial)], capacity=1)
                plan = plan.at_step(config.warmup)
                faulty = jax.device_get(fwd(x, plan))
                for name in DOWNSTREAM[s]:
                    a = np.asarray(clean[name], np.float32)
                    bad = np.asarray(faulty[name], np.float32)
                    if name in ("query", "key", "value", "context"):
                        # [b, l, h, d] -> one [l, h*d] matrix per batch element
                        a, bad = (t.reshape(*t.shape[:2], -1) for t in (a, bad))
                    diff = ~np.isclose(bad, a, rtol=1e-5, atol=1e-6)
                    p = pattern(diff, _MATRIX_AXES.get(name, (1, 2)))
                    tally.setdefault(name, {}).setdefault(p, 0)
                    tally[name][p] += 1
        out[site] = tally
    return out


# --- False positives ----------------------------------------------------------------------------


def gemm_site_table(config: CampaignConfig, dtype: str) -> list[GemmSite]:
    """Every GEMM of the campaign's training step (loss and gradients) in ``dtype``, checked or
    not, as :func:`sdcguard.list_sites` reports it for the ``abft`` protection. Traces only.

    Example:
      >>> [s.why_unchecked for s in gemm_site_table(config, "bf16") if not s.checked][:1]
      ['bfloat16 operands']
    """
    train = TrainConfig(
        model=config.model_config(dtype), model_kind=config.model_kind, seed=config.seed
    )
    return training.gemm_site_table(train, abft_config("abft", "every_gemm"))


def false_positives(config: CampaignConfig, dtype: str, steps: int) -> dict[str, Any]:
    """Alarms over ``steps`` clean ABFT-checked training steps in ``dtype``.

    A checked GEMM is one checked einsum call (one site, one step, forward or backward); the
    batch x head matrices inside one call are counted separately in ``checked_matrices``.
    With ``coverage="every_gemm"`` only GEMMs that were checked count: a site that
    :func:`sdcguard.list_sites` lists as checked in ``dtype`` *and* that the step's report
    holds. The others are counted in ``unchecked_gemms``, with their reasons in
    ``why_unchecked`` (``{'bfloat16 operands': 102}``): zero alarms over unchecked GEMMs is
    no evidence, and the report says so.
    """
    m = config.model_config(dtype)
    # The campaign's own compiled ABFT step when the dtype matches (no extra compilation).
    runner = runner_for(dataclasses.replace(config, dtype=dtype), "abft")
    state, step = runner.state, runner.step
    data = ByteBatches(batch_size=config.batch_size, seq_len=m.seq_len, seed=config.seed + 1)
    plan = FaultPlan.from_faults([], capacity=1)
    alarms = []
    checked_gemms = unchecked_gemms = 0
    why_unchecked: dict[str, int] = {}
    if config.coverage == "every_gemm":
        table = gemm_site_table(config, dtype)
        listed_checked = {s.name for s in table if s.checked}
    t0 = time.perf_counter()
    for i in range(steps):
        state, out = step(state, jnp.asarray(data.batch(i)), plan)
        alarms.append(out.counts)
        if config.coverage == "every_gemm":
            # out.sdc is sdcguard.checked's report: one entry per site it checked this step.
            checked = listed_checked & set(out.sdc)
            checked_gemms += len(checked)
            for s in table:
                if s.name not in checked:
                    why = s.why_unchecked or "listed as checked, absent from the report"
                    why_unchecked[why] = why_unchecked.get(why, 0) + 1
                    unchecked_gemms += 1
    alarms = Counts.of(Counts.rows(np.asarray(jax.device_get(alarms))))
    b, length, h = config.batch_size, m.seq_len, m.num_heads
    if config.coverage == "every_gemm":
        matrices_per_step = softmax_per_step = None
    else:
        # Per layer and step: 6 forward GEMMs, 12 backward; softmax rows are checked apart.
        checked_gemms = steps * m.num_layers * 3 * len(GEMM_SITES)
        # scores and context (and their 4 gradient GEMMs) are b*h matrices; projections 1.
        matrices_per_step = m.num_layers * (3 * 4 + 3 * 2 * b * h)
        softmax_per_step = m.num_layers * b * h * length
    return {
        "dtype": dtype,
        "coverage": config.coverage,
        "steps": steps,
        "checked_gemms": checked_gemms,
        "unchecked_gemms": unchecked_gemms,
        "why_unchecked": why_unchecked,
        "checked_matrices": None if matrices_per_step is None else steps * matrices_per_step,
        "softmax_checks": None if softmax_per_step is None else steps * softmax_per_step,
        "alarm_steps": int((alarms.detected > 0).sum()),
        "alarms": int(alarms.detected.sum()),
        "seconds": round(time.perf_counter() - t0, 2),
    }
