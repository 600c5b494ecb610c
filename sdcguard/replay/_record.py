"""Runs a replay task on this machine and writes its trace (``sdcguard record``).

What one node records, per level:

* ``submodule``: a forward+backward through the capture program (see
  :mod:`sdcguard.replay._capture`) at step 0, lock-stepped: each tap computed from the
  reference values of the taps before it. Given a ``reference`` trace (the healthy node's),
  those are the reference's; without one, the node first runs freely and lock-steps to its own
  free run. Either way the values lock-stepped nodes read are kept (``sub/ref/``), so a node
  lock-stepped to this trace reads the same ones, and what is compared (``sub/fwd``,
  ``sub/bwd``, ``sub/loss``, ``sub/param_grad``) is always computed the lock-step way.
* ``step`` and ``trajectory``: T free-running steps (loss, gradients, parameters and optimizer
  state before each step, the first update). Given a reference, also T steps each started
  from the reference's parameters and optimizer state (parameter synchronisation).

Every trace also holds a hash of each input the node computed itself (each parameter leaf as
initialised or restored, each optimizer-state leaf, each batch). Given a reference whose
inputs differ, a node records those inputs and nothing else: that the node computed different
inputs from the same task is the finding (see :mod:`sdcguard.replay.diff`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np

from sdcguard import fault_model as inject
from sdcguard.fault_model import match_sites
from sdcguard.replay import _capture as capture, _determinism as determinism
from sdcguard.replay._sites import unknown_site_message
from sdcguard.replay._task import DEFAULT_TASK, ReplayTask, check_task_name, load_task
from sdcguard.replay._trace import Trace, TraceError, TraceWriter

LEVELS = ("submodule", "step", "trajectory")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecordOptions:
    """Everything that decides what a node runs (the ``sdcguard record`` flags).

    Attributes:
      task: the task, ``module:function``.
      steps, seed, checkpoint: overrides of the task's fields (None: keep the task's).
      levels: subset of LEVELS.
      sites: ``--sites`` patterns of the submodules to capture (None: all); module paths or
        site names in the grammar of :func:`sdcguard.fault_model.site_pattern`, see
        :func:`~sdcguard.replay._capture.selects`. Each must match something.
      inject: fault specs (``site=...,kind=...``) this node runs with; ``step=-1`` (the
        default) fires at every step that runs.
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
        check_task_name(self.task)
        object.__setattr__(self, "levels", tuple(self.levels))
        unknown = [lv for lv in self.levels if lv not in LEVELS]
        if not self.levels:
            raise ValueError(f"--levels: no level given; give a comma list of {', '.join(LEVELS)}")
        if unknown:
            raise ValueError(
                f"--levels: unknown level(s) {', '.join(map(repr, unknown))}; valid levels: "
                f"{', '.join(LEVELS)}"
            )
        object.__setattr__(self, "inject", tuple(self.inject))
        if self.sites is not None:
            object.__setattr__(self, "sites", tuple(self.sites))
        if self.armed is not None:
            object.__setattr__(self, "armed", tuple(sorted(set(self.armed))))

    def faults(
        self, valid_sites: Sequence[str] | None = None, *, flag: str = "--inject"
    ) -> list[inject.Fault]:
        """The parsed fault specs.

        Args:
          valid_sites: the sites a spec may name (None: any).
          flag: the flag that gave the specs (``--inject``, ``--inject-b``), named in errors.

        Raises:
          ValueError: ``FLAG 'SPEC': what is wrong`` (the bad field, the valid sites).
        """
        faults = []
        for spec in self.inject:
            try:
                faults.append(inject.parse_spec(spec, valid_sites=valid_sites))
            except ValueError as e:
                message = str(e).removeprefix(f"bad fault spec {spec!r}: ")
                raise ValueError(f"{flag} {spec!r}: {message}") from None
        return faults

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

    def run_steps(self, task: ReplayTask) -> int:
        """Training steps that run: the task's with the trajectory level, else step 0 alone."""
        return task.steps if "trajectory" in self.levels else 1


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


# --- Checking options against the task, before anything runs ---------------------------------


