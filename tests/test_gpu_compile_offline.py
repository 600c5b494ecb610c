"""``scripts/gpu_compile_offline.py``: the kernels of each check, counted in an HLO module.

The parser is tested on a module written here; the deviceless compile for an H200 runs where
JAX's CUDA plugin is installed (it needs no GPU), in a subprocess that can set the variable
the plugin's version check needs.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "scripts"))
import gpu_compile_offline

SCRIPT = Path(__file__).parent.parent / "scripts" / "gpu_compile_offline.py"

CHECK = "jit(step)/a/b/sdcguard_check[a|b:dot_general"


def _meta(op_name: str) -> str:
    return f'metadata={{op_name="{op_name}"}}'


MODULE = "\n".join(
    [
        "HloModule jit_step",
        "",
        "%fused_reduce (p: f32[8]) -> f32[] {",
        "  %p = f32[8]{0} parameter(0)",
        f"  ROOT %r = f32[] reduce(%p), dimensions={{0}}, {_meta(CHECK + ']/reduce')}",
        "}",
        "",
        "ENTRY %main (x: f32[8,8], w: f32[8,8]) -> (f32[8,8], s32[4]) {",
        f"  %x = f32[8,8]{{1,0}} parameter(0), {_meta('x')}",
        "  %w = f32[8,8]{1,0} parameter(1)",
        "  %custom-call.1 = f32[8,8]{1,0} custom-call(%x, %w), "
        f'custom_call_target="__cublas$gemm", {_meta("jit(step)/a/b/dot_general")}',
        "  %input_reduce_fusion.2 = (f32[8]{0}, f32[8]{0}) fusion(%custom-call.1), "
        f"kind=kInput, calls=%fused_reduce, {_meta(CHECK + ']/reduce')}",
        "  %get-tuple-element.3 = f32[8]{0} get-tuple-element(%input_reduce_fusion.2), "
        f"index=0, {_meta(CHECK + ']/reduce')}",
        "  %loop_not_fusion = pred[8]{0} fusion(%get-tuple-element.3), kind=kLoop, "
        f"calls=%fused_reduce, {_meta(CHECK + '.grad_lhs]/not')}",
        "  %conditional.4 = s32[4]{0} conditional(%loop_not_fusion), "
        f"branch_computations={{%fused_reduce}}, {_meta('jit(step)/sdcguard_check/cond')}",
        "  ROOT %tuple.5 = (f32[8,8]{1,0}, s32[4]{0}) tuple(%custom-call.1, %conditional.4)",
        "}",
        "",
    ]
)


def test_each_kernel_is_counted_under_its_check():
    kernels = gpu_compile_offline.kernels(MODULE)
    assert [k["name"] for k in kernels] == [
        "custom-call.1",
        "input_reduce_fusion.2",
        "loop_not_fusion",
        "conditional.4",
    ]
    inv = gpu_compile_offline.inventory(MODULE)
    assert inv["kernels"] == 4
    assert inv["check_kernels"] == 2  # the GEMM is the step's; the bare-scope cond no site's
    assert inv["per_site"] == {"a|b:dot_general": 1, "a|b:dot_general.grad_lhs": 1}
    assert inv["per_kind"] == {"input_reduce_fusion": 1, "loop_not_fusion": 1}
    assert inv["per_direction"] == {
        "forward": {"checks": 1, "kernels": 1},
        "grad_lhs": {"checks": 1, "kernels": 1},
    }


# A GEMM whose bf16 output two checks read (the scale's reduction and the row sums), and the
# step's own elementwise kernel.
TRAFFIC_MODULE = "\n".join(
    [
        "HloModule jit_step",
        "",
        "%fused (p: bf16[8,16]) -> f32[8] {",
        "  %p = bf16[8,16]{1,0} parameter(0)",
        "  ROOT %r = f32[8]{0} reduce(%p), dimensions={1}",
        "}",
        "",
        "ENTRY %main (x: bf16[8,4], w: f32[4,16]) -> (bf16[8,16], pred[]) {",
        "  %x = bf16[8,4]{1,0} parameter(0)",
        "  %w = f32[4,16]{1,0} parameter(1)",
        "  %gemm_fusion_dot.1 = bf16[8,16]{1,0} fusion(%x, %w), kind=kCustom, calls=%fused, "
        f"{_meta('jit(step)/a/b/dot_general')}",
        "  %input_reduce_fusion.2 = (f32[8]{0}, f32[8]{0}) fusion(%gemm_fusion_dot.1), "
        f"kind=kInput, calls=%fused, {_meta(CHECK + ']/reduce')}",
        "  %input_reduce_fusion.3 = f32[] fusion(%gemm_fusion_dot.1, %x), kind=kInput, "
        f"calls=%fused, {_meta(CHECK + '.grad_lhs]/reduce')}",
        "  %loop_not_fusion = pred[] fusion(%input_reduce_fusion.3), kind=kLoop, "
        f"calls=%fused, {_meta(CHECK + '.grad_lhs]/not')}",
        "  %loop_add_fusion = bf16[8,16]{1,0} fusion(%gemm_fusion_dot.1), kind=kLoop, "
        f"calls=%fused, {_meta('jit(step)/a/add')}",
        "  %conditional.4 = bf16[8,16]{1,0} conditional(%loop_not_fusion, %loop_add_fusion), "
        f"branch_computations={{%fused}}, {_meta(CHECK + ']/cond')}",
        "  ROOT %tuple.5 = (bf16[8,16]{1,0}, pred[]) tuple(%conditional.4, %loop_not_fusion)",
        "}",
        "",
    ]
)


def test_the_bytes_each_kernel_moves_are_its_operands_and_its_result():
    kernels = gpu_compile_offline.kernels(TRAFFIC_MODULE)
    moved = {k["name"]: (k["reads"], k["writes"]) for k in kernels}
    gemm_out = 8 * 16 * 2  # bf16
    assert moved == {
        "gemm_fusion_dot.1": (8 * 4 * 2 + 4 * 16 * 4, gemm_out),
        "input_reduce_fusion.2": (gemm_out, 2 * 8 * 4),  # a tuple of two f32[8]
        "input_reduce_fusion.3": (gemm_out + 8 * 4 * 2, 4),
        "loop_not_fusion": (4, 1),
        "loop_add_fusion": (gemm_out, gemm_out),
        "conditional.4": (0, 0),  # its branches' kernels move the bytes
    }
    inv = gpu_compile_offline.inventory(TRAFFIC_MODULE)
    assert inv["total_bytes"] == sum(r + w for r, w in moved.values())
    assert inv["check_bytes"] + inv["step_bytes"] == inv["total_bytes"]
    assert inv["step_bytes"] == sum(moved["gemm_fusion_dot.1"]) + sum(moved["loop_add_fusion"])
    assert inv["gemm_outputs_checked_bytes"] == gemm_out  # read twice, counted once
    # The GEMM's output is read by two checks (once more than a shared pass would); x only by
    # one check (the GEMM is the step's).
    assert inv["reread"] == [
        {
            "tensor": "gemm_fusion_dot.1",
            "bytes": gemm_out,
            "sites": ["a|b:dot_general", "a|b:dot_general.grad_lhs"],
        }
    ]
    assert inv["reread_bytes"] == gemm_out


def test_branch_copies_counts_the_copies_inside_conditionals_only():
    module = "\n".join(
        [
            "HloModule jit_step",
            "",
            "%keep (p: (bf16[8,16], s32[4])) -> (bf16[8,16], s32[4]) {",
            "  %p = (bf16[8,16]{1,0}, s32[4]{0}) parameter(0)",
            "  %get-tuple-element.1 = bf16[8,16]{1,0} get-tuple-element(%p), index=0",
            "  %copy.2 = bf16[8,16]{1,0} copy(%get-tuple-element.1)",
            "  %get-tuple-element.3 = s32[4]{0} get-tuple-element(%p), index=1",
            "  ROOT %tuple.4 = (bf16[8,16]{1,0}, s32[4]{0}) tuple(%copy.2, %get-tuple-element.3)",
            "}",
            "",
            "%again (q: (bf16[8,16], s32[4])) -> (bf16[8,16], s32[4]) {",
            "  ROOT %q = (bf16[8,16]{1,0}, s32[4]{0}) parameter(0)",
            "}",
            "",
            "ENTRY %main (x: bf16[8,16], n: s32[4], i: s32[]) -> (bf16[8,16], s32[4]) {",
            "  %x = bf16[8,16]{1,0} parameter(0)",
            "  %n = s32[4]{0} parameter(1)",
            "  %i = s32[] parameter(2)",
            "  %copy.5 = bf16[8,16]{1,0} copy(%x)",
            "  %tuple.6 = (bf16[8,16]{1,0}, s32[4]{0}) tuple(%copy.5, %n)",
            "  ROOT %conditional.7 = (bf16[8,16]{1,0}, s32[4]{0}) conditional(%i, %tuple.6, "
            "%tuple.6), branch_computations={%keep, %again}",
            "}",
            "",
        ]
    )
    # The entry's own copy is not a conditional's.
    assert gpu_compile_offline.branch_copies(module) == {"copies": 1, "bytes": 8 * 16 * 2}
    assert gpu_compile_offline.branch_copies(TRAFFIC_MODULE) == {"copies": 0, "bytes": 0}


def test_branch_kernels_counts_what_conditionals_compile_nested_ones_too():
    module = "\n".join(
        [
            "HloModule jit_step",
            "",
            "%inner (r: bf16[8,16]) -> bf16[8,16] {",
            "  %r = bf16[8,16]{1,0} parameter(0)",
            "  ROOT %loop_select_fusion.9 = bf16[8,16]{1,0} fusion(%r), kind=kLoop, calls=%x",
            "}",
            "",
            "%repair (p: bf16[8,16]) -> bf16[8,16] {",
            "  %p = bf16[8,16]{1,0} parameter(0)",
            "  %input_reduce_fusion.1 = pred[] fusion(%p), kind=kInput, calls=%x",
            "  %loop_gather_fusion.2 = bf16[1,16]{1,0} fusion(%p), kind=kLoop, calls=%x",
            "  ROOT %conditional.3 = bf16[8,16]{1,0} conditional(%input_reduce_fusion.1, %p, %p), "
            "true_computation=%inner, false_computation=%keep",
            "}",
            "",
            "%keep (q: bf16[8,16]) -> bf16[8,16] {",
            "  %q = bf16[8,16]{1,0} parameter(0)",
            "  ROOT %copy.4 = bf16[8,16]{1,0} copy(%q)",
            "}",
            "",
            "ENTRY %main (x: bf16[8,16], i: pred[]) -> bf16[8,16] {",
            "  %x = bf16[8,16]{1,0} parameter(0)",
            "  %i = pred[] parameter(1)",
            "  %loop_not_fusion.5 = bf16[8,16]{1,0} fusion(%x), kind=kLoop, calls=%x",
            "  ROOT %conditional.6 = bf16[8,16]{1,0} conditional(%i, %loop_not_fusion.5, "
            "%loop_not_fusion.5), true_computation=%repair, false_computation=%keep",
            "}",
            "",
        ]
    )
    inside = gpu_compile_offline.branch_kernels(module)
    # The repair's two fusions and its nested conditional, the nested branches' fusion and the
    # copy of %keep (reached from both conditionals, counted once); the entry's fusion is not.
    assert inside["per_kind"] == {
        "input_reduce_fusion": 1,
        "loop_gather_fusion": 1,
        "conditional": 1,
        "loop_select_fusion": 1,
        "copy": 1,
    }
    assert inside["kernels"] == 5
    assert (inside["copies"], inside["copy_bytes"]) == (1, 8 * 16 * 2)
    assert [k["name"] for k in gpu_compile_offline.kernels(module)] == [
        "loop_not_fusion.5",
        "conditional.6",
    ]


def test_array_bytes_reads_every_dtype_and_tuple():
    assert gpu_compile_offline.array_bytes("bf16[8,1024]{1,0}") == 8 * 1024 * 2
    assert gpu_compile_offline.array_bytes("(f32[3]{0}, s8[5]{0}, pred[2]{0})") == 12 + 5 + 2
    assert gpu_compile_offline.array_bytes("f16[]") == 2
    assert gpu_compile_offline.array_bytes("f64[2,2]{1,0}") == 32


def _has_cuda_plugin() -> bool:
    return importlib.util.find_spec("jax_plugins") is not None and (
        importlib.util.find_spec("jax_plugins.xla_cuda13") is not None
    )


@pytest.mark.skipif(
    not _has_cuda_plugin(),
    reason="needs JAX's CUDA plugin (pip install 'jax[cuda13]'); no GPU needed",
)
def test_the_checked_step_compiles_for_an_h200_without_one(tmp_path):
    out = tmp_path / "inventory.json"
    env = {**os.environ, "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPT.parent.parent), str(SCRIPT.parent)])
    command = [sys.executable, str(SCRIPT), "--size", "tiny", "--out", str(out)]
    variants = ["plain", "detect only", "in place", "recompute"]
    subprocess.run([*command, "--variants", *variants], check=True, env=env)
    inv = json.loads(out.read_text())
    assert inv["plain"]["check_kernels"] == 0
    detect = inv["detect only"]
    assert detect["sites"] > 0 and detect["check_kernels"] >= detect["sites"]
    assert detect["kernels"] > inv["plain"]["kernels"]
    # The checks read each checked GEMM's output at least once.
    added = detect["total_bytes"] - inv["plain"]["total_bytes"]
    assert added >= detect["gemm_outputs_checked_bytes"] > 0
    # A clean step copies no checked tensor through a conditional: the repairs' (predicated)
    # pass C on in place, the recomputation's (indexed) the step's outputs. Both copy int32
    # [4] counters only: the repairs' clean branch writes each site's zeros (a copy of one
    # zero broadcast per group), the recomputation's the counters it merges (a predicated
    # conditional copied every output).
    for name in ("in place", "recompute"):
        assert inv[name]["branch_copies"]["bytes"] <= inv[name]["sites"] * 4 * 4, name
    # The clean branches write the counters and compute nothing: at most a kernel per site.
    assert inv["in place"]["clean_branch_kernels"] <= inv["in place"]["sites"]
    # Every reduction of a check is XLA:GPU's reduction kernel: none a loop over strided
    # elements (a projection's [b, h, s, d] output summed over h and d at once was one).
    for name in ("detect only", "in place", "recompute"):
        assert "loop_reduce_fusion" not in inv[name]["per_kind"], (name, inv[name]["per_kind"])


@pytest.mark.skipif(
    not _has_cuda_plugin(),
    reason="needs JAX's CUDA plugin (pip install 'jax[cuda13]'); no GPU needed",
)
def test_the_pass_after_the_mosaic_gemm_has_no_scan_on_an_h200(tmp_path):
    """The pass after the checked GEMM kernel compiles for an H200 with no scan (XLA:GPU makes
    a cumsum ``reduce_window`` fusions) and one scatter into C."""
    out = tmp_path / "after.json"
    env = {**os.environ, "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPT.parent.parent), str(SCRIPT.parent)])
    command = [sys.executable, str(SCRIPT), "--after-pass", "1024x256x2048", "--out", str(out)]
    subprocess.run(command, check=True, env=env)
    kinds = json.loads(out.read_text())["1024x256x2048"]["per_kind"]
    assert not any("reduce_window" in kind for kind in kinds), kinds
    assert kinds.get("input_scatter_fusion") == 1, kinds


@pytest.mark.skipif(
    not _has_cuda_plugin(),
    reason="needs JAX's CUDA plugin (pip install 'jax[cuda13]'); no GPU needed",
)
def test_a_clean_correcting_mosaic_gemm_launches_what_detection_does_and_copies_nothing(
    tmp_path,
):
    """Compiled for an H200: a correcting checked GEMM runs its second, locating kernel and
    the pass after it behind one conditional, and a clean call copies nothing through it
    (before, the clean branch copied ``C`` and the statuses, and the pass after the kernel
    ran on every call: 25 kernels against detection's 13 at 8192x1024x4096). With the rows'
    bounds from shared memory (``row_bounds="fused"``) it launches fewer kernels and moves
    less: nothing reads ``A`` before the kernel."""
    out = tmp_path / "gemm.json"
    env = {**os.environ, "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPT.parent.parent), str(SCRIPT.parent)])
    command = [sys.executable, str(SCRIPT), "--mosaic-gemm", "1024x2048x512", "--out", str(out)]
    subprocess.run(command, check=True, env=env)
    inv = json.loads(out.read_text())["1024x2048x512"]
    detect, correcting = inv["detect only"], inv["correcting"]
    assert correcting["branch_copies"] == {"copies": 0, "bytes": 0}
    assert correcting["per_kind"].get("conditional") == 1
    assert correcting["per_kind"].get("custom-call") == 1  # the detection kernel alone
    assert correcting["kernels"] <= detect["kernels"]
    # The rows' bounds from the kernel's shared memory: no pass over A before it, and
    # parameters per tile rather than per row of A.
    for name in ("detect only", "correcting"):
        fused = inv[f"{name}, row bounds in the kernel"]
        assert fused["kernels"] < inv[name]["kernels"], name
        assert fused["bytes"] < inv[name]["bytes"] - 1024 * 2048 * 2, name  # A: one read fewer


@pytest.mark.skipif(
    not _has_cuda_plugin(),
    reason="needs JAX's CUDA plugin (pip install 'jax[cuda13]'); no GPU needed",
)
def test_the_fusion_probes_show_what_bounds_a_checks_kernels(tmp_path):
    """What docs/performance.md ("What XLA:GPU will not fuse") states, compiled for an H200:
    a small verdict's comparison and the work after a row reduction are kernels of their own,
    and each output of a step is one kernel while one stacked output is a few in all."""
    out = tmp_path / "probes.json"
    env = {**os.environ, "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPT.parent.parent), str(SCRIPT.parent)])
    subprocess.run(
        [sys.executable, str(SCRIPT), "--fusion-probes", "--out", str(out)], check=True, env=env
    )
    probes = {name: p["kernels"] for name, p in json.loads(out.read_text()).items()}
    assert probes["verdict of 8192 rows"] == 2
    assert probes["row sums then comparison"] == 2
    # 99 sites' reductions, then their counters: one kernel per site's output, against a few
    # in all for one stacked output.
    assert probes["per-site counters"] == 2 * 99
    assert probes["stacked counters"] <= 99 + 3
    assert probes["two scalings of one scale"] == 2


def test_clean_branch_kernels_counts_what_a_clean_step_runs_in_each_conditional():
    module = "\n".join(
        [
            "HloModule jit_step",
            "",
            "%repair (p: bf16[8,16]) -> bf16[8,16] {",
            "  %p = bf16[8,16]{1,0} parameter(0)",
            "  ROOT %loop_gather_fusion.1 = bf16[8,16]{1,0} fusion(%p), kind=kLoop, calls=%x",
            "}",
            "",
            "%keep (q: bf16[8,16]) -> bf16[8,16] {",
            "  %q = bf16[8,16]{1,0} parameter(0)",
            "  ROOT %loop_broadcast_fusion.2 = bf16[8,16]{1,0} fusion(), kind=kLoop, calls=%x",
            "}",
            "",
            "%outer_keep (r: bf16[8,16]) -> bf16[8,16] {",
            "  %r = bf16[8,16]{1,0} parameter(0)",
            "  %i = pred[] constant(false)",
            "  %copy.3 = bf16[8,16]{1,0} copy(%r)",
            "  ROOT %conditional.4 = bf16[8,16]{1,0} conditional(%i, %copy.3, %copy.3), "
            "true_computation=%repair, false_computation=%keep",
            "}",
            "",
            "ENTRY %main (x: bf16[8,16], i: pred[], j: s32[]) -> (bf16[8,16], bf16[8,16]) {",
            "  %x = bf16[8,16]{1,0} parameter(0)",
            "  %i = pred[] parameter(1)",
            "  %j = s32[] parameter(2)",
            "  %conditional.5 = bf16[8,16]{1,0} conditional(%i, %x, %x), "
            "true_computation=%repair, false_computation=%outer_keep",
            "  %conditional.6 = bf16[8,16]{1,0} conditional(%j, %x, %x), "
            "branch_computations={%keep, %repair}",
            "  ROOT %tuple.7 = (bf16[8,16]{1,0}, bf16[8,16]{1,0}) tuple(%conditional.5, "
            "%conditional.6)",
            "}",
            "",
        ]
    )
    clean = gpu_compile_offline.clean_branch_kernels(module)
    # conditional.5's clean branch: its copy, and the clean branch of the conditional nested
    # in it; conditional.6's branch 0 (an indexed conditional's clean one): %keep again, run
    # once more. No repair.
    assert clean == {"kernels": 3, "per_kind": {"loop_broadcast_fusion": 2, "copy": 1}}
