"""Layers import downwards only (tiercache/README.md): nothing in tiercache imports the
daemon, and the rooms added beside the core import only what lies under them, so that
the core can be rearranged around them."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# room -> the tiercache modules it may import (a prefix allows a package)
ALLOWED = {
    "tiercache/tiers/remote": ("tiercache.errors", "tiercache.hashing", "tiercache.results",
                               "tiercache.metrics", "tiercache.tiers.remote"),
    "tiercache/remote.py": ("tiercache.background", "tiercache.events", "tiercache.hashing",
                            "tiercache.index", "tiercache.layout", "tiercache.metrics",
                            "tiercache.results",
                            "tiercache.tiers.arena", "tiercache.tiers.remote"),
    "service/fleet.py": ("service.workers", "tiercache.errors", "tiercache.events"),
    "tiercache/events.py": ("tiercache.hashing", "tiercache.results", "tiercache.keymap"),
    "service/kv_encoding.py": ("tiercache.events", "tiercache.results"),
    "service/kv_events.py": ("service.kv_encoding", "tiercache.errors", "tiercache.events"),
}


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_the_library_never_imports_the_daemon():
    offenders = {str(p.relative_to(ROOT)): sorted(m for m in imports(p) if m.split(".")[0] == "service")
                 for p in (ROOT / "tiercache").rglob("*.py")}
    assert {p: m for p, m in offenders.items() if m} == {}


def test_rooms_beside_the_core_import_only_what_lies_under_them():
    for room, allowed in ALLOWED.items():
        path = ROOT / room
        files = [path] if path.suffix == ".py" else sorted(path.rglob("*.py"))
        assert files, f"{room} has no modules"
        for path in files:
            ours = {m for m in imports(path) if m.split(".")[0] in ("tiercache", "service")}
            wrong = sorted(m for m in ours if not any(m == a or m.startswith(a + ".") for a in allowed))
            assert wrong == [], f"{path.relative_to(ROOT)} imports {wrong} from above its layer"
