"""The one layering rule import-linter cannot state (it sees external packages by their top
name only): planning imports nothing of ``torch.distributed``. The other layers are the
import-linter contracts in setup.cfg (``lint-imports``, run in CI; docs/design.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PLANNING = Path(__file__).resolve().parents[1] / "oss_plus" / "planning"


def distributed_uses(source: str) -> list[int]:
    """Lines of ``source`` that import or name ``torch.distributed``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            names = [module] + [f"{module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            names = [f"{node.value.id}.{node.attr}"]
        else:
            continue
        if any(n == "torch.distributed" or n.startswith("torch.distributed.") for n in names):
            found.append(node.lineno)
    return found


@pytest.mark.parametrize(
    "source",
    [
        "import torch.distributed as dist",
        "from torch.distributed import ProcessGroup",
        "from torch import distributed",
        "import torch\nx = torch.distributed",
    ],
)
def test_the_scan_sees_every_form(source):
    assert distributed_uses(source)


def test_planning_imports_nothing_of_torch_distributed():
    files = sorted(PLANNING.glob("*.py"))
    assert len(files) >= 8  # the scan found the package
    offenders = [f"{p.name}:{line}" for p in files for line in distributed_uses(p.read_text())]
    assert not offenders, "planning is pure (docs/design.md): " + ", ".join(offenders)


def optional_imports(source: str) -> list[int]:
    """Lines of ``source`` that import an optional optimizer package (torchao, bitsandbytes)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        else:
            continue
        if any(n.split(".")[0] in ("torchao", "bitsandbytes") for n in names):
            found.append(node.lineno)
    return found


def test_planning_knows_low_bit_optimizers_by_table_only():
    """``oss-plus plan --optimizer`` reads a table (planning/optim_state.py); the packages
    are imported only by the bench and the tests that check the table."""
    assert optional_imports("import torchao.optim\nfrom bitsandbytes import optim")
    files = sorted(PLANNING.glob("*.py"))
    offenders = [f"{p.name}:{line}" for p in files for line in optional_imports(p.read_text())]
    assert not offenders, "planning is pure: " + ", ".join(offenders)


def _imports(root: Path) -> dict[str, set[str]]:
    """For every module of ``oss_plus`` (packages apart), the modules it imports from
    ``oss_plus``: at the top, in functions and under ``TYPE_CHECKING`` alike."""
    modules = {
        ".".join(p.relative_to(root.parent).with_suffix("").parts): p
        for p in root.rglob("*.py")
        if p.name != "__init__.py"
    }
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("oss_plus"):
                for alias in node.names:
                    target = f"{node.module}.{alias.name}"
                    edges[name].add(target if target in modules else str(node.module))
    return {m: {t for t in e if t in modules} for m, e in edges.items()}


def test_no_module_imports_one_that_imports_it_back():
    """Each file imports only downwards (issue 55: four circles inside subpackages, e.g.
    ``compat/fairscale.py`` <-> ``compat/_install.py``, were untied)."""
    edges = _imports(PLANNING.parent)

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            module = todo.pop()
            if module == goal:
                return True
            if module not in seen:
                seen.add(module)
                todo.extend(edges[module])
        return False

    circles = sorted((a, b) for a, targets in edges.items() for b in targets if reaches(b, a))
    assert not circles, circles
