"""``sdcguard.checked``: every GEMM of any JAX function, forward and backward, under ABFT.

``checked(fn)`` traces ``fn`` to a jaxpr and evaluates it again with every floating-point
``dot_general`` replaced by the same GEMM followed by its checksum check (detect, locate, correct:
:func:`sdcguard.protection.checksums.check_contraction`). It works on the program, not on the model
code, so it reaches every GEMM whatever wrote it (Flax linen or NNX, Equinox, plain ``jnp``), inside
``jit``, ``scan``, ``while``, ``cond``, ``remat``, ``custom_jvp``/``custom_vjp`` bodies and
``shard_map``; and when ``fn`` is a training step that calls ``jax.grad``, the backward GEMMs that
``grad`` produced are ``dot_general`` s of the same program and are checked too.

Under sharding each device checks the GEMM it computes, on the blocks it holds: inside ``shard_map``
and ``pmap`` the program is already per device; under ``jit`` with ``NamedSharding`` (automatic or
explicit axes) each checked GEMM is partitioned by :mod:`sdcguard.protection.sharding`, and the
counters, one row per device, are summed in one all-reduce at the end of the step.

Each GEMM is a *site*, named by where it is in the model: the module path that Flax and
``jax.named_scope`` leave in the program (``Model/decoder/block_0/mlp/Dense_0:dot_general``), or,
for code without scopes, the Python call path (``loss/Block.__call__/MLP.__call__/...``); the
two gradient GEMMs of a forward GEMM carry its name with ``.grad_lhs`` / ``.grad_rhs``.
:func:`list_sites` lists them; ``ABFTConfig(include=..., exclude=...)`` selects them by glob.

Why one module: the transform is one interpreter over a jaxpr, one rule per primitive that can hold
a GEMM (``pjit``, ``scan``, ``while``, ``cond``, ``remat``, ``custom_jvp``/``custom_vjp``,
``shard_map``); the rules call each other recursively and share the naming of sites, so split they
would still be read as one.

Example:
  >>> step = sdcguard.checked(train_step)               # same arguments as train_step
  >>> (state, metrics), report = jax.jit(step)(state, batch)
  >>> report["Model/decoder/block_0/mlp/Dense_0:dot_general.grad_rhs"]   # int32 [4]
"""

from __future__ import annotations

import collections
import dataclasses
import fnmatch
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import source_info_util
from jax.extend import core as jex_core

from sdcguard.fault_model import inject
from sdcguard.in_place import apply_if
from sdcguard.protection import abft, checksums, naming, sharding
from sdcguard.protection.abft import NUM_COUNTERS, ABFTConfig

__all__ = ["GemmSite", "checked", "list_sites", "total"]

Report = dict[str, jax.Array]

