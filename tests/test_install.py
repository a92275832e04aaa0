"""attnlib installed from a wheel, not from this checkout (issue 11, part 1).

A wheel is built from a copy of the repository's package sources, installed (not editable)
into a fresh virtual environment, and used from a directory outside the checkout: it
imports, the exercise checker grades a solutions notebook, and one benchmark runs with
``--small``. Anything found through ``Path(__file__).parents[...]`` (results files, the
repository's folders) would be missing here.

No network: the wheel is built with ``--no-build-isolation`` and installed with ``--no-index
--no-deps``; the new environment reaches the heavy dependencies (torch, nbclient, ...) through
a ``.pth`` line naming this environment's site-packages, whose own ``.pth`` files (the
editable install of this checkout among them) are not processed from there.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from fresh_env import ROOT, build_wheel, fresh_venv, offline_env, run

SOLUTIONS = ROOT / "solutions" / "01_attention_from_averages_solutions.ipynb"


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """``(python of the new environment, a working directory outside the checkout, its environment variables)``."""
    tmp = tmp_path_factory.mktemp("install")
    env = offline_env()
    wheel = build_wheel(tmp, env)  # 1. a wheel from a copy of the sources
    python = fresh_venv(tmp, env)  # 2. a fresh environment that sees this one's dependencies but not attnlib
    venv = python.parents[1]
    run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q", wheel],
        cwd=tmp, env=env)

    work = tmp / "work"  # outside the checkout
    work.mkdir()
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    return python, work, env


def test_the_wheel_is_what_gets_imported(installed):
    python, work, env = installed
    probe = ("import attnlib, importlib.metadata, json, sys; "
             "print(json.dumps([attnlib.__file__, attnlib.__version__, importlib.metadata.version('attnlib'), sys.prefix]))")
    file, version, dist_version, prefix = json.loads(run([python, "-c", probe], cwd=work, env=env).stdout)
    venv = python.parent.parent
    assert Path(file).is_relative_to(venv) and not Path(file).is_relative_to(ROOT), file
    assert Path(prefix) == venv
    assert dist_version == "2.0.0" and version == dist_version, (version, dist_version)
    committed = "from attnlib.book import results; print([sorted(results.load(n))[0] for n in results.NAMES])"
    run([python, "-c", committed], cwd=work, env=env)  # the committed results files are in the wheel


def test_the_exercise_checker_grades_a_solutions_notebook(installed):
    import nbformat

    python, work, env = installed
    nb = nbformat.read(SOLUTIONS, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(  # which attnlib the kernel ran
        "import json, sys, attnlib\n"
        "open('kernel.json', 'w').write(json.dumps([attnlib.__file__, sys.executable]))"))
    nbformat.write(nb, work / "my_chapter_01.ipynb")
    result = run([python, "-m", "attnlib.book.exercises", "check", "my_chapter_01.ipynb"], cwd=work, env=env)
    assert "3 of 3 correct" in result.stdout, result.stdout
    assert [line.split()[:2] for line in result.stdout.splitlines()[1:4]] == [
        ["01.1", "correct"], ["01.2", "correct"], ["01.3", "correct"]], result.stdout
    attnlib_file, kernel_python = json.loads((work / "kernel.json").read_text())
    assert Path(attnlib_file).is_relative_to(python.parent.parent), (attnlib_file, kernel_python)


def test_a_small_benchmark_runs(installed):
    python, work, env = installed
    out = work / "bench" / "mha.json"
    result = run([python, "-m", "attnlib.bench", "mha", "--small", "--out", out], cwd=work, env=env)
    assert out.is_file(), result.stdout
    payload = json.loads(out.read_text())
    assert payload["benchmark"] == "mha" and payload["rows"], payload.keys()
