"""The interpreter of ``checked``: a jaxpr evaluated again with its GEMMs checked.

:class:`Evaluator` runs a traced program equation by equation: each selected ``dot_general``
through the checked-GEMM routine, each grouped GEMM (``ragged_dot_general``) and convolution
through a check by its own primitive (:mod:`sdcguard.protection._primitive_checks`), each
supported cuDNN attention through the ABFT flash kernel
(:mod:`sdcguard.protection._fused_attention`), and each primitive that holds jaxprs (``jit``,
``scan``, ``while``, ``cond``, ``remat``, ``custom_jvp``/``custom_vjp``, ``shard_map``,
``custom_linear_solve``) by a rule that evaluates its body the same way and carries the
counters out. Under a sharded ``jit`` each GEMM is checked per device, one counter row per
device, summed once at the end of the step (:func:`reduce_counts`). See docs/protection.md,
"How checked runs a step".
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import source_info_util
from jax.extend import core as jex_core

from sdcguard import fault_model as inject
from sdcguard._jax_compat import scan_consts_and_carry, varying_axes
from sdcguard.protection import _fused_attention as fused_attention, _sharding as sharding
from sdcguard.protection._checks import Verdict, apply_verdicts, repair_strategy
from sdcguard.protection._config import ABFTConfig, zero_counts
from sdcguard.protection._contraction import Contraction
from sdcguard.protection._gemm import GemmJob, checked_gemm, gemm_verdict, groups_checks
from sdcguard.protection._primitive_checks import CHECKED_PRIMITIVES, checked_primitive_gemm
from sdcguard.protection._select import OPENED_PRIMITIVES, SiteTable, checkable_dtype
from sdcguard.protection._trace import Traced
from sdcguard.protection._walk import Gemm, collect_gemms, is_fused_attention

Report = dict[str, jax.Array]


def varying(x: jax.Array, axes: frozenset) -> jax.Array:
    """``x`` typed as varying over the manual ``axes`` of an enclosing ``shard_map``.

    Counters computed from a device's own data vary across devices; a loop carry that holds
    them must be typed so from its first value on (``check_vma``).
    """
    missing = tuple(sorted(axes - varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


class _Deferred(NamedTuple):
    """A checked GEMM whose repair waits for its group (:meth:`Evaluator.run`)."""

    outvar: Any
    site: str
    out: jax.Array
    verdict: Verdict


def _add(total: dict, more: dict) -> dict:
    out = dict(total)
    for site, c in more.items():
        out[site] = out[site] + c if site in out else c
    return out


def _explicit_mesh(aval):
    mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
    return mesh if sharding.has_explicit_axes(mesh) else None


def _replicated(x: jax.Array) -> jax.Array:
    """``x`` whole on every device, where its type says it is sharded over explicit axes."""
    mesh = _explicit_mesh(jax.typeof(x))
    if mesh is None:
        return x
    return jax.sharding.reshard(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


def _sharded_as(x: jax.Array, aval) -> jax.Array:
    """``x`` resharded to ``aval``'s sharding over explicit axes (as it is otherwise)."""
    return x if _explicit_mesh(aval) is None else jax.sharding.reshard(x, aval.sharding)


