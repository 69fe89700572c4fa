"""What `pip install` of the project puts into site-packages: the distribution is
tiercache-sidecar, and it installs two packages, `tiercache` and `tiercache_service`
(the daemon, kept in service/), and nothing named `service`."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def declared() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_package_list_names_every_package_in_the_tree():
    tree = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "tiercache").rglob("__init__.py")}
    tree |= {"tiercache_service"} if (ROOT / "service" / "__init__.py").exists() else set()
    setuptools = declared()["tool"]["setuptools"]
    assert set(setuptools["packages"]) == tree
    assert setuptools["package-dir"] == {"tiercache_service": "service"}


def test_the_wheel_installs_tiercache_and_tiercache_service_and_runs_from_there(tmp_path):
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                            "--no-build-isolation", "-w", str(tmp_path / "dist"), str(ROOT)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    wheel, = (tmp_path / "dist").glob("*.whl")
    assert wheel.name.startswith("tiercache_sidecar-")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {
        "tiercache", "tiercache_service"}
    assert any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE")
               for n in names)
    assert any(n.startswith("tiercache/_keymap.") and n.endswith(".so") for n in names)  # C, built
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "tiercache = tiercache_service.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
    # installed apart from the tree, the command's module runs from there
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    str(site), str(wheel)], check=True, timeout=300)
    script = ("import tiercache_service.cli as cli, tiercache.keymap as km, sys; "
              "print(cli.__file__); print(km._keymap.__file__); sys.exit(cli.main(['--version']))")
    ran = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(site)})
    assert ran.returncode == 0, ran.stderr
    where, native, version = ran.stdout.splitlines()
    assert Path(where).is_relative_to(site) and Path(native).is_relative_to(site)
    assert version.startswith("tiercache ")
