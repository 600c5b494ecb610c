"""The programs a replay runs, and the hooks that capture and lock-step submodules.

Two jitted programs, the same on every node: fault plans are data with a fixed number of
slots, and compared nodes compile injection code at the same ("armed") sites, so a simulated
faulty node runs exactly the program a healthy one does (same HLO, same fingerprint):

* the **train step** ``(params, opt_state, batch, plan) -> (loss, grads, updates, new_params,
  new_opt_state)``: the step/trajectory levels.
* the **capture program** ``(params, batch, plan, sinks, fwd_refs, bwd_refs, use_ref)``: one
  forward and backward pass with every selected submodule call wrapped in *taps*. A tap
  records the tensor that crosses a module boundary (inputs and outputs forward, their
  cotangents backward) and, when ``use_ref`` is set, replaces it by the reference node's value.
  That is Ma et al.'s lock-step: the suspect node computes each submodule on the healthy
  node's inputs (and, backward, on its output cotangents), so an error is seen where it arises
  and is not carried downstream. With ``use_ref`` off, the same program records a node's own
  values: the free run whose values the lock-stepped nodes read.

  The two modes are one program but not one computation. With ``use_ref`` off, XLA fuses a
  tap's producer into its consumers (a head's input cotangent is multiplied out inside the
  add that sums two heads' cotangents, and contracted into an FMA there); with it on, the
  consumers read the reference's materialised values. The roundings differ, so lock-stepped
  values are only ever compared with lock-stepped values: every node runs the lock-step, a
  node without a reference against its own free run (see ``sdcguard.replay._record``).

Who produced a tensor (the module to blame when it differs):
  forward ``m:output`` -> m; ``m:input.i`` -> m's caller (its own ops made the argument);
  backward ``m:input.i.grad`` -> m; ``m:output.grad`` -> m's caller (``loss`` for the root).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.core.tracers import current_trace

from sdcguard import fault_model as inject
from sdcguard.fault_model import module_path_name, site_id, site_pattern
from sdcguard.replay._task import ReplayTask

# Every node runs plans of this many faults (unused slots never fire), so that the compiled
# programs of a healthy and a faulty node are the same.
FAULT_SLOTS = 4
LOSS = "loss"  # producer of the loss and of the root output's cotangent
INPUTS = "(inputs)"  # producer of the root module's inputs (the batch)


def padded_plan(faults: Sequence[inject.Fault] = ()) -> inject.FaultPlan:
    """A FaultPlan with exactly FAULT_SLOTS entries; the unused ones are inert."""
    if len(faults) > FAULT_SLOTS:
        raise ValueError(f"at most {FAULT_SLOTS} faults per node, got {len(faults)}")
    return inject.FaultPlan.from_faults(list(faults), capacity=FAULT_SLOTS)


def _with_resolved_injection(
    fn,
    armed: frozenset[str],
    sizes: dict[str, int] | None = None,
    dtypes: dict[str, str] | None = None,
):
    """``fn`` traced with injection code only at the ``armed`` sites (see
    :func:`sdcguard.fault_model.restrict_sites`); ``sizes`` receives every site's element
    count, ``dtypes`` its dtype.

    The whole trace must be covered, not just the forward: the backward injection points
    (``...grad_lhs``) are traced when ``value_and_grad`` transposes, after the forward returns.
    Random fault indices are resolved on the host beforehand (:func:`resolve_plan`), so a trace
    records the element that was hit.
    """

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with inject.restrict_sites(armed, sizes=sizes, dtypes=dtypes):
            return fn(*args, **kwargs)

    return wrapped


def resolve_plan(faults: Sequence[inject.Fault], sizes: dict[str, int]) -> list[inject.Fault]:
    """Faults with a random index replaced by the index ``inject.apply`` would draw.

    Raises:
      ValueError: a fault names a site that is not in ``sizes`` (not a site of this task).
    """
    out = []
    for f in faults:
        if f.site not in sizes:
            listing = "\n  ".join(sizes)
            raise ValueError(f"unknown site {f.site!r}; valid sites:\n  {listing}")
        if f.index is None:
            index = int(inject.random_index(jnp.int32(f.seed), site_id(f.site), sizes[f.site]))
            f = dataclasses.replace(f, index=index)
        out.append(f)
    return out


def param_site(path: Sequence[str]) -> str:
    """Site of a parameter: ``decoder/block_0/mlp/fc_in:kernel`` (``model:pos_embed`` at root)."""
    return f"{module_path_name(path[:-1])}:{path[-1]}"


def _keys(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", k)) for k in path)


def _param_paths(params) -> list[tuple[str, ...]]:
    return [_keys(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]


def _inject_tree(tree, plan, suffix: str):
    """Applies the plan's faults to every leaf of a parameter-shaped tree (sites ``...suffix``)."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: inject.apply(x, plan, param_site(_keys(p)) + suffix),
        tree,
    )


