"""Settings of the test session, applied before JAX starts its backend.

The programs under test are small and each is compiled about once, so XLA's compile time, most
of it LLVM optimising the CPU code, is most of the suite's time. The tests turn LLVM's
optimisation down (about 30% less time on this suite). The results are the same: XLA's own HLO
passes run as usual, and LLVM does not reorder floating-point arithmetic at any level (no
fast-math), so every comparison, bit-for-bit ones included, tests what users run. Benchmarks
in ``scripts/`` keep XLA's defaults. Flags already in ``XLA_FLAGS`` come last and win.
"""

import os

# Mosaic GPU interpret mode (the kernels' tests) blocks XLA:CPU pool threads in barrier waits
# and needs at least four of them (sdcguard.protection.pallas._platform.require_interpreter_pool);
# the pool is one thread per CPU unless PJRT_NPROC says otherwise, read when JAX starts.
os.environ.setdefault("PJRT_NPROC", "4")

_FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")
os.environ["XLA_FLAGS"] = " ".join([*_FAST_COMPILE, os.environ.get("XLA_FLAGS", "")]).strip()
