"""One configuration's compiled step, the trials run with it, and the results file."""

from __future__ import annotations

import json
import math
import os
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sdcguard import fault_model as inject
from sdcguard.campaign._config import CampaignConfig, CampaignFileError
from sdcguard.fault_model import Fault, FaultPlan, is_output_site, site_class
from sdcguard.models import ByteBatches, GPTConfig
from sdcguard.protection import ABFTConfig, Counts, linen
from sdcguard.training import UNCHECKED, UNCHECKED_GEMMS, TrainConfig, TrainState, make_train_step

if TYPE_CHECKING:
    from rich.console import Console

# --- The training step of one configuration ----------------------------------------------------


def abft_config(protection: str, coverage: str) -> ABFTConfig:
    """The checks of a protection level: none for ``off`` (injection points only), else all."""
    if protection == "off":
        return UNCHECKED_GEMMS if coverage == "every_gemm" else UNCHECKED
    return ABFTConfig()


def make_step(
    model_config: GPTConfig,
    protection: str,
    *,
    learning_rate: float,
    seed: int,
    model_kind: str = "gpt",
    coverage: str = "attention",
    output_sites: Sequence[str] = (),
    hit_log: inject.HitLog | None = None,
) -> tuple[TrainState, Callable]:
    """Initial state and the jitted :func:`sdcguard.training.make_train_step` of one
    configuration; with ``abft+guard`` the optimizer is wrapped in the update guard (the step
    passes it the loss and ABFT's uncorrectable count), with ``abft-recompute`` a step with a
    detection is recomputed under in-place repair. ``coverage`` is the attention layers or
    every GEMM of the step (:class:`sdcguard.training.TrainConfig`). ``output_sites`` are the
    module outputs
    armed for injection; ``hit_log`` receives every fault that fires."""
    optimizer = optax.adam(learning_rate)
    if protection == "abft+guard":
        from sdcguard.guard import refuse_corrupted

        optimizer = refuse_corrupted(optimizer)
    train = TrainConfig(
        model=model_config,
        learning_rate=learning_rate,
        seed=seed,
        abft=abft_config(protection, coverage),
        model_kind=model_kind,
        coverage=coverage,
        output_sites=tuple(output_sites),
        repair="recompute" if protection == "abft-recompute" else "in_place",
    )
    return make_train_step(train, optimizer, hit_log=hit_log)


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


def _site_counter(site: str, sdc, sink_grads, coverage: str) -> list[int]:
    if coverage == "every_gemm":
        counts = dict(sdc)  # the report of sdcguard.checked: site -> counters
    else:
        counts = linen.site_counts(sdc)
        counts.update(linen.backward_site_counts(sink_grads))
    return [int(c) for c in counts.get(site, Counts.zeros())]


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
        self.hits = inject.HitLog()
        self.state, self.step = make_step(
            model,
            protection,
            learning_rate=config.learning_rate,
            seed=config.seed,
            model_kind=config.model_kind,
            coverage=config.coverage,
            output_sites=config.output_sites(),
            hit_log=self.hits,
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

    def _injected(self, site: str) -> dict[str, Any]:
        """What the fault did at its site in the fault step: the element, its old and new
        value and |new - old| (None when the fault did not fire)."""
        hits = [h for h in self.hits.take() if h.site == site and h.step == self.config.warmup]
        if not hits:
            return {"index": None, "old_value": None, "new_value": None, "abs_delta": None}
        h = hits[0]
        with np.errstate(invalid="ignore", over="ignore"):
            delta = abs(np.float64(h.new) - np.float64(h.old))
        return {
            "index": h.index,
            "old_value": _num(h.old),
            "new_value": _num(h.new),
            "abs_delta": _num(float(delta)),
        }

    def trial(self, site: str, kind: str, trial: int) -> dict[str, Any]:
        fault = make_fault(self.config, site, kind, trial)
        t0 = time.perf_counter()
        self.hits.take()  # forget the hits of earlier runs
        losses, (counts, sdc, sg), params_finite, params = self._run(
            FaultPlan.from_faults([fault], capacity=1)
        )
        injected = self._injected(site)
        site_c = _site_counter(site, sdc, sg, self.config.coverage)
        cls, excess = classify(losses, self.clean_losses, params_finite, self.config.spike_rel)
        drift = _rel_l2(params, self.clean_params)
        return {
            "key": trial_key(self.config.trial_hash(self.protection), site, kind, trial),
            "config_hash": self.config.trial_hash(self.protection),
            "protection": self.protection,
            "model_kind": self.config.model_kind,
            "dtype": self.config.dtype,
            "site": site,
            "kind": kind,
            "trial": trial,
            "direction": "backward" if ".grad_" in site else "forward",
            # A GEMM site of the coverage ("attention" layers or "gemm": every GEMM), or a
            # module output (not a GEMM: ABFT never checks it there).
            "site_type": "output"
            if is_output_site(site)
            else ("gemm" if self.config.coverage == "every_gemm" else "attention"),
            "site_class": site_class(site),
            "coverage": self.config.coverage,
            "seed": fault.seed,
            "bit": fault.bit if kind == "bitflip" else None,
            "fault_step": self.config.warmup,
            **injected,
            "site_counts": site_c,  # detected, corrected, uncorrectable at the fault site
            "total_counts": [int(c) for c in np.asarray(counts)],
            # ABFT alarmed somewhere in the fault step (at the fault site or downstream of it).
            "alarm_any": int(np.asarray(counts)[0]) > 0,
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


def runner_for(config: CampaignConfig, protection: str) -> _Runner:
    """The compiled configuration (protection, dtype, model...) of ``config``, made once per
    process: its step, its warm state and its clean run."""
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
