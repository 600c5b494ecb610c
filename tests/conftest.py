"""Settings of the test session, applied before JAX starts its backend.

The programs under test are small and each is compiled about once, so XLA's compile time is
most of the suite's time. The tests compile with XLA:CPU's LLVM optimisation turned down and,
with jaxlib 0.10, its older fusion emitters (``tests/helpers/xla_settings.py``).
XLA's own HLO passes run as usual and LLVM does not reorder floating-point arithmetic at any
level (no fast-math), but at its default level it contracts a multiply and an add into one
fused multiply-add, which rounds once, and the two emitters may round an elementwise function
differently: a result can differ in its last bits from what users run. Tests of numerical
claims hold at both (their tolerances cover an ulp); a claim that two compiled computations
round alike (the replay of a healthy node against itself, ``tests/replay/test_models.py``) runs
its program in a subprocess with XLA's defaults, and a claim about what the emitters decide
compiles with them (``compile_as_users_do``). Benchmarks in ``scripts/`` keep XLA's defaults.
Flags already in ``XLA_FLAGS`` come last and win.

Importing JAX does not start its backend: the settings below still apply.
"""

import atexit
import os
import shutil
import tempfile

import jax

from tests.helpers.xla_settings import JAXLIB_VERSION, fast_compile_flags

# Mosaic GPU interpret mode (the kernels' tests) blocks XLA:CPU pool threads in barrier waits
# and needs at least four of them (sdcguard.protection.pallas._platform.require_interpreter_pool);
# the pool is one thread per CPU unless PJRT_NPROC says otherwise, read when JAX starts.
os.environ.setdefault("PJRT_NPROC", "4")

os.environ["XLA_FLAGS"] = f"{fast_compile_flags()} {os.environ.get('XLA_FLAGS', '')}".strip()

# A persistent compilation cache for this test process alone (a fresh directory, removed at
# exit): the suite compiles the same programs many times over from new function objects (a
# test's own jit of a lambda, a fixture per parameter), and XLA's compile is most of its time.
# The cache's key includes the programs' metadata (op names carry the checks' site names, which
# tests read back from compiled HLO). Set with jax.config, not the environment, so that the
# processes tests start (which may run side by side) do not share it. With jaxlib 0.10 alone:
# jaxlib 0.12's XLA:CPU crashed the process once writing an entry (a segmentation fault in
# `executable.serialize()`, in CI at ee8e5d3), and a crash loses the test run.
if JAXLIB_VERSION < (0, 11):
    _CACHE_DIR = tempfile.mkdtemp(prefix="sdcguard-tests-xla-cache-")
    atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", _CACHE_DIR)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_compilation_cache_include_metadata_in_key", True)
