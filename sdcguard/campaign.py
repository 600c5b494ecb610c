"""``sdcguard campaign``: systematic fault injection into real training, with and without ABFT.

A campaign trains the reference GPT, and for every cell of a grid (site x kind x trial) injects
one fault at a fixed step after a short clean warm-up, trains ``steps_after`` more steps, and
compares with the clean run on the same batches. Faults are data (a :class:`FaultPlan` of fixed
capacity), so each (protection, dtype) configuration compiles its step once.

Every trial starts from the same warmed-up state (the warm-up is clean and deterministic, so it
is computed once per configuration) and is independent of every other trial: results are
appended to a JSON-lines file, one flushed line per trial, and an interrupted campaign resumes
from it without redoing or losing trials.

Reports (markdown + JSON + PNG): error propagation inside one attention block (unprotected),
harm (unprotected), detection/correction per site x kind (ABFT), false positives over many
clean checked GEMMs per dtype, and recovery cost (quoted from ``runs/bench_recovery.json``).

Example:
  >>> result = run_campaign(CampaignConfig(out=Path("runs/campaign")))
  >>> result["summary"]["abft"]["detection_rate"]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from sdcguard import inject, linen
from sdcguard.abft import NUM_COUNTERS, ABFTConfig
from sdcguard.inject import Fault, FaultPlan
from sdcguard.models import ByteBatches, GPTConfig
from sdcguard.sites import (
    ATTENTION_SITES,
    FAULT_KINDS,
    GEMM_SITES,
    attention_site_names,
    split_site,
)
from sdcguard.training import UNCHECKED, TrainConfig, TrainState, make_train_step

PROTECTIONS = ("off", "abft", "abft+guard")
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
# Exponent bits (counted from the least significant bit) of each dtype's bit pattern: the
# "high-exponent" flips of the targets, and the default bit range of `bitflip`.
EXPONENT_BITS = {"fp32": (23, 30), "bf16": (7, 14)}
DEFAULT_KINDS = ("inf", "-inf", "nan", "near_inf", "bitflip")
CLASSES = ("harmless", "loss_spike", "non_trainable")
RESULTS_FILE = "trials.jsonl"
FORMAT_VERSION = 1


class CampaignFileError(ValueError):
    """The results file is corrupt beyond a partially written last line."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CampaignConfig:
    """A fault-injection campaign on the reference GPT.

    Attributes:
      model: size of the GPT (its ``dtype`` is replaced by ``dtype`` below).
      batch_size: sequences per batch.
      learning_rate: Adam learning rate.
      sites: full site names to inject into; empty means every attention site (forward and
        backward) of every layer.
      kinds: fault kinds (see :data:`sdcguard.sites.FAULT_KINDS`).
      bit_range: inclusive ``(lo, hi)`` bits for ``bitflip``; None means the dtype's exponent
        bits (the high-exponent flips that matter).
      value: the value set by ``value`` faults and the factor of ``scale`` faults.
      trials: trials per (site, kind) cell; each draws its element (and bit) from its seed.
      seed: seed of parameters, data and trial draws.
      dtype: computation dtype of the trials, ``fp32`` or ``bf16``.
      protections: protection levels to run, each one configuration (one compilation):
        ``off`` (injection points, no checks), ``abft``, ``abft+guard`` (ABFT and the Optax
        update guard, fed the loss and ABFT's uncorrectable count).
      warmup: clean steps before the fault (the fault fires at step ``warmup``).
      steps_after: steps trained after the fault step.
      spike_rel: relative loss excess over the clean run that counts as a loss spike.
      fp_steps: clean protected steps per dtype of the false-positive measurement (0: skip).
      fp_dtypes: dtypes of the false-positive measurement.
      propagation_trials: faults per (forward site, kind) of the propagation study (0: skip).
      out: output directory (results file, summary, figures).
    """

    model: GPTConfig = GPTConfig()
    batch_size: int = 8
    learning_rate: float = 3e-3
    sites: tuple[str, ...] = ()
    kinds: tuple[str, ...] = DEFAULT_KINDS
    bit_range: tuple[int, int] | None = None
    value: float = 1e4
    trials: int = 2
    seed: int = 0
    dtype: str = "fp32"
    protections: tuple[str, ...] = PROTECTIONS
    warmup: int = 3
    steps_after: int = 4
    spike_rel: float = 0.05
    fp_steps: int = 300
    fp_dtypes: tuple[str, ...] = ("fp32", "bf16")
    propagation_trials: int = 4
    out: Path = Path("runs/campaign")

    def __post_init__(self):
        for name in ("sites", "kinds", "protections", "fp_dtypes"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "out", Path(self.out))
        if self.bit_range is not None:
            lo, hi = (int(b) for b in self.bit_range)
            if not 0 <= lo <= hi < 64:
                raise ValueError(f"bit_range must satisfy 0 <= lo <= hi < 64, got {lo, hi}")
            object.__setattr__(self, "bit_range", (lo, hi))
        for site in self.sites:
            split_site(site)
        bad = set(self.kinds) - set(FAULT_KINDS)
        if bad or not self.kinds:
            raise ValueError(f"unknown fault kinds {sorted(bad)}; valid: {list(FAULT_KINDS)}")
        bad = set(self.protections) - set(PROTECTIONS)
        if bad or not self.protections:
            raise ValueError(f"unknown protections {sorted(bad)}; valid: {list(PROTECTIONS)}")
        for d in (self.dtype, *self.fp_dtypes):
            if d not in DTYPES:
                raise ValueError(f"dtype must be one of {list(DTYPES)}, got {d!r}")
        for name in ("trials", "steps_after", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup", "fp_steps", "propagation_trials"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.spike_rel > 0:
            raise ValueError(f"spike_rel must be > 0, got {self.spike_rel}")

    def model_config(self, dtype: str | None = None) -> GPTConfig:
        return dataclasses.replace(self.model, dtype=DTYPES[dtype or self.dtype])

    def site_list(self) -> list[str]:
        if self.sites:
            return list(self.sites)
        return [
            s
            for i in range(self.model.num_layers)
            for s in attention_site_names(f"decoder/block_{i}/attn")
        ]

    def bits(self) -> tuple[int, int]:
        return self.bit_range or EXPONENT_BITS[self.dtype]

    def trial_hash(self, protection: str) -> str:
        """Hash of everything that determines a trial's outcome (not the grid's extent)."""
        key = {
            "version": FORMAT_VERSION,
            "model": dataclasses.asdict(self.model_config()),
            "batch_size": self.batch_size,
            "learning_rate": self.learning_rate,
            "bits": self.bits(),
            "value": self.value,
            "seed": self.seed,
            "protection": protection,
            "warmup": self.warmup,
            "steps_after": self.steps_after,
            "spike_rel": self.spike_rel,
        }
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


# --- The training step of one configuration ----------------------------------------------------


def _abft_config(protection: str) -> ABFTConfig:
    return UNCHECKED if protection == "off" else ABFTConfig()


def make_step(
    model_config: GPTConfig,
    protection: str,
    *,
    learning_rate: float,
    seed: int,
) -> tuple[TrainState, Callable]:
    """Initial state and the jitted :func:`sdcguard.training.make_train_step` of one
    configuration; with ``abft+guard`` the optimizer is wrapped in the update guard (the step
    passes it the loss and ABFT's uncorrectable count)."""
    optimizer = optax.adam(learning_rate)
    if protection == "abft+guard":
        from sdcguard.optim import refuse_corrupted

        optimizer = refuse_corrupted(optimizer)
    train = TrainConfig(
        model=model_config,
        learning_rate=learning_rate,
        seed=seed,
        abft=_abft_config(protection),
    )
    return make_train_step(train, optimizer)


def _all_finite(tree) -> bool:
    return all(bool(np.all(np.isfinite(x))) for x in jax.tree_util.tree_leaves(tree))


# --- Trials ------------------------------------------------------------------------------------


def _trial_seed(seed: int, site: str, kind: str, trial: int) -> int:
    return zlib.crc32(f"{seed}|{site}|{kind}|{trial}".encode()) & 0x7FFFFFFF


def make_fault(config: CampaignConfig, site: str, kind: str, trial: int) -> Fault:
    """The fault of one trial: a random element (from the trial seed) of ``site`` at the fault
    step; ``bitflip`` draws its bit from the bit range with the same seed."""
    tseed = _trial_seed(config.seed, site, kind, trial)
    lo, hi = config.bits()
    bit = lo + tseed % (hi - lo + 1) if kind == "bitflip" else 0
    value = config.value if kind in ("value", "scale") else 0.0
    return Fault(site=site, kind=kind, seed=tseed, step=config.warmup, bit=bit, value=value)


def _site_counter(site: str, sdc, sink_grads) -> list[int]:
    counts = linen.site_counts(sdc)
    counts.update(linen.backward_site_counts(sink_grads))
    return [int(c) for c in counts.get(site, np.zeros(NUM_COUNTERS))]


def classify(
    losses: Sequence[float], clean: Sequence[float], final_params_finite: bool, spike_rel: float
) -> tuple[str, float]:
    """Class of a trial and its largest relative loss excess over the clean run.

    ``non_trainable``: the parameters or the final loss are non-finite (training cannot go on);
    ``loss_spike``: a non-finite loss that training recovered from, or a loss above the clean
    run's by more than ``spike_rel`` (relative) at any step after the fault;
    ``harmless``: neither.
    """
    losses, clean = np.asarray(losses, float), np.asarray(clean, float)
    with np.errstate(invalid="ignore", over="ignore"):
        excess = (losses - clean) / np.abs(clean)
    finite = np.isfinite(losses)
    max_excess = float(np.max(np.where(finite, excess, np.inf)))
    if not final_params_finite or not finite[-1]:
        return "non_trainable", max_excess
    if not finite.all() or max_excess > spike_rel:
        return "loss_spike", max_excess
    return "harmless", max_excess


class _Runner:
    """One configuration (protection, dtype): its compiled step, warm state and clean run."""

    def __init__(self, config: CampaignConfig, protection: str):
        self.config = config
        self.protection = protection
        model = config.model_config()
        self.state, self.step = make_step(
            model,
            protection,
            learning_rate=config.learning_rate,
            seed=config.seed,
        )
        data = ByteBatches(batch_size=config.batch_size, seq_len=model.seq_len, seed=config.seed)
        n = config.warmup + config.steps_after + 1
        self.batches = [jnp.asarray(data.batch(i)) for i in range(n)]
        # Capacity 1 for every plan, the empty one included: one compilation for all trials.
        self.no_fault = FaultPlan.from_faults([], capacity=1)
        for i in range(config.warmup):
            self.state, _ = self.step(self.state, self.batches[i], self.no_fault)
        losses, _, _, self.clean_params = self._run(self.no_fault)
        self.clean_losses = losses

    def _run(self, plan: FaultPlan):
        state, first = self.state, None
        losses = []
        for i in range(self.config.warmup, len(self.batches)):
            state, out = self.step(state, self.batches[i], plan)
            losses.append(out.loss)
            if first is None:
                first = (out.counts, out.sdc, out.sink_grads)
        losses = [float(x) for x in jax.device_get(losses)]
        return losses, first, _all_finite(state.params), state.params

    def trial(self, site: str, kind: str, trial: int) -> dict[str, Any]:
        fault = make_fault(self.config, site, kind, trial)
        t0 = time.perf_counter()
        losses, (counts, sdc, sg), params_finite, params = self._run(
            FaultPlan.from_faults([fault], capacity=1)
        )
        site_c = _site_counter(site, sdc, sg)
        cls, excess = classify(losses, self.clean_losses, params_finite, self.config.spike_rel)
        drift = _rel_l2(params, self.clean_params)
        return {
            "key": trial_key(self.config.trial_hash(self.protection), site, kind, trial),
            "config_hash": self.config.trial_hash(self.protection),
            "protection": self.protection,
            "dtype": self.config.dtype,
            "site": site,
            "kind": kind,
            "trial": trial,
            "direction": "backward" if ".grad_" in site else "forward",
            "seed": fault.seed,
            "bit": fault.bit if kind == "bitflip" else None,
            "fault_step": self.config.warmup,
            "site_counts": site_c,  # detected, corrected, uncorrectable at the fault site
            "total_counts": [int(c) for c in np.asarray(counts)],
            "detected": site_c[0] > 0,
            "corrected": site_c[0] > 0 and site_c[1] >= site_c[0] and site_c[2] == 0,
            "uncorrectable": site_c[2] > 0 or int(np.asarray(counts)[2]) > 0,
            "loss_fault": _num(losses[0]),
            "clean_loss_fault": _num(self.clean_losses[0]),
            "loss_after": _num(losses[-1]),
            "clean_loss_after": _num(self.clean_losses[-1]),
            "max_rel_loss_excess": _num(excess),
            "nonfinite_loss": not all(math.isfinite(x) for x in losses),
            "nonfinite_params": not params_finite,
            "param_drift": _num(drift),
            "class": cls,
            "seconds": round(time.perf_counter() - t0, 4),
        }


# Compiled configurations of this process, by trial hash: a resumed or repeated campaign in the
# same process (tests, notebooks) does not compile again. Each holds one small model.
_RUNNERS: dict[str, _Runner] = {}


def _runner(config: CampaignConfig, protection: str) -> _Runner:
    key = config.trial_hash(protection) + f"|{config.batch_size}"
    if key not in _RUNNERS:
        _RUNNERS[key] = _Runner(config, protection)
    return _RUNNERS[key]


def _rel_l2(a, b) -> float:
    da = jax.tree_util.tree_leaves(jax.tree_util.tree_map(lambda x, y: x - y, a, b))
    num = float(np.sqrt(sum(float(jnp.sum(jnp.square(x.astype(jnp.float32)))) for x in da)))
    den = float(optax.tree.norm(b))
    return num / den if den else num


def _num(x: float) -> float | str:
    """JSON has no NaN/Inf: non-finite numbers are written as strings."""
    return x if math.isfinite(x) else str(x)


def trial_key(config_hash: str, site: str, kind: str, trial: int) -> str:
    """The identity of a trial in the results file."""
    return f"{config_hash}|{site}|{kind}|{trial}"


# --- The results file: append-only JSON lines --------------------------------------------------

_REQUIRED = ("key", "config_hash", "protection", "site", "kind", "trial", "class")


def load_results(path: Path, console: Console | None = None) -> dict[str, dict]:
    """Reads finished trials from ``path``, keyed by trial key.

    A partially written last line (an interrupted append) is reported and cut off the file, so
    the next append starts on a clean line; it is never half-read. A corrupt line anywhere else
    means the file was damaged or edited, and raises :class:`CampaignFileError`.
    """
    if not path.exists():
        return {}
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    # A complete file ends with "\n", leaving an empty last element.
    results: dict[str, dict] = {}
    offset = 0
    for i, line in enumerate(lines):
        last = i == len(lines) - 1
        if not line.strip():
            offset += len(line) + 1
            continue
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict) or any(k not in rec for k in _REQUIRED):
                raise ValueError("missing fields")
            if last:
                raise ValueError("no trailing newline: the write was interrupted")
        except (ValueError, UnicodeDecodeError) as err:
            remaining = [ln for ln in lines[i + 1 :] if ln.strip()]
            if remaining:
                raise CampaignFileError(
                    f"{path}: line {i + 1} is corrupt ({err}) and is not the last line; the "
                    "file was damaged or edited. Move it aside to start over."
                ) from None
            if console is not None:
                console.print(
                    f"[yellow]{path}: line {i + 1} is a partial write ({err}); ignoring it and "
                    "truncating the file there. That trial will be rerun.[/yellow]"
                )
            with open(path, "r+b") as f:
                f.truncate(offset)
            break
        results[rec["key"]] = rec
        offset += len(line) + 1
    return results


