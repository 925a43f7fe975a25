"""The shape of the device code: shared building blocks live in `kdagen.kernels` and are imported by the
rendered stages; templates paste nothing into each other."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "kdagen" / "kernels"


def _exported(module: Path) -> set[str]:
    """A kernels module's `__all__`, read without importing it (the modules import cutlass)."""
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    raise AssertionError(f"{module} has no __all__")


def test_templates_include_and_import_nothing():
    for template in sorted((ROOT / "templates").rglob("*.j2")):
        text = template.read_text()
        found = re.findall(r"\{%-?\s*(include|import|from|extends)\b", text)
        where = template.relative_to(ROOT)
        assert not found, f"{where}: {found} (shared device code belongs in kdagen/kernels, imported)"


def test_rendered_stages_import_only_what_the_package_exports():
    exported = {p.stem: _exported(p) for p in KERNELS.glob("*.py") if p.stem != "__init__"}
    stages = sorted((ROOT / "generated").rglob("*.py"))
    assert stages, "no rendered stages under generated/"
    imported = 0
    for stage in stages:
        for node in ast.walk(ast.parse(stage.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kdagen.kernels."):
                module = node.module.rsplit(".", 1)[1]
                assert module in exported, f"{stage}: imports the unknown module {node.module}"
                missing = {a.name for a in node.names} - exported[module]
                assert not missing, f"{stage}: imports {sorted(missing)} that {node.module} does not export"
                imported += 1
    assert imported >= len(stages)  # every stage but forward imports several; forward imports cu_at


@pytest.mark.parametrize("module", sorted(p.name for p in KERNELS.glob("*.py")))
def test_kernels_modules_define_what_they_export(module: str):
    path = KERNELS / module
    tree = ast.parse(path.read_text())
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assigned = [t for n in tree.body if isinstance(n, ast.Assign) for t in n.targets]
    defined |= {t.id for t in assigned if isinstance(t, ast.Name)}
    if module != "__init__.py":
        assert _exported(path) <= defined


def test_wheel_ships_every_package():
    line = re.search(r"^packages = (\[.*\])$", (ROOT / "pyproject.toml").read_text(), re.M)
    assert line, "pyproject.toml: no `packages = [...]` line under [tool.setuptools]"
    listed = set(ast.literal_eval(line.group(1)))
    found = {
        ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "kdagen").rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    assert found <= listed, f"pyproject.toml [tool.setuptools] packages misses {sorted(found - listed)}"
