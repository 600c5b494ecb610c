"""Fault campaigns: a tiny campaign end to end, classification, ABFT rates, resumption."""

import dataclasses
import io
import json

import pytest
from rich.console import Console

from sdcguard import campaign
from sdcguard.campaign import CampaignConfig, CampaignFileError, _trials, load_results, run_campaign
from sdcguard.cli import _campaign, build_parser
from sdcguard.models import GPTConfig

SCORES = "decoder/block_0/attn:scores"
BACKWARD = "decoder/block_0/attn:context.grad_lhs"
MLP_OUT = "decoder/block_0/mlp:output"  # a module output: outside what ABFT checks


def tiny(out, **overrides) -> CampaignConfig:
    base = dict(
        model=GPTConfig(num_layers=1, d_model=32, num_heads=4, seq_len=16),
        batch_size=2,
        sites=(SCORES, BACKWARD, MLP_OUT),
        kinds=("nan", "inf", "scale"),
        value=1.0,  # scale by 1.0: a fault that changes nothing, the known-harmless control
        trials=2,
        protections=("off", "abft"),
        warmup=1,
        steps_after=2,
        fp_steps=3,
        fp_dtypes=("fp32",),
        propagation_trials=1,
        out=out,
    )
    return CampaignConfig(**{**base, **overrides})


def quiet() -> Console:
    return Console(file=io.StringIO(), width=200)


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    config = tiny(tmp_path_factory.mktemp("full"))
    result = run_campaign(config, quiet())
    records = [json.loads(line) for line in (config.out / "trials.jsonl").read_text().splitlines()]
    return config, result, records


def test_tiny_campaign_writes_every_trial_and_report(full):
    config, result, records = full
    n = len(config.protections) * 3 * 3 * config.trials  # protections x sites x kinds x trials
    assert len(records) == n == result["trials_done"] == result["trials_total"]
    assert len({r["key"] for r in records}) == n
    for field in (
        "site_counts",
        "total_counts",
        "detected",
        "corrected",
        "uncorrectable",
        "loss_fault",
        "clean_loss_fault",
        "loss_after",
        "clean_loss_after",
        "nonfinite_loss",
        "nonfinite_params",
        "class",
    ):
        assert all(field in r for r in records), field
    saved = json.loads((config.out / "campaign.json").read_text())
    assert set(saved["summary"]) == {"off", "abft"}
    # The main rates cover the attention sites (what ABFT protects); outputs are apart.
    assert saved["summary"]["off"]["trials"] == n // 2 * 2 // 3
    assert saved["summary"]["off"]["output_sites"]["trials"] == n // 2 // 3
    assert saved["false_positives"][0]["alarms"] == 0
    assert saved["false_positives"][0]["checked_gemms"] == 3 * 18  # 3 steps x 1 layer x 18
    # inf/nan in scores: one bad probs row; scale by 1.0: no change
    assert saved["propagation"][SCORES]["probs"] == {"1D": 2, "none": 1}
    assert (config.out / "summary.md").read_text().startswith("# sdcguard fault-injection")
    assert (config.out / "harm.png").stat().st_size > 0
    assert (config.out / "correction_abft.png").stat().st_size > 0


def test_known_harmful_and_harmless_faults_are_classified(full):
    _, _, records = full
    off = [r for r in records if r["protection"] == "off"]
    nan_scores = [r for r in off if r["site"] == SCORES and r["kind"] == "nan"]
    assert nan_scores and all(r["class"] == "non_trainable" for r in nan_scores)
    assert all(r["nonfinite_params"] for r in nan_scores)
    identity = [r for r in off if r["kind"] == "scale"]
    assert identity and all(r["class"] == "harmless" for r in identity)
    assert all(r["loss_after"] == r["clean_loss_after"] for r in identity)


def test_abft_detects_and_corrects_every_inf_and_nan(full):
    _, result, records = full
    hits = [
        r
        for r in records
        if r["protection"] == "abft" and r["kind"] in ("inf", "nan") and r["site"] != MLP_OUT
    ]
    assert len(hits) == 2 * 2 * 2
    assert all(r["detected"] and r["corrected"] and not r["uncorrectable"] for r in hits)
    assert all(r["class"] == "harmless" for r in hits)
    per_kind = result["summary"]["abft"]["per_kind"]
    assert per_kind["inf"]["detected"] == per_kind["nan"]["corrected"] == 1.0