def append_result(f, record: dict) -> None:
    """Appends one trial as one line and makes it durable before the next trial starts."""
    f.write(json.dumps(record, sort_keys=True) + "\n")
    f.flush()
    os.fsync(f.fileno())


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


def _block_forward(x, w, plan, prefix, heads):
    """One pre-LN attention block, residual and MLP, with injection at every attention site
    (the arithmetic of Flax's attention layer and :func:`protected_attention`)."""

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
    mask = jnp.tril(jnp.ones((length, length), bool))
    masked = jnp.where(mask, t["scores"], jnp.finfo(x.dtype).min)
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
    prefix = "decoder/block_0/attn"
    fwd = jax.jit(lambda x, plan: _block_forward(x, w, plan, prefix, heads))
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


def false_positives(config: CampaignConfig, dtype: str, steps: int) -> dict[str, Any]:
    """Alarms over ``steps`` clean ABFT-checked training steps in ``dtype``.

    A checked GEMM is one checked einsum call (one site, one step, forward or backward); the
    batch x head matrices inside one call are counted separately in ``checked_matrices``.
    """
    m = config.model_config(dtype)
    # The campaign's own compiled ABFT step when the dtype matches (no extra compilation).
    runner = _runner(dataclasses.replace(config, dtype=dtype), "abft")
    state, step = runner.state, runner.step
    data = ByteBatches(batch_size=config.batch_size, seq_len=m.seq_len, seed=config.seed + 1)
    plan = FaultPlan.from_faults([], capacity=1)
    alarms = []
    t0 = time.perf_counter()
    for i in range(steps):
        state, out = step(state, jnp.asarray(data.batch(i)), plan)
        alarms.append(out.counts)
    alarms = np.asarray(jax.device_get(alarms)).reshape(-1, NUM_COUNTERS)
    # Per layer and step: 6 forward GEMMs, 12 backward GEMMs; softmax rows are checked apart.
    gemms_per_step = m.num_layers * 3 * len(GEMM_SITES)
    b, length, h, hd = config.batch_size, m.seq_len, m.num_heads, m.d_model // m.num_heads
    del hd
    # scores and context (and their 4 gradient GEMMs) are b*h matrices each; projections are 1.
    matrices_per_step = m.num_layers * (3 * 4 + 3 * 2 * b * h)
    return {
        "dtype": dtype,
        "steps": steps,
        "checked_gemms": steps * gemms_per_step,
        "checked_matrices": steps * matrices_per_step,
        "softmax_checks": steps * m.num_layers * b * h * length,
        "alarm_steps": int((alarms[:, 0] > 0).sum()),
        "alarms": int(alarms[:, 0].sum()),
        "seconds": round(time.perf_counter() - t0, 2),
    }