def check_faults(
    options: RecordOptions,
    task: ReplayTask,
    sizes: dict[str, int],
    dtypes: dict[str, str],
    *,
    flag: str = "--inject",
    transformed: Sequence[str] = (),
) -> list[inject.Fault]:
    """The parsed fault specs of ``options``, each checked against its site and the run.

    Args:
      flag: the flag that gave the specs (``--inject``, ``--inject-b``), named in errors.
      transformed: modules inside a lifted transform, where no site is (see
        :func:`unknown_site_message`).

    Raises:
      ValueError: one line naming the flag, the spec and what is wrong: an unknown site, an
        element index beyond the site's tensor, a step that does not run (or below -1, which
        means every step), a bit at or beyond the width of the site's dtype.
    """
    faults = []
    run_steps = options.run_steps(task)
    for spec in options.inject:
        f = inject.parse_spec(spec)
        if f.site not in sizes:
            message = unknown_site_message(f.site, sizes, transformed)
            raise ValueError(f"{flag} {spec!r}: {message}")
        n = sizes[f.site]
        if f.index is not None and f.index >= n:
            raise ValueError(
                f"{flag} {spec!r}: index {f.index} is beyond site {f.site!r}, which has "
                f"{n} elements (index 0 to {n - 1})"
            )
        if f.step < -1:
            raise ValueError(
                f"{flag} {spec!r}: step {f.step}; give a step from 0, or -1 for every step"
            )
        if f.step >= run_steps:
            why = (
                f"the task runs {run_steps} steps (--steps)"
                if "trajectory" in options.levels
                else "without the trajectory level only step 0 runs"
            )
            raise ValueError(
                f"{flag} {spec!r}: step {f.step} is beyond the run: {why}, so it would never fire"
            )
        if f.kind == "bitflip":
            dtype = jax.numpy.dtype(dtypes[f.site])
            width = dtype.itemsize * 8
            if f.bit >= width:
                raise ValueError(
                    f"{flag} {spec!r}: bit {f.bit} is beyond site {f.site!r}, a {dtype.name} "
                    f"tensor (bit 0 to {width - 1})"
                )
        faults.append(f)
    return faults


def check_site_patterns(patterns: Sequence[str], modules: Sequence[str], sites: Sequence[str]):
    """Every ``--sites`` pattern must select a submodule (ValueError: one line, which not).

    Args:
      patterns: the ``--sites`` patterns.
      modules: every submodule the capture program can tap.
      sites: every site name (injection sites and taps' names), for patterns with ``:``.
    """
    for p in patterns:
        if ":" in p and not match_sites(p, sites):
            raise ValueError(
                f"--sites pattern {p!r} matches no site of the task; `sdcguard sites` lists "
                "the sites and submodules ('*' matches within one path component, '**' across)"
            )
        if not any(capture.selects(p, m) for m in modules):
            raise ValueError(
                f"--sites pattern {p!r} selects no submodule of the task; `sdcguard sites` "
                "lists them ('*' matches within one path component, '**' across)"
            )


def check_options(
    options: RecordOptions,
    task: ReplayTask | None = None,
    *,
    inject_flag: str = "--inject",
    armed_by: Mapping[str, str] | None = None,
) -> list[inject.Fault]:
    """Checks fault specs, armed sites and ``--sites`` patterns against the task.

    Nothing runs: shapes come from abstract evaluation (``jax.eval_shape``).

    Args:
      options: what the node runs.
      task: the loaded task (None: loaded from ``options``).
      inject_flag: the flag that gave ``options.inject``, named in errors.
      armed_by: for armed sites that another flag put there (``sdcguard compare`` arms the
        sites of ``--inject-a`` and ``--inject-b`` on both nodes), that flag and spec, named
        when the site is unknown; other armed sites came from ``--arm``.

    Returns:
      The parsed faults.

    Raises:
      TaskError: the task cannot be loaded. ValueError: a bad spec, site or pattern.
    """
    task = task or options.load_task()
    params = task.check()
    opt_state = jax.eval_shape(task.optimizer.init, params)
    batch = task.batch(0)
    programs = programs_for(task, options)
    sizes = programs.site_sizes(params, opt_state, batch)
    dtypes = programs.site_dtypes(params, opt_state, batch)
    transformed = programs.discover(params, batch).inside_transforms
    faults = check_faults(options, task, sizes, dtypes, flag=inject_flag, transformed=transformed)
    armed = options.armed_sites()
    for site in armed:
        if site not in sizes:
            source = (armed_by or {}).get(site, "--arm")
            raise ValueError(f"{source}: {unknown_site_message(site, sizes, transformed)}")
    for f in faults:
        if f.site not in armed:  # compared nodes must compile the same injection sites
            raise ValueError(
                f"fault site {f.site!r} is not armed (armed: {', '.join(armed) or 'none'}); "
                "add it to --arm on every node compared"
            )
    if options.sites:
        every = programs_for(task, dataclasses.replace(options, sites=None))
        taps = every.taps(params, batch)
        check_site_patterns(
            options.sites, sorted({t.module for t in taps}), [*sizes, *(t.name for t in taps)]
        )
    return faults


def _leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _write_tree(writer: TraceWriter, prefix: str, named: dict) -> None:
    # Device arrays go to host one at a time and are written (streamed) as they come.
    for name, x in named.items():
        writer.add(f"{prefix}/{name}", np.asarray(x))


