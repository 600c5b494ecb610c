"""The campaign's configuration: one frozen dataclass, parsed into by the command line."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from pathlib import Path

from sdcguard._console import close_matches
from sdcguard.fault_model import (
    FAULT_KINDS,
    attention_site_names,
    is_output_site,
    match_sites,
)
from sdcguard.models import GPTConfig
from sdcguard.training import (
    COVERAGES,
    MODEL_KINDS,
    STACK_NAMES,
    TrainConfig,
    gemm_sites,
    model_output_sites,
)

PROTECTIONS = ("off", "abft", "abft+guard", "abft-recompute")
DEFAULT_PROTECTIONS = ("off", "abft", "abft+guard")
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# The other spelling of each dtype (``sdcguard demo --dtype float32``), accepted everywhere.
DTYPE_ALIASES = {v: k for k, v in DTYPES.items()}
DTYPE_BITS = {"fp32": 32, "bf16": 16}
# Exponent bits (counted from the least significant bit) of each dtype's bit pattern: the
# "high-exponent" flips of the targets, and the default bit range of `bitflip`.
EXPONENT_BITS = {"fp32": (23, 30), "bf16": (7, 14), "fp16": (10, 14)}
# The module outputs added by `include_outputs`: every block's and every MLP's output.
OUTPUT_GROUPS = ("{stack}/block_*:output", "{stack}/block_*/mlp:output")
DEFAULT_KINDS = ("inf", "-inf", "nan", "near_inf", "bitflip")
CLASSES = ("harmless", "loss_spike", "non_trainable")
RESULTS_FILE = "trials.jsonl"
FORMAT_VERSION = 2  # 2: model kind, output sites, injected values


class CampaignFileError(ValueError):
    """The results file is corrupt beyond a partially written last line."""


class UnknownSiteError(ValueError):
    """A site name or pattern of the campaign that names no site of its model."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CampaignConfig:
    """A fault-injection campaign on a reference model.

    Attributes:
      model: size of the model (its ``dtype`` is replaced by ``dtype`` below).
      model_kind: ``gpt`` (decoder, next-byte prediction; sites ``decoder/block_{i}/...``) or
        ``encoder`` (bidirectional, masked-byte prediction; sites ``encoder/block_{i}/...``).
      batch_size: sequences per batch.
      learning_rate: Adam learning rate.
      coverage: what ABFT checks and where faults are injected. ``attention``: the protected
        attention layers (sites ``decoder/block_0/attn:scores``...). ``every_gemm``: every
        floating-point GEMM of the step, forward and backward, under :func:`sdcguard.checked`
        (sites ``decoder/block_0/mlp/fc_in:dot_general.grad_rhs``...: attention,
        projections, MLP and the output head).
      sites: site names or patterns (:func:`sdcguard.fault_model.site_matches`: ``*`` within a
        path component, ``**`` across; one without ``:`` selects every site of the modules it
        matches) to inject into: GEMM sites of the
        coverage (forward and backward, ``decoder/block_0/attn:scores.grad_lhs``) and module
        outputs (``decoder/block_0/mlp:output``, forward only); empty means every GEMM site
        of the coverage. Each must name or match a site of the model.
      include_outputs: also inject at every block's and every MLP's output
        (:data:`OUTPUT_GROUPS`), after the sites above.
      kinds: fault kinds (see :data:`sdcguard.fault_model.FAULT_KINDS`).
      bit_range: inclusive ``(lo, hi)`` bits for ``bitflip``; None means the dtype's exponent
        bits (the high-exponent flips that matter).
      value: the value set by ``value`` faults and the factor of ``scale`` faults.
      trials: trials per (site, kind) cell; each draws its element (and bit) from its seed.
      seed: seed of parameters, data and trial draws.
      dtype: computation dtype of the trials, ``fp32`` or ``bf16`` (``float32`` and
        ``bfloat16`` are accepted and stored as the short names).
      protections: protection levels to run, each one configuration (one compilation):
        ``off`` (the same injection points, no checks), ``abft``, ``abft+guard`` (ABFT and the Optax
        update guard, fed the loss and ABFT's uncorrectable count); opt-in
        ``abft-recompute`` (detect-only checks, a step with a detection recomputed under
        in-place repair: ``TrainConfig(repair="recompute")``).
      warmup: clean steps before the fault (the fault fires at step ``warmup``).
      steps_after: steps trained after the fault step.
      spike_rel: relative loss excess over the clean run that counts as a loss spike.
      fp_steps: clean protected steps per dtype of the false-positive measurement (0: skip).
      fp_dtypes: dtypes of the false-positive measurement.
      propagation_trials: faults per (forward site, kind) of the propagation study (0: skip).
      out: output directory (results file, summary, figures).

    Example:
      >>> config = CampaignConfig(
      ...     model_kind="encoder", sites=("encoder/block_*/attn:scores",),
      ...     include_outputs=True, kinds=("nan", "bitflip"), dtype="bf16")
      >>> config.site_list()[:3]
      ['encoder/block_0/attn:scores', 'encoder/block_1/attn:scores', 'encoder/block_0:output']
    """

    model: GPTConfig = GPTConfig()
    model_kind: str = "gpt"
    coverage: str = "attention"
    batch_size: int = 8
    learning_rate: float = 3e-3
    sites: tuple[str, ...] = ()
    include_outputs: bool = False
    kinds: tuple[str, ...] = DEFAULT_KINDS
    bit_range: tuple[int, int] | None = None
    value: float = 1e4
    trials: int = 2
    seed: int = 0
    dtype: str = "fp32"
    protections: tuple[str, ...] = DEFAULT_PROTECTIONS
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
        # Either spelling of a dtype ("bf16" or "bfloat16"); the short one is stored.
        object.__setattr__(self, "dtype", DTYPE_ALIASES.get(self.dtype, self.dtype))
        object.__setattr__(
            self, "fp_dtypes", tuple(DTYPE_ALIASES.get(d, d) for d in self.fp_dtypes)
        )
        object.__setattr__(self, "out", Path(self.out))
        if self.bit_range is not None:
            lo, hi = (int(b) for b in self.bit_range)
            if not 0 <= lo <= hi < 64:
                raise ValueError(f"bit_range must satisfy 0 <= lo <= hi < 64, got {lo, hi}")
            object.__setattr__(self, "bit_range", (lo, hi))
        if self.model_kind not in MODEL_KINDS:
            raise ValueError(
                f"model_kind must be one of {list(MODEL_KINDS)}, got {self.model_kind!r}"
            )
        if self.coverage not in COVERAGES:
            raise ValueError(f"coverage must be one of {list(COVERAGES)}, got {self.coverage!r}")
        for site in self.sites:
            name = site.rpartition(":")[2]
            if ":" in site and name.startswith("output") and ".grad" in name:
                raise ValueError(
                    f"{site!r}: module-output sites take forward faults only; backward faults "
                    "exist at the attention GEMM sites (e.g. 'decoder/block_0/attn:scores."
                    "grad_lhs')"
                )
        bad = set(self.kinds) - set(FAULT_KINDS)
        if bad or not self.kinds:
            raise ValueError(f"unknown fault kinds {sorted(bad)}; valid: {list(FAULT_KINDS)}")
        bad = set(self.protections) - set(PROTECTIONS)
        if bad or not self.protections:
            raise ValueError(f"unknown protections {sorted(bad)}; valid: {list(PROTECTIONS)}")
        for d in (self.dtype, *self.fp_dtypes):
            if d not in DTYPES:
                raise ValueError(f"dtype must be one of {list(DTYPES)}, got {d!r}")
        if self.bit_range is not None and self.bit_range[1] >= DTYPE_BITS[self.dtype]:
            # A flip of bit b >= width would flip bit b % width while being recorded as b.
            raise ValueError(
                f"bit range {self.bit_range} does not fit {self.dtype} (bits 0 to "
                f"{DTYPE_BITS[self.dtype] - 1})"
            )
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

    @property
    def stack_name(self) -> str:
        return STACK_NAMES[self.model_kind]

    def valid_sites(self) -> list[str]:
        """Every site of the model: the coverage's GEMM sites (fwd and bwd), then module
        outputs."""
        return [*self.gemm_sites(), *_output_sites(self.model, self.model_kind)]

    def gemm_sites(self) -> list[str]:
        """The GEMM sites of the coverage: attention sites, or every GEMM of the step."""
        if self.coverage == "every_gemm":
            return list(_every_gemm_sites(self.model, self.model_kind))
        return self.attention_sites()

    def attention_sites(self) -> list[str]:
        return [
            s
            for i in range(self.model.num_layers)
            for s in attention_site_names(f"{self.stack_name}/block_{i}/attn")
        ]

    def site_list(self) -> list[str]:
        """The sites of the grid, in order, each once.

        Raises:
          UnknownSiteError: a name or pattern that is no site of the model (its close
            matches named).
        """
        return list(self._sites)

    @functools.cached_property
    def _sites(self) -> tuple[str, ...]:
        patterns = list(self.sites) or self.gemm_sites()
        if self.include_outputs:
            patterns += [g.format(stack=self.stack_name) for g in OUTPUT_GROUPS]
        valid = self.valid_sites()
        out: list[str] = []
        for pat in patterns:
            hits = match_sites(pat, valid)
            if not hits:
                raise UnknownSiteError(self._unknown_site(pat, valid))
            out += [s for s in hits if s not in out]
        return tuple(out)

    def _unknown_site(self, pattern: str, valid: list[str]) -> str:
        """One line: the pattern, its close matches, and how to list every site."""
        close = close_matches(pattern, valid, n=4)
        hint = f"; close: {', '.join(close)}" if close else ""
        if pattern.rpartition(":")[2].endswith((".grad", ".update")):
            hint += (
                " (parameter sites such as 'path:kernel.grad' or 'path:kernel.update' are "
                "injected by `sdcguard compare --inject-b` and `sdcguard record --inject`; "
                "a campaign injects at GEMM sites and module outputs)"
            )
        return (
            f"{pattern!r} is no site of the {self.model_kind} model ({self.model.num_layers} "
            f"layers, coverage {self.coverage}: {len(valid)} sites){hint}; "
            "`sdcguard campaign --list-sites` lists them, with the same --model, --layers and "
            "--coverage"
        )

    def output_sites(self) -> tuple[str, ...]:
        """The module-output sites of the grid (armed in the compiled step)."""
        return tuple(s for s in self.site_list() if is_output_site(s))

    def bits(self) -> tuple[int, int]:
        return self.bit_range or EXPONENT_BITS[self.dtype]

    def trial_hash(self, protection: str) -> str:
        """Hash of everything that determines a trial's outcome (not the grid's extent)."""
        key = {
            "version": FORMAT_VERSION,
            "model": dataclasses.asdict(self.model_config()),
            "model_kind": self.model_kind,
            "output_sites": sorted(self.output_sites()),
            "batch_size": self.batch_size,
            "learning_rate": self.learning_rate,
            "bits": self.bits(),
            "value": self.value,
            "seed": self.seed,
            "protection": protection,
            # Only when not the default, so the trials of attention campaigns keep their keys.
            **({"coverage": self.coverage} if self.coverage != "attention" else {}),
            "warmup": self.warmup,
            "steps_after": self.steps_after,
            "spike_rel": self.spike_rel,
        }
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


@functools.cache
def _every_gemm_sites(model: GPTConfig, model_kind: str) -> tuple[str, ...]:
    """The GEMM sites of the whole step under :func:`sdcguard.checked` (traced, cached)."""
    return tuple(gemm_sites(TrainConfig(model=model, model_kind=model_kind)))


@functools.cache
def _output_sites(model: GPTConfig, model_kind: str) -> tuple[str, ...]:
    """The module-output sites of a model (abstract evaluation, cached)."""
    return tuple(model_output_sites(TrainConfig(model=model, model_kind=model_kind)))