class Evaluator:
    """Evaluates jaxprs with every selected dot_general checked, returning the counters."""

    def __init__(
        self, table: SiteTable, config: ABFTConfig, mesh=None, own_points: frozenset = frozenset()
    ):
        self.names = table.names
        self.why = table.why
        self.cores = table.cores
        self.config = config
        self.per_device: set[str] = set()  # sites whose counters are rows per device
        self.manual_axes: frozenset = frozenset()  # of the shard_map being evaluated
        # The mesh the step's inputs are sharded over under jit (None: unsharded, shard_map,
        # pmap): every GEMM outside shard_map is checked per device, its counters [rows, 4].
        self.mesh = mesh
        # Sites the function injects into itself (a drop-in layer's): a fault there is the
        # function's to inject, once, not again at a GEMM this interpreter names the same.
        self.own_points = own_points

    def plan(self, site: str, like: jax.Array):
        """The fault plan to inject at ``site`` here: None where the function has its own
        injection point of that name."""
        return None if site in self.own_points else inject.active_plan(like=like)

    @property
    def sharded(self) -> bool:
        """Whether GEMMs here are checked per device with one counter row per device."""
        return self.mesh is not None and not self.manual_axes

    def zeros(self) -> jax.Array:
        """Counters to start a loop's carry with, typed as the loop's counts will be."""
        if self.sharded:
            return sharding.zero_rows(self.mesh)
        return varying(zero_counts(), self.manual_axes)

    def counts_of(self, counts: dict, sites: list[str]) -> list[jax.Array]:
        """``counts`` of ``sites`` in order (zeros where a site did not run), carry-typed."""
        if self.sharded:
            return [counts[s] if s in counts else self.zeros() for s in sites]
        return [varying(counts.get(s, zero_counts()), self.manual_axes) for s in sites]

    def sites_in(self, jaxpr) -> list[str]:
        """The checked sites of ``jaxpr`` and everything nested in it, in a fixed order."""
        out = []
        cores: list[Gemm] = []
        for g in collect_gemms(jaxpr, cores=cores):
            name, _ = self.names[id(g.eqn)]
            if not self.why[id(g.eqn)] and name not in out:
                out.append(name)
        for c in cores:
            checked = self.cores[id(c.eqn)].checked
            out += [n for n in sorted(checked) if n not in out]
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
        # Where checked GEMMs share repair decisions (:meth:`_groups`), a checked GEMM's repair
        # waits in ``pending``, and every equation that reads its output, directly or not,
        # waits in ``postponed``, while the equations that do not go on: among them the GEMMs
        # that form one group with it (a layer's two gradient GEMMs; query, key and value).
        # The group's verdicts are applied together when a checked GEMM or an equation with
        # effects needs what waits, and at the end. XLA schedules by dataflow, not by this order.
        pending: list[_Deferred] = []
        postponed: list = []
        waiting: set = set()  # the variables pending and postponed equations write

        def evaluate(eqn):
            nonlocal counts
            invals = [read(v) for v in eqn.invars]
            name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
            place = source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack)
            with place, eqn.ctx.manager:
                deferred = self._deferred_gemm(eqn, invals)
                if deferred is not None:
                    pending.append(deferred)
                    waiting.add(deferred.outvar)
                    return
                outs, eqn_counts = self.eqn(eqn, invals)
            counts = _add(counts, eqn_counts)
            if not eqn.primitive.multiple_results:
                outs = [outs]
            for v, x in zip(eqn.outvars, outs, strict=True):
                write(v, x)

        def release():
            nonlocal counts
            if pending:
                verdicts = [p.verdict for p in pending]
                results = apply_verdicts(verdicts, [p.out for p in pending], self.config)
                for p, (out, site_counts) in zip(pending, results, strict=True):
                    write(p.outvar, out.astype(p.outvar.aval.dtype))
                    counts = _add(counts, {p.site: site_counts})
            waits = list(postponed)
            pending.clear()
            postponed.clear()
            waiting.clear()
            for eqn in waits:
                evaluate(eqn)

        for eqn in jaxpr.eqns:
            if waiting or pending:
                reads_waiting = any(
                    not isinstance(v, jex_core.Literal) and v in waiting for v in eqn.invars
                )
                if eqn.effects or (reads_waiting and self._may_defer(eqn)):
                    release()
                elif reads_waiting:
                    postponed.append(eqn)
                    waiting.update(eqn.outvars)
                    continue
            evaluate(eqn)
        release()
        return [read(v) for v in jaxpr.outvars], counts

    def _groups(self) -> bool:
        """Whether checked GEMMs here share repair decisions (:meth:`_deferred_gemm`)."""
        config = self.config
        return (
            config.correct
            and config.group_repairs
            and repair_strategy(config) == "cond"
            and not self.sharded
        )

    def _may_defer(self, eqn) -> bool:
        """Whether ``eqn`` is a GEMM whose check may join a group (before its operands are seen)."""
        return self._groups() and eqn.primitive.name == "dot_general" and not self.why[id(eqn)]

    def _deferred_gemm(self, eqn, invals) -> _Deferred | None:
        """A checked dot_general computed and checked with its repair left for later, where
        its repair can share a decision with others (:func:`groups_checks`), else None."""
        if eqn.primitive.name != "dot_general" or is_fused_attention(eqn):
            return None
        config = self.config
        lhs, rhs = invals
        if not self._groups() or self.why[id(eqn)] or not groups_checks(config, lhs, rhs):
            return None
        name, _ = self.names[id(eqn)]
        params = eqn.primitive.get_bind_params(eqn.params)
        contraction = Contraction.from_dot_general(lhs.ndim, rhs.ndim, params["dimension_numbers"])
        out, verdict = gemm_verdict(
            GemmJob(lhs, rhs, contraction, name),
            config=config,
            plan=self.plan(name, lhs),
            precision=params.get("precision"),
            preferred_element_type=params.get("preferred_element_type"),
        )
        return _Deferred(eqn.outvars[0], name, out, verdict)

    def eqn(self, eqn, invals):
        if is_fused_attention(eqn):
            return self._fused_attention(eqn, invals)
        if eqn.primitive.name in CHECKED_PRIMITIVES:
            return self._checked_by_primitive(eqn, invals)
        if eqn.primitive.name in OPENED_PRIMITIVES or eqn.primitive.name == "dot_general":
            return getattr(self, "_" + eqn.primitive.name)(eqn, invals)
        # Any other primitive runs as it is; GEMMs inside one that holds jaxprs run unchecked,
        # and list_sites says so (_not_run_checked).
        return eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params)), {}

    def _unchecked_gemm(self, eqn, invals, name: str):
        """A GEMM that runs unchecked, as it is. A fault strikes a GEMM whether or not it is
        checked: an unchecked floating GEMM keeps its injection point (a campaign's
        unprotected baseline is ``include=()``)."""
        out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
        if all(checkable_dtype(x.dtype) for x in invals[:2]):
            out = inject.apply(out, self.plan(name, out), name)
        return out, {}

    # dot_general: the GEMM, its injection point and its check.
    def _dot_general(self, eqn, invals):
        name, _ = self.names[id(eqn)]
        lhs, rhs = invals
        if self.why[id(eqn)]:
            return self._unchecked_gemm(eqn, invals, name)
        params = eqn.primitive.get_bind_params(eqn.params)
        dimension_numbers = params["dimension_numbers"]
        contraction = Contraction.from_dot_general(lhs.ndim, rhs.ndim, dimension_numbers)
        mesh = sharding.device_mesh(lhs, rhs) if self.sharded else None
        out, counts = checked_gemm(
            lhs,
            rhs,
            contraction,
            site=name,
            config=self.config,
            plan=self.plan(name, lhs),
            precision=params.get("precision"),
            preferred_element_type=params.get("preferred_element_type"),
            mesh=mesh,
        )
        out = out.astype(eqn.outvars[0].aval.dtype)
        if mesh is not None and params.get("out_sharding") is not None:
            out = jax.sharding.reshard(out, params["out_sharding"])
        if self.sharded:
            if mesh is None:  # a GEMM of values on no mesh (constants): computed alike everywhere
                counts = sharding.as_rows(counts, self.mesh)
            elif counts.shape[0] != sharding.counter_rows(self.mesh)[0]:
                counts = sharding.as_rows(jnp.sum(counts, axis=0), self.mesh)
            self.per_device.add(name)
        return out, {name: counts}

    # A grouped GEMM or a convolution, checked by its own primitive (protection._primitive_checks).
    def _checked_by_primitive(self, eqn, invals):
        name, _ = self.names[id(eqn)]
        if self.why[id(eqn)]:
            return self._unchecked_gemm(eqn, invals, name)
        out, counts = checked_primitive_gemm(
            eqn,
            invals,
            site=name,
            config=self.config,
            plan=self.plan(name, invals[0]),
            sharded=self.sharded,
        )
        if self.sharded:
            # Checked on the global arrays (XLA partitions the check with the GEMM): the same
            # counts on every device, kept once.
            counts = sharding.as_rows(counts, self.mesh)
            self.per_device.add(name)
        return out, {name: counts}

    # cuDNN attention: through the ABFT flash kernel where it can run it, else as it is.
    def _fused_attention(self, eqn, invals):
        core = self.cores[id(eqn)]
        if core.why:
            return eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params)), {}
        forward = fused_attention.is_forward(eqn)
        rule = fused_attention.forward if forward else fused_attention.backward

        def run(*invals):
            return rule(eqn, invals, path=core.path, checked=core.checked, config=self.config)

        if not self.sharded:
            return run(*invals)
        if sharding.has_explicit_axes(self.mesh):
            # The kernel is not partitioned: every device computes the whole attention (as
            # XLA has it under automatic axes, where it replicates the kernel's operands), its
            # outputs resharded as cuDNN's would be.
            whole = jax.sharding.PartitionSpec()
            run = jax.shard_map(
                run, mesh=self.mesh, in_specs=whole, out_specs=whole, check_vma=False
            )
            invals = [_replicated(x) for x in invals]
        outs, counts = run(*invals)
        outs = [_sharded_as(x, v.aval) for x, v in zip(outs, eqn.outvars, strict=True)]
        # Every device computed the same counts: kept once.
        counts = {s: sharding.as_rows(c, self.mesh) for s, c in counts.items()}
        self.per_device.update(counts)
        return outs, counts

    def _custom_linear_solve(self, eqn, invals):
        # The step is already differentiated: what runs is the solve, on its consts and b.
        p = eqn.params
        lengths, jaxprs = p["const_lengths"], p["jaxprs"]
        start = lengths.matvec + lengths.vecmat
        consts = invals[start : start + lengths.solve]
        b = invals[sum(lengths) :]
        return self.run(jaxprs.solve.jaxpr, jaxprs.solve.consts, [*consts, *b])

    # Calls whose bodies are evaluated in line.
    def _inline(self, eqn, invals, closed):
        return self.run(closed.jaxpr, closed.consts, invals)

    def _jit(self, eqn, invals):
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
        closed = p["jaxpr"]
        n_consts, n_carry = scan_consts_and_carry(p)
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


class Program(NamedTuple):
    """A traced step, its site table, and the mesh its inputs are sharded over (or None)."""

    traced: Traced
    table: SiteTable
    mesh: Any
    own_points: frozenset = frozenset()  # injection points the traced function has itself


def reduce_counts(counts: dict, per_device: set[str], mesh=None) -> Report:
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


def run_checked(program: Program, config: ABFTConfig, inputs=None) -> tuple[list, Report]:
    """The traced step with its GEMMs checked.

    Args:
      program: the step (:class:`Program`).
      config: the checks' settings.
      inputs: ``(consts, arrays)`` to run it on; None: the traced ones.

    Returns:
      ``(outputs, report)``: the jaxpr's outputs and ``{site: int32 [4]}``.
    """
    evaluator = Evaluator(program.table, config, mesh=program.mesh, own_points=program.own_points)
    traced = program.traced
    consts, arrays = inputs or (traced.closed.consts, traced.arrays)
    outs, counts = evaluator.run(traced.closed.jaxpr, consts, arrays)
    return outs, reduce_counts(counts, evaluator.per_device, evaluator.mesh)
