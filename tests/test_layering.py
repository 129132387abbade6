"""The layers' import rules (issue 11): the gateway does not import `adapters` (the record format and the
suffix-floor route are the gateway's own), and kernels (`engine/ops/`) never import the model."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def imports(folder: str) -> list[tuple[str, str]]:
    """(file, module) for every import in the Python files under `folder`, lazy ones inside functions too."""
    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found += [(str(path.relative_to(ROOT)), alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.append((str(path.relative_to(ROOT)), node.module))
    return found


@pytest.mark.parametrize(
    ("folder", "forbidden"),
    [("gateway", "adapters"), ("engine/ops", "engine.model")],
    ids=["gateway", "kernels"],
)
def test_layer_does_not_import(folder, forbidden):
    found = imports(folder)
    assert found  # the walk saw the folder's imports
    assert [(f, m) for f, m in found if m == forbidden or m.startswith(forbidden + ".")] == []


def test_the_gateways_error_types_live_in_one_module():
    """Every exception class of the gateway is in gateway/errors.py (where the app's handlers are), but the
    renderer's private signal from a template's `raise_exception`, which it turns into a `RenderError`."""
    private = {"TemplateRaised"}
    outside = []
    for path in sorted((ROOT / "gateway").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            bases = [
                b.id if isinstance(b, ast.Name) else getattr(b, "attr", "")
                for b in getattr(node, "bases", [])
            ]
            if isinstance(node, ast.ClassDef) and any(
                b.endswith(("Error", "Exception", "BadRequest")) for b in bases
            ):
                outside += (
                    [] if path.name == "errors.py" or node.name in private else [f"{path.name}:{node.name}"]
                )
    assert outside == []