# --- Summary ------------------------------------------------------------------------------------


def _rate(xs: Sequence[bool]) -> float | None:
    return float(np.mean(xs)) if len(xs) else None


def summarize(records: Sequence[dict]) -> dict[str, Any]:
    """Per protection: class fractions, detection/correction rates overall, per site x kind and
    per kind, and the uncorrectable trials."""
    out: dict[str, Any] = {}
    for prot in PROTECTIONS:
        recs = [r for r in records if r["protection"] == prot]
        if not recs:
            continue
        cells: dict[str, dict[str, Any]] = {}
        for r in recs:
            cells.setdefault(f"{r['site']}|{r['kind']}", []).append(r)
        per_cell = {
            k: {
                "n": len(v),
                "detected": _rate([r["detected"] for r in v]),
                "corrected": _rate([r["corrected"] for r in v]),
                **{c: _rate([r["class"] == c for r in v]) for c in CLASSES},
            }
            for k, v in sorted(cells.items())
        }
        per_kind = {}
        for kind in sorted({r["kind"] for r in recs}):
            v = [r for r in recs if r["kind"] == kind]
            per_kind[kind] = {
                "n": len(v),
                "detected": _rate([r["detected"] for r in v]),
                "corrected": _rate([r["corrected"] for r in v]),
                **{c: _rate([r["class"] == c for r in v]) for c in CLASSES},
            }
        out[prot] = {
            "trials": len(recs),
            "classes": {c: _rate([r["class"] == c for r in recs]) for c in CLASSES},
            "detection_rate": _rate([r["detected"] for r in recs]),
            "correction_rate": _rate([r["corrected"] for r in recs]),
            "per_kind": per_kind,
            "per_cell": per_cell,
            "uncorrectable": [r["key"] for r in recs if r["uncorrectable"]],
        }
        # The same (site, kind, trial) is the same fault under every protection: pair each
        # protected trial with its unprotected twin to tell missed harm from missed noise.
        twins = {(r["site"], r["kind"], r["trial"]): r for r in records if r["protection"] == "off"}
        if prot != "off" and twins:
            paired = [(r, twins.get((r["site"], r["kind"], r["trial"]))) for r in recs]
            harmful = [r for r, t in paired if t is not None and t["class"] != "harmless"]
            out[prot]["detection_rate_harmful"] = _rate([r["detected"] for r in harmful])
            out[prot]["harmful_trials"] = len(harmful)
            out[prot]["missed"] = [
                {
                    "key": r["key"],
                    "bit": r["bit"],
                    "unprotected_class": t["class"] if t else None,
                    "unprotected_param_drift": t["param_drift"] if t else None,
                }
                for r, t in paired
                if not r["detected"]
            ]
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _recovery_text(path: Path) -> list[str]:
    if not path.exists():
        return [f"Not measured: {path} is absent (run scripts/bench_recovery.py)."]
    try:
        d = json.loads(path.read_text())
        rec, ratio = d["recovery_s"], d["ratio_to_abft"]
    except (ValueError, KeyError, TypeError) as err:
        return [f"Not usable: {path} could not be read ({err})."]
    lines = [
        f"From `{path}` (recovery benchmark):",
        "",
        "| recovery | seconds | x ABFT |",
        "|---|---:|---:|",
    ]
    for k, v in rec.items():
        lines.append(f"| {k} | {v:.4f} | {ratio.get(k, float('nan')):.1f} |")
    return lines