@dataclasses.dataclass(frozen=True)
class Tap:
    """One tensor crossing a module boundary, as the capture program sees it.

    Attributes:
      name: e.g. ``decoder/block_0/mlp:input.0`` or ``embed:attend.output``.
      module: the module whose call it belongs to.
      kind: ``'input'`` or ``'output'``.
      forward_producer: the module whose forward ops made the value.
      backward_producer: the module whose backward ops made its cotangent.
      order: position in forward execution order (backward runs in reverse).
      shape, dtype: of the tensor.
      differentiable: whether it has a cotangent (floating dtypes).
    """

    name: str
    module: str
    kind: str
    forward_producer: str
    backward_producer: str
    order: int
    shape: tuple[int, ...]
    dtype: str
    differentiable: bool

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "shape": list(self.shape)}

    @classmethod
    def from_json(cls, d: dict) -> Tap:
        return cls(**{**d, "shape": tuple(d["shape"])})


# The tap: forward returns x (or the reference value); backward records the cotangent into the
# sink's gradient and passes on g (or the reference cotangent).
@jax.custom_vjp
def _swap(x, sink, fwd_ref, bwd_ref, use_ref):
    del sink, bwd_ref
    return jnp.where(use_ref > 0, fwd_ref, x)


def _swap_fwd(x, sink, fwd_ref, bwd_ref, use_ref):
    return _swap(x, sink, fwd_ref, bwd_ref, use_ref), (fwd_ref, bwd_ref, use_ref)


def _swap_bwd(residuals, g):
    fwd_ref, bwd_ref, use_ref = residuals
    passed = jnp.where(use_ref > 0, bwd_ref, g)
    return passed, g, jnp.zeros_like(fwd_ref), jnp.zeros_like(bwd_ref), jnp.zeros_like(use_ref)


_swap.defvjp(_swap_fwd, _swap_bwd)


def selects(pattern: str, module: str) -> bool:
    """Whether a ``--sites`` pattern selects ``module`` for capture.

    Patterns follow :func:`sdcguard.fault_model.site_pattern`. One without ``:`` is matched
    against module paths (``decoder/block_*/mlp``, ``decoder/**``); one with ``:`` names sites
    (``decoder/block_0/mlp/fc_in:kernel.grad``, ``decoder/block_1/attn:scores``) and selects the
    modules whose path its part before the last ``:`` matches.
    """
    path = pattern.rpartition(":")[0] if ":" in pattern else pattern
    return site_pattern(path).fullmatch(module) is not None


class CaptureArrays(NamedTuple):
    """The arrays a capture program taps into, each ``{tap name: array}`` but ``use_ref``.

    Attributes:
      sinks: zeros added to each differentiable tap; their gradients are its cotangents.
      fwd_refs: the reference node's value of each tap.
      bwd_refs: the reference node's cotangent of each differentiable tap.
      use_ref: float32 scalar; above 0, each tap passes the reference values on.
    """

    sinks: dict[str, jax.Array]
    fwd_refs: dict[str, jax.Array]
    bwd_refs: dict[str, jax.Array]
    use_ref: jax.Array


