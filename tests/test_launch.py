"""Launch anywhere (issue 12, item 1; issue 20): a notebook opened where attnlib is missing installs it.

Every notebook (chapters and solutions) starts with the same hidden cell (id
``install-attnlib``, tag ``remove-cell``): where attnlib cannot be imported (Colab, Binder
before its build installed it) it pip-installs ``attnlib[book]`` from the repository, or
``$ATTNLIB_INSTALL_SOURCE`` when that is set; where attnlib is importable it does nothing. The
launch notebooks (launch/, the plain-Jupyter copies that the book's Colab and Binder buttons
open; tests/test_launch_notebooks.py) start with the same cell made visible, installing
``attnlib[...]`` with the extras that notebook's imports need, from the repository or from
``$ATTNLIB_INSTALL_FROM``. ``binder/`` configures Binder (repo2docker) with the chapters' pinned
dependencies, PyTorch's CPU build and attnlib from this repository.

The end-to-end tests run a chapter's first cells, and the first launch notebooks from top to
bottom under nbval, each in a Jupyter kernel of its own fresh virtual environment without
attnlib, offline: ``ATTNLIB_INSTALL_SOURCE`` (the chapter) or ``ATTNLIB_INSTALL_FROM`` (the
launch notebooks) names a wheel built from this checkout (``--no-build-isolation``, as
tests/test_install.py does) and ``PIP_NO_INDEX=1`` keeps pip off the network; the environment
reaches torch, matplotlib, ipykernel, ... through a ``.pth`` line naming this environment's
site-packages, whose own ``.pth`` files (this checkout's editable attnlib among them) are not
processed from there.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from fresh_env import build_wheel, fresh_venv, offline_env, run

import attnlib

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb")) + sorted((ROOT / "solutions").glob("*.ipynb"))
CHAPTER = ROOT / "notebooks" / "01_attention_from_averages.ipynb"
IMPORTS_ATTNLIB = re.compile(r"^\s*(?:import attnlib|from attnlib[\w.]* import)", re.MULTILINE)


def install_cell(path: Path) -> nbformat.NotebookNode:
    return nbformat.read(path, as_version=4).cells[0]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_notebook_starts_with_the_install_cell(path):
    first = install_cell(path)
    assert first.get("id") == "install-attnlib", f"{path.name}: the first cell is not the install cell"
    assert first.cell_type == "code" and "remove-cell" in first.metadata.get("tags", []), first.metadata
    assert first.source == install_cell(CHAPTER).source, f"{path.name}: its install cell differs from chapter 01's"
    assert not first.get("outputs"), f"{path.name}: the install cell has stored outputs"


def test_the_install_cell_does_nothing_where_attnlib_is_importable(monkeypatch):
    calls = []
    monkeypatch.setattr(subprocess, "run", lambda *args, **kwargs: calls.append(args))
    exec(install_cell(CHAPTER).source, {})  # attnlib is importable here (this checkout)
    assert calls == []


def test_binder_pins_what_the_chapters_need():
    binder = ROOT / "binder"
    assert (binder / "runtime.txt").read_text().strip() == "python-3.11"
    pins = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==")
            pins[name.lower()] = version
    lines = [line.split("#")[0].strip() for line in (binder / "requirements.txt").read_text().splitlines()]
    lines = [line for line in lines if line]
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in lines
    assert ".[book]" in lines, "binder/requirements.txt does not install attnlib from the repository"
    binder_pins = dict(line.split("==") for line in lines if "==" in line)
    assert binder_pins.pop("torch") == pins["torch"] + "+cpu"
    for name, version in binder_pins.items():
        assert pins.get(name.lower()) == version, f"binder pins {name}=={version}, requirements.txt {pins.get(name.lower())}"
    for needed in ("numpy", "matplotlib", "ipywidgets", "ipykernel", "transformers", "tokenizers", "nbclient"):
        assert needed in binder_pins, f"binder/requirements.txt lacks {needed}"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel of attnlib built from this checkout (offline)."""
    return build_wheel(tmp_path_factory.mktemp("wheel"), offline_env())


