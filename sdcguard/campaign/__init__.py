"""``sdcguard campaign``: systematic fault injection into real training, with and without ABFT.

A campaign trains a reference model (the decoder GPT or the encoder), and for every cell of a
grid (site x kind x trial) injects one fault at a fixed step after a short clean warm-up, trains
``steps_after`` more steps, and compares with the clean run on the same batches. Sites are the
attention sites (forward and backward GEMMs, softmax) and any module output (``path:output``,
forward). Faults are data (a :class:`FaultPlan` of fixed capacity), so each (protection, dtype)
configuration compiles its step once.

Every trial starts from the same warmed-up state (the warm-up is clean and deterministic, so it
is computed once per configuration) and is independent of every other trial: results are
appended to a JSON-lines file, one flushed line per trial, and an interrupted campaign resumes
from it without redoing or losing trials.

Reports (markdown + JSON + PNG): error propagation inside one attention block (unprotected),
harm (unprotected), detection/correction per site x kind (ABFT), bit flips per bit, module
outputs, false positives over many clean checked GEMMs per dtype, and recovery cost (quoted from
``runs/bench_recovery.json``).

Modules: :mod:`~sdcguard.campaign.config` (the configuration), :mod:`~.trials` (compiled steps,
trials, the results file), :mod:`~.studies` (propagation, false positives), :mod:`~.report`
(summary, markdown, figures); this module runs a campaign and holds its command line.

Example:
  >>> result = run_campaign(CampaignConfig(model_kind="encoder", out=Path("runs/enc")))
  >>> result["summary"]["abft"]["detection_rate"]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from sdcguard.campaign.config import (
    CLASSES,
    COVERAGES,
    DEFAULT_KINDS,
    DEFAULT_PROTECTIONS,
    DTYPE_ALIASES,
    DTYPES,
    EXPONENT_BITS,
    FORMAT_VERSION,
    OUTPUT_GROUPS,
    PROTECTIONS,
    RESULTS_FILE,
    CampaignConfig,
    CampaignFileError,
)
from sdcguard.campaign.report import _print, markdown, plot, summarize
from sdcguard.campaign.studies import (
    DOWNSTREAM,
    PROPAGATION_TENSORS,
    false_positives,
    pattern,
    propagation,
)
from sdcguard.campaign.trials import (
    _runner,
    append_result,
    classify,
    load_results,
    make_fault,
    make_step,
    trial_key,
)
from sdcguard.fault_model.sites import FAULT_KINDS
from sdcguard.models import GPTConfig
from sdcguard.training import MODEL_KINDS

__all__ = [
    "CLASSES",
    "DEFAULT_KINDS",
    "DEFAULT_PROTECTIONS",
    "DOWNSTREAM",
    "DTYPES",
    "EXPONENT_BITS",
    "OUTPUT_GROUPS",
    "PROPAGATION_TENSORS",
    "PROTECTIONS",
    "RESULTS_FILE",
    "CampaignConfig",
    "CampaignFileError",
    "CampaignGridError",
    "append_result",
    "classify",
    "config_from_args",
    "false_positives",
    "grid",
    "load_results",
    "make_fault",
    "make_step",
    "markdown",
    "pattern",
    "plot",
    "propagation",
    "register",
    "run_campaign",
    "source_fingerprint",
    "summarize",
    "trial_key",
]

# --- The campaign -------------------------------------------------------------------------------


def grid(config: CampaignConfig) -> Iterator[tuple[str, str, str, int]]:
    """Every trial of the campaign: (protection, site, kind, trial).

    Raises:
      ValueError: a site that the model does not have (see :meth:`CampaignConfig.site_list`).
    """
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
    config.site_list()  # unknown sites fail here, before anything is written
    config.out.mkdir(parents=True, exist_ok=True)
    path = config.out / RESULTS_FILE
    done = load_results(path, console)
    _refuse_other_grids(config, done, path)
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
        "environment": {
            "jax": jax.__version__,
            "backend": jax.default_backend(),
            **source_fingerprint(),
        },
    }
    (config.out / "campaign.json").write_text(json.dumps(result, indent=1))
    (config.out / "summary.md").write_text(markdown(result))
    result["figures"] = [str(p) for p in plot(result, config.out)]
    return result


class CampaignGridError(ValueError):
    """The output directory holds trials of another campaign (grid or configuration)."""


def _refuse_other_grids(config: CampaignConfig, done: dict[str, dict], path: Path) -> None:
    """Refuses a results file holding trials outside this campaign's grid.

    Resuming, or growing the grid (more trials, sites or kinds), is fine: every trial on file
    is one of the grid's. A trial of another grid or configuration (other sites, kinds,
    protections, model, dtype, bits, seed...) would be mixed into this campaign's summary.
    """
    keys = {trial_key(config.trial_hash(p), s, k, t) for p, s, k, t in grid(config)}
    foreign = [r for key, r in done.items() if key not in keys]
    if foreign:
        r = foreign[0]
        raise CampaignGridError(
            f"{path} holds {len(foreign)} of {len(done)} trials that are not in this "
            f"campaign's grid (e.g. {r['protection']} {r['site']} {r['kind']} trial "
            f"{r['trial']}, configuration {r['config_hash']}): its summary would mix two "
            "campaigns; give a new --out, or the options that made them (campaign.json in the "
            "same directory lists them)"
        )


# The sources whose behaviour a campaign measures: results name the code that produced them.
_MEASURED_SOURCES = (
    "protection/config.py",
    "protection/checksums.py",
    "protection/abft.py",
    "protection/sharding.py",
    "protection/attention.py",
    "protection/linen.py",
    "protection/transform.py",
    "fault_model/inject.py",
    "training.py",
)


def source_fingerprint() -> dict[str, Any]:
    """The git commit of the package, whether its sources differ from it, and a SHA-256 per
    measured source file (so results of an uncommitted tree are still identified)."""
    root = Path(__file__).resolve().parent.parent
    out: dict[str, Any] = {
        "sources_sha256": {
            name: hashlib.sha256((root / name).read_bytes()).hexdigest()[:16]
            for name in _MEASURED_SOURCES
        }
    }
    try:
        git = ["git", "-C", str(root)]
        head = subprocess.run(
            [*git, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--", "."], capture_output=True, text=True, timeout=10
        )
        if head.returncode == 0:
            out["git_commit"] = head.stdout.strip()
            out["git_dirty"] = bool(dirty.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass  # not a git checkout: the file hashes still identify the code
    return out


def _jsonable(config: CampaignConfig) -> dict:
    d = dataclasses.asdict(config)
    d["out"] = str(config.out)
    return d


def _dtype(name: str) -> str:
    """Either spelling of a dtype (``bf16`` or ``bfloat16``, as ``sdcguard demo`` takes it)."""
    short = DTYPE_ALIASES.get(name, name)
    if short not in DTYPES:
        spellings = ", ".join(f"{k} ({v})" for k, v in DTYPES.items())
        raise argparse.ArgumentTypeError(f"unknown dtype {name!r}; valid: {spellings}")
    return short


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "campaign",
        help="fault-injection campaign with/without protection",
        description="Injects one fault per trial into real training, for every site x kind x "
        "trial of the grid and every protection level, and reports harm, detection and "
        "correction. Results are appended per trial to OUT/trials.jsonl: rerun the same "
        "command to resume (after Ctrl-C, exit 130). Exit 2 on bad options (the error on "
        "stderr, no traceback), among them an OUT holding trials of another grid.",
    )
    d = CampaignConfig()
    p.add_argument(
        "--out",
        type=Path,
        default=d.out,
        help="output directory: trials.jsonl, summary.md, campaign.json, figures "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--model",
        choices=MODEL_KINDS,
        default=d.model_kind,
        help="gpt: decoder, next-byte loss; encoder: bidirectional, masked-byte loss",
    )
    p.add_argument(
        "--coverage",
        choices=COVERAGES,
        default=d.coverage,
        help="what ABFT checks and where faults go: the attention layers, or every GEMM of "
        "the step (attention, projections, MLP, head; forward and backward) under "
        "sdcguard.checked (default: %(default)s)",
    )
    p.add_argument(
        "--layers", type=int, default=d.model.num_layers, help="transformer blocks (%(default)s)"
    )
    p.add_argument("--d-model", type=int, default=d.model.d_model, help="model width (%(default)s)")
    p.add_argument(
        "--heads", type=int, default=d.model.num_heads, help="attention heads (%(default)s)"
    )
    p.add_argument(
        "--seq-len", type=int, default=d.model.seq_len, help="tokens per sequence (%(default)s)"
    )
    p.add_argument(
        "--batch-size", type=int, default=d.batch_size, help="sequences per batch (%(default)s)"
    )
    p.add_argument(
        "--sites",
        nargs="*",
        default=[],
        help="site names or patterns ('*' within one path component, '**' across, as for "
        "every --sites of sdcguard): GEMM sites of the coverage (fwd and bwd, e.g. "
        "'decoder/block_0/attn:scores.grad_lhs', or with --coverage every_gemm "
        "'GPT/**/mlp/*'), and module outputs (forward, e.g. "
        "'decoder/block_*/mlp:output'); default: every GEMM site of the coverage. Parameter sites "
        "('...:kernel.grad') are injected by sdcguard compare/record only",
    )
    p.add_argument(
        "--output-sites",
        action="store_true",
        help="also inject at every block's and MLP's output ("
        + ", ".join(OUTPUT_GROUPS).replace("{stack}", "decoder|encoder")
        + ")",
    )
    p.add_argument(
        "--kinds",
        nargs="+",
        default=list(d.kinds),
        choices=FAULT_KINDS,
        help="fault kinds (default: %(default)s)",
    )
    p.add_argument(
        "--bits",
        type=int,
        nargs=2,
        metavar=("LO", "HI"),
        default=None,
        help="bitflip bit range (inclusive, below the dtype's width); default: the dtype's "
        "exponent bits",
    )
    p.add_argument(
        "--value",
        type=float,
        default=d.value,
        help="the value set by 'value' faults, the factor of 'scale' faults (%(default)s)",
    )
    p.add_argument(
        "--trials", type=int, default=d.trials, help="trials per site and kind (%(default)s)"
    )
    p.add_argument(
        "--seed", type=int, default=d.seed, help="seed of parameters, data, trials (%(default)s)"
    )
    p.add_argument(
        "--dtype",
        type=_dtype,
        default=d.dtype,
        help="computation dtype: fp32 or bf16 (float32, bfloat16 also accepted; default "
        "%(default)s)",
    )
    p.add_argument(
        "--protection",
        nargs="+",
        choices=PROTECTIONS,
        default=list(d.protections),
        help="protection levels to run (default: %(default)s)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=d.warmup,
        help="clean steps before the fault step (%(default)s)",
    )
    p.add_argument(
        "--steps-after",
        type=int,
        default=d.steps_after,
        help="steps trained after the fault (%(default)s)",
    )
    p.add_argument(
        "--fp-steps",
        type=int,
        default=d.fp_steps,
        help="clean ABFT steps per dtype for the false-positive count (0: skip; %(default)s)",
    )
    p.add_argument(
        "--fp-dtypes",
        nargs="*",
        type=_dtype,
        default=list(d.fp_dtypes),
        help="dtypes of the false-positive count (default: %(default)s)",
    )
    p.add_argument(
        "--propagation-trials",
        type=int,
        default=d.propagation_trials,
        help="faults per forward site and kind of the propagation study (0: skip; %(default)s)",
    )
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
        model_kind=args.model,
        coverage=args.coverage,
        batch_size=args.batch_size,
        sites=tuple(args.sites),
        include_outputs=args.output_sites,
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

    from sdcguard.cli import check_output_dir, error

    console = Console()
    try:
        config = config_from_args(args)
        config.site_list()  # unknown sites fail before anything is created
        check_output_dir(config.out, "--out")
        result = run_campaign(
            config,
            console,
            max_trials=args.max_trials,
            command=shlex.join(["sdcguard", *sys.argv[1:]]),
        )
    except KeyboardInterrupt:
        done = Path(args.out) / RESULTS_FILE
        return error(
            f"interrupted; the finished trials are in {done}: rerun the same command to resume",
            130,
        )
    except OSError as err:
        return error(f"{err.strerror or type(err).__name__}: {err.filename}")
    except (ValueError, CampaignFileError) as err:
        return error(str(err))
    _print(result, console)
    console.print(
        f"wrote {config.out / 'summary.md'}, campaign.json, {RESULTS_FILE} and "
        f"{len(result['figures'])} figures"
    )
    return 0
