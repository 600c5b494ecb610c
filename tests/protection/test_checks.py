"""The in-place repair of a checked contraction, compiled each way (``ABFTConfig.repair``).

Every strategy gives the same outputs and counters, in fp32, bf16 and fp16, clean and with a
fault; what differs is the control flow XLA compiles, which the last tests pin.
"""

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sdcguard
from sdcguard.fault_model import Fault, FaultPlan
from sdcguard.protection import ABFTConfig, _checks, _checksums, checked_einsum
from sdcguard.protection._checks import check_scope, recompute_strategy, repair_strategy
from sdcguard.protection._walk import sub_jaxprs

from tests.helpers.tolerances import assert_close
from tests.helpers.xla_settings import compile_as_users_do

SPEC = "bmk,bkn->bmn"
SITE = "t:gemm"
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
STRATEGIES = ["branch_free", "cond", "while"]


def operands(dtype):
    ka, kb = jax.random.split(jax.random.key(3))
    return (
        jax.random.normal(ka, (3, 24, 32)).astype(dtype),
        jax.random.normal(kb, (3, 32, 16)).astype(dtype),
    )


def run(repair, a, b, plan):
    config = ABFTConfig(repair=repair)
    return jax.jit(lambda a, b, p: checked_einsum(SPEC, a, b, site=SITE, plan=p, config=config))(
        a, b, plan
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("repair", STRATEGIES)
@pytest.mark.parametrize("kind", ["inf", "nan", "near_inf"])
def test_each_strategy_corrects_a_fault(repair, dtype, kind):
    a, b = operands(dtype)
    plan = FaultPlan.from_faults([Fault(site=SITE, kind=kind, index=333)])
    out, counts = run(repair, a, b, plan)
    np.testing.assert_array_equal(counts, [1, 1, 0, 0])
    assert_close(out, jnp.einsum(SPEC, a, b), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("repair", STRATEGIES)
def test_each_strategy_gives_the_branch_free_result(repair, dtype):
    """Bit for bit, clean and repaired: the strategies differ in control flow only."""
    a, b = operands(dtype)
    for faults in ([], [Fault(site=SITE, kind="inf", index=40)]):
        plan = FaultPlan.from_faults(faults, capacity=1)
        out, counts = run(repair, a, b, plan)
        want, want_counts = run("branch_free", a, b, plan)
        np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
        np.testing.assert_array_equal(counts, want_counts)


@pytest.mark.parametrize("repair", STRATEGIES)
def test_two_rows_of_one_matrix_stay_uncorrectable(repair):
    a, b = operands(jnp.float32)
    plan = FaultPlan.from_faults(
        [Fault(site=SITE, kind="inf", index=0), Fault(site=SITE, kind="inf", index=16 * 5)]
    )
    out, counts = run(repair, a, b, plan)
    np.testing.assert_array_equal(counts, [1, 0, 1, 0])
    assert not np.isfinite(np.asarray(out)).all()  # never silently passed on as corrected


@pytest.mark.parametrize("repair", STRATEGIES)
def test_a_whole_checked_step_trains_the_same(repair):
    """Under ``sdcguard.checked``, forward and backward GEMMs, with a fault in the backward."""

    def loss(w, x):
        with jax.named_scope("mlp"):
            return jnp.mean(jnp.tanh(x @ w[0]) @ w[1])

    def step(w, x):
        value, grads = jax.value_and_grad(loss)(w, x)
        return [p - 0.1 * g for p, g in zip(w, grads, strict=True)], value

    w = [jnp.ones((8, 16)) / 8, jnp.ones((16, 4)) / 16]
    x = jax.random.normal(jax.random.key(0), (4, 8))
    plan = FaultPlan.from_faults([Fault(site="mlp:loss.grad_rhs", kind="nan", index=3)])

    @jax.jit
    def checked(w, x, plan):
        with sdcguard.faults(plan):
            return sdcguard.checked(step, ABFTConfig(repair=repair))(w, x)

    (new_w, _), report = checked(w, x, plan)
    want_w, _ = jax.jit(step)(w, x)
    np.testing.assert_array_equal(report["mlp:loss.grad_rhs"], [1, 1, 0, 0])
    for got, want in zip(new_w, want_w, strict=True):
        assert_close(got, want, jnp.float32)


def _share_a_pass(monkeypatch, one_pass: bool):
    """The check's reductions as on a GPU (one multi-output pass) or as on the CPU."""
    monkeypatch.setattr(_checksums, "reductions_share_a_pass", lambda: one_pass)
    monkeypatch.setattr(_checks, "reductions_share_a_pass", lambda: one_pass)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("repair", STRATEGIES)
@pytest.mark.parametrize("one_pass", [True, False], ids=["one_pass", "separate"])
def test_each_matrix_repairs_its_first_failed_row_however_the_reductions_run(
    one_pass, repair, dtype, monkeypatch
):
    """Matrix 1 has one failed row (not its first), matrix 2 two, matrix 0 none: the first is
    repaired, the second left as it is and counted uncorrectable, the third untouched."""
    _share_a_pass(monkeypatch, one_pass)
    a, b = operands(dtype)  # 3 matrices of [24, 16]
    at = lambda matrix, row, col: (matrix * 24 + row) * 16 + col
    plan = FaultPlan.from_faults(
        [
            Fault(site=SITE, kind="inf", index=at(1, 7, 3)),
            Fault(site=SITE, kind="nan", index=at(2, 2, 0)),
            Fault(site=SITE, kind="inf", index=at(2, 9, 5)),
        ]
    )
    out, counts = run(repair, a, b, plan)
    np.testing.assert_array_equal(counts, [2, 1, 1, 0])
    want = jnp.einsum(SPEC, a, b)
    assert_close(out[:2], want[:2], dtype)
    failed = np.asarray(out[2], np.float32)[[2, 9]]
    assert (~np.isfinite(failed)).any(axis=1).all()  # both rows left as they are
    others = np.setdiff1d(np.arange(24), [2, 9])
    assert_close(out[2, others], want[2, others], dtype)


def _primitives(jaxpr) -> set[str]:
    """Every primitive of ``jaxpr`` and of the jaxprs inside its equations."""
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for inner in sub_jaxprs(eqn):
            names |= _primitives(inner)
    return names


def _repair_branches(jaxpr) -> list:
    """The jaxprs of the branches the conds of ``jaxpr`` (at any depth) take when flagged."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "cond":
            found.append(eqn.params["branches"][1].jaxpr)
        for inner in sub_jaxprs(eqn):
            found += _repair_branches(inner)
    return found


@pytest.mark.parametrize("one_pass", [True, False], ids=["one_pass", "separate"])
def test_the_repair_finds_the_failed_row_in_the_checks_own_pass_where_reductions_share_it(
    one_pass, monkeypatch
):
    """On a GPU the first failed row of each matrix is one more output of the check's
    reduction, so the repair's branch (compiled for every GEMM) does not compute the rows'
    flags and their ``argmax`` again; on the CPU the branch does (a reduction fewer per step)."""
    _share_a_pass(monkeypatch, one_pass)
    a, b = operands(jnp.bfloat16)
    plan = FaultPlan.from_faults([], capacity=1)
    config = ABFTConfig(repair="cond")
    fn = lambda a, b, p: checked_einsum(SPEC, a, b, site=SITE, plan=p, config=config)
    (branch,) = _repair_branches(jax.make_jaxpr(fn)(a, b, plan).jaxpr)
    assert ("argmax" in _primitives(branch)) == (not one_pass)


def _control_flow(repair) -> dict[str, int]:
    a, b = operands(jnp.bfloat16)
    plan = FaultPlan.from_faults([], capacity=1)
    config = ABFTConfig(repair=repair)
    fn = lambda a, b, p: checked_einsum(SPEC, a, b, site=SITE, plan=p, config=config)
    hlo = compile_as_users_do(jax.jit(fn).lower(a, b, plan)).as_text()
    return {
        op: len(re.findall(rf"^\s*(?:ROOT )?%\S+ = .* {op}\(", hlo, re.M))
        for op in ("conditional", "while")
    }


def test_the_compiled_control_flow_of_each_strategy():
    """Branch-free compiles no control flow; cond one conditional, while one loop."""
    assert _control_flow("branch_free") == {"conditional": 0, "while": 0}
    assert _control_flow("cond") == {"conditional": 1, "while": 0}
    assert _control_flow("while") == {"conditional": 0, "while": 1}


def test_auto_resolves_per_backend_and_unknown_strategies_are_refused():
    assert repair_strategy(ABFTConfig()) == "cond"
    assert repair_strategy(ABFTConfig(repair="while")) == "while"
    assert repair_strategy(ABFTConfig(repair="branch_free")) == "branch_free"
    # recompute=True: a second copy behind a cond on a GPU, a loop around one copy elsewhere.
    assert recompute_strategy(ABFTConfig(), "cpu") == "while"
    assert recompute_strategy(ABFTConfig(), "gpu") == "cond"
    assert recompute_strategy(ABFTConfig(), "cuda") == "cond"
    assert recompute_strategy(ABFTConfig(repair="cond"), "cpu") == "cond"
    assert recompute_strategy(ABFTConfig(repair="branch_free"), "gpu") == "while"
    with pytest.raises(ValueError, match="repair must be one of"):
        ABFTConfig(repair="sometimes")


# The compiled program of one checked GEMM on XLA:CPU, against the plain one: issue 39's proxy,
# off a GPU, for the kernels a check adds (docs/performance.md, "Kernels per check"). The check
# is traced as for a GPU (its reductions over one tensor as one multi-output reduction; the CPU
# takes them apart, see test_abft.py). Counted:
# the instructions of the entry computation that run code (fusions, dots, conditionals, ...);
# a conditional's branches run only when a check fired. Bounds: the most any JAX of CI's matrix
# compiles (jax 0.10 converts bf16 operands in fusions of their own).
_NOT_KERNELS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast"}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%\S+ = (?:\(.*?\)|\S+) ([\w-]+)\(")
# In place behind a cond adds to detection the predicate, the conditional and the operands its
# branch reads (for bf16/fp16 on XLA:CPU, A and B rounded as stored, and C, as separate copies).
EXTRA_KERNELS = {  # (mode, dtype) -> at most this many kernels more than the plain GEMM
    ("detect", jnp.float32): 8,
    ("detect", jnp.bfloat16): 11,
    ("detect", jnp.float16): 8,
    ("cond", jnp.float32): 10,
    ("cond", jnp.bfloat16): 14,
    ("cond", jnp.float16): 12,
}
# No host round trip anywhere in the program: a check decides on the device.
_HOST_SYNC = re.compile(r"\b(infeed|outfeed|send|recv|send-done|recv-done)\(|callback", re.I)


def _gemm_then_tanh(a, b):
    return jnp.tanh(a @ b)


def compiled_kernels(fn, *args) -> tuple[collections.Counter, str]:
    """The kernels of ``fn``'s compiled entry computation, by opcode, and the whole program."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    entry = text[text.index("\nENTRY") :]
    ops = (m.group(1) for line in entry.splitlines() if (m := _INSTRUCTION.match(line)))
    return collections.Counter(op for op in ops if op not in _NOT_KERNELS), text


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the proxy is XLA:CPU's program")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_kernels_a_check_adds_to_a_gemm(dtype, monkeypatch):
    monkeypatch.setattr(_checksums, "reductions_share_a_pass", lambda: True)
    a = jax.random.normal(jax.random.key(0), (256, 512)).astype(dtype)
    b = jax.random.normal(jax.random.key(1), (512, 384)).astype(dtype)
    plain, _ = compiled_kernels(_gemm_then_tanh, a, b)
    counts = {}
    for mode, config in (
        ("detect", ABFTConfig(correct=False)),
        ("cond", ABFTConfig(repair="cond")),
        ("branch_free", ABFTConfig(repair="branch_free")),
    ):
        kernels, text = compiled_kernels(sdcguard.checked(_gemm_then_tanh, config), a, b)
        assert not _HOST_SYNC.search(text), f"{mode}: a host round trip in the compiled check"
        counts[mode] = kernels
    extra = {mode: sum(k.values()) - sum(plain.values()) for mode, k in counts.items()}
    assert extra["detect"] <= EXTRA_KERNELS["detect", dtype], counts["detect"]
    assert extra["cond"] <= EXTRA_KERNELS["cond", dtype], counts["cond"]
    # The branch-free repair runs on every call; behind the cond, only when a check fired.
    assert counts["cond"]["conditional"] == 1
    assert extra["branch_free"] > extra["cond"]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_a_checks_operations_run_under_the_check_scope(dtype):
    """A profile tells the checks' kernels from the step's: in the compiled program, the check's
    operations carry ``CHECK_SCOPE`` in their op names, the GEMM and the step's own do not."""
    a = jax.random.normal(jax.random.key(0), (64, 32)).astype(dtype)
    b = jax.random.normal(jax.random.key(1), (32, 48)).astype(dtype)
    text = jax.jit(sdcguard.checked(_gemm_then_tanh)).lower(a, b).compile().as_text()
    names = set(re.findall(r'op_name="([^"]*)"', text))
    in_scope = {n for n in names if sdcguard.protection.CHECK_SCOPE in n}
    assert any(n.endswith("/reduce_max") or "/reduce" in n for n in in_scope), in_scope
    (site,) = sdcguard.list_sites(_gemm_then_tanh, a, b)
    assert all(check_scope(site.name) in n for n in in_scope), in_scope  # named by its site
    outside = names - in_scope
    assert any(n.endswith("dot_general") for n in outside), outside
    assert any(n.endswith("tanh") for n in outside), outside
    assert not any(n.endswith("tanh") for n in in_scope), in_scope
