"""Runs a replay task on this machine and writes its trace (``sdcguard record``).

What one node records, per level:

* ``submodule``: one forward+backward through the capture program (see
  :mod:`sdcguard.replay.capture`) at step 0. Given a ``reference`` trace (the healthy node's),
  the run is lock-stepped to it.
* ``step`` and ``trajectory``: T free-running steps (loss, gradients, parameters and optimizer
  state before each step, the first update). Given a reference, also T steps each started
  from the reference's parameters and optimizer state (parameter synchronisation).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence

import jax
import numpy as np

from sdcguard import inject
from sdcguard.replay import capture, determinism
from sdcguard.replay.task import DEFAULT_TASK, ReplayTask, load_task
from sdcguard.replay.trace import Trace, TraceError, TraceWriter

LEVELS = ("submodule", "step", "trajectory")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecordOptions:
    """Everything that decides what a node runs (the ``sdcguard record`` flags).

    Attributes:
      task: the task, ``module:function``.
      steps, seed, checkpoint: overrides of the task's fields (None: keep the task's).
      levels: subset of LEVELS.
      sites: fnmatch patterns of the submodules to capture (None: all).
      inject: fault specs (``site=...,kind=...``) this node runs with.
      armed: sites whose injection code is compiled in; every compared node must arm the
        same ones. Defaults to the sites of ``inject``.
      device: index of the local device to run on.
    """

    task: str = DEFAULT_TASK
    steps: int | None = None
    seed: int | None = None
    checkpoint: str | None = None
    levels: tuple[str, ...] = LEVELS
    sites: tuple[str, ...] | None = None
    inject: tuple[str, ...] = ()
    armed: tuple[str, ...] | None = None
    device: int = 0

    def __post_init__(self):
        object.__setattr__(self, "levels", tuple(self.levels))
        unknown = [lv for lv in self.levels if lv not in LEVELS]
        if unknown or not self.levels:
            raise ValueError(f"unknown level(s) {unknown}; valid levels: {', '.join(LEVELS)}")
        object.__setattr__(self, "inject", tuple(self.inject))
        if self.sites is not None:
            object.__setattr__(self, "sites", tuple(self.sites))
        if self.armed is not None:
            object.__setattr__(self, "armed", tuple(sorted(set(self.armed))))

    def faults(self, valid_sites: Sequence[str] | None = None) -> list[inject.Fault]:
        """The parsed fault specs (ValueError names the bad field, lists valid sites)."""
        return [inject.parse_spec(s, valid_sites=valid_sites) for s in self.inject]

    def armed_sites(self) -> tuple[str, ...]:
        if self.armed is not None:
            return self.armed
        return tuple(sorted({f.site for f in self.faults()}))

    @classmethod
    def from_json(cls, d: dict) -> RecordOptions:
        """The options stored in a trace's manifest (lists back to tuples)."""
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(
            **{k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in fields}
        )

    def load_task(self) -> ReplayTask:
        return load_task(self.task, steps=self.steps, seed=self.seed, checkpoint=self.checkpoint)


# Compiled programs, shared by every run in this process with the same task and options.
_PROGRAMS: dict[tuple, capture.Programs] = {}


def programs_for(task: ReplayTask, options: RecordOptions) -> capture.Programs:
    # The programs depend on shapes, not on parameter values: a checkpoint shares them.
    key = (options.task, options.seed, options.sites, options.armed_sites())
    cached = _PROGRAMS.get(key)
    if cached is None:
        cached = _PROGRAMS[key] = capture.Programs(
            task, select=options.sites, armed=options.armed_sites()
        )
    return cached


def _leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _write_tree(writer: TraceWriter, prefix: str, named: dict) -> None:
    # Device arrays go to host one at a time and are written (streamed) as they come.
    for name, x in named.items():
        writer.add(f"{prefix}/{name}", np.asarray(x))