_FLOAT_KINDS = {"f"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class GemmSite:
    """One ``dot_general`` of the program.

    Attributes:
      name: the site name (what fault plans and the report use).
      direction: ``'forward'``, ``'grad_lhs'`` or ``'grad_rhs'``.
      lhs_shape, rhs_shape, out_shape: the GEMM's shapes.
      dtype: the operands' dtype.
      checked: whether ``checked`` verifies it (floating point, selected by the config).
      why_unchecked: ``''`` when checked, else the reason (``'int8 operands'``, ``'excluded'``).
    """

    name: str
    direction: str
    lhs_shape: tuple[int, ...]
    rhs_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    dtype: str
    checked: bool
    why_unchecked: str


def _selected(name: str, config: ABFTConfig) -> bool:
    included = any(fnmatch.fnmatchcase(name, p) for p in config.include)
    return included and not any(fnmatch.fnmatchcase(name, p) for p in config.exclude)


def _why_unchecked(dtype, name: str, config: ABFTConfig) -> str:
    dtype = jnp.dtype(dtype)
    if dtype.kind not in _FLOAT_KINDS or dtype.itemsize < 2:
        return f"{dtype.name} operands"  # integer and fp8 GEMMs pass through
    if not _selected(name, config):
        return "excluded"
    return ""


def _site_table(
    jaxpr, config: ABFTConfig, input_paths: Sequence[str] = ()
) -> tuple[dict[int, tuple[str, str]], list[GemmSite]]:
    names = naming.name_gemms(jaxpr, input_paths)
    sites: dict[str, GemmSite] = {}
    for g in naming.collect_gemms(jaxpr):
        name, direction = names[id(g.eqn)]
        why = _why_unchecked(g.dtype, name, config)
        sites.setdefault(
            name,
            GemmSite(
                name=name,
                direction=direction,
                lhs_shape=g.lhs_shape,
                rhs_shape=g.rhs_shape,
                out_shape=g.out_shape,
                dtype=g.dtype.name,
                checked=not why,
                why_unchecked=why,
            ),
        )
    return names, list(sites.values())


# --- Evaluating the program with checked GEMMs --------------------------------------------------


def _zeros() -> jax.Array:
    return jnp.zeros((NUM_COUNTERS,), jnp.int32)


def _varying(x: jax.Array, axes: frozenset) -> jax.Array:
    """``x`` typed as varying over the manual ``axes`` of an enclosing ``shard_map``.

    Counters computed from a device's own data vary across devices; a loop carry that holds
    them must be typed so from its first value on (``check_vma``).
    """
    mat = getattr(jax.typeof(x), "mat", None)
    missing = tuple(sorted(axes - (mat.varying if mat is not None else frozenset())))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _add(total: dict, more: dict) -> dict:
    out = dict(total)
    for site, c in more.items():
        out[site] = out[site] + c if site in out else c
    return out


class _Evaluator:
    """Evaluates jaxprs with every selected dot_general checked, returning the counters."""

    def __init__(self, names: dict[int, tuple[str, str]], config: ABFTConfig, mesh=None):
        self.names = names
        self.config = config
        self.unchecked_primitives: set[str] = set()
        self.per_device: set[str] = set()  # sites whose counters are rows per device
        self.manual_axes: frozenset = frozenset()  # of the shard_map being evaluated
        # The mesh the step's inputs are sharded over under jit (None: unsharded, shard_map,
        # pmap): every GEMM outside shard_map is checked per device, its counters [rows, 4].
        self.mesh = mesh

    @property
    def sharded(self) -> bool:
        """Whether GEMMs here are checked per device with one counter row per device."""
        return self.mesh is not None and not self.manual_axes

    def zeros(self) -> jax.Array:
        """Counters to start a loop's carry with, typed as the loop's counts will be."""
        if self.sharded:
            return sharding.zero_rows(self.mesh)
        return _varying(_zeros(), self.manual_axes)

    def counts_of(self, counts: dict, sites: list[str]) -> list[jax.Array]:
        """``counts`` of ``sites`` in order (zeros where a site did not run), carry-typed."""
        if self.sharded:
            return [counts[s] if s in counts else self.zeros() for s in sites]
        return [_varying(counts.get(s, _zeros()), self.manual_axes) for s in sites]

    def sites_in(self, jaxpr) -> list[str]:
        """The checked sites of ``jaxpr`` and everything nested in it, in a fixed order."""
        out = []
        for g in naming.collect_gemms(jaxpr):
            name, _ = self.names[id(g.eqn)]
            if not _why_unchecked(g.dtype, name, self.config) and name not in out:
                out.append(name)
        return out

    def run(self, jaxpr, consts: Sequence, args: Sequence) -> tuple[list, dict]:
        env: dict = {}

        def read(v):
            return v.val if isinstance(v, jex_core.Literal) else env[v]

        def write(v, x):
            if not isinstance(v, jex_core.DropVar):
                env[v] = x

        for v, x in zip(jaxpr.constvars, consts, strict=True):
            write(v, x)
        for v, x in zip(jaxpr.invars, args, strict=True):
            write(v, x)
        counts: dict = {}
        for eqn in jaxpr.eqns:
            invals = [read(v) for v in eqn.invars]
            name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
            place = source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack)
            with place, eqn.ctx.manager:
                outs, eqn_counts = self.eqn(eqn, invals)
            counts = _add(counts, eqn_counts)
            if not eqn.primitive.multiple_results:
                outs = [outs]
            for v, x in zip(eqn.outvars, outs, strict=True):
                write(v, x)
        return [read(v) for v in jaxpr.outvars], counts

    def eqn(self, eqn, invals):
        rule = getattr(self, "_" + eqn.primitive.name, None)
        if rule is not None:
            return rule(eqn, invals)
        if any(True for _ in naming.sub_jaxprs(eqn)):
            # A higher-order primitive this transform does not open: its GEMMs run unchecked
            # (list_sites reports them).
            self.unchecked_primitives.add(eqn.primitive.name)
        return eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params)), {}

    # dot_general: the GEMM, its injection point and its check.
    def _dot_general(self, eqn, invals):
        name, _ = self.names[id(eqn)]
        lhs, rhs = invals
        why = _why_unchecked(eqn.invars[0].aval.dtype, name, self.config)
        params = eqn.primitive.get_bind_params(eqn.params)
        if why == "excluded":
            # A fault strikes a GEMM whether or not it is checked: an unchecked site keeps its
            # injection point (a campaign's unprotected baseline is ``include=()``).
            out = eqn.primitive.bind(lhs, rhs, **params)
            return inject.apply(out, inject.active_plan(like=out), name), {}
        if why:
            return eqn.primitive.bind(lhs, rhs, **params), {}
        # One stored value of each operand for the GEMM and its checksums (see abft._as_stored).
        lhs, rhs = abft._as_stored(lhs), abft._as_stored(rhs)
        spec = checksums.dot_general_to_einsum(lhs.ndim, rhs.ndim, params["dimension_numbers"])
        contraction = checksums.Contraction.parse(spec, lhs.ndim, rhs.ndim)
        plan = inject.active_plan(like=lhs)
        mesh = sharding.device_mesh(lhs, rhs) if self.sharded else None
        # Under sharding the GEMM runs on each device's blocks, so its output sharding is the
        # blocks' (an explicit ``out_sharding`` is applied to the checked result below).
        local_params = params if mesh is None else {**params, "out_sharding": None}

        def local(a, b, plan, block):
            out = eqn.primitive.bind(a, b, **local_params)
            out = block.inject(out, plan, name, axes=tuple(range(out.ndim)))
            return checksums.check_contraction(
                out, a, b, contraction, config=self.config, precision=params.get("precision")
            )

        out, counts = sharding.shard_local(local, lhs, rhs, plan, contraction, mesh=mesh)
        if mesh is not None and params.get("out_sharding") is not None:
            out = jax.sharding.reshard(out, params["out_sharding"])
        if self.sharded:
            if mesh is None:  # a GEMM of values on no mesh (constants): computed alike everywhere
                counts = sharding.as_rows(counts, self.mesh)
            elif counts.shape[0] != sharding.counter_rows(self.mesh)[0]:
                counts = sharding.as_rows(jnp.sum(counts, axis=0), self.mesh)
            self.per_device.add(name)
        return out, {name: counts}

    # Calls whose bodies are evaluated in line.
    def _inline(self, eqn, invals, closed):
        return self.run(closed.jaxpr, closed.consts, invals)

    def _pjit(self, eqn, invals):
        return self._inline(eqn, invals, eqn.params["jaxpr"])

    def _closed_call(self, eqn, invals):
        return self._inline(eqn, invals, eqn.params["call_jaxpr"])

    def _custom_jvp_call(self, eqn, invals):
        # The step is already differentiated where it needed to be: the primal body is what runs.
        return self._inline(eqn, invals, eqn.params["call_jaxpr"])

    def _custom_vjp_call(self, eqn, invals):
        return self._inline(eqn, invals, eqn.params["call_jaxpr"])

    def _remat2(self, eqn, invals):
        jaxpr = eqn.params["jaxpr"]
        sites = self.sites_in(jaxpr)

        def body(*args):
            outs, counts = self.run(jaxpr, (), args)
            return outs, self.counts_of(counts, sites)

        rematted = jax.checkpoint(
            body, prevent_cse=eqn.params["prevent_cse"], policy=eqn.params["policy"]
        )
        outs, counts = rematted(*invals)
        return outs, dict(zip(sites, counts, strict=True))

    def _scan(self, eqn, invals):
        p = eqn.params
        closed, n_consts, n_carry = p["jaxpr"], p["num_consts"], p["num_carry"]
        consts, carry, xs = (
            invals[:n_consts],
            invals[n_consts : n_consts + n_carry],
            invals[n_consts + n_carry :],
        )
        sites = self.sites_in(closed.jaxpr)
        per_iteration = self.config.per_iteration

        def body(state, x):
            carry, totals = state
            outs, counts = self.run(closed.jaxpr, closed.consts, [*consts, *carry, *x])
            step = self.counts_of(counts, sites)
            if per_iteration:
                return (outs[:n_carry], totals), (outs[n_carry:], step)
            totals = [t + c for t, c in zip(totals, step, strict=True)]
            return (outs[:n_carry], totals), (outs[n_carry:], [])

        (carry, totals), (ys, per_step) = jax.lax.scan(
            body,
            (list(carry), [self.zeros() for _ in sites]),
            list(xs),
            length=p["length"],
            reverse=p["reverse"],
            unroll=p["unroll"],
        )
        counts = per_step if per_iteration else totals
        if per_iteration and self.sharded:
            counts = [jnp.moveaxis(c, 0, 1) for c in counts]  # the device axis first
        return [*carry, *ys], dict(zip(sites, counts, strict=True))

    def _while(self, eqn, invals):
        p = eqn.params
        cond, body_jaxpr = p["cond_jaxpr"], p["body_jaxpr"]
        n_cond, n_body = p["cond_nconsts"], p["body_nconsts"]
        cond_consts, body_consts = invals[:n_cond], invals[n_cond : n_cond + n_body]
        carry = invals[n_cond + n_body :]
        sites = self.sites_in(body_jaxpr.jaxpr)

        def cond_fun(state):
            # A GEMM in a loop condition is evaluated unchecked (its counters could not leave).
            return jax.core.eval_jaxpr(cond.jaxpr, cond.consts, *cond_consts, *state[0])[0]

        def body_fun(state):
            carry, totals = state
            outs, counts = self.run(body_jaxpr.jaxpr, body_jaxpr.consts, [*body_consts, *carry])
            step = self.counts_of(counts, sites)
            return outs, [t + c for t, c in zip(totals, step, strict=True)]

        carry, totals = jax.lax.while_loop(
            cond_fun, body_fun, (list(carry), [self.zeros() for _ in sites])
        )
        return carry, dict(zip(sites, totals, strict=True))

    def _cond(self, eqn, invals):
        branches = eqn.params["branches"]
        index, operands = invals[0], invals[1:]
        sites = []
        for branch in branches:
            sites += [s for s in self.sites_in(branch.jaxpr) if s not in sites]

        def as_function(branch):
            def run_branch(*ops):
                outs, counts = self.run(branch.jaxpr, branch.consts, ops)
                return outs, self.counts_of(counts, sites)

            return run_branch

        outs, counts = jax.lax.switch(index, [as_function(b) for b in branches], *operands)
        return outs, dict(zip(sites, counts, strict=True))

    def _shard_map(self, eqn, invals):
        p = eqn.params
        jaxpr, mesh = p["jaxpr"], p["mesh"]
        sites = self.sites_in(jaxpr)
        manual = tuple(n for n in mesh.axis_names if n in p["newly_manual_axes"])
        # Counters stay on the device that computed them: one row per device, summed once, with
        # every other counter of the step, when the report is formed.
        row = jax.sharding.PartitionSpec(manual)

        def body(*args):
            outer, self.manual_axes = self.manual_axes, self.manual_axes | set(manual)
            try:
                outs, counts = self.run(jaxpr, (), args)
                return outs, [c[None] for c in self.counts_of(counts, sites)]
            finally:
                self.manual_axes = outer

        mapped = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=tuple(p["in_specs"]),
            out_specs=(list(p["out_specs"]), [row] * len(sites)),
            check_vma=p["check_vma"],
            axis_names=set(p["newly_manual_axes"]),
        )
        outs, counts = mapped(*invals)
        self.per_device.update(sites)
        return outs, dict(zip(sites, counts, strict=True))


