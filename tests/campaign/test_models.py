"""Campaigns beyond the fp32 GPT: the encoder, module-output sites, bf16, the per-bit table,
and the errors for sites that do not exist."""

import dataclasses
import io
import json

import pytest
from rich.console import Console

from sdcguard import campaign
from sdcguard.campaign import CampaignConfig, run_campaign, summarize
from sdcguard.cli import _campaign, build_parser
from sdcguard.models import GPTConfig

TINY = GPTConfig(num_layers=1, d_model=32, num_heads=4, seq_len=16)
SCORES = "encoder/block_0/attn:scores"
MLP_OUT = "encoder/block_0/mlp:output"


def quiet() -> Console:
    return Console(file=io.StringIO(), width=200)


def _records(config):
    return [json.loads(x) for x in (config.out / "trials.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def bf16_encoder(tmp_path_factory):
    """The bf16 encoder under ABFT: a NaN and bf16's exponent-MSB flip at scores, a backward
    site and an MLP output. (The unprotected runs and the harm of output-site faults are
    tested on the fp32 GPT in test_campaign.py; one compiled step keeps this test cheap.)"""
    config = CampaignConfig(
        model=TINY,
        model_kind="encoder",
        batch_size=2,
        sites=(SCORES, "encoder/block_0/attn:key.grad_rhs", MLP_OUT),
        kinds=("nan", "bitflip"),
        bit_range=(14, 14),
        trials=1,
        dtype="bf16",
        protections=("abft",),
        warmup=1,
        steps_after=2,
        fp_steps=2,
        fp_dtypes=("bf16",),
        propagation_trials=1,
        out=tmp_path_factory.mktemp("bf16_encoder"),
    )
    return config, run_campaign(config, quiet()), _records(config)


def test_bf16_encoder_campaign_runs_end_to_end(bf16_encoder):
    config, result, records = bf16_encoder
    assert len(records) == result["trials_done"] == 3 * 2  # sites x kinds
    assert {r["dtype"] for r in records} == {"bf16"} and result["bits"] == [14, 14]
    assert {r["model_kind"] for r in records} == {"encoder"}
    assert result["config"]["model"]["dtype"] == "bfloat16"
    assert result["false_positives"][0]["dtype"] == "bf16"
    assert result["false_positives"][0]["alarms"] == 0
    # The result names the code it measured (file hashes hold for an uncommitted tree too).
    assert len(result["environment"]["sources_sha256"]["training.py"]) == 16
    att = [r for r in records if r["protection"] == "abft" and r["site_type"] == "attention"]
    nan = [r for r in att if r["kind"] == "nan"]
    assert len(nan) == 2 and all(r["detected"] and r["corrected"] for r in nan)
    # No causal mask: every fault in the encoder's scores reaches its row of probs.
    assert result["propagation"][SCORES]["probs"] == {"1D": 2}
    # Every bit-14 flip records what it did to the element.
    flips = [r for r in records if r["kind"] == "bitflip"]
    assert len(flips) == 3 and all(r["bit"] == 14 and r["index"] is not None for r in flips)
    assert all(r["old_value"] != r["new_value"] for r in flips)
    per_bit = result["summary"]["abft"]["per_bit"]["14"]
    assert per_bit["n"] == 2  # attention sites only: the output site is reported apart
    md = (config.out / "summary.md").read_text()
    assert md.count("encoder (masked-byte prediction)") == 1
    assert "## 3b. Bit flips, per bit" in md and "| abft | 14 | 2 |" in md
    # A NaN at the encoder's MLP output: outside the attention GEMMs, not claimed by ABFT.
    (out,) = [r for r in records if r["site"] == MLP_OUT and r["kind"] == "nan"]
    assert out["site_type"] == "output" and not out["detected"] and not out["corrected"]
    assert result["summary"]["abft"]["output_sites"]["detected_at_site"] == 0.0


def test_unknown_and_backward_output_sites_fail_with_the_valid_list(tmp_path):
    bad = CampaignConfig(model=TINY, sites=("decoder/block_0/ln_1:output",), out=tmp_path / "x")
    with pytest.raises(ValueError, match=r"no site of the gpt model(.|\n)*ln_mlp:output"):
        run_campaign(bad, quiet())
    assert not (tmp_path / "x").exists()  # nothing written
    with pytest.raises(ValueError, match="forward faults only"):
        CampaignConfig(sites=("decoder/block_0/mlp:output.grad_lhs",))
    with pytest.raises(ValueError, match="no site of the encoder model"):
        CampaignConfig(model_kind="encoder", sites=("decoder/block_0/attn:scores",)).site_list()
    with pytest.raises(ValueError, match="model_kind must be one of"):
        CampaignConfig(model_kind="bert")
    # The CLI reports the error and exits 2 instead of a traceback.
    args = build_parser().parse_args(
        [
            "campaign",
            "--layers",
            "1",
            "--sites",
            "decoder/block_0/nope:output",
            "--out",
            str(tmp_path),
        ]
    )
    assert args.handler(args) == 2


def test_cli_encoder_with_output_sites():
    args = build_parser().parse_args(
        ["campaign", "--model", "encoder", "--output-sites", "--sites", "encoder/block_*/attn:out"]
    )
    config = _campaign.config_from_args(args)
    assert config.model_kind == "encoder" and config.include_outputs
    assert config.site_list() == [
        "encoder/block_0/attn:out",
        "encoder/block_1/attn:out",
        "encoder/block_0:output",
        "encoder/block_1:output",
        "encoder/block_0/mlp:output",
        "encoder/block_1/mlp:output",
    ]
    assert config.output_sites() == tuple(config.site_list()[2:])
    # The default grid is unchanged: every attention site of both layers, fwd and bwd.
    assert len(CampaignConfig().site_list()) == 2 * 19


def _rec(prot, trial, bit, detected, cls, delta):
    return {
        "key": f"{prot}|{trial}",
        "protection": prot,
        "site": "decoder/block_0/attn:scores",
        "site_type": "attention",
        "kind": "bitflip",
        "trial": trial,
        "bit": bit,
        "detected": detected,
        "corrected": detected,
        "uncorrectable": False,
        "class": cls,
        "param_drift": 0.0,
        "abs_delta": delta,
    }


def test_per_bit_table_counts():
    # Trials 0-3 flip bit 30, 4-5 bit 28. Twins: 0 and 1 harmful; 2 harmless but large.
    off = [
        _rec("off", t, b, False, c, d)
        for t, b, c, d in [
            (0, 30, "non_trainable", "inf"),
            (1, 30, "loss_spike", 3e38),
            (2, 30, "harmless", 5.0),
            (3, 30, "harmless", 1e-3),
            (4, 28, "harmless", 1e-29),
            (5, 28, "harmless", 2.0),
        ]
    ]
    abft = [
        _rec("abft", t, b, det, "harmless", d)
        for t, b, det, d in [
            (0, 30, True, "inf"),
            (1, 30, True, 3e38),
            (2, 30, False, 5.0),  # a miss of a large error: must show up
            (3, 30, False, 1e-3),
            (4, 28, False, 1e-29),
            (5, 28, True, 2.0),
        ]
    ]
    bits = summarize(off + abft)["abft"]["per_bit"]
    b30, b28 = bits["30"], bits["28"]
    assert b30["n"] == 4 and b30["detected"] == 0.5 and b30["harmful_unprotected"] == 0.5
    assert b30["harmful_n"] == 2 and b30["detected_among_harmful"] == 1.0
    assert b30["large_delta_n"] == 3 and b30["detected_among_large_delta"] == pytest.approx(2 / 3)
    assert b28["detected"] == 0.5 and b28["harmful_n"] == 0
    assert b28["detected_among_harmful"] is None and b28["detected_among_large_delta"] == 1.0
    md = campaign.markdown(
        {
            "config": {
                **campaign.config_json(CampaignConfig()),
                "model": dataclasses.asdict(GPTConfig()),
            },
            "summary": summarize(off + abft),
            "bits": [28, 30],
            "command": "x",
            "recovery_file": "/nonexistent",
            "seconds": 0,
        }
    )
    assert "| abft | 30 | 4 | 50.0% | 50.0% | 50.0% | 100.0% (2) | 3 | 66.7% |" in md