def record(
    options: RecordOptions,
    out: str,
    *,
    reference: Trace | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> dict:
    """Runs the task and writes the trace to ``out``; returns its manifest.

    Args:
      options: what to run.
      out: the trace directory (created atomically).
      reference: the healthy node's trace: lock-step the submodule level and synchronise
        parameters in the trajectory level to it.
      progress: called as ``progress(phase, done, total)``.

    Raises:
      TaskError, TraceError, ValueError: bad task, reference or fault spec.
    """
    progress = progress or (lambda *_: None)
    task = options.load_task()
    devices = jax.devices()
    if not 0 <= options.device < len(devices):
        raise ValueError(f"device {options.device} does not exist here ({len(devices)} devices)")
    with jax.default_device(devices[options.device]):
        return _record(task, options, out, reference, progress)


def _record(task, options, out, reference, progress) -> dict:
    params = task.init_params()
    opt_state = task.optimizer.init(params)
    batch0 = task.batch(0)
    programs = programs_for(task, options)
    sizes = programs.site_sizes(params, opt_state, batch0)
    faults = capture.resolve_plan(options.faults(valid_sites=list(sizes)), sizes)
    for site in {f.site for f in faults} - set(options.armed_sites()):
        raise ValueError(f"fault site {site!r} is not armed (armed: {options.armed_sites()})")
    plan = capture.padded_plan(faults)
    levels = options.levels
    run_steps = task.steps if "trajectory" in levels else 1
    batches = [task.batch(t) for t in range(task.steps)]
    inputs = {  # all of the task's batches, whichever levels run: one task, one hash
        "params": determinism.tree_hash(params),
        "opt_state": determinism.tree_hash(opt_state),
        "batches": determinism.tree_hash(batches),
    }
    batches = batches[:run_steps]
    if reference is not None:
        ref_inputs = reference.manifest["fingerprint"]["inputs"]
        if ref_inputs != inputs:
            raise TraceError(
                "the reference trace was recorded from different inputs (parameters, optimizer "
                "state or batches); run both nodes with the same task"
            )
    hlo: dict[str, str] = {}
    writer = TraceWriter(out)
    try:
        taps: list[capture.Tap] = []
        if "submodule" in levels:
            taps = _record_submodule(programs, writer, params, batch0, plan, reference, hlo)
            progress("submodule", 1, 1)
        if "step" in levels or "trajectory" in levels:
            _record_steps(programs, writer, params, opt_state, batches, plan, hlo, progress)
            if reference is not None and "trajectory" in levels:
                _record_synced(
                    programs, writer, params, opt_state, batches, plan, reference, progress
                )
        fingerprint = determinism.fingerprint(hlo=hlo, inputs=inputs)
        return writer.finish(
            {
                "task": options.task,
                "task_name": task.name,
                "options": {**dataclasses.asdict(options), "armed": options.armed_sites()},
                "levels": list(levels),
                "steps": run_steps,
                "faults": [dataclasses.asdict(f) for f in faults],
                "fingerprint": fingerprint,
                "reference": None if reference is None else reference.content_hash,
                "taps": [t.to_json() for t in taps],
                "params": capture.param_names(params),
            }
        )
    except BaseException:
        writer.abort()
        raise


def _compiled(programs, name, fn, args, hlo):
    """Compiles ``fn`` for ``args`` once and notes its HLO hash (the program that runs)."""
    cache = programs.compiled
    if name not in cache:
        compiled = fn.lower(*args).compile()
        cache[name] = (compiled, determinism.hlo_hash(compiled))
    compiled, hlo[name] = cache[name]
    return compiled


def _record_submodule(programs, writer, params, batch, plan, reference, hlo):
    taps = programs.taps(params, batch)
    if reference is not None and "submodule" in reference.manifest["levels"]:
        want = [t.to_json() for t in taps]
        if reference.manifest["taps"] != want:
            raise TraceError("the reference trace captured different submodules (--sites)")
        fwd = {t.name: reference.get(f"sub/fwd/{t.name}") for t in taps}
        bwd = {t.name: reference.get(f"sub/bwd/{t.name}") for t in taps if t.differentiable}
        sinks, fwd, bwd, use_ref = programs.capture_args(params, batch, fwd, bwd)
    else:
        sinks, fwd, bwd, use_ref = programs.capture_args(params, batch)
    args = (params, batch, plan.at_step(0), sinks, fwd, bwd, use_ref)
    run = _compiled(programs, "capture", programs.capture, args, hlo)
    loss, fwd_out, bwd_out, param_grads = run(*args)
    del fwd, bwd, sinks
    writer.add("sub/loss", np.asarray(loss))
    for t in taps:
        writer.add(f"sub/fwd/{t.name}", np.asarray(fwd_out.pop(t.name)))
    for t in taps:
        if t.differentiable:
            writer.add(f"sub/bwd/{t.name}", np.asarray(bwd_out.pop(t.name)))
    _write_tree(writer, "sub/param_grad", capture.flatten_params(param_grads))
    return taps


def _record_steps(programs, writer, params, opt_state, batches, plan, hlo, progress):
    p, o = params, opt_state
    for t, batch in enumerate(batches):
        args = (p, o, batch, plan.at_step(t))
        run = _compiled(programs, "train_step", programs.train_step, args, hlo)
        loss, grads, updates, new_p, new_o = run(*args)
        prefix = f"traj/free/{t}"
        writer.add(f"{prefix}/loss", np.asarray(loss))
        _write_tree(writer, f"{prefix}/params", capture.flatten_params(p))
        _write_tree(writer, f"{prefix}/grads", capture.flatten_params(grads))
        for i, leaf in enumerate(_leaves(o)):
            writer.add(f"{prefix}/opt/{i}", leaf)
        if t == 0:
            _write_tree(writer, f"{prefix}/updates", capture.flatten_params(updates))
        p, o = new_p, new_o
        progress("steps", t + 1, len(batches))
    _write_tree(writer, f"traj/free/{len(batches)}/params", capture.flatten_params(p))


def _record_synced(programs, writer, params, opt_state, batches, plan, reference, progress):
    run = programs.compiled["train_step"][0]
    names = reference.manifest["params"]
    treedef = jax.tree.structure(params)
    opt_def = jax.tree.structure(opt_state)
    for t, batch in enumerate(batches):
        prefix = f"traj/free/{t}"
        p = jax.tree.unflatten(treedef, [reference.get(f"{prefix}/params/{n}") for n in names])
        o = jax.tree.unflatten(
            opt_def, [reference.get(f"{prefix}/opt/{i}") for i in range(opt_def.num_leaves)]
        )
        loss, grads, _, new_p, _ = run(p, o, batch, plan.at_step(t))
        writer.add(f"traj/sync/{t}/loss", np.asarray(loss))
        _write_tree(writer, f"traj/sync/{t}/grads", capture.flatten_params(grads))
        _write_tree(writer, f"traj/sync/{t + 1}/params", capture.flatten_params(new_p))
        progress("synchronised steps", t + 1, len(batches))


def open_trace(path: str) -> Trace:
    """Opens and validates a trace directory (TraceError if it is not a valid trace)."""
    return Trace(os.path.abspath(path))
