"""The Makefile's commands, as `make -n` prints them (nothing is installed here): what
`make test` runs reports its count, and torch comes from the index the README says."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def planned(target: str, *assignments: str, env: dict[str, str] | None = None) -> list[str]:
    """The recipe lines `make TARGET` would run, in a fresh virtual environment's place
    (so that its setup is planned too and this checkout's .venv is left alone)."""
    printed = subprocess.run(["make", "-n", "-C", str(ROOT), target, *assignments],
                             capture_output=True, text=True, timeout=60,
                             env=env if env is not None else os.environ)
    assert printed.returncode == 0, printed.stderr
    return printed.stdout.splitlines()


def test_make_test_ends_with_the_count_of_tests_passed(tmp_path):
    (tmp_path / "test_one.py").write_text("def test_one():\n    pass\n")
    command = next(line for line in planned("test") if " -m pytest" in line)
    # the same command, with the repository's pytest settings, on one test
    ran = subprocess.run([*shlex.split(command), "-p", "no:cacheprovider",
                          "-c", str(ROOT / "pyproject.toml"), str(tmp_path / "test_one.py")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "1 passed" in ran.stdout, ran.stdout


def torch_install(tmp_path: Path, *assignments: str, env: dict[str, str] | None = None) -> str:
    lines = planned("env", f"VENV={tmp_path / 'venv'}", *assignments, env=env)
    return next(line for line in lines if "pip install" in line and "torch==" in line)


def test_the_torch_index_can_be_chosen_or_left_to_pip(tmp_path):
    assert torch_install(tmp_path, "TORCH_INDEX=https://mirror.example/cpu").endswith(
        '"torch==2.13.0" --index-url https://mirror.example/cpu')
    assert torch_install(tmp_path, "TORCH_INDEX=").endswith('"torch==2.13.0"')


def test_without_a_gpu_or_a_pip_configuration_torch_is_the_cpu_build(tmp_path):
    bare = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    bare["PIP_CONFIG_FILE"] = os.devnull  # pip reads no configuration file
    expected = "" if shutil.which("nvidia-smi") else f" --index-url {CPU_INDEX}"
    assert torch_install(tmp_path, env=bare).endswith(f'"torch==2.13.0"{expected}')
    # a machine whose pip has a wheel directory of its own (as this project's CI
    # machines do) keeps it: no index that replaces pip's
    with_wheels = {**bare, "PIP_FIND_LINKS": str(tmp_path)}
    assert torch_install(tmp_path, env=with_wheels).endswith('"torch==2.13.0"')


def test_the_readme_and_the_cpu_image_name_the_makefiles_torch_and_cpu_index():
    makefile = (ROOT / "Makefile").read_text()
    torch = re.search(r"^TORCH \?= (\S+)", makefile, re.M).group(1)
    assert re.search(rf"^TORCH_CPU_INDEX := {CPU_INDEX}$", makefile, re.M)
    by_hand = f"pip install {torch} --index-url {CPU_INDEX}"
    assert by_hand in (ROOT / "README.md").read_text()
    assert f'pip install "{torch}" --index-url {CPU_INDEX}' in (ROOT / "deploy" / "Dockerfile.cpu").read_text()