# --- The transformation --------------------------------------------------------------------------


def _is_array(x) -> bool:
    # ShapeDtypeStruct: list_sites traces abstract arguments (make_jaxpr takes them as is).
    return isinstance(x, jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct)


class _Traced(NamedTuple):
    closed: Any  # the ClosedJaxpr of fn over its array arguments
    rebuild: Callable  # the jaxpr's outputs -> fn's output pytree
    arrays: list  # the array arguments, in the order of the jaxpr's inputs
    paths: list[str]  # each array argument's key path in ``(args, kwargs)``, ``jax.tree_util``'s


def _trace(fn, args, kwargs) -> _Traced:
    """``fn(*args, **kwargs)`` traced to a jaxpr over its array arguments.

    Only arrays are arguments of the traced program; any other leaf (a Python bool, a
    callable, an Equinox module's static field) stays what it is, as under ``eqx.filter_jit``.
    """
    with_paths, in_tree = jax.tree_util.tree_flatten_with_path((args, kwargs))
    leaves = [x for _, x in with_paths]
    dynamic = [i for i, x in enumerate(leaves) if _is_array(x)]
    out_tree = []

    def flat_fn(*arrays):
        full = list(leaves)
        for i, x in zip(dynamic, arrays, strict=True):
            full[i] = x
        a, k = jax.tree_util.tree_unflatten(in_tree, full)
        out_leaves, tree = jax.tree_util.tree_flatten(fn(*a, **k))
        out_tree.append((tree, [not _is_array(x) for x in out_leaves]))
        return [x for x in out_leaves if _is_array(x)], [x for x in out_leaves if not _is_array(x)]

    arrays = [leaves[i] for i in dynamic]
    static_out = []

    def traced(*arrays):
        outs, static = flat_fn(*arrays)
        static_out.append(static)
        return outs

    closed = jax.make_jaxpr(traced)(*arrays)
    tree, is_static = out_tree[0]

    def rebuild(outs):
        it_dyn, it_static = iter(outs), iter(static_out[0])
        return jax.tree_util.tree_unflatten(
            tree, [next(it_static) if s else next(it_dyn) for s in is_static]
        )

    paths = [jax.tree_util.keystr(with_paths[i][0]) for i in dynamic]
    return _Traced(closed, rebuild, arrays, paths)


