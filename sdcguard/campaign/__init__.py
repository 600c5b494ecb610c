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

Modules, one job each (this package's face only re-exports their public names):
  config   :class:`CampaignConfig`, the grid's sites, the results file's constants.
  trials   one configuration's compiled step, a trial, the results file.
  studies  error propagation in one attention block, false positives.
  report   summary, markdown, figures, the terminal table.
  run      :func:`run_campaign`: the grid, resumption, the reports.
  command  ``sdcguard campaign`` (flags -> :class:`CampaignConfig`).

Example:
  >>> result = run_campaign(CampaignConfig(model_kind="encoder", out=Path("runs/enc")))
  >>> result["summary"]["abft"]["detection_rate"]
"""

from sdcguard.campaign import command, config, report, run, studies, trials
from sdcguard.campaign.command import config_from_args, register
from sdcguard.campaign.config import (
    CLASSES,
    DEFAULT_KINDS,
    DEFAULT_PROTECTIONS,
    DTYPES,
    EXPONENT_BITS,
    OUTPUT_GROUPS,
    PROTECTIONS,
    RESULTS_FILE,
    CampaignConfig,
    CampaignFileError,
    UnknownSiteError,
)
from sdcguard.campaign.report import markdown, plot, summarize
from sdcguard.campaign.run import (
    CampaignGridError,
    config_json,
    grid,
    run_campaign,
    source_fingerprint,
)
from sdcguard.campaign.studies import (
    DOWNSTREAM,
    PROPAGATION_TENSORS,
    false_positives,
    pattern,
    propagation,
)
from sdcguard.campaign.trials import (
    append_result,
    classify,
    load_results,
    make_fault,
    make_step,
    trial_key,
)

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
    "UnknownSiteError",
    "append_result",
    "classify",
    "command",
    "config",
    "config_from_args",
    "config_json",
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
    "report",
    "run",
    "run_campaign",
    "source_fingerprint",
    "studies",
    "summarize",
    "trial_key",
    "trials",
]
