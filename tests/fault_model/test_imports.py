"""The fault model every part shares does not depend on Flax at import time.

``import sdcguard.fault_model`` runs ``sdcguard/__init__`` first, which imports the Flax parts,
so this reads the source with ``ast``: no module of ``sdcguard/fault_model`` imports Flax at
module level (the linen interceptor imports it inside its functions).
"""

import ast
from pathlib import Path

FAULT_MODEL = Path(__file__).resolve().parents[2] / "sdcguard" / "fault_model"


def module_level_imports(path: Path) -> set[str]:
    """The top-level package of every import outside functions (class bodies and
    ``if``/``try`` blocks at module level count)."""
    found: set[str] = set()

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, ast.Import):
                found.update(alias.name.split(".")[0] for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                found.add(child.module.split(".")[0])
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found


def test_no_fault_model_module_imports_flax_at_module_level():
    modules = sorted(FAULT_MODEL.glob("*.py"))
    assert len(modules) > 3
    offenders = [p.name for p in modules if "flax" in module_level_imports(p)]
    assert not offenders, f"these fault_model modules import flax at module level: {offenders}"


def test_the_check_sees_a_module_level_import(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        "import jax\nif True:\n    import flax.linen as nn\ndef f():\n    import optax\n"
    )
    assert module_level_imports(path) == {"jax", "flax"}