def _reduce(counts: dict, per_device: set[str], mesh=None) -> Report:
    """Each site's counters, those kept per device (``[devices, ...]``, from ``shard_map`` or a
    sharded ``jit`` over ``mesh``) summed over the devices in one reduction for the step."""
    out = dict(counts)
    groups: dict = collections.defaultdict(list)
    for s in counts:
        if s in per_device:
            groups[counts[s].shape[0]].append(s)
    for rows in groups.values():
        flat = [counts[s].reshape(counts[s].shape[0], -1) for s in rows]
        sizes = [f.shape[1] for f in flat]
        stacked = jnp.concatenate(flat, axis=1)  # [devices, all counters]
        summed = jnp.sum(stacked, axis=0) if mesh is None else sharding.sum_rows(stacked, mesh)
        for s, part in zip(rows, jnp.split(summed, np.cumsum(sizes)[:-1]), strict=True):
            out[s] = part.reshape(counts[s].shape[1:])
    return out


def _evaluate(fn, config, args, kwargs) -> tuple[Any, Report]:
    closed, rebuild, arrays, paths = _trace(fn, args, kwargs)
    names, _ = _site_table(closed.jaxpr, config, paths)
    evaluator = _Evaluator(names, config, mesh=sharding.device_mesh(*arrays))
    outs, counts = evaluator.run(closed.jaxpr, closed.consts, arrays)
    out = rebuild(outs)
    return out, _reduce(counts, evaluator.per_device, evaluator.mesh)


