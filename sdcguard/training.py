"""A jitted training step for the reference models, with protection and fault plans as inputs.

This is the workload of the demo, the benchmarks and the campaigns, and a worked example of wiring
sdcguard into a training step: the fault plan is an argument (one compilation for any plan),
:func:`sdcguard.protection.linen.protect` swaps the attention layers, forward counters come back in
the ``'sdc'`` collection and backward counters as the gradient of the ``'sdc_grad'`` sinks, and
:func:`sdcguard.fault_model.module_outputs` arms the module-output sites (``path:output``)
asked for.

Two tasks share everything but the model and the loss: ``gpt`` (the decoder, next-byte
prediction) and ``encoder`` (the bidirectional encoder, masked-byte prediction with a mask drawn
from the step number, so a step is a pure function of its inputs).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from sdcguard import fault_model as inject
from sdcguard._in_place import apply_if
from sdcguard.guard import GuardState, with_triage
from sdcguard.models import GPT, Encoder, GPTConfig, init_params, lm_loss, mask_tokens, mlm_loss
from sdcguard.protection import (
    ABFTConfig,
    Counts,
    GemmSite,
    checked,
    linen,
    list_sites,
    total,
    unsafe_checks,
)
from sdcguard.recovery import TrainState  # the one state of a run: step, params, opt_state, rng

UNCHECKED = ABFTConfig(sites=())  # layers swapped, injection points live, nothing checked
# The same for `coverage="every_gemm"`: every GEMM an injection point, none checked.
UNCHECKED_GEMMS = ABFTConfig(include=())
MODEL_KINDS = ("gpt", "encoder")
REPAIRS = ("in_place", "recompute")
COVERAGES = ("attention", "every_gemm")
# The module holding the blocks of each model kind: attention sites are
# ``{stack}/block_{i}/attn:...``.
STACK_NAMES = {"gpt": "decoder", "encoder": "encoder"}
_MASK_STREAM = 0x6D61736B  # "mask"


class StepOutput(NamedTuple):
    """What one step reports (all arrays; nothing is read on the host by the step itself).

    loss: float32 scalar, before the update. grad_norm: float32 scalar, global L2 norm of the
    parameter gradients. counts: int32 ``[4]`` totals forward + backward (see
    :class:`sdcguard.protection.Counts`). sdc: the ``'sdc'`` collection (forward counters per
    layer); with
      ``coverage="every_gemm"``, the report of :func:`sdcguard.checked` (site -> counters).
    sink_grads: gradient of the ``'sdc_grad'`` collection (backward counters per layer);
      empty with ``coverage="every_gemm"`` (the report holds the backward sites too).
    """

    loss: jax.Array
    grad_norm: jax.Array
    counts: jax.Array
    sdc: dict
    sink_grads: dict


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """A training run of a reference model.

    Attributes:
      model: size of the model (the GPT and the encoder share :class:`GPTConfig`).
      model_kind: ``gpt`` (decoder, next-byte loss on ``batch[:, :-1]`` -> ``batch[:, 1:]``)
        or ``encoder`` (bidirectional, masked-byte loss on ``batch[:, :-1]``; the mask of step
        ``t`` is drawn from ``fold_in(key(seed), t)``).
      mask_rate: fraction of bytes masked per sequence (``encoder`` only).
      batch_size: sequences per batch.
      learning_rate: Adam learning rate.
      seed: parameter seed (data seed is ``seed`` too).
      abft: the checks: None (plain Flax layers, no injection points), ``UNCHECKED``
        (attention injection points, no checks), ``UNCHECKED_GEMMS`` (every GEMM an injection
        point, none checked; with ``coverage="every_gemm"``) or an ABFTConfig.
      coverage: what is checked. ``attention``: the attention layers, swapped for the
        protected drop-ins by :func:`sdcguard.protection.linen.protect` (sites
        ``decoder/block_0/attn:scores``...). ``every_gemm``: every floating-point GEMM of
        the loss and its gradients, forward and backward, by :func:`sdcguard.checked` on the
        plain model (sites ``decoder/block_0/mlp/fc_in:dot_general``... as
        :func:`sdcguard.list_sites` names them; ``abft.include``/``exclude`` select them).
      output_sites: module-output sites (``decoder/block_0/mlp:output`` ...) where the fault
        plan can inject (see :func:`sdcguard.fault_model.module_outputs`); others compile to
        nothing.
      repair: how a detected error is corrected (with ``abft.correct``). ``in_place``: each
        checked GEMM repairs its own output, in a loop that the step waits on.
        ``recompute``: the checks only detect, so nothing waits on them; a step with a
        detection is computed again (gradients and update, from the same state) with
        in-place repair and reports that pass's counters; if the second pass detects
        nothing (a transient fault does not come back), the first pass's detections are
        counted as corrected. A clean step costs detection only. With
        ``abft.correct=False`` both modes are the same detect-only step; a ``hit_log`` sees
        the faults of both passes of a recomputed step.
      triage: when the optimizer is an update guard
      (:func:`sdcguard.guard.refuse_corrupted`),
        a step it would refuse for a gradient-norm or loss spike alone is computed again
        (:func:`sdcguard.guard.with_triage`): bit-identical, the spike is real and the update
        stands; different, the first pass was corrupted and the recomputation is used. The
        recomputation runs with the fault plan disarmed: an injected fault is a transient
        one, which does not come back.

    Example:
      >>> TrainConfig(model_kind="encoder", output_sites=("encoder/block_0/mlp:output",))
    """

    model: GPTConfig = GPTConfig()
    model_kind: str = "gpt"
    mask_rate: float = 0.15
    batch_size: int = 8
    learning_rate: float = 3e-3
    seed: int = 0
    abft: ABFTConfig | None = ABFTConfig()
    output_sites: tuple[str, ...] = ()
    repair: str = "in_place"
    triage: bool = True
    coverage: str = "attention"

    def __post_init__(self):
        object.__setattr__(self, "output_sites", tuple(self.output_sites))
        if self.model_kind not in MODEL_KINDS:
            raise ValueError(
                f"model_kind must be one of {list(MODEL_KINDS)}, got {self.model_kind!r}"
            )
        if not 0 < self.mask_rate < 1:
            raise ValueError(f"mask_rate must be in (0, 1), got {self.mask_rate}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
        if self.repair not in REPAIRS:
            raise ValueError(f"repair must be one of {list(REPAIRS)}, got {self.repair!r}")
        if self.coverage not in COVERAGES:
            raise ValueError(f"coverage must be one of {list(COVERAGES)}, got {self.coverage!r}")

    @property
    def stack_name(self) -> str:
        """The module holding the blocks: ``decoder`` (gpt) or ``encoder``."""
        return STACK_NAMES[self.model_kind]


def build_model(config: TrainConfig) -> nn.Module:
    """The Flax module of ``config.model_kind``, at size ``config.model``."""
    return (GPT if config.model_kind == "gpt" else Encoder)(config.model)


def objective(config: TrainConfig) -> Callable[[Callable, jax.Array, jax.Array], jax.Array]:
    """The loss of the task: ``objective(apply, batch, step) -> float32 scalar``.

    ``apply(tokens) -> logits`` runs the model; ``batch`` is int32 ``[batch, seq_len + 1]``;
    ``step`` (int32, may be traced) seeds the encoder's mask.
    """
    if config.model_kind == "gpt":

        def gpt_objective(apply, batch, step):
            del step
            return lm_loss(apply(batch[:, :-1]), batch[:, 1:])

        return gpt_objective
    # A stream of its own: the parameters are drawn from key(seed) itself.
    mask_key = jax.random.fold_in(jax.random.key(config.seed), _MASK_STREAM)

    def encoder_objective(apply, batch, step):
        key = jax.random.fold_in(mask_key, step)
        inputs, targets, weights = mask_tokens(batch[:, :-1], key, config.mask_rate)
        return mlm_loss(apply(inputs), targets, weights)

    return encoder_objective


def model_output_sites(config: TrainConfig) -> dict[str, tuple[int, ...]]:
    """Every module-output site of the model of ``config`` (batch 1), with its shape."""
    model = build_model(config)
    tokens = jnp.zeros((1, config.model.seq_len), jnp.int32)
    return inject.output_sites(lambda: model.init(jax.random.key(0), tokens))


def gemm_site_table(config: TrainConfig, abft: ABFTConfig | None = None) -> list[GemmSite]:
    """Every GEMM of the model's loss and gradients (batch 1), checked or not, as
    :func:`sdcguard.list_sites` reports it under ``abft`` (default ``ABFTConfig()``).

    Traces only (nothing runs).
    """
    model = build_model(config)
    task_loss = objective(config)
    params = jax.eval_shape(lambda: init_params(model, config.seed))
    batch = jax.ShapeDtypeStruct((1, config.model.seq_len + 1), jnp.int32)

    def loss_and_grads(params, batch):
        return jax.value_and_grad(
            lambda p: task_loss(lambda t: model.apply({"params": p}, t), batch, 0)
        )(params)

    return list_sites(loss_and_grads, params, batch, config=abft)


def gemm_sites(config: TrainConfig) -> list[str]:
    """Every floating-point GEMM site of the model's loss and gradients (batch 1), as
    :func:`sdcguard.checked` names them with ``coverage="every_gemm"``: forward, then backward.

    Traces only (nothing runs).
    """
    sites = gemm_site_table(config)
    forward = [s.name for s in sites if s.direction == "forward" and s.checked]
    backward = [s.name for s in sites if s.direction != "forward" and s.checked]
    return forward + backward


def _check_output_sites(config: TrainConfig) -> None:
    if not config.output_sites:
        return
    valid = model_output_sites(config)
    unknown = [s for s in config.output_sites if s not in valid]
    if unknown:
        listing = "\n  ".join(valid)
        raise ValueError(
            f"unknown module-output sites {unknown} for the {config.model_kind} model; valid "
            f"output sites:\n  {listing}"
        )


def _sinks(model: nn.Module, config: GPTConfig):
    tokens = jnp.zeros((1, config.seq_len), jnp.int32)
    with linen.protect(UNCHECKED):
        return linen.init_sinks(model, tokens)


def merge_counts(first: jax.Array, second: jax.Array, second_detected: jax.Array) -> jax.Array:
    """One site's counters ``[..., 4]`` after a step computed twice
    (``repair='recompute'``).

    ``first`` are the detect-only counts (``[d, 0, u, n]``, ``u + n = d``: nothing is repaired,
    so a detection is uncorrectable or, from a non-finite operand, ``nonfinite_input``),
    ``second`` those of the recomputation
    with in-place repair, ``second_detected`` whether the recomputation detected anything at
    any site. If it did, its counters stand: the first pass's also count the sites an error
    reached downstream, since nothing was repaired there. If it did not, the fault did not come
    back and recomputing corrected it: ``[d, d, 0, 0]``.
    """
    recomputed = Counts.all_corrected(first)
    return jnp.where(second_detected, second, recomputed)


def make_train_step(
    config: TrainConfig,
    optimizer: optax.GradientTransformation | None = None,
    *,
    hit_log: inject.HitLog | None = None,
) -> tuple[TrainState, Callable]:
    """The initial state and the jitted step ``step(state, batch, plan) -> (state, StepOutput)``.

    ``batch`` is int32 ``[batch, seq_len + 1]`` (the GPT's inputs and shifted targets; the encoder
    reads the first ``seq_len`` bytes); ``plan`` is a :class:`sdcguard.fault_model.FaultPlan`
    (``FaultPlan.none()`` for a clean step).

    Args:
      config: the run.
      optimizer: default ``optax.adam(config.learning_rate)``; it receives ``loss`` and
        ``abft_uncorrectable`` (:func:`sdcguard.protection.unsafe_checks` of the counters) as
        extra arguments (an update guard reads them; with ``config.triage`` its spikes are triaged).
      hit_log: if given, every fault that fires is reported to it (a diagnostic; see
        :class:`sdcguard.fault_model.HitLog`).

    Raises:
      ValueError: an output site that the model does not have (the valid ones are listed).

    Example:
      >>> state, step = make_train_step(TrainConfig(model_kind="encoder"))
      >>> state, out = step(state, ByteBatches().batch(0), FaultPlan.none())
    """
    _check_output_sites(config)
    model = build_model(config)
    task_loss = objective(config)
    # Extra args (loss, ABFT counts) reach an update guard and are ignored by plain optimizers.
    optimizer = optax.with_extra_args_support(optimizer or optax.adam(config.learning_rate))
    params = init_params(model, config.seed)
    # The key is carried for train_with_recovery's snapshots; the reference step draws none.
    rng = jax.random.key(config.seed)
    state = TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params), rng)
    protected = config.abft is not None
    drop_ins = protected and config.coverage == "attention"
    whole_step = protected and config.coverage == "every_gemm"
    sinks = _sinks(model, config.model) if drop_ins else {}

    def loss_fn(params, sinks, batch, plan, step, abft):
        sdc = {}

        def apply(tokens):
            if not drop_ins:
                return model.apply({"params": params}, tokens)
            logits, updated = model.apply(
                {"params": params, "sdc_grad": sinks}, tokens, mutable=["sdc"]
            )
            sdc.update(updated["sdc"])
            return logits

        with contextlib.ExitStack() as stack:
            if hit_log is not None:
                stack.enter_context(inject.recording_hits(hit_log))
            if drop_ins or config.output_sites:
                stack.enter_context(inject.faults(plan))
            if drop_ins:
                stack.enter_context(linen.protect(abft))
            if config.output_sites:
                stack.enter_context(inject.module_outputs(config.output_sites))
            loss = task_loss(apply, batch, step)
        return loss, sdc

    grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)

    def gradients(state, batch, plan, abft):
        """``(loss, grads, counts, sdc, sink_grads)`` of one step, checked as configured."""
        with contextlib.ExitStack() as stack:
            if hit_log is not None:  # backward sites are traced after loss_fn returns
                stack.enter_context(inject.recording_hits(hit_log))
            if whole_step:
                # The transform injects at its GEMM sites while it evaluates the step.
                stack.enter_context(inject.faults(plan))
                checked_grads = checked(grad_fn, abft)
                ((loss, _), (grads, _)), report = checked_grads(
                    state.params, sinks, batch, plan, state.step, abft
                )
                return loss, grads, total(report), report, {}
            # A fault aimed at a site this step does not have fails the step, naming it: a
            # misspelt site would otherwise look like a fault that was caught.
            with inject.recording_injection_points({}) as points:
                (loss, sdc), (grads, sink_grads) = grad_fn(
                    state.params, sinks, batch, plan, state.step, abft
                )
            inject.raise_if_unmatched(plan, points)
        counts = linen.total_counts(sdc, sink_grads) if drop_ins else Counts.zeros()
        return loss, grads, counts, sdc, sink_grads

    def advance(state, batch, plan, abft):
        loss, grads, counts, sdc, sink_grads = gradients(state, batch, plan, abft)
        new_state = state.apply_gradients(
            optimizer, grads, loss=loss, abft_uncorrectable=unsafe_checks(counts)
        )
        return new_state, StepOutput(loss, optax.tree.norm(grads), counts, sdc, sink_grads)

    def recomputed_if_detected(state, batch, plan):
        # The whole step, update included, is redone: a decision on the gradients alone would
        # make every parameter update wait for the last check of the backward pass.
        first = advance(state, batch, plan, dataclasses.replace(config.abft, correct=False))

        def recompute(first):
            _, first_out = first
            new_state, out = advance(state, batch, plan, config.abft)
            again = Counts.of(out.counts).detected > 0
            sdc, sink_grads = jax.tree.map(
                lambda f, s: merge_counts(f, s, again),
                (first_out.sdc, first_out.sink_grads),
                (out.sdc, out.sink_grads),
            )
            counts = linen.total_counts(sdc, sink_grads)
            return new_state, out._replace(counts=counts, sdc=sdc, sink_grads=sink_grads)

        return apply_if(Counts.of(first[1].counts).detected > 0, recompute, first)

    def one_step(state: TrainState, batch: jax.Array, plan: inject.FaultPlan):
        plan = plan.at_step(state.step)
        recompute = protected and config.repair == "recompute" and config.abft.correct
        if recompute and whole_step:
            # The transform owns the gradients: it recomputes them itself on a detection.
            return advance(state, batch, plan, dataclasses.replace(config.abft, recompute=True))
        if recompute:
            return recomputed_if_detected(state, batch, plan)
        return advance(state, batch, plan, config.abft)

    guarded = any(
        isinstance(x, GuardState)
        for x in jax.tree.leaves(state.opt_state, is_leaf=lambda x: isinstance(x, GuardState))
    )
    if config.triage and guarded:
        one_step = with_triage(one_step, recompute_args=_disarmed)
    return state, jax.jit(one_step)


def _disarmed(args: tuple) -> tuple:
    """The step's arguments with the fault plan made inert: a transient fault does not recur."""
    state, batch, plan = args
    return state, batch, plan._replace(site=jnp.full_like(plan.site, -1))
