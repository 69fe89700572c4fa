"""The layer rule of tiercache/README.md, checked: a module imports only from its own layer
or the layers below, nothing in tiercache imports the daemon (service), no import
circle, and the wire converter and the remote client load neither the engine nor LMDB.

A new module must be given its layer here: where it goes is a decision, not an accident.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# lowest first; a module may import its own layer and those below
LAYERS = [
    {"errors", "failpoints", "flops", "v1", "trace", "channel", "arrays", "deadlines", "streams"},
    {"keymap", "hashing", "layout", "results"},
    {"counters", "metrics", "chores", "tenancy", "buffers", "shm", "cuda_ipc", "kernels", "copy_engines",
     "tiers.arena", "tiers.lmdb_format", "events", "tiers.remote.entry", "tiers.remote.resp",
     "tiers.remote.incidents", "tiers.remote.store", "tiers.remote.redis_cluster",
     "tiers.remote.adapters"},
    {"index", "policy", "admission", "tuning", "transfer", "tiers.host", "tiers.device",
     "tiers.recovery", "tiers.disk", "regions", "signals"},
    {"joint"},
    {"room"},
    {"books"},
    {"background"},
    {"promotions"},
    {"load"},
    {"store", "remote"},
    {"engine"},
    {"invariants", "wire", "call_stream", "lane", "client", "group", "outbox"},
    {"integrations.placement", "integrations.capture", "integrations.hf_cache",
     "integrations.stores", "integrations.vllm.config", "integrations.vllm.jobs",
     "integrations.vllm.pages"},
    {"integrations.transformers", "integrations.vllm.events", "integrations.vllm.scheduler_side",
     "integrations.vllm.worker_side"},
    {"integrations.vllm.connector"},
]
LAYER = {name: n for n, names in enumerate(LAYERS) for name in names}


def modules() -> dict[str, Path]:
    found = {}
    for path in (ROOT / "tiercache").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT / "tiercache").with_suffix("").parts)
        if name.endswith("__init__") or name.startswith("v1."):
            continue
        found[name] = path
    return found


def imports(path: Path) -> set[str]:
    """The tiercache modules (and the daemon, `tiercache_service`) a file imports, by name under tiercache."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            if name == "service" or name.startswith(("service.", "tiercache_service")):
                out.add("service")
            elif name.startswith("tiercache."):
                out.add(name.removeprefix("tiercache."))
    return out


def resolve(name: str, known: set[str]) -> str | None:
    """The module a dotted import name lands in (`tiers.disk.DiskTier` -> `tiers.disk`)."""
    while name and name not in known and name not in ("v1",):
        name = name.rpartition(".")[0]
    return name or None


def test_every_module_has_a_layer():
    missing = sorted(set(modules()) - set(LAYER))
    assert not missing, f"give these modules a layer in tests/tiercache/test_layers.py: {missing}"


def test_imports_go_downwards_only_and_never_to_the_daemon():
    found, known = modules(), set(modules()) | {"v1"}
    wrong = []
    for name, path in found.items():
        for target in imports(path):
            if target == "service":
                wrong.append(f"{name} imports the daemon (service)")
                continue
            target = resolve(target, known)
            if target and target != name and LAYER.get(target, 0) > LAYER[name]:
                wrong.append(f"{name} (layer {LAYER[name]}) imports {target} (layer {LAYER[target]})")
    assert not wrong, "\n".join(wrong)


def test_there_is_no_import_circle():
    found, known = modules(), set(modules())
    graph = {name: {t for t in (resolve(i, known) for i in imports(path)) if t and t != name}
             for name, path in found.items()}
    state: dict[str, int] = {}

    def visit(name: str, trail: list[str]) -> None:
        state[name] = 1
        for target in sorted(graph.get(name, ())):
            if state.get(target) == 1:
                pytest.fail("import circle: " + " -> ".join(trail + [name, target]))
            if target not in state:
                visit(target, trail + [name])
        state[name] = 2
    for name in sorted(graph):
        if name not in state:
            visit(name, [])


def test_the_wire_and_the_remote_client_load_no_engine():
    code = ("import sys, tiercache.client, tiercache.wire; "
            "print(sorted(m for m in ('tiercache.engine', 'tiercache.books', 'lmdb') if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                            check=True).stdout.strip()
    assert loaded == "[]"


VLLM_FREE = ["jobs", "pages", "worker_side", "scheduler_side", "config", "__init__"]


@pytest.mark.parametrize("name", VLLM_FREE)
def test_the_vllm_connectors_data_path_needs_no_vllm(name):
    # the GPU machine has no vLLM: what its tests import must not need it
    tree = ast.parse((ROOT / "tiercache" / "integrations" / "vllm" / f"{name}.py").read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not {n for n in names if n == "vllm" or n.startswith("vllm.")}