class Hooks:
    """The ``nn.intercept_methods`` interceptor of a replay run.

    Always: injects the plan's faults into every module output (sites ``path:output``).
    With ``capture``: taps the inputs and outputs of selected module calls.

    Args:
      plan: the (traced) fault plan.
      select: ``--sites`` patterns of the modules to capture (:func:`selects`); None = all.
      mode: ``None`` (no capture), ``'discover'`` (record Tap descriptions only), or
        ``'capture'`` (record values, swap in references when ``arrays.use_ref``).
      arrays: what the taps read (mode ``'capture'``).
    """

    def __init__(self, plan, *, select=None, mode=None, arrays: CaptureArrays | None = None):
        self.plan = plan
        self.select = select
        self.mode = mode
        self.arrays = arrays
        self.taps: list[Tap] = []
        self.records: dict[str, jax.Array] = {}
        # Modules called inside a lifted transform (nn.scan, nn.remat...), seen by no tap.
        self.inside_transforms: list[str] = []
        self._stack: list[str] = []
        self._calls: dict[str, int] = {}
        self._trace = None  # the JAX trace of the root module's call

    def selected(self, path: str) -> bool:
        if self.mode is None:
            return False
        if not self.select:
            return True
        return any(selects(p, path) for p in self.select)

    def _inside_transform(self) -> bool:
        """Whether this call runs inside a Flax lifted transform (``nn.scan``, ``nn.remat``,
        ``nn.vmap``...) or Flax's own abstract checks, i.e. in another JAX trace than the
        root module's.

        There a tensor is a value of the transform's body, not of the program: a scan body is
        traced more than once and runs once per layer, a remat body is traced apart from the
        program. A tap there would leak the body's tracers out of it and a fault there would
        name one of several traces, so such calls are run untouched: the transformed module is
        part of its caller, as any other op is.
        """
        trace = current_trace()
        if self._trace is None:
            self._trace = trace
        return trace != self._trace

    def _tap(self, name, x, *, module, kind, fwd_producer, bwd_producer):
        diff = jnp.issubdtype(x.dtype, jnp.inexact)
        if self.mode == "discover":
            self.taps.append(
                Tap(
                    name,
                    module,
                    kind,
                    fwd_producer,
                    bwd_producer,
                    len(self.taps),
                    tuple(x.shape),
                    str(x.dtype),
                    bool(diff),
                )
            )
            return x
        self.records[name] = x
        arrays = self.arrays
        if diff:
            return _swap(
                x, arrays.sinks[name], arrays.fwd_refs[name], arrays.bwd_refs[name], arrays.use_ref
            )
        return jnp.where(arrays.use_ref > 0, arrays.fwd_refs[name], x)

    def __call__(self, next_fun, args, kwargs, context):
        method = context.method_name
        if method == "setup" or (method != "__call__" and method.startswith("_")):
            return next_fun(*args, **kwargs)
        path = module_path_name(context.module.path)
        if self._inside_transform():
            # Flax's abstract checks of a module (path ()) are no call of the model's.
            if context.module.path and path not in self.inside_transforms:
                self.inside_transforms.append(path)
            return next_fun(*args, **kwargs)
        call_id = f"{path}:" + ("" if method == "__call__" else f"{method}.")
        count = self._calls.get(call_id, 0)
        self._calls[call_id] = count + 1
        suffix = f"#{count}" if count else ""
        caller = self._stack[-1] if self._stack else None
        tapped = self.selected(path)

        if tapped:
            leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
            for i, x in enumerate(leaves):
                if isinstance(x, jax.Array | np.ndarray):
                    leaves[i] = self._tap(
                        f"{call_id}input.{i}{suffix}",
                        jnp.asarray(x),
                        module=path,
                        kind="input",
                        fwd_producer=caller or INPUTS,
                        bwd_producer=path,
                    )
            args, kwargs = jax.tree_util.tree_unflatten(tree, leaves)

        self._stack.append(path)
        try:
            out = next_fun(*args, **kwargs)
        finally:
            self._stack.pop()

        leaves, tree = jax.tree_util.tree_flatten(out)
        arrays = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
        for j, i in enumerate(arrays):
            site = f"{call_id}output" + (f".{j}" if len(arrays) > 1 else "") + suffix
            x = leaves[i]
            if jnp.issubdtype(x.dtype, jnp.inexact):
                x = inject.apply(x, self.plan, site)
            if tapped:
                x = self._tap(
                    site,
                    x,
                    module=path,
                    kind="output",
                    fwd_producer=path,
                    bwd_producer=caller or LOSS,
                )
            leaves[i] = x
        return jax.tree_util.tree_unflatten(tree, leaves)