def test_output_site_fault_is_harmful_and_abft_does_not_claim_it(full):
    config, result, records = full
    out = [r for r in records if r["site"] == MLP_OUT and r["kind"] == "nan"]
    off = [r for r in out if r["protection"] == "off"]
    abft = [r for r in out if r["protection"] == "abft"]
    assert len(off) == len(abft) == config.trials
    assert all(r["site_type"] == "output" and r["direction"] == "forward" for r in out)
    assert all(r["class"] == "non_trainable" and r["new_value"] == "nan" for r in off)
    # ABFT checks attention GEMMs: it never claims a detection at an MLP output, and its
    # alarms downstream (the NaN reaches the attention backward GEMMs) do not undo the harm.
    assert not any(r["detected"] or r["corrected"] for r in abft)
    assert all(r["class"] == "non_trainable" for r in abft)
    summary = result["summary"]["abft"]
    assert summary["output_sites"]["detected_at_site"] == 0.0
    assert summary["per_kind"]["nan"]["detected"] == 1.0  # attention sites only
    assert all(MLP_OUT not in m["key"] for m in summary["missed"])
    md = (config.out / "summary.md").read_text()
    assert "## 3c. Module-output sites" in md
    assert f"{MLP_OUT}|nan: detected" not in md  # not listed as an ABFT miss