def record_trace(
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


def _input_hashes(params, opt_state, batches) -> dict[str, str]:
    """A hash per input leaf the node computed: ``params/<site>``, ``opt/<i>``, ``batches/<t>``."""
    out = {
        f"params/{k}": determinism.array_hash(v) for k, v in capture.flatten_params(params).items()
    }
    out.update({f"opt/{i}": determinism.array_hash(x) for i, x in enumerate(_leaves(opt_state))})
    out.update({f"batches/{t}": determinism.tree_hash(b) for t, b in enumerate(batches)})
    return out


def _record(task, options, out, reference, progress) -> dict:
    check_options(options, task)  # bad specs, sites or patterns fail before any compute
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
    run_steps = options.run_steps(task)
    batches = [task.batch(t) for t in range(task.steps)]
    inputs = {  # all of the task's batches, whichever levels run: one task, one hash
        "params": determinism.tree_hash(params),
        "opt_state": determinism.tree_hash(opt_state),
        "batches": determinism.tree_hash(batches),
    }
    input_hashes = _input_hashes(params, opt_state, batches)
    batches = batches[:run_steps]
    if reference is not None:
        ref_hashes = reference.manifest.get("input_hashes")
        if ref_hashes is not None and ref_hashes != input_hashes:
            return _record_inputs(
                task, options, out, reference, params, opt_state, batches, input_hashes
            )
        if reference.manifest["fingerprint"]["inputs"] != inputs:
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
                "input_hashes": input_hashes,
            }
        )
    except BaseException:
        writer.abort()
        raise


def _record_inputs(task, options, out, reference, params, opt_state, batches, hashes) -> dict:
    """The trace of a node whose inputs differ from the reference's: those inputs alone.

    Comparing anything computed from different inputs would blame every tensor; the inputs
    themselves are what differs, and they are kept so the report can say by how much.
    """
    ref = reference.manifest["input_hashes"]
    differ = sorted(k for k in set(ref) | set(hashes) if ref.get(k) != hashes.get(k))
    writer = TraceWriter(out)
    try:
        for name, x in capture.flatten_params(params).items():
            if f"params/{name}" in differ:
                writer.add(f"inputs/params/{name}", np.asarray(x))
        for i, leaf in enumerate(_leaves(opt_state)):
            if f"opt/{i}" in differ:
                writer.add(f"inputs/opt/{i}", leaf)
        for t, batch in enumerate(batches):
            if f"batches/{t}" in differ:
                for j, leaf in enumerate(_leaves(batch)):
                    writer.add(f"inputs/batches/{t}/{j}", leaf)
        inputs = {
            "params": determinism.tree_hash(params),
            "opt_state": determinism.tree_hash(opt_state),
            "batches": determinism.tree_hash([task.batch(t) for t in range(task.steps)]),
        }
        return writer.finish(
            {
                "task": options.task,
                "task_name": task.name,
                "options": {**dataclasses.asdict(options), "armed": options.armed_sites()},
                "levels": ["inputs"],
                "steps": 0,
                "faults": [],
                "fingerprint": determinism.fingerprint(hlo={}, inputs=inputs),
                "reference": reference.content_hash,
                "taps": [],
                "params": capture.param_names(params),
                "input_hashes": hashes,
                "inputs_differ": differ,
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
    """Records the lock-stepped capture of step 0 (and the values it was lock-stepped to).

    The free-running and the lock-stepped capture are one compiled program but compute
    differently (see :mod:`sdcguard.replay._capture`): comparing one node's free run with
    another's lock-step would blame a healthy node for XLA's fusion. So both nodes' compared
    values come from the lock-step, fed the same reference values.
    """
    taps = programs.taps(params, batch)
    plan0 = plan.at_step(0)
    if reference is not None and "submodule" in reference.manifest["levels"]:
        want = [t.to_json() for t in taps]
        if reference.manifest["taps"] != want:
            raise TraceError("the reference trace captured different submodules (--sites)")
        ref_fwd = {t.name: reference.get(f"sub/ref/fwd/{t.name}") for t in taps}
        ref_bwd = {t.name: reference.get(f"sub/ref/bwd/{t.name}") for t in taps if t.differentiable}
    else:  # no reference: this node's own free run is what it lock-steps to
        args = (params, batch, plan0, *programs.capture_args(params, batch))
        run = _compiled(programs, "capture", programs.capture, args, hlo)
        _, ref_fwd, ref_bwd, _ = run(*args)
        del args
    args = (params, batch, plan0, *programs.capture_args(params, batch, ref_fwd, ref_bwd))
    run = _compiled(programs, "capture", programs.capture, args, hlo)
    loss, fwd_out, bwd_out, param_grads = run(*args)
    del args
    for t in taps:
        writer.add(f"sub/ref/fwd/{t.name}", np.asarray(ref_fwd.pop(t.name)))
        if t.differentiable:
            writer.add(f"sub/ref/bwd/{t.name}", np.asarray(ref_bwd.pop(t.name)))
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
