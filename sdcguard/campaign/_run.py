"""Running a campaign: its grid of trials, the results file, the studies, the reports.

:func:`run_campaign` runs (or resumes) every trial of a :class:`CampaignConfig` that the results
file does not hold yet, one flushed JSON line per trial, then the studies beside the trials
(propagation, false positives), and writes ``campaign.json``, ``summary.md`` and the figures.
A results file holding trials of another grid is refused (:class:`CampaignGridError`).

Example:
  >>> result = run_campaign(CampaignConfig(model_kind="encoder", out=Path("runs/enc")))
  >>> result["summary"]["abft"]["detection_rate"]
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax

from sdcguard._console import make_console, progress as progress_display
from sdcguard.campaign._config import FORMAT_VERSION, RESULTS_FILE, CampaignConfig
from sdcguard.campaign._figures import plot
from sdcguard.campaign._report import markdown, summarize
from sdcguard.campaign._studies import false_positives, propagation
from sdcguard.campaign._trials import append_result, load_results, runner_for, trial_key

if TYPE_CHECKING:
    from rich.console import Console


def grid(config: CampaignConfig) -> Iterator[tuple[str, str, str, int]]:
    """Every trial of the campaign: (protection, site, kind, trial), in the order they run.

    The protections alternate fastest (the same fault under each, one after the other), then
    the kinds (each site starts one kind further on), then the sites, then the trial number:
    any prefix, such as the trials a ``max_trials`` run gets, samples every protection and
    every kind about evenly.

    Raises:
      ValueError: a site that the model does not have (see :meth:`CampaignConfig.site_list`).
    """
    kinds = config.kinds
    for trial in range(config.trials):
        for j, site in enumerate(config.site_list()):
            for k in range(len(kinds)):
                kind = kinds[(j + k) % len(kinds)]
                for prot in config.protections:
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
    console = console or make_console()
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
    if max_trials is not None and max_trials < len(todo):
        console.print(f"running {max_trials} of the {len(todo)} trials left (--max-trials)")
        todo = todo[:max_trials]
    with progress_display(console) as progress, open(path, "a") as f:
        # Counts this run's trials: a resumed or capped run starts at 0 of what it will run.
        task = progress.add_task("trials", total=len(todo))
        runners: dict[str, Any] = {}  # one compiled step per protection
        for prot, site, kind, trial in todo:
            if prot not in runners:
                progress.update(task, description=f"compiling {prot}")
                runners[prot] = runner_for(config, prot)
            runner = runners[prot]
            progress.update(task, description=prot)
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
        "config": {**config_json(config), "model": dataclasses.asdict(config.model_config())},
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


# The sources whose behaviour a campaign measures (glob patterns under the package): results
# name the code that produced them.
_MEASURED_SOURCES = ("protection/*.py", "fault_model/*.py", "_shard_local.py", "training.py")


def source_fingerprint() -> dict[str, Any]:
    """The git commit of the package, whether its sources differ from it, and a SHA-256 per
    measured source file (so results of an uncommitted tree are still identified)."""
    root = Path(__file__).resolve().parent.parent  # the sdcguard package
    out: dict[str, Any] = {
        "sources_sha256": {
            path.relative_to(root).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()[:16]
            for pattern in _MEASURED_SOURCES
            for path in sorted(root.glob(pattern))
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


def config_json(config: CampaignConfig) -> dict:
    """The configuration as JSON data (``campaign.json``'s ``config``)."""
    d = dataclasses.asdict(config)
    d["out"] = str(config.out)
    return d