def test_resume_neither_repeats_nor_loses_trials(full, tmp_path):
    config, _, records = full
    config = dataclasses.replace(config, out=tmp_path, fp_steps=0, propagation_trials=0)
    run_campaign(config, quiet(), max_trials=5)  # "interrupted" after 5 trials
    path = tmp_path / "trials.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    assert len(lines) == 5
    # Interrupted again mid-write: the 5th line is half there.
    path.write_text("".join(lines[:4]) + lines[4][: len(lines[4]) // 2])
    console = quiet()
    run_campaign(config, console)
    assert "partial write" in console.file.getvalue()
    resumed = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["key"] for r in resumed[:4]] == [json.loads(x)["key"] for x in lines[:4]]
    assert sorted(r["key"] for r in resumed) == sorted(r["key"] for r in records)
    # Trials are deterministic: the resumed campaign found what the uninterrupted one found.
    by_key = {r["key"]: r for r in records}
    assert all(r["class"] == by_key[r["key"]]["class"] for r in resumed)
    assert all(r["loss_after"] == by_key[r["key"]]["loss_after"] for r in resumed)
    # A complete file is left alone: running again adds nothing.
    run_campaign(config, quiet())
    assert len(path.read_text().splitlines()) == len(records)


def test_corrupt_lines(tmp_path):
    path = tmp_path / "trials.jsonl"
    good = json.dumps({k: 0 for k in _trials._REQUIRED} | {"key": "a"}) + "\n"
    path.write_text(good + '{"key": "b", "tri')
    console = quiet()
    assert list(load_results(path, console)) == ["a"]
    assert "line 2 is a partial write" in console.file.getvalue()
    assert path.read_text() == good  # truncated to the last complete line
    path.write_text(good + "not json\n" + good)
    with pytest.raises(CampaignFileError, match="line 2 is corrupt"):
        load_results(path)
    # A last line that parses but lacks its newline was also cut short (or tampered with).
    path.write_text(good + good.strip())
    assert list(load_results(path, quiet())) == ["a"] and path.read_text() == good


def test_cli_parses_into_config(tmp_path):
    args = build_parser().parse_args(
        [
            "campaign",
            "--out",
            str(tmp_path),
            "--kinds",
            "nan",
            "bitflip",
            "--bits",
            "10",
            "14",
            "--protection",
            "abft",
            "abft+guard",
            "--dtype",
            "bf16",
            "--trials",
            "3",
        ]
    )
    config = _campaign.config_from_args(args)
    assert config.kinds == ("nan", "bitflip") and config.bit_range == (10, 14)
    assert config.protections == ("abft", "abft+guard") and config.dtype == "bf16"
    assert config.model_config().dtype == "bfloat16" and config.trials == 3
    assert len(config.site_list()) == 2 * 19  # default: every attention site of both layers
    with pytest.raises(ValueError, match="unknown fault kinds"):
        CampaignConfig(kinds=("melt",))


def test_abft_plus_guard_runs_and_keeps_training_clean(tmp_path):
    config = tiny(
        tmp_path,
        sites=(SCORES, MLP_OUT),  # the armed output site of `full`: its "off" step is reused
        kinds=("nan",),
        trials=1,
        protections=("off", "abft+guard"),
        fp_steps=0,
        propagation_trials=0,
    )
    result = run_campaign(config, quiet())
    guard = result["summary"]["abft+guard"]
    assert guard["detection_rate"] == guard["correction_rate"] == 1.0
    assert guard["classes"]["harmless"] == 1.0
    assert guard["detection_rate_harmful"] == 1.0 and guard["missed"] == []
    lines = (tmp_path / "trials.jsonl").read_text().splitlines()
    out = [r for r in map(json.loads, lines) if r["site"] == MLP_OUT]
    # A NaN at an MLP output: ABFT does not detect it there, but the guard refuses the step it
    # poisons, so training goes on (the fault step's own loss is lost: a spike, not a failure).
    by_prot = {r["protection"]: r for r in out}
    assert by_prot["off"]["class"] == "non_trainable"
    guarded = by_prot["abft+guard"]
    assert not guarded["detected"] and guarded["class"] == "loss_spike"
    assert guarded["nonfinite_loss"] and not guarded["nonfinite_params"]


# A campaign of its own (~50 s): recompute on detection is also checked, faster, in
# tests/test_checked_programs.py and tests/test_linen.py.
@pytest.mark.slow
def test_abft_recompute_detects_and_corrects_like_in_place_repair(tmp_path):
    """Detect-only checks and a recomputed step: the same rates as in-place repair."""
    config = tiny(
        tmp_path,
        sites=(SCORES, BACKWARD),
        kinds=("nan", "inf"),
        trials=1,
        protections=("abft", "abft-recompute"),
        fp_steps=0,
        propagation_trials=0,
    )
    assert "abft-recompute" not in CampaignConfig().protections  # opt-in
    result = run_campaign(config, quiet())
    records = [json.loads(line) for line in (tmp_path / "trials.jsonl").read_text().splitlines()]
    recompute = [r for r in records if r["protection"] == "abft-recompute"]
    assert len(recompute) == 2 * 2
    assert all(r["detected"] and r["corrected"] and not r["uncorrectable"] for r in recompute)
    assert all(r["class"] == "harmless" for r in recompute)
    summary = result["summary"]
    assert summary["abft-recompute"]["detection_rate"] == summary["abft"]["detection_rate"] == 1.0
    assert summary["abft-recompute"]["correction_rate"] == 1.0


# --- false positives count only the GEMMs that were checked ------------------------------------


def every_gemm(tmp_path, dtype="fp32") -> CampaignConfig:
    # sites=(): every GEMM of the step, whatever the names (no trial runs here).
    return tiny(
        tmp_path, coverage="every_gemm", sites=(), dtype=dtype, fp_dtypes=(dtype,), fp_steps=2
    )


# fp32 is slow (suite budget): bf16 counts the same GEMMs against the narrower tolerance.
@pytest.mark.parametrize("dtype", [pytest.param("fp32", marks=pytest.mark.slow), "bf16"])
def test_false_positives_count_the_gemms_checked(tmp_path, dtype):
    """Whatever sdcguard.list_sites says of a dtype's GEMMs, only the checked ones count."""
    from sdcguard.campaign import _studies as studies

    config = every_gemm(tmp_path, dtype)
    table = studies.gemm_site_table(config, dtype)
    fp = studies.false_positives(config, dtype, 2)
    checked = [s.name for s in table if s.checked]
    assert fp["checked_gemms"] == 2 * len(checked)
    assert fp["unchecked_gemms"] == 2 * (len(table) - len(checked))
    assert fp["alarms"] == 0
    if dtype == "fp32":
        assert checked and fp["unchecked_gemms"] == 0


def test_false_positives_of_unchecked_gemms_count_zero(tmp_path, monkeypatch):
    """A run whose GEMMs are all unchecked (as bf16 GEMMs were) counts 0 checked GEMMs, not
    the number of sites; a GEMM listed as checked that the step's report lacks is not counted
    either."""
    from sdcguard import training
    from sdcguard.campaign import _studies as studies

    config = every_gemm(tmp_path)
    real = training.list_sites  # what the studies list sites with

    def all_unchecked(*args, **kwargs):
        return [
            dataclasses.replace(s, checked=False, why_unchecked="bfloat16 operands")
            for s in real(*args, **kwargs)
        ]

    monkeypatch.setattr(training, "list_sites", all_unchecked)
    fp = studies.false_positives(config, "fp32", 2)
    monkeypatch.setattr(training, "list_sites", real)
    n = len(studies.gemm_site_table(config, "fp32"))
    assert n > 0 and fp["checked_gemms"] == 0
    assert fp["unchecked_gemms"] == 2 * n and fp["why_unchecked"] == {"bfloat16 operands": 2 * n}
    console = quiet()
    campaign.print_summary({"summary": {}, "false_positives": [fp]}, console)
    assert (
        f"false positives fp32: 0 alarms in 0 checked GEMMs; fp32: {2 * n} GEMMs not checked "
        f"(bfloat16 operands: {2 * n}), no evidence either way"
    ) in console.file.getvalue()

    def one_phantom(*args, **kwargs):
        sites = real(*args, **kwargs)
        return [*sites, dataclasses.replace(sites[0], name="nowhere/dense:dot_general")]

    monkeypatch.setattr(training, "list_sites", one_phantom)
    fp = studies.false_positives(config, "fp32", 2)
    assert fp["why_unchecked"] == {"listed as checked, absent from the report": 2}


# The console's log mode (whole tables, plain progress lines) runs in the default run through
# ``sdcguard demo`` (tests/test_demo.py); the campaign's own headers, with -m slow.
@pytest.mark.slow
def test_campaign_output_in_a_log_is_whole(tmp_path, monkeypatch):
    """``sdcguard campaign > log``: whole headers (not ``protec…``) and progress lines."""
    import sys

    log = tmp_path / "campaign.log"
    argv = [
        *("campaign", "--layers", "1", "--d-model", "32", "--heads", "4", "--seq-len", "16"),
        *("--batch-size", "2", "--trials", "1", "--fp-steps", "0", "--propagation-trials", "0"),
        *("--sites", SCORES, "--kinds", "nan", "--protection", "off", "abft"),
        *("--warmup", "1", "--steps-after", "2", "--out", str(tmp_path / "c")),
    ]
    with open(log, "w") as stdout:
        monkeypatch.setattr(sys, "stdout", stdout)  # what `> campaign.log` gives the command
        from sdcguard import cli

        code = cli.main(argv)
    text = log.read_text()
    assert code == 0, text
    assert "…" not in text and "\x1b[" not in text
    header = next(ln for ln in text.splitlines() if "protection" in ln)
    for column in ("protection", "trials", "harmless", "loss spike", "non-trainable"):
        assert column in header
    for column in ("detected", "corrected", "uncorrectable"):
        assert column in header
    assert "trials: 2/2 (100%)" in text or "abft: 2/2 (100%)" in text


def test_a_capped_campaign_samples_protections_and_kinds_evenly(tmp_path):
    config = tiny(
        tmp_path,
        protections=("off", "abft", "abft+guard"),
        kinds=("inf", "-inf", "nan", "near_inf", "bitflip"),
    )
    order = list(campaign.grid(config))
    assert len(order) == len(set(order)) == 3 * 3 * 5 * 2  # the whole grid, each trial once
    first = order[:12]  # what --max-trials 12 runs
    assert [sum(t[0] == p for t in first) for p in config.protections] == [4, 4, 4]
    kinds = [sum(t[2] == k for t in first) for k in config.kinds]
    assert max(kinds) - min(kinds) <= len(config.protections) and sum(k > 0 for k in kinds) >= 4
    # Every fault runs under every protection, one after the other.
    assert [t[0] for t in order[:3]] == list(config.protections)
    assert len({t[1:] for t in order[:3]}) == 1
    first_30 = order[:30]
    assert all(
        sum(t[0] == p and t[2] == k for t in first_30) == 2
        for p in config.protections
        for k in config.kinds
    )


def test_capped_run_counts_its_own_trials(tmp_path):
    config = tiny(tmp_path, fp_steps=0, propagation_trials=0)
    console = quiet()
    run_campaign(config, console, max_trials=4)
    text = console.file.getvalue()
    total = len(list(campaign.grid(config)))
    assert f"running 4 of the {total} trials left (--max-trials)" in text
    assert f"/{total}" not in text  # the progress counts the 4 trials this run makes
    records = load_results(config.out / "trials.jsonl")
    assert {r["protection"] for r in records.values()} == {"off", "abft"}


def test_summary_tells_a_pip_user_where_the_recovery_benchmark_is(tmp_path):
    from sdcguard.campaign._report import _recovery_text

    text = " ".join(_recovery_text(tmp_path / "bench_recovery.json"))
    assert "source repository" in text and "not installed by pip" in text