@pytest.fixture
def fresh_kernel(tmp_path, wheel):
    """``(its python, a directory outside the checkout, the wheel, the environment)``: a Jupyter
    kernel ``fresh-venv`` of a new virtual environment that can import torch and ipykernel but not
    attnlib (one per test: each test's install cell must find attnlib missing)."""
    tmp = tmp_path
    env = offline_env()
    python = fresh_venv(tmp, env)
    venv = python.parents[1]

    kernels = tmp / "jupyter" / "kernels" / "fresh-venv"
    kernels.mkdir(parents=True)
    (kernels / "kernel.json").write_text(json.dumps({
        "argv": [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "fresh venv without attnlib",
        "language": "python",
    }))
    work = tmp / "work"  # outside the checkout: the kernel's cwd must not hold an attnlib/ folder
    work.mkdir()
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(venv),
               JUPYTER_PATH=str(tmp / "jupyter"))
    missing = run([python, "-c", "import importlib.util; print(importlib.util.find_spec('attnlib'))"], cwd=work, env=env)
    assert missing.stdout.strip() == "None", f"attnlib is importable before the install cell: {missing.stdout}"
    return python, work, wheel, env


def test_a_chapter_installs_attnlib_where_it_is_missing(fresh_kernel, monkeypatch):
    from nbclient import NotebookClient

    python, work, wheel, env = fresh_kernel
    nb = nbformat.read(CHAPTER, as_version=4)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert code[0].get("id") == "install-attnlib"
    first_attnlib = next(i for i, cell in enumerate(code) if IMPORTS_ATTNLIB.search(cell.source))
    assert first_attnlib > 0
    probe = nbformat.v4.new_code_cell(
        "import json, sys, attnlib, importlib.metadata\n"
        "print(json.dumps([attnlib.__file__, sys.prefix, importlib.metadata.version('attnlib')]))")
    nb.cells = code[: first_attnlib + 1] + [probe]

    for name in ("PYTHONPATH", "PYTHONHOME"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("ATTNLIB_INSTALL_SOURCE", f"attnlib[book] @ {wheel.as_uri()}")
    NotebookClient(nb, kernel_name="fresh-venv", timeout=240, resources={"metadata": {"path": str(work)}}).execute()

    attnlib_file, prefix, version = json.loads(nb.cells[-1].outputs[0]["text"])
    venv = python.parent.parent
    assert Path(prefix) == venv
    assert Path(attnlib_file).is_relative_to(venv), f"attnlib imported from {attnlib_file}, not the fresh environment"
    assert version == attnlib.__version__ == "2.0.0"
    errors = [out for cell in nb.cells for out in cell.get("outputs", []) if out.get("output_type") == "error"]
    assert not errors, errors


#: The launch notebooks run end to end in the fresh environment (the book's first chapters).
LAUNCHED = [ROOT / "launch" / "notebooks" / f"{name}.ipynb"
            for name in ("01_attention_from_averages", "02_self_attention", "03_causal_attention")]


def test_the_launch_notebooks_run_where_attnlib_is_missing(fresh_kernel):
    """The first launch notebooks (launch/, what Colab and Binder open) under nbval, in a kernel of
    a fresh virtual environment without attnlib, as a learner on Colab runs them: the visible first
    cell installs attnlib with the extras it names (from a wheel of this checkout, named by
    ``ATTNLIB_INSTALL_FROM``; pip offline), then every cell runs and prints what the book shows.

    Where a learner launches a notebook there is no myst-nb (the book's build tool): ``glue()``
    then records nothing, and the launch notebooks store no glue records. The fresh environment
    sees this one's packages, so a stand-in module makes ``import myst_nb`` fail there too."""
    python, work, wheel, env = fresh_kernel
    purelib = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                       cwd=work, env=env).stdout.strip())
    (purelib / "myst_nb.py").write_text('raise ImportError("myst-nb is not installed where a learner launches")\n')
    copies = []
    for notebook in LAUNCHED:
        copies.append(work / notebook.name)
        copies[-1].write_bytes(notebook.read_bytes())
    env = dict(env, ATTNLIB_INSTALL_FROM=wheel.as_uri(), PYDEVD_DISABLE_FILE_VALIDATION="1")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--nbval", "--nbval-kernel-name", "fresh-venv", "--nbval-cell-timeout", "600",
         "--nbval-sanitize-with", str(ROOT / ".nbval_sanitize.cfg"), "-p", "no:cacheprovider", "-q", *copies],
        cwd=work, env=env, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    installed = run([python, "-c", "import attnlib, importlib.metadata; print(attnlib.__file__);"
                     " print(importlib.metadata.version('attnlib'))"], cwd=work, env=env).stdout.split()
    assert Path(installed[0]).is_relative_to(python.parents[1]), f"attnlib imported from {installed[0]}"
    assert installed[1] == attnlib.__version__ == "2.0.0"
