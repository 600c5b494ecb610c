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

Private modules, one job each: ``_config`` (:class:`CampaignConfig`, the grid's sites),
``_trials`` (one configuration's compiled step, a trial, the results file), ``_studies``
(propagation, false positives), ``_report`` (summary, markdown, terminal table), ``_figures``
(PNGs), ``_run`` (:func:`run_campaign`). The command line is :mod:`sdcguard.cli`.

Example:
  >>> result = run_campaign(CampaignConfig(model_kind="encoder", out=Path("runs/enc")))
  >>> result["summary"]["abft"]["detection_rate"]
"""

from sdcguard.campaign._config import (
    CLASSES as CLASSES,
    DEFAULT_KINDS as DEFAULT_KINDS,
    DEFAULT_PROTECTIONS as DEFAULT_PROTECTIONS,
    DTYPE_ALIASES as DTYPE_ALIASES,
    DTYPE_BITS as DTYPE_BITS,
    DTYPES as DTYPES,
    EXPONENT_BITS as EXPONENT_BITS,
    OUTPUT_GROUPS as OUTPUT_GROUPS,
    PROTECTIONS as PROTECTIONS,
    RESULTS_FILE as RESULTS_FILE,
    CampaignConfig as CampaignConfig,
    CampaignFileError as CampaignFileError,
    UnknownSiteError as UnknownSiteError,
)
from sdcguard.campaign._figures import plot as plot
from sdcguard.campaign._report import (
    markdown as markdown,
    print_summary as print_summary,
    summarize as summarize,
)
from sdcguard.campaign._run import (
    CampaignGridError as CampaignGridError,
    config_json as config_json,
    grid as grid,
    run_campaign as run_campaign,
    source_fingerprint as source_fingerprint,
)
from sdcguard.campaign._studies import (
    DOWNSTREAM as DOWNSTREAM,
    PROPAGATION_TENSORS as PROPAGATION_TENSORS,
    false_positives as false_positives,
    pattern as pattern,
    propagation as propagation,
)
from sdcguard.campaign._trials import (
    append_result as append_result,
    classify as classify,
    load_results as load_results,
    make_fault as make_fault,
    make_step as make_step,
    trial_key as trial_key,
)

__all__ = [
    "CLASSES",
    "DEFAULT_KINDS",
    "DEFAULT_PROTECTIONS",
    "DOWNSTREAM",
    "DTYPES",
    "DTYPE_ALIASES",
    "DTYPE_BITS",
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
    "config_json",
    "false_positives",
    "grid",
    "load_results",
    "make_fault",
    "make_step",
    "markdown",
    "pattern",
    "plot",
    "print_summary",
    "propagation",
    "run_campaign",
    "source_fingerprint",
    "summarize",
    "trial_key",
]