@contextlib.contextmanager
def _hooked(task: ReplayTask, hooks: Hooks, plan):
    from sdcguard.protection import ABFTConfig
    from sdcguard.protection.linen import protect

    with contextlib.ExitStack() as stack:
        stack.enter_context(inject.faults(plan))
        if task.protect_attention:
            # No checks, but the attention-internal injection points (query ... out and
            # their .grad_lhs/.grad_rhs) are live.
            stack.enter_context(protect(ABFTConfig(sites=())))
        stack.enter_context(nn.intercept_methods(hooks))
        yield


def _gemm_sites(task: ReplayTask, fn, plan):
    """``fn`` with every floating-point GEMM an injection point of ``plan`` when the task asks
    for it (``ReplayTask.gemm_sites``): :func:`sdcguard.checked` with nothing selected checks
    nothing and keeps the injection points, named by module path."""
    if not task.gemm_sites:
        return fn
    from sdcguard.protection import ABFTConfig, checked

    unchecked = checked(fn, ABFTConfig(include=()))

    def run(*args):
        with inject.faults(plan):  # the transform injects while it evaluates the program
            out, _ = unchecked(*args)
        return out

    return run


def _forward(task: ReplayTask, params, batch, step, hooks: Hooks, plan):
    task.model_state()  # made before the hooks, which would see its model.init
    with _hooked(task, hooks, plan), warnings.catch_warnings():
        # Replay compares tensors; the ABFT counts of drop-in layers are not wanted here.
        warnings.filterwarnings("ignore", "a protected attention layer was applied without")
        out = task.apply(params, batch, step)
    return task.loss(out, batch)


