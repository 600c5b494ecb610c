"""The XLA:CPU settings the suite compiles with, and XLA's defaults for tests that need them.

Most of the suite's time is XLA compiling small programs once each. The suite turns down what
costs compile time and not correctness: LLVM's optimisation and, where XLA:CPU still has them
(jaxlib 0.10), its MLIR fusion emitters (fusions are emitted by its older LLVM IR emitters,
which compile the suite's programs in about half the time). XLA's HLO passes run as usual, so
a program's HLO graph, its fusions, conditionals and collectives are the ones a user gets; a
test that asserts something only the emitters decide (a scatter is emitted as a loop without
the fusion emitters) compiles with XLA's defaults (:func:`compile_as_users_do`).

Two different programs that share operations do not always round them alike: at LLVM's
default level a multiply and an add may become one fused multiply-add in one program and not in
the other, and the older emitters differ too. A test that two programs round alike, where the
claim is about sdcguard's code and not XLA's, compiles both with :func:`compile_as_written`.

Example:
  >>> hlo = compile_as_users_do(jax.jit(fn).lower(x)).as_text()
"""

import jax
import jaxlib

JAXLIB_VERSION = tuple(int(part) for part in jaxlib.__version__.split(".")[:2])
# The older emitters, and the flag that picks them, are gone from jaxlib 0.11's XLA (an
# unknown flag in XLA_FLAGS stops the process).
HAS_OLDER_EMITTERS = JAXLIB_VERSION < (0, 11)

# flag: (the suite's value, XLA's default)
FAST_COMPILE = {
    "xla_backend_optimization_level": (0, 3),
    "xla_llvm_disable_expensive_passes": (True, False),
    **({"xla_cpu_use_fusion_emitters": (False, True)} if HAS_OLDER_EMITTERS else {}),
}


def fast_compile_flags() -> str:
    """The suite's settings as ``XLA_FLAGS`` text."""
    return " ".join(f"--{flag}={str(ours).lower()}" for flag, (ours, _) in FAST_COMPILE.items())


def compile_as_users_do(lowered: jax.stages.Lowered) -> jax.stages.Compiled:
    """Compiles ``lowered`` with XLA's defaults for the flags the suite changes."""
    return lowered.compile(
        compiler_options={flag: default for flag, (_, default) in FAST_COMPILE.items()}
    )


def compile_as_written(lowered: jax.stages.Lowered) -> jax.stages.Compiled:
    """Compiles ``lowered`` so that each operation rounds as its HLO says, whatever fusion
    holds it: no multiply-add contraction (LLVM at level 0) and XLA's fusion emitters."""
    options = {"xla_backend_optimization_level": 0}
    if HAS_OLDER_EMITTERS:
        options["xla_cpu_use_fusion_emitters"] = True
    return lowered.compile(compiler_options=options)
