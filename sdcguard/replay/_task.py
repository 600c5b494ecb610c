"""What a replay runs: the :class:`ReplayTask` (model, parameters, batches, loss, optimizer).

A task is plain data plus a few pure functions. On the command line it is named
``module:function`` (``--task``); the function takes no arguments and returns a ReplayTask.
The default, :func:`reference_task`, trains the tiny reference GPT on byte batches, so
``sdcguard compare`` runs with no set-up.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import re
import sys
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

DEFAULT_TASK = "sdcguard.replay:reference_task"
_TASK_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class TaskError(ValueError):
    """A task could not be loaded or built (bad name, missing checkpoint, wrong return type)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplayTask:
    """One training workload, described well enough to run it twice bit for bit.

    Attributes:
      model: a Flax linen module. Its submodules are the units of the lock-step comparison.
        An NNX model runs wrapped as ``flax.nnx.bridge.to_linen(ModelClass, ...)``: every
        level works, and the submodule level sees the wrapper as one submodule. Collections
        besides ``params`` (BatchNorm's ``batch_stats``) are held at their initial values
        (:meth:`model_state`).
      batches: ``batches(step)`` -> the batch of that step (a pytree of arrays), identical on
        every machine (e.g. ``ByteBatches().batch``).
      model_inputs: ``model_inputs(batch)`` -> tuple of positional arguments of ``model.apply``.
      loss: ``loss(outputs, batch)`` -> scalar float loss.
      optimizer: the Optax transformation of a training step.
      seed: seed of the initial parameters (used when ``checkpoint`` is None) and of the
        per-step PRNG keys in ``rng_collections``.
      checkpoint: an Orbax checkpoint directory holding the parameter tree; restored instead
        of initialising from ``seed``.
      steps: number of training steps of the step/trajectory levels.
      apply_kwargs: keyword arguments of ``model.apply`` (e.g. ``{"deterministic": False}``).
      rng_collections: PRNG collections the model needs (e.g. ``("dropout",)``); their keys are
        pinned: ``fold_in(key(seed), step)``.
      protect_attention: route ``nn.MultiHeadDotProductAttention`` through sdcguard's attention
        (no checks) so attention-internal sites (``...attn:scores`` etc.) can be injected.
      gemm_sites: make every floating-point GEMM of the loss and its gradients an injection
        point (no checks), named as :func:`sdcguard.checked` names it
        (``decoder/block_0/mlp/fc_in:dot_general.grad_rhs``): faults at MLP, projection
        and head GEMMs, forward and backward, for any model.
      name: shown in reports.
    """

    model: nn.Module
    batches: Callable[[int], Any]
    model_inputs: Callable[[Any], tuple]
    loss: Callable[[Any, Any], jax.Array]
    optimizer: optax.GradientTransformation
    seed: int = 0
    checkpoint: str | None = None
    steps: int = 3
    apply_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    rng_collections: tuple[str, ...] = ()
    protect_attention: bool = True
    gemm_sites: bool = False
    name: str = "task"

    def __post_init__(self):
        if not isinstance(self.model, nn.Module):
            raise TaskError(
                f"ReplayTask.model must be a flax.linen Module, got {type(self.model).__name__}"
            )
        if self.steps < 1:
            raise TaskError(f"ReplayTask.steps must be >= 1, got {self.steps}")
        if not (
            callable(getattr(self.optimizer, "init", None))
            and callable(getattr(self.optimizer, "update", None))
        ):
            raise TaskError(
                "ReplayTask.optimizer must be an Optax transformation, e.g. optax.adam(1e-3); "
                f"got {type(self.optimizer).__name__}"
            )
        for field, signature, example in _FUNCTIONS:
            value = getattr(self, field)
            if not callable(value):
                raise TaskError(
                    f"ReplayTask.{field} must be a function {signature}, got "
                    f"{_describe(value)}; e.g. {field}={example}"
                )
        object.__setattr__(self, "rng_collections", tuple(self.rng_collections))

    def batch(self, step: int):
        """The batch of ``step`` as numpy arrays (host memory).

        Raises:
          TaskError: ``batches`` raised, or its batch holds a leaf that is not an array (a
            string, a Python list of numbers).
        """
        batch = _user_call(f"ReplayTask.batches({step})", self.batches, step)
        for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
            if not isinstance(leaf, np.ndarray | np.generic | jax.Array):
                where = f"batch{jax.tree_util.keystr(path)}"
                listed = any(isinstance(k, jax.tree_util.SequenceKey) for k in path)
                fix = (
                    "a Python list is a container to JAX, not an array: make it one with np.asarray"
                    if listed
                    else "a batch holds arrays only: make it an array (np.asarray), or keep "
                    "it out of the batch"
                )
                raise TaskError(
                    f"ReplayTask.batches({step}) returned a batch whose {where} is "
                    f"{_describe(leaf)}, not an array; {fix}"
                )
        return jax.tree.map(np.asarray, batch)

    def rngs(self, step) -> dict[str, jax.Array]:
        """Pinned PRNG keys of ``step`` (``step`` may be traced)."""
        base = jax.random.key(self.seed)
        return {
            c: jax.random.fold_in(jax.random.fold_in(base, i), step)
            for i, c in enumerate(self.rng_collections)
        }

    def model_args(self, batch) -> tuple:
        """``model_inputs(batch)``: the positional arguments of ``model.apply``."""
        args = _user_call("ReplayTask.model_inputs", self.model_inputs, batch)
        if not isinstance(args, tuple | list):
            got = type(args).__name__
            if hasattr(args, "shape"):
                got = f"an array of shape {args.shape}"
            raise TaskError(
                "ReplayTask.model_inputs must return a tuple of model.apply's positional "
                f"arguments, got {got}; for one input write "
                "model_inputs=lambda batch: (batch['x'],)"
            )
        return tuple(args)

    def apply(self, params, batch, step):
        """The model's output on ``batch`` at ``step``: ``params`` and :meth:`model_state`, the
        step's pinned keys (:meth:`rngs`) and ``apply_kwargs``."""
        state = self.model_state()
        out = self.model.apply(
            {"params": params, **state},
            *self.model_args(batch),
            rngs=self.rngs(step),
            # The collections besides params are held fixed: what apply writes is dropped.
            **({"mutable": list(state)} if state else {}),
            **self.apply_kwargs,
        )
        return out[0] if state else out

    def check(self):
        """The parameters' shapes and dtypes (:meth:`abstract_params`), once the task's
        functions were found to fit together on the first batch (nothing is computed).

        Raises:
          TaskError: ``model_inputs`` does not return a tuple, or ``loss`` does not return a
            floating-point scalar.
        """
        params = self.abstract_params()
        batch = self.batch(0)
        self.model_state()  # made here, outside the trace below

        def forward(p):
            out = _user_call("the model's call (model.apply) at step 0", self.apply, p, batch, 0)
            return _user_call("ReplayTask.loss at step 0", self.loss, out, batch)

        loss = jax.eval_shape(forward, params)
        shape, dtype = getattr(loss, "shape", None), getattr(loss, "dtype", None)
        if shape != () or not jnp.issubdtype(dtype, jnp.floating):
            what = f"shape {shape} and dtype {dtype}" if shape is not None else type(loss).__name__
            raise TaskError(
                "ReplayTask.loss must return the loss as a floating-point scalar, got "
                f"{what}; reduce it (jnp.mean) and leave metrics out of it"
            )
        return params

    def abstract_params(self):
        """The parameter tree's shapes and dtypes (``jax.ShapeDtypeStruct``), initialising no
        parameters (the first batch is made, outside the trace: ``batches`` may compute it with
        JAX)."""
        batch = self.batch(0)
        init = functools.partial(
            _user_call, "the model's model.init on batch 0", self._init_from_seed
        )
        return jax.eval_shape(init, batch)["params"]

    def init_params(self):
        """Initial parameters: restored from ``checkpoint`` or initialised from ``seed``."""
        abstract = self.abstract_params()
        if self.checkpoint is None:
            return self._init_from_seed(self.batch(0))["params"]
        return restore_params(self.checkpoint, abstract)

    def model_state(self) -> dict[str, Any]:
        """The model's collections other than ``params`` (BatchNorm's ``batch_stats``...), as
        ``model.init`` makes them from ``seed``; ``{}`` for a model without any.

        A replay holds them at these values on every step: each ``apply`` may update them
        (BatchNorm in training mode), and the updates are not carried to the next step. The
        loss and gradients of a training-mode BatchNorm do not read them; a model in eval mode
        reads these initial values, on every node alike.
        """
        return self._initial_state

    @functools.cached_property
    def _initial_state(self) -> dict[str, Any]:
        # Made once per task (every traced program reads it), concrete even when the first
        # call is made while a step is being traced.
        with jax.ensure_compile_time_eval():
            first = self.batch(0)
            shapes = jax.eval_shape(self._init_from_seed, first)
            if set(shapes) <= {"params"}:
                return {}
            variables = self._init_from_seed(first)
        return {name: tree for name, tree in variables.items() if name != "params"}

    def _init_from_seed(self, first_batch):
        args = self.model_args(first_batch)
        rngs = {"params": jax.random.key(self.seed), **self.rngs(0)}
        return dict(self.model.init(rngs, *args, **self.apply_kwargs))