class Programs:
    """The jitted programs of one task (compiled once, shared by every run in a process).

    Args:
      task: the replay task.
      select: capture patterns (``--sites``), or None for every submodule.
      armed: the sites whose fault-injection code is compiled in. Nodes that are compared
        must arm the same sites (their programs, and so their HLO hashes, must be equal);
        ``sdcguard compare`` arms the sites of both nodes' fault plans.
    """

    def __init__(
        self,
        task: ReplayTask,
        select: Sequence[str] | None = None,
        armed: Iterable[str] = (),
    ):
        self.task = task
        self.select = tuple(select) if select else None
        self.armed = frozenset(armed)
        self.train_step = jax.jit(_with_resolved_injection(self._train_step, self.armed))
        self.capture = jax.jit(_with_resolved_injection(self._capture, self.armed))
        self._taps: list[Tap] | None = None
        self._discovered: Hooks | None = None
        # Compiled executables and their HLO hashes, by program name (see record.py).
        self.compiled: dict[str, tuple] = {}
        self._site_sizes: dict[str, int] | None = None
        self._site_dtypes: dict[str, str] = {}

    # --- the train step --------------------------------------------------------------------

    def _train_step(self, params, opt_state, batch, plan):
        task = self.task

        def loss_fn(p):
            return _forward(task, p, batch, plan.current_step, Hooks(plan), plan)

        loss, grads = _gemm_sites(task, jax.value_and_grad(loss_fn), plan)(params)
        grads = _inject_tree(grads, plan, ".grad")
        updates, new_opt_state = task.optimizer.update(grads, opt_state, params)
        updates = _inject_tree(updates, plan, ".update")
        new_params = optax.apply_updates(params, updates)
        return loss, grads, updates, new_params, new_opt_state

    # --- the capture (lock-step) program ---------------------------------------------------

    def discover(self, params, batch) -> Hooks:
        """Traces one forward pass (no compute) to learn the taps of the capture program."""
        if self._discovered is None:
            plan = padded_plan()
            hooks = Hooks(plan, select=self.select, mode="discover")
            # The plan is an argument (traced), as in the real programs.
            fn = _with_resolved_injection(
                lambda p, b, pl: _forward(self.task, p, b, 0, hooks, pl), frozenset()
            )
            jax.eval_shape(fn, params, batch, plan)
            self._discovered = hooks
        return self._discovered

    def site_sizes(self, params, opt_state, batch) -> dict[str, int]:
        """``{site: number of elements}`` of every injection site, in execution order.

        Traces the train step (forward, backward, optimizer) without running it.
        """
        if self._site_sizes is None:
            sizes: dict[str, int] = {}
            fn = _with_resolved_injection(self._train_step, frozenset(), sizes, self._site_dtypes)
            jax.eval_shape(fn, params, opt_state, batch, padded_plan())
            self._site_sizes = sizes
        return self._site_sizes

    def site_dtypes(self, params, opt_state, batch) -> dict[str, str]:
        """``{site: dtype name}`` of every injection site (same tracing as :meth:`site_sizes`)."""
        self.site_sizes(params, opt_state, batch)
        return self._site_dtypes

    def taps(self, params, batch) -> list[Tap]:
        return self.discover(params, batch).taps

    def _capture(self, params, batch, plan, sinks, fwd_refs, bwd_refs, use_ref):
        task = self.task

        def loss_fn(p, s):
            arrays = CaptureArrays(s, fwd_refs, bwd_refs, use_ref)
            hooks = Hooks(plan, select=self.select, mode="capture", arrays=arrays)
            loss = _forward(task, p, batch, plan.current_step, hooks, plan)
            return loss, hooks.records

        grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)
        (loss, fwd), (param_grads, bwd) = _gemm_sites(task, grad_fn, plan)(params, sinks)
        return loss, fwd, bwd, param_grads

    def capture_args(self, params, batch, refs_fwd=None, refs_bwd=None):
        """Sinks and reference arrays of the capture program (zeros where no reference)."""
        taps = self.taps(params, batch)
        sinks = {t.name: np.zeros(t.shape, t.dtype) for t in taps if t.differentiable}
        if refs_fwd is None:
            fwd = {t.name: np.zeros(t.shape, t.dtype) for t in taps}
            bwd = dict(sinks)
            use_ref = np.float32(0)
        else:
            fwd, bwd, use_ref = refs_fwd, refs_bwd, np.float32(1)
        return sinks, fwd, bwd, use_ref

    def sites(self, params, opt_state, batch) -> list[str]:
        """Every site a fault can be injected at (the names ``--inject`` accepts)."""
        return list(self.site_sizes(params, opt_state, batch))


def owner_of_param(name: str) -> str:
    """The module that owns a parameter site (``decoder/block_0/mlp/fc_in:kernel`` -> path)."""
    return name.rpartition(":")[0]


def param_names(params) -> list[str]:
    """Site names of every parameter leaf, in tree order."""
    return [param_site(p) for p in _param_paths(params)]


def flatten_params(tree) -> dict[str, np.ndarray]:
    """A parameter-shaped tree as ``{site name: array}`` (tree order)."""
    return {param_site(_keys(p)): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}
