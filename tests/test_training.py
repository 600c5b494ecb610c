"""Whole-step protection of the reference models: ``TrainConfig(coverage="every_gemm")`` runs
the loss and its gradients under :func:`sdcguard.checked`, and a campaign injects at every GEMM
site (attention, projections, MLP, head; forward and backward)."""

import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from rich.console import Console

from sdcguard.campaign import CampaignConfig, run_campaign
from sdcguard.fault_model import Fault, FaultPlan, site_class
from sdcguard.models import ByteBatches, GPTConfig
from sdcguard.training import UNCHECKED_GEMMS, TrainConfig, gemm_sites, make_train_step

from tests.helpers.tolerances import assert_close

TINY = GPTConfig(num_layers=1, d_model=32, num_heads=4, seq_len=16)
# Plain SGD: parameters then differ as the gradients do (Adam's first step is about
# lr * sign(g), which turns a rounding difference in a near-zero gradient into a full step).
SGD = optax.sgd(0.1)
BLOCK = "decoder/block_0"
# One GEMM site of each class, forward and backward.
TARGETS = {
    "mlp forward": f"{BLOCK}/mlp/fc_in:dot_general",
    "mlp backward": f"{BLOCK}/mlp/fc_out:dot_general.grad_rhs",
    "projection backward": f"{BLOCK}/attn/query:dot_general.grad_lhs",
    "attention forward": f"{BLOCK}/attn:scores",
    "head backward": "embed:attend.grad_lhs",
}


def quiet() -> Console:
    return Console(file=io.StringIO(), width=200)


@pytest.fixture(scope="module")
def batch():
    return jnp.asarray(ByteBatches(batch_size=2, seq_len=TINY.seq_len, seed=0).batch(0))


@pytest.fixture(scope="module")
def plain(batch):
    state, step = make_train_step(TrainConfig(model=TINY, batch_size=2, abft=None), SGD)
    return step(state, batch, FaultPlan.from_faults([], capacity=1))


@pytest.fixture(scope="module")
def whole_step():
    return make_train_step(TrainConfig(model=TINY, batch_size=2, coverage="every_gemm"), SGD)


def plan_of(site: str, kind: str = "inf") -> FaultPlan:
    return FaultPlan.from_faults([Fault(site=site, kind=kind, seed=7)], capacity=1)


def test_sites_cover_every_class_forward_and_backward():
    sites = gemm_sites(TrainConfig(model=TINY))
    assert set(TARGETS.values()) <= set(sites)
    classes = {(site_class(s), ".grad_" in s) for s in sites}
    for cls in ("attention", "projection", "mlp", "head"):
        assert {(cls, False), (cls, True)} <= classes, cls
    # 8 forward GEMMs per block and the head; two gradient GEMMs each.
    assert len(sites) == 3 * (8 * TINY.num_layers + 1)


def test_clean_step_equals_the_plain_step_and_reports_every_site(whole_step, plain, batch):
    state, step = whole_step
    new_state, out = step(state, batch, FaultPlan.from_faults([], capacity=1))
    plain_state, plain_out = plain
    assert set(out.sdc) == set(gemm_sites(TrainConfig(model=TINY)))
    assert np.asarray(out.counts).tolist() == [0, 0, 0, 0]
    assert float(out.loss) == float(plain_out.loss)
    jax.tree.map(lambda a, b: assert_close(a, b, jnp.float32), new_state.params, plain_state.params)


@pytest.mark.parametrize("where", list(TARGETS))
def test_inf_at_each_class_is_corrected_at_its_site(whole_step, plain, batch, where):
    state, step = whole_step
    site = TARGETS[where]
    new_state, out = step(state, batch, plan_of(site))
    assert np.asarray(out.sdc[site]).tolist() == [1, 1, 0, 0]
    assert np.asarray(out.counts).tolist() == [1, 1, 0, 0]  # nothing leaked downstream
    jax.tree.map(lambda a, b: assert_close(a, b, jnp.float32), new_state.params, plain[0].params)


@pytest.mark.slow  # one more compilation of the step; the campaign test runs the same baseline
def test_unchecked_gemms_keep_their_injection_points(batch):
    """The unprotected baseline: the same sites, no checks, the fault does its harm."""
    state, step = make_train_step(
        TrainConfig(model=TINY, batch_size=2, coverage="every_gemm", abft=UNCHECKED_GEMMS)
    )
    new_state, out = step(state, batch, plan_of(TARGETS["mlp backward"]))
    assert out.sdc == {} and np.asarray(out.counts).tolist() == [0, 0, 0, 0]
    assert not all(bool(jnp.isfinite(p).all()) for p in jax.tree.leaves(new_state.params))


@pytest.mark.slow  # a third compilation (recompute itself: tests/test_checked_programs.py)
def test_recompute_mode_recomputes_the_gradients(plain, batch):
    state, step = make_train_step(
        TrainConfig(model=TINY, batch_size=2, coverage="every_gemm", repair="recompute"), SGD
    )
    site = TARGETS["mlp backward"]
    new_state, out = step(state, batch, plan_of(site, "nan"))
    # The detect-only pass flags it; the plan fires again in the recomputation, whose in-place
    # repair corrects it, so the recomputation's counters stand.
    assert np.asarray(out.sdc[site]).tolist() == [1, 1, 0, 0]
    jax.tree.map(lambda a, b: assert_close(a, b, jnp.float32), new_state.params, plain[0].params)


def test_coverage_errors_name_the_choices():
    with pytest.raises(ValueError, match="coverage must be one of"):
        TrainConfig(coverage="everything")
    with pytest.raises(ValueError, match="coverage must be one of"):
        CampaignConfig(coverage="mlp")
    config = CampaignConfig(model=TINY, coverage="every_gemm", sites=("decoder/**/nowhere:*",))
    with pytest.raises(ValueError, match=r"nowhere:\*' is no site of the gpt model.*--list-sites"):
        config.site_list()
    # A near miss is answered with the sites it was near.
    config = CampaignConfig(
        model=TINY, coverage="every_gemm", sites=("decoder/block_0/mlp/fc_im:*",)
    )
    with pytest.raises(ValueError, match=r"(?s)no site of the gpt model.*fc_in:dot_general"):
        config.site_list()


def test_every_gemm_campaign_reports_per_site_class(tmp_path):
    config = CampaignConfig(
        model=TINY,
        coverage="every_gemm",
        batch_size=2,
        sites=(TARGETS["mlp backward"], TARGETS["head backward"]),
        kinds=("nan",),
        trials=1,
        protections=("off", "abft"),
        warmup=1,
        steps_after=1,
        fp_steps=2,
        fp_dtypes=("fp32",),
        propagation_trials=0,
        out=tmp_path,
    )
    result = run_campaign(config, quiet())
    records = [json.loads(x) for x in (tmp_path / "trials.jsonl").read_text().splitlines()]
    assert {(r["protection"], r["site_class"], r["site_type"]) for r in records} == {
        ("off", "mlp", "gemm"),
        ("off", "head", "gemm"),
        ("abft", "mlp", "gemm"),
        ("abft", "head", "gemm"),
    }
    abft = result["summary"]["abft"]
    assert abft["per_class"]["mlp|backward|nan"]["corrected"] == 1.0
    assert abft["per_class"]["head|backward|nan"]["corrected"] == 1.0
    assert result["summary"]["off"]["classes"]["non_trainable"] == 1.0
    assert result["false_positives"][0]["alarms"] == 0
    assert result["false_positives"][0]["checked_gemms"] == 2 * len(config.gemm_sites())
    assert "## 3a. Per site class and direction" in (tmp_path / "summary.md").read_text()
