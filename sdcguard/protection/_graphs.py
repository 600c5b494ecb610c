"""XLA:GPU compiler options that keep a checked step's control flow inside CUDA graphs."""

from __future__ import annotations

# XLA:GPU's default command types (jax 0.10-0.12), to which the two control-flow ops are added.
_DEFAULT_COMMANDS = ("FUSION", "CUBLAS", "CUBLASLT", "CUSTOM_CALL", "CUDNN", "DYNAMIC_SLICE_FUSION")


def command_buffer_options(*, conditionals: bool = True) -> dict[str, str]:
    """Compiler options for ``jax.jit`` that record ``cond`` and ``while`` in CUDA graphs.

    By default XLA:GPU runs a ``conditional`` or ``while`` between CUDA graphs, the host reading
    its predicate; recorded as CUDA graph conditional nodes, the GPU evaluates it. This matters
    for ``ABFTConfig(repair="cond")``, ``repair="while"`` and ``recompute=True``. The options
    apply to the one function jitted with them; other backends ignore them.

    Args:
      conditionals: record ``conditional`` and ``while`` ops too (``False`` gives XLA's
        default command types, to compare).

    Returns:
      ``{"xla_gpu_enable_command_buffer": ...}``, for ``jax.jit(..., compiler_options=...)``
      or ``.lower(...).compile(compiler_options=...)``.

    Example:
      >>> step = jax.jit(sdcguard.checked(train_step), compiler_options=command_buffer_options())
    """
    commands = _DEFAULT_COMMANDS + (("CONDITIONAL", "WHILE") if conditionals else ())
    return {"xla_gpu_enable_command_buffer": ",".join(commands)}
