"""Layers import downwards only (tiercache/README.md): read every module's imports."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def imports(path: Path) -> set[str]:
    """The modules a file imports, absolute (relative imports are not used here)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def modules(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("path", modules("tiercache"), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_library_never_imports_the_daemon_or_an_integration(path):
    names = imports(path)
    assert not {n for n in names if n == "service" or n.startswith("service.")}
    if "integrations" not in path.parts:
        assert not {n for n in names if n.startswith("tiercache.integrations")}


VLLM_FREE = ["jobs", "pages", "worker_side", "scheduler_side", "config", "__init__"]


@pytest.mark.parametrize("name", VLLM_FREE)
def test_the_vllm_connectors_data_path_needs_no_vllm(name):
    # the GPU machine has no vLLM: what its tests import must not need it
    names = imports(ROOT / "tiercache" / "integrations" / "vllm" / f"{name}.py")
    assert not {n for n in names if n == "vllm" or n.startswith("vllm.")}