def _model_text(m: dict) -> str:
    return (
        f"{m['num_layers']} layers, d_model {m['d_model']}, {m['num_heads']} heads, "
        f"seq_len {m['seq_len']}"
    )


def markdown(result: dict) -> str:
    """The human-readable report."""
    cfg, summ = result["config"], result["summary"]
    lines = [
        "# sdcguard fault-injection campaign",
        "",
        f"Reference GPT {_model_text(cfg['model'])}, dtype {cfg['dtype']}, batch "
        f"{cfg['batch_size']}, fault at step {cfg['warmup']}, then {cfg['steps_after']} "
        f"steps; {cfg['trials']} trials per cell; bitflip bits {result['bits']}. "
        f"Command: `{result['command']}`.",
        "",
        "## 1. Propagation (unprotected, one block)",
        "",
    ]
    prop = result.get("propagation") or {}
    if prop:
        lines += [
            "Error pattern (count of faults) in each downstream tensor: 0D one element, 1D one "
            "row or column of one matrix, 2D more; none: the fault was erased (e.g. a causally "
            "masked score). Per-head tensors count as one [length, heads*dim] matrix.",
            "",
        ]
        lines += [
            "| fault site | " + " | ".join(PROPAGATION_TENSORS) + " |",
            "|---" * (len(PROPAGATION_TENSORS) + 1) + "|",
        ]
        for site, tally in prop.items():
            row = []
            for t in PROPAGATION_TENSORS:
                c = tally.get(t)
                if not c:
                    row.append("")
                    continue
                row.append(", ".join(f"{p} {n}" for p, n in sorted(c.items())))
            lines.append(f"| {site.rsplit(':', 1)[1]} | " + " | ".join(row) + " |")
    else:
        lines.append("Not run.")
    lines += ["", "## 2-3. Harm and protection per fault kind", ""]
    lines += [
        "| protection | kind | trials | harmless | loss spike | non-trainable | detected "
        "| corrected |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for prot, s in summ.items():
        for kind, k in s["per_kind"].items():
            lines.append(
                f"| {prot} | {kind} | {k['n']} | {_pct(k['harmless'])} | "
                f"{_pct(k['loss_spike'])} | {_pct(k['non_trainable'])} | {_pct(k['detected'])} "
                f"| {_pct(k['corrected'])} |"
            )
        lines.append(
            f"| **{prot}** | **all** | {s['trials']} | {_pct(s['classes']['harmless'])} | "
            f"{_pct(s['classes']['loss_spike'])} | {_pct(s['classes']['non_trainable'])} | "
            f"{_pct(s['detection_rate'])} | {_pct(s['correction_rate'])} |"
        )
    for prot, s in summ.items():
        if prot == "off":
            continue
        missed = [
            k for k, c in s["per_cell"].items() if c["detected"] is not None and c["detected"] < 1
        ]
        lines += ["", f"### {prot}: cells below 100% detection ({len(missed)})", ""]
        lines += [
            f"- {k}: detected {_pct(s['per_cell'][k]['detected'])}, corrected "
            f"{_pct(s['per_cell'][k]['corrected'])}"
            for k in missed
        ] or ["- none"]
        if "missed" in s:
            lines += [
                "",
                f"Detection of the faults that harmed the unprotected run: "
                f"{_pct(s['detection_rate_harmful'])} of {s['harmful_trials']}. Undetected "
                "faults and what the same fault did without protection:",
                "",
            ]
            lines += [
                f"- `{m['key'].split('|', 1)[1]}` bit {m['bit']}: unprotected "
                f"{m['unprotected_class']}, parameter drift {m['unprotected_param_drift']}"
                for m in s["missed"][:50]
            ] or ["- none"]
        lines += ["", f"Uncorrectable trials: {len(s['uncorrectable'])}"]
        lines += [f"- `{k}`" for k in s["uncorrectable"][:50]]
    lines += ["", "## 4. False positives (clean ABFT-checked training)", ""]
    fps = result.get("false_positives") or []
    if fps:
        lines += [
            "| dtype | steps | checked GEMMs | checked matrices | alarms |",
            "|---|---:|---:|---:|---:|",
        ]
        for fp in fps:
            lines.append(
                f"| {fp['dtype']} | {fp['steps']} | {fp['checked_gemms']} | "
                f"{fp['checked_matrices']} | {fp['alarms']} |"
            )
        lines += [
            "",
            "A checked GEMM is one checked einsum call (a site in one step, forward or "
            "backward); checked matrices count each batch x head matrix of the attention "
            "GEMMs separately.",
        ]
    else:
        lines.append("Not run.")
    lines += ["", "## 5. Recovery cost", "", *_recovery_text(Path(result["recovery_file"]))]
    lines += ["", f"Wall time: {result['seconds']:.0f} s.", ""]
    return "\n".join(lines)


def plot(result: dict, out: Path) -> list[Path]:
    """Harm per site (unprotected) and detection per site x kind (ABFT) as PNGs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    summ = result["summary"]
    if "off" in summ:
        cells = summ["off"]["per_cell"]
        sites = sorted({k.split("|")[0] for k in cells})
        frac = {c: [] for c in CLASSES}
        for s in sites:
            v = [c for k, c in cells.items() if k.split("|")[0] == s]
            for c in CLASSES:
                frac[c].append(np.mean([x[c] for x in v]))
        fig, ax = plt.subplots(figsize=(10, max(4, 0.25 * len(sites))))
        left = np.zeros(len(sites))
        for c, color in zip(CLASSES, ("tab:green", "tab:orange", "tab:red"), strict=True):
            ax.barh(range(len(sites)), frac[c], left=left, color=color, label=c)
            left += np.asarray(frac[c])
        ax.set_yticks(range(len(sites)), [s.replace("decoder/", "") for s in sites], fontsize=7)
        ax.set_xlabel("fraction of trials")
        ax.set_title("Harm of one fault, unprotected")
        ax.legend(loc="lower right")
        fig.tight_layout()
        written.append(out / "harm.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    for prot in ("abft", "abft+guard"):
        if prot not in summ:
            continue
        cells = summ[prot]["per_cell"]
        sites = sorted({k.split("|")[0] for k in cells})
        kinds = sorted({k.split("|")[1] for k in cells})
        grid = np.full((len(sites), len(kinds)), np.nan)
        for k, c in cells.items():
            s, kd = k.split("|")
            grid[sites.index(s), kinds.index(kd)] = c["corrected"]
        fig, ax = plt.subplots(figsize=(6, max(4, 0.25 * len(sites))))
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(kinds)), kinds)
        ax.set_yticks(range(len(sites)), [s.replace("decoder/", "") for s in sites], fontsize=7)
        ax.set_title(f"Correction rate per site x kind ({prot})")
        fig.colorbar(im)
        fig.tight_layout()
        name = "correction_" + prot.replace("+", "_") + ".png"
        written.append(out / name)
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written


# --- The campaign -------------------------------------------------------------------------------


def grid(config: CampaignConfig) -> Iterator[tuple[str, str, str, int]]:
    """Every trial of the campaign: (protection, site, kind, trial)."""
    for prot in config.protections:
        for site in config.site_list():
            for kind in config.kinds:
                for trial in range(config.trials):
                    yield prot, site, kind, trial


def run_campaign(
    config: CampaignConfig,
    console: Console | None = None,
    *,
    max_trials: int | None = None,
    command: str = "",
    recovery_file: Path = Path("runs/bench_recovery.json"),
) -> dict[str, Any]:
    """Runs (or resumes) the campaign and writes its outputs into ``config.out``.

    Args:
      config: the campaign.
      console: where progress and messages go.
      max_trials: stop after running this many new trials (to split a campaign, or to test
        resumption); the reports then cover the trials finished so far.
      command: the command line, quoted in the report.
      recovery_file: the recovery benchmark's JSON, quoted in the report.

    Returns:
      The result dict also written to ``campaign.json``.
    """
    console = console or Console()
    t_start = time.perf_counter()
    config.out.mkdir(parents=True, exist_ok=True)
    path = config.out / RESULTS_FILE
    done = load_results(path, console)
    todo = [
        t for t in grid(config) if trial_key(config.trial_hash(t[0]), t[1], t[2], t[3]) not in done
    ]
    total = sum(1 for _ in grid(config))
    if done:
        console.print(f"resuming: {total - len(todo)} of {total} trials already in {path}")
    if max_trials is not None:
        todo = todo[:max_trials]
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=True) as progress, open(path, "a") as f:
        task = progress.add_task("trials", total=total, completed=total - len(todo))
        runner = None
        for prot, site, kind, trial in todo:
            if runner is None or runner.protection != prot:
                progress.update(task, description=f"compiling {prot}")
                runner = _runner(config, prot)
            progress.update(task, description=f"{prot:10s} {kind:8s}")
            rec = runner.trial(site, kind, trial)
            append_result(f, rec)
            done[rec["key"]] = rec
            progress.advance(task)
        prop, fps = None, []
        if max_trials is None:
            if config.propagation_trials:
                progress.update(task, description="propagation")
                prop = propagation(config)
            for dt in config.fp_dtypes if config.fp_steps else ():
                progress.update(task, description=f"false positives {dt}")
                fps.append(false_positives(config, dt, config.fp_steps))
    hashes = {config.trial_hash(p) for p in config.protections}
    records = [r for r in done.values() if r["config_hash"] in hashes]
    result = {
        "version": FORMAT_VERSION,
        "config": {**_jsonable(config), "model": dataclasses.asdict(config.model_config())},
        "bits": list(config.bits()),
        "command": command or "sdcguard.campaign.run_campaign(...)",
        "trials_total": total,
        "trials_done": len(records),
        "summary": summarize(records),
        "propagation": prop,
        "false_positives": fps,
        "recovery_file": str(recovery_file),
        "seconds": time.perf_counter() - t_start,
        "environment": {"jax": jax.__version__, "backend": jax.default_backend()},
    }
    (config.out / "campaign.json").write_text(json.dumps(result, indent=1))
    (config.out / "summary.md").write_text(markdown(result))
    result["figures"] = [str(p) for p in plot(result, config.out)]
    return result


def _jsonable(config: CampaignConfig) -> dict:
    d = dataclasses.asdict(config)
    d["out"] = str(config.out)
    return d


def _print(result: dict, console: Console) -> None:
    table = Table(title="Fault campaign: one fault per trial")
    for col in (
        "protection",
        "trials",
        "harmless",
        "loss spike",
        "non-trainable",
        "detected",
        "corrected",
        "uncorrectable",
    ):
        table.add_column(col, justify="right")
    for prot, s in result["summary"].items():
        table.add_row(
            prot,
            str(s["trials"]),
            _pct(s["classes"]["harmless"]),
            _pct(s["classes"]["loss_spike"]),
            _pct(s["classes"]["non_trainable"]),
            _pct(s["detection_rate"]),
            _pct(s["correction_rate"]),
            str(len(s["uncorrectable"])),
        )
    console.print(table)
    for fp in result["false_positives"]:
        console.print(
            f"false positives {fp['dtype']}: {fp['alarms']} alarms in "
            f"{fp['checked_gemms']} checked GEMMs ({fp['checked_matrices']} matrices)"
        )


def register(subparsers) -> None:
    p = subparsers.add_parser("campaign", help="fault-injection campaign with/without protection")
    d = CampaignConfig()
    p.add_argument("--out", type=Path, default=d.out)
    p.add_argument("--layers", type=int, default=d.model.num_layers)
    p.add_argument("--d-model", type=int, default=d.model.d_model)
    p.add_argument("--heads", type=int, default=d.model.num_heads)
    p.add_argument("--seq-len", type=int, default=d.model.seq_len)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument(
        "--sites",
        nargs="*",
        default=[],
        help="full site names; default: every attention site, fwd and bwd",
    )
    p.add_argument("--kinds", nargs="+", default=list(d.kinds), choices=FAULT_KINDS)
    p.add_argument(
        "--bits",
        type=int,
        nargs=2,
        metavar=("LO", "HI"),
        default=None,
        help="bitflip bit range (inclusive); default: the dtype's exponent bits",
    )
    p.add_argument("--value", type=float, default=d.value)
    p.add_argument("--trials", type=int, default=d.trials)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--dtype", choices=tuple(DTYPES), default=d.dtype)
    p.add_argument("--protection", nargs="+", choices=PROTECTIONS, default=list(d.protections))
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--steps-after", type=int, default=d.steps_after)
    p.add_argument("--fp-steps", type=int, default=d.fp_steps)
    p.add_argument("--fp-dtypes", nargs="*", choices=tuple(DTYPES), default=list(d.fp_dtypes))
    p.add_argument("--propagation-trials", type=int, default=d.propagation_trials)
    p.add_argument(
        "--max-trials",
        type=int,
        default=None,
        help="stop after this many new trials (resume later with the same command)",
    )
    p.set_defaults(handler=_main)


def config_from_args(args: argparse.Namespace) -> CampaignConfig:
    model = dataclasses.replace(
        GPTConfig(),
        num_layers=args.layers,
        d_model=args.d_model,
        num_heads=args.heads,
        seq_len=args.seq_len,
    )
    return CampaignConfig(
        model=model,
        batch_size=args.batch_size,
        sites=tuple(args.sites),
        kinds=tuple(args.kinds),
        bit_range=tuple(args.bits) if args.bits else None,
        value=args.value,
        trials=args.trials,
        seed=args.seed,
        dtype=args.dtype,
        protections=tuple(args.protection),
        warmup=args.warmup,
        steps_after=args.steps_after,
        fp_steps=args.fp_steps,
        fp_dtypes=tuple(args.fp_dtypes),
        propagation_trials=args.propagation_trials,
        out=args.out,
    )


def _main(args: argparse.Namespace) -> int:
    import shlex
    import sys

    console = Console()
    try:
        config = config_from_args(args)
        result = run_campaign(
            config,
            console,
            max_trials=args.max_trials,
            command=shlex.join(["sdcguard", *sys.argv[1:]]),
        )
    except (ValueError, CampaignFileError) as err:
        console.print(f"[red]error:[/red] {err}")
        return 2
    _print(result, console)
    console.print(
        f"wrote {config.out / 'summary.md'}, campaign.json, {RESULTS_FILE} and "
        f"{len(result['figures'])} figures"
    )
    return 0