def _merge_recomputed(first: dict, second: dict, second_detected) -> dict:
    """Counters after a step computed twice: those of the recomputation if it detected
    anything; else the first pass's detections were transient and recomputing corrected them."""
    corrected_by_recompute = jnp.asarray([1, 1, 0, 0], jnp.int32)
    return {
        s: jnp.where(second_detected, second[s], first[s][..., :1] * corrected_by_recompute)
        for s in first
    }


def checked(fn: Callable, config: ABFTConfig | None = None) -> Callable:
    """``fn`` with every floating-point GEMM verified (and repaired) by checksums.

    Args:
      fn: any JAX-traceable function; typically a whole training step that calls ``jax.grad``.
      config: checks and repair. ``include`` / ``exclude`` select sites by glob;
        ``correct=False`` only detects; ``recompute=True`` detects only and, when anything was
        detected, computes the whole of ``fn`` again from the same arguments with in-place
        repair (a loop of zero or one trips: a clean call computes it once); ``per_iteration``
        keeps one row of counters per ``scan`` iteration.

    Returns:
      A function with ``fn``'s arguments returning ``(fn's outputs, report)``; ``report`` maps
      each checked site to int32 ``[detected, corrected, uncorrectable, nonfinite_input]``
      (``[iterations, 4]`` inside a scan with ``per_iteration``), with no host sync.
      Faults set by :func:`sdcguard.faults` around the call are injected at their sites,
      checked or excluded (``include=()`` checks nothing and keeps every injection point).

    Example:
      >>> out, report = sdcguard.checked(train_step)(state, batch)
      >>> bad = sum(sdcguard.protection.abft.unsafe_checks(c) for c in report.values())
    """
    config = ABFTConfig() if config is None else config

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not config.recompute:
            return _evaluate(fn, config, args, kwargs)
        detect = dataclasses.replace(config, correct=False, recompute=False)
        repair = dataclasses.replace(config, correct=True, recompute=False)
        out, counts = _evaluate(fn, detect, args, kwargs)
        detected = total(counts)[0] > 0

        def again(first):
            _, first_counts = first
            out2, counts2 = _evaluate(fn, repair, args, kwargs)
            merged = _merge_recomputed(first_counts, counts2, total(counts2)[0] > 0)
            return out2, merged

        return apply_if(detected, again, (out, counts))

    return run


def total(report: Report) -> jax.Array:
    """int32 ``[4]``: the report's counters summed over sites (and iterations)."""
    out = _zeros()
    for c in report.values():
        out = out + jnp.sum(c.reshape(-1, NUM_COUNTERS), axis=0)
    return out


def list_sites(fn: Callable, *args, config: ABFTConfig | None = None, **kwargs) -> list[GemmSite]:
    """Every GEMM site of ``fn(*args, **kwargs)``, checked or not, in program order.

    Traces ``fn`` only (nothing runs). Arguments may be arrays or ``jax.ShapeDtypeStruct``.

    Example:
      >>> [s.name for s in list_sites(train_step, state, batch) if s.direction == "forward"]
    """
    config = ABFTConfig() if config is None else config
    traced = _trace(fn, args, kwargs)
    _, sites = _site_table(traced.closed.jaxpr, config, traced.paths)
    return sites
