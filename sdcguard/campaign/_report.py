"""The campaign's summary (JSON), its markdown report and its console table."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from sdcguard.campaign._config import CLASSES, PROTECTIONS
from sdcguard.campaign._studies import PROPAGATION_TENSORS
from sdcguard.fault_model import is_output_site, site_class

if TYPE_CHECKING:
    from rich.console import Console

# ATTNChecker's fixed detection threshold: an injected error |new - old| above it is one the
# paper's method would flag; sdcguard's round-off bound is far tighter on these layers.
LARGE_DELTA = 1.0

# --- Summary ------------------------------------------------------------------------------------


def _rate(xs: Sequence[bool]) -> float | None:
    return float(np.mean(xs)) if len(xs) else None


def summarize(records: Sequence[dict]) -> dict[str, Any]:
    """Per protection: class fractions, detection/correction rates overall, per kind and per bit
    over the attention sites (what ABFT protects); per site x kind over every site; module-output
    sites apart; the uncorrectable trials."""
    out: dict[str, Any] = {}
    for prot in PROTECTIONS:
        every = [r for r in records if r["protection"] == prot]
        if not every:
            continue
        recs = [r for r in every if r.get("site_type", "attention") != "output"]
        cells: dict[str, dict[str, Any]] = {}
        for r in every:
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
            "per_class": _per_class(recs),
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
        per_bit = _per_bit(recs, twins)
        if per_bit:
            out[prot]["per_bit"] = per_bit
        outputs = [r for r in every if r.get("site_type") == "output"]
        if outputs:
            out[prot]["output_sites"] = {
                "trials": len(outputs),
                "detected_at_site": _rate([r["detected"] for r in outputs]),
                "alarm_anywhere": _rate([r.get("alarm_any", False) for r in outputs]),
                "uncorrectable": _rate([r["uncorrectable"] for r in outputs]),
                "classes": {c: _rate([r["class"] == c for r in outputs]) for c in CLASSES},
            }
        if prot != "off" and twins:
            paired = [(r, twins.get((r["site"], r["kind"], r["trial"]))) for r in recs]
            harmful = [r for r, t in paired if t is not None and t["class"] != "harmless"]
            out[prot]["detection_rate_harmful"] = _rate([r["detected"] for r in harmful])
            out[prot]["harmful_trials"] = len(harmful)
            out[prot]["missed"] = [
                {
                    "key": r["key"],
                    "bit": r["bit"],
                    "old_value": r.get("old_value"),
                    "new_value": r.get("new_value"),
                    "abs_delta": r.get("abs_delta"),
                    "unprotected_class": t["class"] if t else None,
                    "unprotected_param_drift": t["param_drift"] if t else None,
                }
                for r, t in paired
                if not r["detected"]
            ]
    return out


def _per_class(recs: Sequence[dict]) -> dict[str, dict[str, Any]]:
    """Detection and correction per site class (attention, projection, MLP, head),
    direction and kind: ``"mlp|backward|nan" -> {n, detected, corrected, ...}``."""
    cells: dict[str, list[dict]] = {}
    for r in recs:
        cls = r.get("site_class") or site_class(r["site"])
        direction = r.get("direction") or ("backward" if ".grad_" in r["site"] else "forward")
        cells.setdefault(f"{cls}|{direction}|{r['kind']}", []).append(r)
    return {
        k: {
            "n": len(v),
            "detected": _rate([r["detected"] for r in v]),
            "corrected": _rate([r["corrected"] for r in v]),
            **{c: _rate([r["class"] == c for r in v]) for c in CLASSES},
        }
        for k, v in sorted(cells.items())
    }


def _per_class_lines(summ: dict) -> list[str]:
    protected = {p: s for p, s in summ.items() if s.get("per_class")}
    if not protected:
        return []
    kinds = sorted({k.split("|")[2] for s in protected.values() for k in s["per_class"]})
    lines = [
        "",
        "## 3a. Per site class and direction",
        "",
        "Detected / corrected per fault kind, over every site of the class (attention: the "
        "score and context GEMMs; projection: query, key, value and output projections; mlp; "
        "head: the output head). Unprotected: the non-trainable fraction.",
        "",
        "| protection | class | direction | trials | " + " | ".join(kinds) + " |",
        "|---|---|---|---:|" + "---:|" * len(kinds),
    ]
    for prot, s in protected.items():
        groups = sorted({tuple(k.split("|")[:2]) for k in s["per_class"]})
        for cls, direction in groups:
            cells = [s["per_class"].get(f"{cls}|{direction}|{kd}") for kd in kinds]
            n = sum(c["n"] for c in cells if c)
            if prot == "off":
                text = [_pct(c["non_trainable"]) if c else "" for c in cells]
            else:
                text = [
                    f"{_pct(c['detected'])} / {_pct(c['corrected'])}" if c else "" for c in cells
                ]
            lines.append(f"| {prot} | {cls} | {direction} | {n} | " + " | ".join(text) + " |")
    return lines


def _delta(r: dict) -> float | None:
    """|new - old| of a trial's injected element (inf when either is non-finite), or None."""
    d = r.get("abs_delta")
    if d is None:
        return None
    return float(d)  # "inf"/"nan" strings parse too


