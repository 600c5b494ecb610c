"""Fault plans and fault injection: faults are data, not code.

A :class:`FaultPlan` is a pytree of arrays (one entry per fault). It is passed into jitted code as
an argument, so a campaign of thousands of different faults compiles once. Inside the traced
function, :func:`faults` makes the plan visible to every protected site; each site applies the
faults addressed to it (by :func:`sdcguard.fault_model.sites.site_id`) to the tensor it has just
produced, before any check runs -- exactly where a faulty GEMM would have put them.

Why one module: a plan, the context that carries it, the functions that apply it (whole
tensors, a device's block, module outputs) and the record of what fired share one addressing
scheme (site id, flat index, step); apart, a change to one would silently move the element
another hits.

Example:
  >>> plan = FaultPlan.from_faults([
  ...     Fault(site="decoder/block_0/attn:scores", kind="inf", index=17, step=3)])
  >>> @jax.jit
  ... def train_step(state, batch, plan):
  ...     with faults(plan.at_step(state.step)):
  ...         return step_fn(state, batch)
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import difflib
import functools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from sdcguard.fault_model.sites import (
    NEAR_INF,
    FaultKind,
    is_output_site,
    output_site_name,
    site_id,
    site_name_of,
    split_site,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fault:
    """One fault, as a person writes it.

    Attributes:
      site: full site name, e.g. ``decoder/block_0/attn:scores`` or ``...:scores.grad_lhs``
        for the backward GEMM that produces the gradient of the left operand.
      kind: one of ``inf, -inf, nan, near_inf, bitflip, value, scale``.
      index: flat element index into the site's tensor (row-major), or None for an index drawn
        from ``seed``.
      seed: seed of the random index when ``index`` is None.
      step: the training step at which the fault fires, or -1 for every step.
      bit: the bit to flip (``bitflip``), counted from the least significant bit.
      value: the value to set (``value``) or the factor (``scale``).
    """

    site: str
    kind: str
    index: int | None = None
    seed: int = 0
    step: int = -1
    bit: int = 0
    value: float = 0.0

    def __post_init__(self):
        split_site(self.site)
        kind = FaultKind.parse(self.kind)
        if self.index is not None and self.index < 0:
            raise ValueError(f"fault index must be >= 0 or None (random), got {self.index}")
        if kind == FaultKind.BITFLIP and not 0 <= self.bit < 64:
            raise ValueError(f"bitflip needs 0 <= bit < 64, got bit={self.bit}")


class FaultPlan(NamedTuple):
    """Faults as arrays: every field has shape ``[num_faults]`` except ``current_step``.

    Build one with :meth:`from_faults` or :meth:`none`; set the step with :meth:`at_step`.
    """

    site: jax.Array  # int32 site_id of the target site
    kind: jax.Array  # int32 FaultKind
    index: jax.Array  # int32 flat index, or -1 for random from `seed`
    seed: jax.Array  # int32
    step: jax.Array  # int32 step at which it fires, -1 = every step
    bit: jax.Array  # int32
    value: jax.Array  # float32
    current_step: jax.Array  # int32 scalar: the step being run now

    @classmethod
    def from_faults(cls, faults: Sequence[Fault], *, capacity: int | None = None) -> FaultPlan:
        """The plan of ``faults``, padded with inert entries to ``capacity`` if given.

        Plans of equal capacity have equal shapes, so a jitted step compiles once for all.
        """
        if capacity is not None and capacity < len(faults):
            raise ValueError(f"{len(faults)} faults do not fit in capacity={capacity}")
        pad = (capacity or len(faults)) - len(faults)

        def col(fn, dtype, inert=0):
            return np.asarray([fn(f) for f in faults] + [inert] * pad, dtype=dtype)

        return cls(
            site=col(lambda f: site_id(f.site), np.int32, inert=-1),  # no site has id -1
            kind=col(lambda f: int(FaultKind.parse(f.kind)), np.int32),
            index=col(lambda f: -1 if f.index is None else f.index, np.int32),
            seed=col(lambda f: f.seed, np.int32),
            step=col(lambda f: f.step, np.int32),
            bit=col(lambda f: f.bit, np.int32),
            value=col(lambda f: f.value, np.float32),
            current_step=np.zeros((), np.int32),
        )

    @classmethod
    def none(cls) -> FaultPlan:
        """A plan with no faults (still a valid jit argument)."""
        return cls.from_faults([])

    @property
    def num_faults(self) -> int:
        return int(np.shape(self.site)[0])

    def at_step(self, step) -> FaultPlan:
        """The same plan, with ``current_step`` set (``step`` may be a traced int)."""
        return self._replace(current_step=jnp.asarray(step, jnp.int32))


_ACTIVE_PLAN: contextvars.ContextVar[FaultPlan | None] = contextvars.ContextVar(
    "sdcguard_active_fault_plan", default=None
)


@contextlib.contextmanager
def faults(plan: FaultPlan | None) -> Iterator[None]:
    """Makes ``plan`` visible to every protected site called inside the block.

    Enter it *inside* the jitted function with the plan as an argument of that function: a plan
    captured from outside would be baked into the compiled code as a constant (the sites refuse
    that with an error, see :func:`active_plan`).
    """
    token = _ACTIVE_PLAN.set(plan)
    try:
        yield
    finally:
        _ACTIVE_PLAN.reset(token)


def _is_staged(x) -> bool:
    """Whether ``x`` is being staged out for compilation (jit), under any grad/vmap tracers."""
    while isinstance(x, jax.core.Tracer):
        if "Jaxpr" in type(x).__name__:
            return True
        x = getattr(x, "primal", getattr(x, "val", None))
    return False


def active_plan(like: jax.Array | None = None) -> FaultPlan | None:
    """The plan set by :func:`faults`, or None.

    Args:
      like: a tensor of the computation that asks. If it is traced and the plan is concrete, the
        plan would be compiled in as a constant (and silently reused for other plans), so this
        raises instead.
    """
    plan = _ACTIVE_PLAN.get()
    if plan is None or plan.num_faults == 0:
        return None
    plan_traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(plan))
    if _is_staged(like) and not plan_traced:
        raise ValueError(
            "sdcguard.faults() got a concrete FaultPlan inside a traced function: it "
            "would be compiled in as a constant and reused for every later plan. Pass the plan "
            "as an argument of the jitted function and enter faults(plan) inside it."
        )
    return plan


def corrupt(old: jax.Array, kind: jax.Array, bit: jax.Array, value: jax.Array) -> jax.Array:
    """The corrupted version of ``old`` (a scalar) for a fault of ``kind`` (all traced)."""
    dtype = old.dtype
    finfo = jnp.finfo(dtype)
    near_inf = jnp.asarray(min(NEAR_INF, float(finfo.max)), dtype)
    nbits = finfo.bits
    uint = jnp.dtype(f"uint{nbits}")
    flipped = jax.lax.bitcast_convert_type(
        jax.lax.bitcast_convert_type(old, uint)
        ^ (jnp.asarray(1, uint) << (bit % nbits).astype(uint)),
        dtype,
    )
    choices = [
        jnp.asarray(jnp.inf, dtype),
        jnp.asarray(-jnp.inf, dtype),
        jnp.asarray(jnp.nan, dtype),
        near_inf,
        flipped,
        value.astype(dtype),
        (old.astype(jnp.float32) * value).astype(dtype),
    ]
    return jnp.select([kind == k for k in FaultKind], choices, old)


def fault_hits(plan: FaultPlan, sid: int) -> jax.Array:
    """bool ``[num_faults]``: which faults of ``plan`` fire at site ``sid`` now."""
    now = (plan.step < 0) | (plan.step == plan.current_step)
    return (plan.site == sid) & now


def random_index(seed: jax.Array, sid: int, size: int) -> jax.Array:
    """A well-mixed index in ``[0, size)`` from (seed, site): a murmur3 finaliser, not a PRNG,
    because a full threefry per fault and site makes compilation of big steps slow."""
    h = seed.astype(jnp.uint32) * jnp.uint32(0x9E3779B1) + jnp.uint32(sid)
    for shift, mult in ((16, 0x85EBCA6B), (13, 0xC2B2AE35), (16, None)):
        h = h ^ (h >> jnp.uint32(shift))
        if mult is not None:
            h = h * jnp.uint32(mult)
    return (h % jnp.uint32(size)).astype(jnp.int32)


_RESTRICTION: contextvars.ContextVar[
    tuple[frozenset[str] | None, dict[str, int] | None, dict[str, str] | None]
] = contextvars.ContextVar("sdcguard_injection_restriction", default=(None, None, None))


@contextlib.contextmanager
def restrict_sites(
    armed: Iterable[str] | None = None,
    *,
    sizes: dict[str, int] | None = None,
    dtypes: dict[str, str] | None = None,
) -> Iterator[None]:
    """While tracing inside the block, compile injection code only at the ``armed`` sites.

    A model has hundreds of sites; when only a few can be targeted (a replay node with a known
    fault spec), the others then compile to nothing. Two programs traced with the same armed set
    are the same program whatever their plans. If ``sizes`` is given, it receives the element
    count of every site traced, armed or not; ``dtypes`` receives their dtype names (a bit
    flip's ``bit`` must be below the width of that dtype).

    Cover the whole trace, ``value_and_grad`` included: backward sites are traced when the
    gradient is, after the forward pass has returned.
    """
    token = _RESTRICTION.set((None if armed is None else frozenset(armed), sizes, dtypes))
    try:
        yield
    finally:
        _RESTRICTION.reset(token)


_INJECTION_POINTS: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar(
    "sdcguard_injection_points", default=None
)


@contextlib.contextmanager
def recording_injection_points(points: set[str]) -> Iterator[set[str]]:
    """While tracing inside the block, adds the name of every site that gets an injection point
    to ``points`` (armed or not, with or without a plan).

    Example:
      >>> with recording_injection_points(set()) as points:
      ...     jax.make_jaxpr(step)(params, batch)
    """
    token = _INJECTION_POINTS.set(points)
    try:
        yield points
    finally:
        _INJECTION_POINTS.reset(token)


def note_injection_point(site: str) -> None:
    """Tells :func:`recording_injection_points` that ``site`` has an injection point: what
    every injector calls (:func:`apply_in_block`, and the Pallas kernels, which inject inside
    the kernel)."""
    points = _INJECTION_POINTS.get()
    if points is not None:
        points.add(site)


def raise_if_unmatched(plan: FaultPlan | None, sites: Iterable[str]) -> None:
    """Makes the step fail when a fault of ``plan`` fires now at a site that is not in
    ``sites`` (the injection points of the step): a misspelt site would otherwise never be
    injected, and the run would look like a fault that was caught.

    Plans are data, so this is decided when the step runs: a host callback raises a
    ``ValueError`` that names the sites (with close matches among ``sites``). It runs only while
    a plan is set: steps without fault injection are unchanged.
    """
    if plan is None or plan.num_faults == 0:
        return
    sites = sorted(set(sites))
    known = jnp.asarray([site_id(s) for s in sites] or [-2], jnp.int32)
    fires_now = (plan.site >= 0) & ((plan.step < 0) | (plan.step == plan.current_step))
    unmatched = fires_now & ~jnp.isin(plan.site, known)

    def report(unmatched, ids):
        if not unmatched.any():
            return
        names = sorted({site_name_of(i) for i in ids[unmatched]})
        close = {n: difflib.get_close_matches(n, sites, n=3, cutoff=0.4) for n in names}
        raise ValueError(
            f"fault plan targets {names}, which match no injection point of this step; close "
            f"matches: {close}. sdcguard.list_sites(step, ...) lists the GEMM sites; "
            "ABFTConfig(allow_unmatched=True) accepts faults aimed elsewhere."
        )

    jax.debug.callback(report, unmatched, plan.site)


def apply(
    x: jax.Array, plan: FaultPlan | None, site: str, *, axes: tuple[int, ...] | None = None
) -> jax.Array:
    """Applies the faults of ``plan`` addressed to ``site`` at the current step to ``x``.

    The element index is taken modulo ``x.size``; a random index comes from the fault's seed
    and the site, so one seed hits a different element at each site. All faults of the plan are
    applied in one gather and one scatter. On a mesh with explicit axes (sharding in the
    types), each device corrupts the element in the block it holds.

    Args:
      x: the site's tensor, or a transpose of it (see ``axes``).
      plan: the faults; None or an empty plan returns ``x``.
      site: the site's name.
      axes: when ``x`` is ``jnp.transpose(t, axes)`` of the site's tensor ``t`` (a GEMM checked
        in its own output order), indices keep naming elements of ``t``, so a fault hits the
        same element whichever order the site is computed in.

    Example:
      >>> with sdcguard.faults(FaultPlan.from_faults([Fault(site="m:x", kind="nan", index=2)])):
      ...     y = apply(jnp.ones(4), active_plan(), "m:x")   # [1, 1, nan, 1]
    """
    spec = _explicit_spec(x)
    if spec is None or plan is None or plan.num_faults == 0:
        return apply_in_block(x, plan, site, axes=axes)
    mesh = jax.typeof(x).sharding.mesh
    names = {name for entry in spec for name in spec_axes(entry)}
    shape = x.shape

    def per_device(block, plan):
        offsets = [
            jax.lax.axis_index(spec_axes(entry)) * n if spec_axes(entry) else 0
            for entry, n in zip(spec, block.shape, strict=True)
        ]
        return apply_in_block(block, plan, site, axes=axes, global_shape=shape, offsets=offsets)

    # Each device corrupts its own block; every replica of that block alike, as they hold one
    # value. The shard_map is outside autodiff (the straight-through gradient is x's own).
    corrupted = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(P(*spec), jax.tree_util.tree_map(lambda _: P(), plan)),
        out_specs=P(*spec),
        axis_names=names,
        check_vma=False,
    )(jax.lax.stop_gradient(x), plan)
    return _straight_through(x, corrupted)


def apply_in_block(
    c: jax.Array,
    plan: FaultPlan | None,
    site: str,
    *,
    axes: tuple[int, ...] | None = None,
    global_shape: tuple[int, ...] | None = None,
    offsets: Sequence | None = None,
    owner: jax.Array | bool = True,
) -> jax.Array:
    """The faults of ``plan`` at ``site`` that fall in ``c``, a block of the site's tensor.

    This is what a device runs on the block it holds (inside ``shard_map``, or a sharded check
    of :mod:`sdcguard.protection.sharding`); :func:`apply` is the whole-tensor case.

    Args:
      c: ``[...]`` the block, in the stored order (see ``axes``).
      plan, site, axes: as in :func:`apply`; indices name elements of the whole tensor.
      global_shape: the whole tensor's shape, in the stored order (default ``c.shape``).
      offsets: per stored axis, where the block starts in the whole tensor (ints or traced);
        None for the whole tensor.
      owner: bool (traced or not): whether this device's block is the one a fault corrupts
        (False for all but one device when each holds a partial sum of the element).
    """
    if c.ndim == 0:  # a scalar site (a dot of two vectors): its one element
        one = apply_in_block(c.reshape(1), plan, site, owner=owner)
        return one.reshape(())
    global_shape = c.shape if global_shape is None else tuple(global_shape)
    size = math.prod(global_shape)
    note_injection_point(site)
    armed, sizes, dtypes = _RESTRICTION.get()
    if sizes is not None:
        sizes.setdefault(site, int(size))
    if dtypes is not None:
        dtypes.setdefault(site, str(c.dtype))
    if plan is None or plan.num_faults == 0 or (armed is not None and site not in armed):
        return c
    sid = site_id(site)
    index = jnp.where(plan.index >= 0, plan.index % size, random_index(plan.seed, sid, size))
    axes = tuple(range(c.ndim)) if axes is None else tuple(axes)
    site_shape = [0] * c.ndim
    for stored_axis, site_axis in enumerate(axes):
        site_shape[site_axis] = global_shape[stored_axis]
    coords = jnp.unravel_index(index, site_shape)
    local = [coords[a] for a in axes]
    fires = fault_hits(plan, sid)
    if offsets is not None:
        local = [x - offset for x, offset in zip(local, offsets, strict=True)]
        inside = jnp.asarray(owner)
        for x, n in zip(local, c.shape, strict=True):
            inside = inside & (x >= 0) & (x < n)
        fires = fires & inside
    flat = c.reshape(-1)
    stored = jnp.ravel_multi_index(tuple(local), c.shape, mode="clip")
    old = flat[stored]
    new = jax.vmap(corrupt)(old, plan.kind, plan.bit, plan.value)
    log = _HIT_LOG.get()
    if log is not None:
        # Only when a fault fires: a host callback at every site and step would serialise the
        # step and slow it several-fold.
        report = functools.partial(log._record, site)
        jax.lax.cond(
            jnp.any(fires),
            lambda: jax.debug.callback(report, fires, index, old, new, plan.current_step),
            lambda: None,
        )
    # Faults that do not fire are sent out of bounds and dropped, so they cannot race a firing
    # fault at the same index.
    stored = jnp.where(fires, stored, flat.size)
    return _straight_through(c, flat.at[stored].set(new, mode="drop").reshape(c.shape))


def spec_axes(entry) -> tuple[str, ...]:
    """The mesh axes one entry of a ``PartitionSpec`` splits its array axis over, major first."""
    if entry is None or entry is P.UNCONSTRAINED:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _explicit_spec(x: jax.Array) -> tuple | None:
    """``x``'s partition spec (one entry per axis) when it is split over explicit mesh axes
    outside ``shard_map``, else None (a whole tensor, or a device's own block)."""
    if jax.sharding.get_abstract_mesh().manual_axes:
        return None
    try:
        sharding = jax.typeof(x).sharding
    except (AttributeError, TypeError):
        return None
    spec = getattr(sharding, "spec", None)
    if spec is None or sharding.mesh.empty:
        return None
    spec = tuple(spec) + (None,) * (x.ndim - len(tuple(spec)))
    if not any(spec_axes(entry) for entry in spec):
        return None
    return spec


@jax.custom_jvp
def _straight_through(clean: jax.Array, corrupted: jax.Array) -> jax.Array:
    """``corrupted`` forward, the gradient of ``clean`` backward.

    A faulty chip corrupts a value, not the chain rule: the backward pass still flows through
    the element as if it were computed correctly.
    """
    return corrupted


@_straight_through.defjvp
def _straight_through_jvp(primals, tangents):
    return primals[1], tangents[0]


# --- Module outputs: sites ``path:output`` --------------------------------------------------------


@contextlib.contextmanager
def module_outputs(
    sites: Iterable[str] | None = None, *, seen: dict[str, tuple[int, ...]] | None = None
) -> Iterator[None]:
    """Injects the active plan's faults into the outputs of Flax linen modules (``path:output``).

    Inside the block, the output of every linen module's ``__call__`` whose site is armed gets
    the faults of the active plan (:func:`faults`) addressed to that site, exactly as a GEMM
    site does (:func:`apply`): forward only, with the gradient flowing straight through as if
    the output were clean. Modules whose site is not armed are untouched, so the compiled code
    changes only at armed sites. The model's code needs no change (the calls are intercepted
    with ``flax.linen.intercept_methods``).

    Site names: the module path joined by ``/``, then ``:output`` -- ``decoder/block_0:output``,
    ``decoder/block_0/mlp:output``, ``decoder/block_0/ln_mlp:output``; the top-level module is
    ``model:output``; a module returning several arrays has ``path:output.0``, ``path:output.1``
    and so on. A module called more than once is one site: its fault fires at every call. List
    a model's sites with :func:`output_sites`.

    Args:
      sites: the output sites to arm; None arms every module output (one gather and scatter
        per module call: a diagnostic setting).
      seen: receives the shape of every module output traced inside the block, armed or not.

    Raises:
      ValueError: on entry, for a name that is not an output site (backward faults, e.g.
        ``path:output.grad_lhs``, exist only at attention GEMM sites); on leaving a block that
        traced module calls, for an armed site that no module produced, listing those that were.

    Example:
      >>> plan = FaultPlan.from_faults([Fault(site="decoder/block_0/mlp:output", kind="nan")])
      >>> @jax.jit
      ... def loss_fn(params, tokens, plan):
      ...     with faults(plan), module_outputs({"decoder/block_0/mlp:output"}):
      ...         return lm_loss(model.apply({"params": params}, tokens[:, :-1]), tokens[:, 1:])
      >>> jax.grad(loss_fn)(params, tokens, plan)  # forward corrupted, gradient straight through
    """
    armed = None if sites is None else frozenset(sites)
    for name in armed or ():
        if not is_output_site(name):
            hint = (
                "output sites take forward faults only; backward faults exist at attention "
                "GEMM sites (path:scores.grad_lhs ...)"
                if ".grad" in split_site(name)[1]
                else "attention sites are armed by sdcguard.linen.protect, not here"
            )
            raise ValueError(f"{name!r} is not a module-output site 'path:output' ({hint})")
    traced: dict[str, tuple[int, ...]] = {} if seen is None else seen

    def interceptor(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        if context.method_name != "__call__":
            return out
        leaves, tree = jax.tree_util.tree_flatten(out)
        arrays = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
        for j, i in enumerate(arrays):
            x = leaves[i]
            site = output_site_name(context.module.path, j if len(arrays) > 1 else None)
            traced.setdefault(site, tuple(x.shape))
            if (armed is None or site in armed) and jnp.issubdtype(x.dtype, jnp.inexact):
                leaves[i] = apply(x, active_plan(like=x), site)
        return jax.tree_util.tree_unflatten(tree, leaves)

    with nn.intercept_methods(interceptor):
        yield
    missing = sorted((armed or frozenset()) - set(traced))
    if traced and missing:
        listing = "\n  ".join(sorted(traced))
        raise ValueError(
            f"unknown module-output sites {missing}: no module produced them; the module "
            f"outputs are:\n  {listing}"
        )


def output_sites(fn: Callable, *args, **kwargs) -> dict[str, tuple[int, ...]]:
    """Every module-output site that ``fn(*args, **kwargs)`` produces, with its shape.

    Found by abstract evaluation (``jax.eval_shape``): nothing is computed.

    Example:
      >>> sites = output_sites(lambda: model.init(jax.random.key(0), tokens))
      >>> sites["decoder/block_0/mlp:output"]
      (1, 64, 64)
    """
    seen: dict[str, tuple[int, ...]] = {}
    with module_outputs((), seen=seen):
        jax.eval_shape(functools.partial(fn, *args, **kwargs))
    return seen


# --- Recording what the faults did --------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hit:
    """One fault that fired: where, which element, and its value before and after."""

    site: str
    index: int
    old: float
    new: float
    step: int


class HitLog:
    """Receives every fault that fires in code traced inside :func:`recording_hits`.

    A diagnostic for campaigns (what did a bit flip actually do to the value?): each site that
    could fire sends its faults to the host with ``jax.debug.callback`` at every run of the
    compiled code, so use it for measurements, not in production steps.

    Example:
      >>> log = HitLog()
      >>> with recording_hits(log):
      ...     step = jax.jit(step_fn).lower(*args).compile()  # or the first (tracing) call
      >>> step(*args); log.take()
      [Hit(site='decoder/block_0/attn:scores', index=17, old=0.25, new=8.5e+37, step=3)]
    """

    def __init__(self):
        self._hits: list[Hit] = []

    def _record(self, site, fires, index, old, new, step):
        for f, i, o, n in zip(
            np.asarray(fires), np.asarray(index), np.asarray(old), np.asarray(new), strict=True
        ):
            if f:
                self._hits.append(
                    Hit(site=site, index=int(i), old=float(o), new=float(n), step=int(step))
                )

    def take(self) -> list[Hit]:
        """The hits recorded so far (waiting for pending callbacks), and forgets them."""
        jax.effects_barrier()
        hits, self._hits = self._hits, []
        return hits


_HIT_LOG: contextvars.ContextVar[HitLog | None] = contextvars.ContextVar(
    "sdcguard_hit_log", default=None
)


@contextlib.contextmanager
def recording_hits(log: HitLog) -> Iterator[HitLog]:
    """While tracing inside the block, compiles a report of every firing fault into ``log``."""
    token = _HIT_LOG.set(log)
    try:
        yield log
    finally:
        _HIT_LOG.reset(token)


# --- The command-line form of a fault: "site=...,kind=...,index=...,step=...". ---

_SPEC_FIELDS = {"site", "kind", "index", "seed", "step", "bit", "value"}


def parse_spec(spec: str, *, valid_sites: Sequence[str] | None = None) -> Fault:
    """Parses ``site=S,kind=K[,index=I][,seed=N][,step=T][,bit=B][,value=V]`` into a Fault.

    Raises:
      ValueError: naming the bad field (and listing the valid sites when the site is unknown).
    """
    fields: dict[str, str] = {}
    for part in spec.split(","):
        name, sep, val = part.partition("=")
        name = name.strip()
        if not sep or not name:
            raise ValueError(f"malformed fault spec {spec!r}: {part!r} is not 'field=value'")
        if name not in _SPEC_FIELDS:
            raise ValueError(
                f"unknown field {name!r} in fault spec; valid fields: {sorted(_SPEC_FIELDS)}"
            )
        if name in fields:  # a repeated field would silently replace the first one
            raise ValueError(f"fault spec {spec!r} gives the field {name!r} twice")
        fields[name] = val.strip()
    for required in ("site", "kind"):
        if required not in fields:
            raise ValueError(f"fault spec {spec!r} is missing the field {required!r}")
    split_site(fields["site"])
    if valid_sites is not None and fields["site"] not in valid_sites:
        listing = "\n  ".join(valid_sites)
        raise ValueError(
            f"unknown site {fields['site']!r} in field 'site'; valid sites:\n  {listing}"
        )
    kwargs: dict = {"site": fields["site"], "kind": fields["kind"]}
    for name, conv in (
        ("index", int),
        ("seed", int),
        ("step", int),
        ("bit", int),
        ("value", float),
    ):
        if name in fields:
            try:
                kwargs[name] = conv(fields[name])
            except ValueError:
                raise ValueError(
                    f"field {name!r} of fault spec must be {conv.__name__}, got {fields[name]!r}"
                ) from None
    try:
        return Fault(**kwargs)
    except ValueError as e:
        raise ValueError(f"bad fault spec {spec!r}: {e}") from None