# The task's functions: (field, signature, example), named when one is not a function.
_FUNCTIONS = (
    (
        "batches",
        "of the step, batches(step) -> batch (replay asks for a step's batch on every node, "
        "and more than once)",
        "lambda step: my_batches[step]",
    ),
    ("model_inputs", "model_inputs(batch) -> tuple", "lambda batch: (batch['x'],)"),
    ("loss", "loss(outputs, batch) -> scalar", "lambda y, batch: jnp.mean((y - batch['y']) ** 2)"),
)


def _describe(value) -> str:
    """``a str ('mse')``: a value's type, and the value when it is short."""
    kind = type(value).__name__
    article = "an" if kind[:1].lower() in "aeiou" else "a"
    text = repr(value)
    return f"{article} {kind} ({text})" if len(text) <= 40 else f"{article} {kind}"


def _user_call(what: str, fn, *args):
    """``fn(*args)``, a function of the user's task; what it raises becomes a TaskError
    naming ``what``, the exception's type and the first line of its message.

    A Flax error for a PRNG collection the model needs and the task does not give says which
    ``rng_collections`` to set. TaskErrors (from the task's own checks) pass as they are.
    """
    try:
        return fn(*args)
    except TaskError:
        raise
    except Exception as e:  # the user's code: any failure is the task's, said in one line
        missing = re.search(r'needs PRNG for "([^"]+)"', str(e))
        if missing:
            name = missing.group(1)
            raise TaskError(
                f"{what}: the model needs a PRNG key for {name!r} (Flax: {type(e).__name__}); "
                f"set ReplayTask(rng_collections=({name!r},)): replay pins its key per step"
            ) from None
        raise TaskError(f"{what} raised {_one_line(e)}") from None