def _per_bit(recs: Sequence[dict], twins: dict) -> dict[str, dict[str, Any]]:
    """Bit-flip trials by bit: detection and correction (raw), harm of the same fault without
    protection, detection among the faults that harmed the unprotected run, and detection
    among faults whose injected error |new - old| exceeds ATTNChecker's threshold of 1."""
    flips = [r for r in recs if r["kind"] == "bitflip" and r.get("bit") is not None]
    out = {}
    for bit in sorted({r["bit"] for r in flips}):
        v = [r for r in flips if r["bit"] == bit]
        twin = [twins.get((r["site"], r["kind"], r["trial"])) for r in v]
        harmful = [r for r, t in zip(v, twin, strict=True) if t and t["class"] != "harmless"]
        known = [r for r in v if _delta(r) is not None]
        large = [r for r in known if not _delta(r) <= LARGE_DELTA]  # NaN counts as large
        out[str(bit)] = {
            "n": len(v),
            "detected": _rate([r["detected"] for r in v]),
            "corrected": _rate([r["corrected"] for r in v]),
            "harmful_unprotected": _rate([t["class"] != "harmless" for t in twin if t])
            if any(twin)
            else None,
            "harmful_n": len(harmful),
            "detected_among_harmful": _rate([r["detected"] for r in harmful]),
            "large_delta_n": len(large),
            "detected_among_large_delta": _rate([r["detected"] for r in large]),
            # NaN is an infinitely wrong value here.
            "median_abs_delta": float(
                np.median(np.nan_to_num([_delta(r) for r in known], nan=np.inf))
            )
            if known
            else None,
        }
    return out


def _value_text(m: dict) -> str:
    if m.get("old_value") is None:
        return ""
    return f" ({_g(m['old_value'])} -> {_g(m['new_value'])}, |Δ| {_g(m['abs_delta'])})"


def _g(x) -> str:
    return x if isinstance(x, str) else f"{x:.3g}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _recovery_text(path: Path) -> list[str]:
    if not path.exists():
        return [
            f"Not measured: {path} is absent. The recovery benchmark that writes it is "
            "`scripts/bench_recovery.py` of sdcguard's source repository (not installed by "
            "pip): run it from a clone, then this campaign again."
        ]
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


_MODEL_NAMES = {"gpt": "GPT (decoder)", "encoder": "encoder (masked-byte prediction)"}


