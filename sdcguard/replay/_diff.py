"""Comparing two traces: per-tensor metrics and the first divergence, level by level.

Metrics of a compared tensor ``b`` against the reference ``a`` (Ma et al. plus the usual
fingerprints of numerical drift):

* ``mismatch_frequency``: mismatched elements / all elements (bitwise comparison);
* ``mismatch_severity``: mean relative difference ``|b - a| / max(|a|, |b|)`` over
  mismatched elements;
* ``max_abs_diff``, ``max_ulp``: worst absolute and units-in-the-last-place distance;
* ``noise_to_signal``: ``‖b - a‖₂ / ‖a‖₂``;
* ``cosine``: cosine similarity of ``a`` and ``b`` flattened.

Levels in execution order: ``inputs`` (what each node computed before training: parameters
as initialised or restored, optimizer state, batches; compared by hash, and by value where
both traces hold the tensor), ``submodule``, ``step``, ``trajectory``. Inputs that differ
between nodes that ran the same task, code and environment are a finding about the node,
not a configuration error: they come first.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from sdcguard.replay import _capture as capture, _determinism as determinism
from sdcguard.replay._trace import Trace, TraceError


class FingerprintMismatch(ValueError):
    """The traces come from different environments; their differences are not hardware faults."""

    def __init__(self, differences: list[str]):
        self.differences = differences
        super().__init__(
            "the two runs are not comparable (their differences would not be hardware "
            "faults); fingerprints differ in: "
            + "; ".join(differences)
            + "; use --allow-mismatch to compare anyway"
        )


def _ordered(bits: np.ndarray, nbits: int) -> np.ndarray:
    # Maps float bit patterns to integers that are ordered like the floats, so that the
    # difference of two of them counts the representable values in between (ULPs).
    i = bits.astype(np.int64)
    sign = np.int64(1) << (nbits - 1)
    return np.where(i >= sign, sign - i, i)


# The metrics of a compared tensor, in the order its dict holds them (after identical, size).
_METRIC_NAMES = (
    "mismatch_frequency",
    "mismatch_severity",
    "max_abs_diff",
    "max_ulp",
    "noise_to_signal",
    "cosine",
)


def _metrics(identical: bool, size: int, values, **extra) -> dict:
    """``{identical, size, *_METRIC_NAMES, **extra}``; ``values`` in ``_METRIC_NAMES`` order."""
    return {
        "identical": identical,
        "size": size,
        **dict(zip(_METRIC_NAMES, values, strict=True)),
        **extra,
    }


def tensor_metrics(a, b) -> dict:
    """Metrics of ``b`` against the reference ``a`` (same shape and dtype).

    Returns:
      ``{identical, mismatch_frequency, mismatch_severity, max_abs_diff, max_ulp,
      noise_to_signal, cosine, size}``; floats may be inf or nan (a non-finite difference).
    """
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        worst = (1.0, math.inf, math.inf, math.inf, math.inf, math.nan)
        note = f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
        return _metrics(False, int(a.size), worst, note=note)
    nbits = a.dtype.itemsize * 8
    uint = np.dtype(f"uint{nbits}") if a.dtype.kind in "fiub" else None
    ab = a.reshape(-1).view(uint) if uint is not None and a.dtype != bool else a.reshape(-1)
    bb = b.reshape(-1).view(uint) if uint is not None and b.dtype != bool else b.reshape(-1)
    mismatch = ab != bb
    count = int(mismatch.sum())
    if count == 0:  # the common case: no arithmetic needed
        return _same(int(a.size))
    fa = a.reshape(-1).astype(np.float64)
    fb = b.reshape(-1).astype(np.float64)
    with np.errstate(all="ignore"):
        d = np.abs(fb - fa)
        d = np.where(mismatch & ~np.isfinite(d), np.inf, d)  # inf-inf, nan: infinitely wrong
        # Relative to the larger magnitude: bounded (<= 2 for finite values) even where the
        # reference is 0 or denormal, where |Δ|/|a| would be astronomically large.
        rel = d / np.maximum(np.maximum(np.abs(fa), np.abs(fb)), np.finfo(np.float64).tiny)
        rel = np.where(np.isfinite(d), rel, np.inf)
        if a.dtype.kind == "f":
            ulp = np.abs(_ordered(bb[mismatch], nbits) - _ordered(ab[mismatch], nbits))
            max_ulp = float(ulp.max()) if count else 0.0
        else:
            max_ulp = float(d.max()) if count else 0.0
        norm_a = float(np.linalg.norm(np.where(np.isfinite(fa), fa, 0.0)))
        norm_d = float(np.sqrt(np.sum(d * d))) if count else 0.0
        nsr = 0.0 if count == 0 else (norm_d / norm_a if norm_a > 0 else math.inf)
        norm_b = float(np.linalg.norm(fb))
        if count == 0:
            cosine = 1.0
        elif norm_a > 0 and norm_b > 0 and math.isfinite(norm_b):
            cosine = float(np.dot(fa, fb) / (norm_a * norm_b))
        else:
            cosine = math.nan
    frequency = count / max(a.size, 1)
    severity = float(rel[mismatch].mean()) if count else 0.0
    max_abs = float(d.max()) if count else 0.0
    return _metrics(False, int(a.size), (frequency, severity, max_abs, max_ulp, nsr, cosine))


@dataclasses.dataclass
class Row:
    """One compared tensor.

    Attributes:
      level: ``inputs``, ``submodule``, ``step`` or ``trajectory``.
      name: the tensor (``decoder/block_0/mlp:output``, ``grads/embed:embedding``, ...).
      direction: ``forward``, ``backward`` or ``-``.
      module: who produced it (the submodule to blame, lock-step level), else ``-``.
      metrics: :func:`tensor_metrics`.
    """

    level: str
    name: str
    direction: str
    module: str
    metrics: dict

    @property
    def identical(self) -> bool:
        return bool(self.metrics["identical"])

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Comparison:
    """The result of comparing trace B against trace A.

    Attributes:
      levels: ``{level: {"rows": [Row...], ...}}`` in execution order.
      first_divergence: the first divergent Row in execution order, or None.
      lockstep: whether B's submodule level was lock-stepped to A.
      trajectory: per-step curves (losses, drift, synchronised gradient deviation).
      fingerprint_differences: what differs (empty unless ``allow_mismatch``).
    """

    a: dict
    b: dict
    levels: dict
    trajectory: dict
    lockstep: bool
    fingerprint_differences: list[str]

    @property
    def rows(self) -> list[Row]:
        return [r for lv in self.levels.values() for r in lv["rows"]]

    @property
    def first_divergence(self) -> Row | None:
        return next((r for r in self.rows if not r.identical), None)

    @property
    def identical(self) -> bool:
        return self.first_divergence is None

    def modules(self) -> list[dict]:
        """Submodule level per (module, direction), execution order: counts and worst case."""
        out: dict[tuple[str, str], dict] = {}
        for r in self.levels.get("submodule", {}).get("rows", []):
            m = out.setdefault(
                (r.module, r.direction),
                {
                    "module": r.module,
                    "direction": r.direction,
                    "tensors": 0,
                    "divergent": 0,
                    "mismatch_frequency": 0.0,
                    "noise_to_signal": 0.0,
                    "first": None,
                },
            )
            m["tensors"] += 1
            if not r.identical:
                m["divergent"] += 1
                m["first"] = m["first"] or r.name
                for k in ("mismatch_frequency", "noise_to_signal"):
                    m[k] = _nanmax(m[k], r.metrics[k])
        return list(out.values())

    def to_json(self) -> dict:
        first = self.first_divergence
        return {
            "identical": self.identical,
            "first_divergence": None if first is None else first.to_json(),
            "lockstep": self.lockstep,
            "node_a": self.a,
            "node_b": self.b,
            "fingerprint_differences": self.fingerprint_differences,
            "modules": self.modules(),
            "levels": {
                k: {"rows": [r.to_json() for r in v["rows"]]} for k, v in self.levels.items()
            },
            "trajectory": self.trajectory,
        }


def _nanmax(x, y):
    if isinstance(y, float) and math.isnan(y):
        return math.inf
    return max(x, y)


def _node_summary(t: Trace) -> dict:
    fp = t.manifest["fingerprint"]
    return {
        "trace": t.path,
        "host": fp.get("host"),
        "backend": fp.get("backend"),
        "device_kind": fp.get("device_kind"),
        "faults": t.manifest.get("faults", []),
        "content_hash": t.content_hash,
    }


def compare_traces(a: Trace, b: Trace, *, allow_mismatch: bool = False) -> Comparison:
    """Compares trace ``b`` (suspect) against trace ``a`` (reference).

    Example:
      >>> comparison = compare_traces(open_trace("traceA"), open_trace("traceB"))
      >>> comparison.first_divergence

    Raises:
      FingerprintMismatch: environments differ and not ``allow_mismatch``.
      TraceError: the traces do not hold comparable data.
    """
    diffs = determinism.fingerprint_differences(
        a.manifest["fingerprint"], b.manifest["fingerprint"]
    )
    if a.manifest["task"] != b.manifest["task"]:
        diffs.insert(0, f"task: {a.manifest['task']} (A) != {b.manifest['task']} (B)")
    armed_a, armed_b = (t.manifest.get("options", {}).get("armed") for t in (a, b))
    if armed_a != armed_b:  # the usual reason for different HLO: say how to fix it
        diffs.append(
            f"armed injection sites: {armed_a} (A) != {armed_b} (B); record both with the "
            "same --arm"
        )
    hashes_a, hashes_b = a.manifest.get("input_hashes"), b.manifest.get("input_hashes")
    levels: dict = {}
    if hashes_a is not None and hashes_b is not None:
        # Inputs are compared leaf by leaf below: a difference there is a finding.
        diffs = [d for d in diffs if not d.startswith("inputs[")]
        levels["inputs"] = {"rows": _input_rows(a, b, hashes_a, hashes_b)}
    if diffs and not allow_mismatch:
        raise FingerprintMismatch(diffs)
    common = [lv for lv in a.manifest["levels"] if lv in b.manifest["levels"]]
    if "submodule" in common:
        levels["submodule"] = {"rows": _submodule_rows(a, b)}
    trajectory: dict = {}
    if "step" in common or "trajectory" in common:
        if "step" in common:
            levels["step"] = {"rows": _step_rows(a, b)}
        if "trajectory" in common:
            rows, trajectory = _trajectory(a, b)
            levels["trajectory"] = {"rows": rows}
    return Comparison(
        a=_node_summary(a),
        b=_node_summary(b),
        levels=levels,
        trajectory=trajectory,
        lockstep=b.manifest.get("reference") == a.content_hash,
        fingerprint_differences=diffs,
    )


def _same(size: int) -> dict:
    return _metrics(True, size, (0.0, 0.0, 0.0, 0.0, 0.0, 1.0))


# Where a trace holds an input's values: the free run's first step, or the inputs a node
# records when they differ from its reference's.
_INPUT_KEYS = {
    "params": ("traj/free/0/params/", "inputs/params/"),
    "opt": ("traj/free/0/opt/", "inputs/opt/"),
}


def _input_value(t: Trace, key: str):
    group, _, name = key.partition("/")
    for prefix in _INPUT_KEYS.get(group, ()):
        if prefix + name in t:
            return t.get(prefix + name)
    return None


def _input_rows(a: Trace, b: Trace, hashes_a: dict, hashes_b: dict) -> list[Row]:
    """One row per input leaf, in the order of A's (then B's) hashes."""
    rows = []
    for key in [*hashes_a, *(k for k in hashes_b if k not in hashes_a)]:
        if hashes_a.get(key) == hashes_b.get(key):
            rows.append(Row("inputs", key, "-", "-", _same(-1)))
            continue
        va, vb = _input_value(a, key), _input_value(b, key)
        if va is not None and vb is not None:
            metrics = tensor_metrics(va, vb)
        else:
            # No numbers to show (None, not nan: nothing was computed wrongly).
            note = "hashes differ; the values are not in both traces"
            metrics = _metrics(False, -1, (None,) * len(_METRIC_NAMES), note=note)
        metrics["identical"] = False  # the hashes differ (dtype, shape or bytes)
        rows.append(Row("inputs", key, "-", "-", metrics))
    return rows


def _pair(a: Trace, b: Trace, key: str):
    if key not in b:
        raise TraceError(f"trace B has no {key!r}: the traces were recorded differently")
    return a.get(key), b.get(key)


def _submodule_rows(a: Trace, b: Trace) -> list[Row]:
    taps = [capture.Tap.from_json(t) for t in a.manifest["taps"]]
    if [t.to_json() for t in taps] != b.manifest["taps"]:
        raise TraceError("the traces captured different submodules (--sites differ)")
    fwd = [
        Row(
            "submodule",
            t.name,
            "forward",
            t.forward_producer,
            tensor_metrics(*_pair(a, b, f"sub/fwd/{t.name}")),
        )
        for t in taps
    ]
    fwd.append(
        Row("submodule", "loss", "forward", capture.LOSS, tensor_metrics(*_pair(a, b, "sub/loss")))
    )
    # Backward runs in reverse: a tap's cotangent is made at (minus) its forward position;
    # a module's parameter gradients just before the cotangents of its inputs.
    keyed = [
        (
            -t.order,
            Row(
                "submodule",
                t.name + ".grad",
                "backward",
                t.backward_producer,
                tensor_metrics(*_pair(a, b, f"sub/bwd/{t.name}")),
            ),
        )
        for t in taps
        if t.differentiable
    ]
    first_input = {}
    for t in taps:
        if t.kind == "input":
            first_input.setdefault(t.module, t.order)
    for name in a.manifest["params"]:
        owner = capture.owner_of_param(name)
        pos = -first_input.get(owner, -len(taps)) - 0.5
        keyed.append(
            (
                pos,
                Row(
                    "submodule",
                    name + ".grad",
                    "backward",
                    owner,
                    tensor_metrics(*_pair(a, b, f"sub/param_grad/{name}")),
                ),
            )
        )
    keyed.sort(key=lambda kr: kr[0])
    return fwd + [r for _, r in keyed]


def _step_rows(a: Trace, b: Trace) -> list[Row]:
    rows = [Row("step", "loss", "-", "-", tensor_metrics(*_pair(a, b, "traj/free/0/loss")))]
    for group, prefix in (
        ("grads", "traj/free/0/grads"),
        ("updates", "traj/free/0/updates"),
        ("new_params", "traj/free/1/params"),
    ):
        for name in a.manifest["params"]:
            rows.append(
                Row(
                    "step",
                    f"{group}/{name}",
                    "-",
                    "-",
                    tensor_metrics(*_pair(a, b, f"{prefix}/{name}")),
                )
            )
    return rows


def _flat(t: Trace, prefix: str, names) -> np.ndarray:
    # Concatenated in the parameters' own dtype, so that ULPs are counted in that dtype.
    return np.concatenate([t.get(f"{prefix}/{n}").reshape(-1) for n in names])


def _trajectory(a: Trace, b: Trace) -> tuple[list[Row], dict]:
    steps = min(a.manifest["steps"], b.manifest["steps"])
    names = a.manifest["params"]
    rows: list[Row] = []
    curves = {
        "step": list(range(steps)),
        "loss_a": [],
        "loss_b": [],
        "param_drift": [],
        "loss_b_synced": [],
        "grad_noise_to_signal_synced": [],
        "synchronised": False,
    }
    for t in range(steps):
        la, lb = _pair(a, b, f"traj/free/{t}/loss")
        curves["loss_a"].append(float(la))
        curves["loss_b"].append(float(lb))
        m = tensor_metrics(
            _flat(a, f"traj/free/{t + 1}/params", names),
            _flat(b, f"traj/free/{t + 1}/params", names),
        )
        curves["param_drift"].append(m["noise_to_signal"])
        rows.append(Row("trajectory", f"free/{t}/loss", "-", "-", tensor_metrics(la, lb)))
        rows.append(Row("trajectory", f"free/{t}/new_params", "-", "-", m))
    if "traj/sync/0/loss" in b:
        curves["synchronised"] = True
        for t in range(steps):
            la, lb = a.get(f"traj/free/{t}/loss"), b.get(f"traj/sync/{t}/loss")
            curves["loss_b_synced"].append(float(lb))
            g = tensor_metrics(
                _flat(a, f"traj/free/{t}/grads", names), _flat(b, f"traj/sync/{t}/grads", names)
            )
            curves["grad_noise_to_signal_synced"].append(g["noise_to_signal"])
            rows.append(Row("trajectory", f"synced/{t}/loss", "-", "-", tensor_metrics(la, lb)))
            rows.append(Row("trajectory", f"synced/{t}/grads", "-", "-", g))
    return rows, curves