def restore_params(directory: str, abstract_params):
    """Restores a parameter tree saved by :func:`save_params` (Orbax), checked against shapes.

    Args:
      directory: the checkpoint directory.
      abstract_params: a pytree of ``jax.ShapeDtypeStruct`` the checkpoint must match.

    Raises:
      TaskError: the directory is missing or does not hold a matching parameter tree.
    """
    import orbax.checkpoint as ocp

    path = os.path.abspath(directory)
    check_checkpoint_dir(directory)
    try:
        with ocp.StandardCheckpointer() as ckpt:
            return ckpt.restore(path, abstract_params)
    except Exception as e:  # Orbax raises many types; all mean "not this model's checkpoint"
        raise TaskError(
            f"could not restore the task's parameters from checkpoint {directory!r}: "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from None


def check_checkpoint_dir(directory: str) -> None:
    """A checkpoint (``--checkpoint``) is a directory that exists.

    Raises:
      TaskError: one line saying which it is not, and what to give.
    """
    if os.path.isdir(directory):
        return
    if os.path.exists(directory):
        raise TaskError(
            f"--checkpoint {directory!r} is a file, not a checkpoint: give the directory that "
            "sdcguard.replay.save_params (Orbax) wrote"
        )
    raise TaskError(f"--checkpoint directory {directory!r} does not exist")


def save_params(directory: str, params) -> None:
    """Saves a parameter tree as an Orbax checkpoint that ``ReplayTask(checkpoint=...)`` reads."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(os.path.abspath(directory), params)
        ckpt.wait_until_finished()


def reference_task(
    *,
    steps: int = 3,
    seed: int = 0,
    checkpoint: str | None = None,
    batch_size: int = 4,
    gemm_sites: bool = False,
) -> ReplayTask:
    """The built-in task: the tiny reference GPT, Adam, next-byte prediction.

    Batches are int32 ``[batch_size, 65]``; the model sees ``[:, :-1]`` and predicts ``[:, 1:]``.
    ``gemm_sites``: every GEMM an injection point (see :class:`ReplayTask`).
    """
    from sdcguard.models import GPT, ByteBatches, GPTConfig, lm_loss

    data = ByteBatches(batch_size=batch_size, seq_len=64, seed=seed)
    return ReplayTask(
        name="reference-gpt",
        model=GPT(GPTConfig()),
        batches=data.batch,
        model_inputs=lambda batch: (batch[:, :-1],),
        loss=lambda logits, batch: lm_loss(logits, batch[:, 1:]),
        optimizer=optax.adam(1e-3),
        seed=seed,
        checkpoint=checkpoint,
        steps=steps,
        gemm_sites=gemm_sites,
        protect_attention=not gemm_sites,  # the GEMM sites include attention's own
    )


def reference_task_gemms() -> ReplayTask:
    """The built-in task with every GEMM an injection point:
    ``--task sdcguard.replay:reference_task_gemms``."""
    return reference_task(gemm_sites=True)


def load_task(
    spec: str = DEFAULT_TASK,
    *,
    steps: int | None = None,
    seed: int | None = None,
    checkpoint: str | None = None,
) -> ReplayTask:
    """Loads the task named ``module:function`` and applies command-line overrides.

    Raises:
      TaskError: malformed name, module or function not found, or it returns no ReplayTask.
    """
    check_task_name(spec)
    if not _TASK_SPEC.match(spec):
        raise TaskError(f"task must be named 'module:function' (e.g. {DEFAULT_TASK}), got {spec!r}")
    module_name, function_name = spec.split(":")
    _importable_from_cwd()
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise TaskError(f"cannot import the task module {module_name!r}: {e}") from None
    except Exception as e:  # the module's own code failed while importing
        raise TaskError(
            f"importing the task module {module_name!r} raised {_one_line(e)}"
        ) from None
    fn = getattr(module, function_name, None)
    if not callable(fn):
        raise TaskError(f"module {module_name!r} has no function {function_name!r}")
    try:
        task = fn()
    except TaskError as e:  # the ReplayTask it built refused a field
        raise TaskError(f"{spec}: {e}") from None
    except Exception as e:  # the user's code: any failure means "no task", said in one line
        raise TaskError(f"the task function {spec} raised {_one_line(e)}") from None
    if not isinstance(task, ReplayTask):
        raise TaskError(f"{spec} returned {type(task).__name__}, expected a ReplayTask")
    overrides = {
        k: v
        for k, v in (("steps", steps), ("seed", seed), ("checkpoint", checkpoint))
        if v is not None
    }
    if "checkpoint" in overrides:
        check_checkpoint_dir(overrides["checkpoint"])
    return dataclasses.replace(task, **overrides) if overrides else task


def _importable_from_cwd() -> None:
    """Puts the current directory first on ``sys.path``, as ``python -m`` does, so that the
    ``sdcguard`` console script finds a task module there as ``python -m sdcguard`` does."""
    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        sys.path.insert(0, cwd)


def check_task_name(spec) -> None:
    """A task is given by name, ``module:function``: every node imports it, even one in
    another process or on another host, which no Python object can reach.

    Raises:
      TaskError: ``spec`` is not a string (a ReplayTask, a function), saying what to give.
    """
    if isinstance(spec, str):
        return
    what = "a ReplayTask object" if isinstance(spec, ReplayTask) else _describe(spec)
    raise TaskError(
        f"task must be a 'module:function' string (e.g. {DEFAULT_TASK!r}), got {what}: every "
        "node imports the task by name, so define a function returning the ReplayTask in an "
        "importable module and give 'module:function'"
    )


def _one_line(e: BaseException) -> str:
    """``Type: first line of the message`` of an exception."""
    text = str(e).strip().splitlines()
    if not text:
        return type(e).__name__
    first = text[0] if len(text[0]) <= 300 else text[0][:300] + "..."
    return f"{type(e).__name__}: {first}"