def _per_bit_lines(summ: dict) -> list[str]:
    protected = {p: s for p, s in summ.items() if p != "off" and s.get("per_bit")}
    if not protected:
        return []
    lines = [
        "",
        "## 3b. Bit flips, per bit",
        "",
        "Raw rates are over every bit-flip trial. *Harmful unprotected*: the same fault (site, "
        "element, bit) made the unprotected run non-trainable or spike its loss. *|Δ| > 1*: the "
        "injected error |new - old| exceeded ATTNChecker's fixed threshold of 1 (conditioning "
        "on sdcguard's own round-off tolerance would be circular: one corrupted element is "
        "missed exactly when its error lies within that tolerance). The two conditional rates "
        "are reported beside the raw rate, never instead of it.",
        "",
        "| protection | bit | trials | detected | corrected | harmful unprotected | detected "
        "among harmful | \\|Δ\\| > 1 | detected among \\|Δ\\| > 1 | median \\|Δ\\| |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for prot, s in protected.items():
        for bit, b in s["per_bit"].items():
            med = b["median_abs_delta"]
            lines.append(
                f"| {prot} | {bit} | {b['n']} | {_pct(b['detected'])} | {_pct(b['corrected'])} "
                f"| {_pct(b['harmful_unprotected'])} | {_pct(b['detected_among_harmful'])} "
                f"({b['harmful_n']}) | {b['large_delta_n']} | "
                f"{_pct(b['detected_among_large_delta'])} | "
                f"{'-' if med is None else f'{med:.3g}'} |"
            )
    return lines


def _output_site_lines(summ: dict) -> list[str]:
    rows = {p: s["output_sites"] for p, s in summ.items() if "output_sites" in s}
    if not rows:
        return []
    lines = [
        "",
        "## 3c. Module-output sites",
        "",
        "Faults in module outputs (`path:output`) are outside the attention GEMMs that ABFT "
        "checks: ABFT cannot detect them at their site (and does not claim to). *Alarm "
        "anywhere*: ABFT flagged some attention GEMM in the fault step, downstream of the "
        "fault (forward or backward); the update guard refuses a step with uncorrectable "
        "alarms.",
        "",
        "| protection | trials | detected at site | alarm anywhere | uncorrectable | harmless "
        "| loss spike | non-trainable |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for prot, o in rows.items():
        c = o["classes"]
        lines.append(
            f"| {prot} | {o['trials']} | {_pct(o['detected_at_site'])} | "
            f"{_pct(o['alarm_anywhere'])} | {_pct(o['uncorrectable'])} | "
            f"{_pct(c['harmless'])} | {_pct(c['loss_spike'])} | {_pct(c['non_trainable'])} |"
        )
    return lines


def markdown(result: dict) -> str:
    """The human-readable report."""
    cfg, summ = result["config"], result["summary"]
    lines = [
        "# sdcguard fault-injection campaign",
        "",
        f"Reference {_MODEL_NAMES.get(cfg.get('model_kind', 'gpt'))} "
        f"{_model_text(cfg['model'])}, dtype {cfg['dtype']}, batch "
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
            k
            for k, c in s["per_cell"].items()
            if c["detected"] is not None
            and c["detected"] < 1
            and not is_output_site(k.split("|")[0])
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
                f"- `{m['key'].split('|', 1)[1]}`"
                + (f" bit {m['bit']}" if m["bit"] is not None else "")
                + _value_text(m)
                + f": unprotected {m['unprotected_class']}, parameter drift "
                f"{m['unprotected_param_drift']}"
                for m in s["missed"][:50]
            ] or ["- none"]
        lines += ["", f"Uncorrectable trials: {len(s['uncorrectable'])}"]
        lines += [f"- `{k}`" for k in s["uncorrectable"][:50]]
    lines += _per_class_lines(summ)
    lines += _per_bit_lines(summ)
    lines += _output_site_lines(summ)
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
                f"{fp['checked_matrices'] or '-'} | {fp['alarms']} |"
            )
        lines += [
            "",
            "A checked GEMM is one checked einsum call (a site in one step, forward or "
            "backward); checked matrices count each batch x head matrix of the attention "
            "GEMMs separately. Only GEMMs that were checked count.",
        ]
        lines += [f"- {_unchecked_note(fp)}" for fp in fps if fp.get("unchecked_gemms")]
    else:
        lines.append("Not run.")
    lines += ["", "## 5. Recovery cost", "", *_recovery_text(Path(result["recovery_file"]))]
    lines += ["", f"Wall time: {result['seconds']:.0f} s.", ""]
    return "\n".join(lines)


def _unchecked_note(fp: dict) -> str:
    """``bf16: 1020 GEMMs not checked (bfloat16 operands: 1020), no evidence either way``."""
    why = ", ".join(f"{k}: {v}" for k, v in sorted(fp.get("why_unchecked", {}).items()))
    return (
        f"{fp['dtype']}: {fp['unchecked_gemms']} GEMMs not checked ({why}), no evidence either way"
    )


def print_summary(result: dict, console: Console) -> None:
    """Prints the campaign's main table and one line per study (output sites, false positives)."""
    from rich.table import Table

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
        if not s["trials"]:
            continue  # only module-output trials: printed below
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
    if table.row_count:
        console.print(table)
    for prot, s in result["summary"].items():
        if "output_sites" in s:
            o = s["output_sites"]
            console.print(
                f"module-output sites, {prot}: {o['trials']} trials, detected at site "
                f"{_pct(o['detected_at_site'])}, ABFT alarm anywhere {_pct(o['alarm_anywhere'])}, "
                f"non-trainable {_pct(o['classes']['non_trainable'])}"
            )
    for fp in result["false_positives"]:
        console.print(
            f"false positives {fp['dtype']}: {fp['alarms']} alarms in "
            f"{fp['checked_gemms']} checked GEMMs"
            + (f" ({fp['checked_matrices']} matrices)" if fp.get("checked_matrices") else "")
            + (f"; {_unchecked_note(fp)}" if fp.get("unchecked_gemms") else ""),
            highlight=False,
        )
