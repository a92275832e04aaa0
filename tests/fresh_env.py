"""A wheel of attnlib and a fresh virtual environment without it, shared by test_install and test_launch.

The environment sees this one's dependencies (a ``.pth`` line to its site-packages; the editable
attnlib there is not processed) but not attnlib itself; pip runs offline.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the checkout: a test may know where the repository is


def run(cmd: list, cwd: Path, env: dict[str, str], timeout: int = 600) -> subprocess.CompletedProcess:
    """Run ``cmd``; fail the test with its output unless it exits 0."""
    result = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{cmd} exited with {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


def offline_env() -> dict[str, str]:
    """This process's environment without Python paths of its own, pip offline."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PYTHONNOUSERSITE="1")
    return env


def build_wheel(tmp: Path, env: dict[str, str]) -> Path:
    """A wheel of attnlib built from a copy of the sources (building in place would leave build/ behind)."""
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "attnlib", src / "attnlib", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp / "dist", src],
        cwd=tmp, env=env)
    (wheel,) = (tmp / "dist").glob("attnlib-*.whl")
    return wheel


def fresh_venv(tmp: Path, env: dict[str, str]) -> Path:
    """The python of a new virtual environment that imports this one's dependencies but not attnlib."""
    venv = tmp / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp, env=env)
    python = venv / "bin" / "python"
    purelib = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                       cwd=tmp, env=env).stdout.strip())
    (purelib / "zz_attnlib_test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python
