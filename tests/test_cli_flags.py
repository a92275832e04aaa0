"""Every command line refuses a bad flag up front (argparse ``error:``, exit status 2), and writes its results atomically.

Issue #26: a list flag that names nothing or repeats an entry, a count that is not a positive integer,
tokens past the model's context, an output path that cannot be written: each is one ``error:`` line
naming the flag and the value, before any model is built, trained or timed. The expensive part of
every command is replaced by a failure here, so a flag that slipped through fails the test at once
instead of starting a run.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from attnlib import _cli
from attnlib.bench import cli as bench_cli
from attnlib.bench._common import write_json as bench_write_json
from attnlib.book.experiments import beyond_softmax, compare_attention, long_context, speculative

EXPERIMENTS = {"speculative": speculative, "long_context": long_context, "compare_attention": compare_attention,
               "beyond_softmax": beyond_softmax}


def _must_not_run(*args, **kwargs):
    raise AssertionError("a bad flag got past the checks: the command started its work")


@pytest.fixture
def nothing_runs(monkeypatch):
    """Every command's work (benchmarks, corpus, training) fails the test if it is reached."""
    monkeypatch.setattr(bench_cli, "_run", _must_not_run)
    for module in (speculative, long_context):
        monkeypatch.setattr(module, "load_char_corpus", _must_not_run)
        monkeypatch.setattr(module, "train", _must_not_run)
    monkeypatch.setattr(compare_attention, "compare", _must_not_run)
    monkeypatch.setattr(beyond_softmax, "compare", _must_not_run)
    monkeypatch.setattr(beyond_softmax, "topk_tradeoff", _must_not_run)


def _refused(main, argv, capsys) -> str:
    """The ``error:`` line of ``main(argv)``, which must exit with status 2 within a few seconds."""
    start = time.perf_counter()
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert time.perf_counter() - start < 5, "a refusal must come before any work"
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and err, err
    return err[-1]


# ------------------------------------------------------------------ python -m attnlib.bench <name>

BENCH_CASES = [
    # an empty list: a benchmark that would time only its reference, or nothing
    (["flash", "--methods", ""], "argument --methods: '' holds no names"),
    (["flash", "--methods", ","], "argument --methods: ',' holds no names"),
    (["flash", "--seq-lens", ""], "argument --seq-lens: '' holds no lengths"),
    (["flash", "--seq-lens", " , "], "argument --seq-lens: ' , ' holds no lengths"),
    (["long-context", "--lengths", ""], "argument --lengths: '' holds no lengths"),
    (["long-context", "--lengths", ","], "argument --lengths: ',' holds no lengths"),  # was a traceback (min([]))
    (["kv-cache", "--variants", ""], "argument --variants: '' names nothing"),
    (["memory", "--seq-lens", ","], "argument --seq-lens: ',' holds no lengths"),
    (["memory", "--methods", ""], "argument --methods: '' names nothing"),
    (["mha", "--rows", ","], "argument --rows: ',' names nothing"),
    (["train", "--sizes", ""], "argument --sizes: '' names nothing"),
    # repeated entries: the same thing timed twice
    (["flash", "--methods", "flash,flash"], "argument --methods: 'flash,flash' repeats flash"),
    (["flash", "--seq-lens", "64,32,64"], "argument --seq-lens: '64,32,64' repeats 64"),
    (["long-context", "--lengths", "256,256"], "argument --lengths: '256,256' repeats 256"),
    (["kv-cache", "--variants", "mha,gqa,mha"], "argument --variants: 'mha,gqa,mha' repeats mha"),
    (["memory", "--seq-lens", "256,256"], "argument --seq-lens: '256,256' repeats 256"),
    (["memory", "--methods", "sdpa,sdpa"], "argument --methods: 'sdpa,sdpa' repeats sdpa"),
    (["mha", "--rows", "core/eager,core/eager"], "argument --rows: 'core/eager,core/eager' repeats core/eager"),
    (["train", "--sizes", "book,book"], "argument --sizes: 'book,book' repeats book"),
    # unknown names, non-integers, counts < 1
    (["flash", "--methods", "naive,fast"], "argument --methods: fast not among naive,sdpa,flash,tiled"),
    (["flash", "--seq-lens", "32,x"], "argument --seq-lens: '32,x' is not a comma-separated list of integers"),
    (["flash", "--batch", "0"], "argument --batch: 0 must be >= 1"),
    (["flash", "--batch", "1.5"], "argument --batch: invalid int value: '1.5'"),
    (["long-context", "--lengths", "0,64"], "must be >= 1"),
    (["memory", "--seq-lens", "64,-1"], "argument --seq-lens: -1 must be positive"),
    (["mha", "--repeats", "0"], "argument --repeats: 0 must be positive"),
    (["kv-cache", "--variants", "mha,gqa2"], "argument --variants: gqa2 not among mha,gqa,mqa,mla"),
    (["serving", "--prompts", "0"], "argument --prompts: 0 must be >= 1"),
    (["serving", "--seed", str(2**64)], f"argument --seed: {2**64} is outside the seeds torch takes"),
    (["layer-types", "--seed", str(-(2**63) - 1)], "is outside the seeds torch takes, [-2**63, 2**64)"),
    # tokens past the model's context
    (["kv-cache", "--tokens", "2000"], "argument --tokens: --prompt-len 8 + --tokens 2000 exceeds the model's block_size 1024"),
    (["kv-cache", "--small", "--tokens", "30"], "--prompt-len 8 + --tokens 30 exceeds the model's block_size 32"),
    (["kv-cache", "--small", "--prompt-len", "30"], "--prompt-len 30 + --tokens 8 exceeds the model's block_size 32"),
    (["kv-cache", "--small", "--prompt-len", "30", "--tokens", "1"], "--prompt-len 30 + --warmup 4 exceeds"),
    (["serving", "--tokens", "200"], "argument --tokens: 200 is too many for the model's block_size 256"),
    (["serving", "--small", "--tokens", "32"], "(expected <= 31)"),
    (["hf-llama", "--small", "--tokens", "100"], "--prompt-len 4 + --tokens 100 exceeds the model's block_size 32"),
]


@pytest.mark.parametrize(("argv", "message"), BENCH_CASES, ids=[" ".join(a) for a, _ in BENCH_CASES])
def test_bench_refuses_bad_flags(argv, message, tmp_path, capsys, nothing_runs):
    out = tmp_path / "x.json"
    line = _refused(bench_cli.main, [*argv, "--out", str(out)], capsys)
    assert line.startswith("python -m attnlib.bench") and "error: " in line and message in line, line
    assert not out.exists()


def test_bench_accepts_what_it_refused_when_it_is_right(tmp_path, nothing_runs):
    """The checks refuse only what is wrong: the limits themselves pass (and reach the run, refused here)."""
    for argv in (["kv-cache", "--small", "--prompt-len", "24", "--tokens", "8"], ["serving", "--small", "--tokens", "31"],
                 ["flash", "--methods", "flash", "--seq-lens", "64,32"], ["long-context", "--lengths", "256"]):
        with pytest.raises(AssertionError, match="got past the checks"):
            bench_cli.main([*argv, "--out", str(tmp_path / "x.json")])


BENCHMARKS = list(bench_cli.BENCHMARKS)


@pytest.mark.parametrize("name", BENCHMARKS)
def test_every_benchmark_refuses_an_out_it_cannot_write(name, tmp_path, capsys, nothing_runs):
    (tmp_path / "a_file").write_text("")
    cases = [(tmp_path / "a_file" / "x.json", "exists and is not a directory"),
             (tmp_path, "is a directory (expected a file name)"),
             (f"{tmp_path}/sub/", "is not a file name")]
    for out, message in cases:
        line = _refused(bench_cli.main, [name, "--small", "--out", str(out)], capsys)
        assert f"argument --out: {str(out)!r}" in line or f"cannot write {str(out)!r}" in line, line
        assert message in line, line


def test_out_in_a_directory_that_refuses_files(tmp_path, capsys, nothing_runs, monkeypatch):
    """Permission bits say nothing to root, nor about a read-only file system: a probe file is made instead."""
    import tempfile

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Read-only file system")

    monkeypatch.setattr(tempfile, "TemporaryFile", refuse)
    line = _refused(bench_cli.main, ["mha", "--small", "--out", str(tmp_path / "m.json")], capsys)
    assert f"cannot write {str(tmp_path / 'm.json')!r}: the directory {tmp_path} refuses a new file" in line
    assert list(tmp_path.iterdir()) == []


def test_bench_refusal_through_python_dash_m(tmp_path):
    """The real entry point: status 2 and one ``error:`` line, in the time it takes to import torch."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "attnlib.bench", "flash", "--methods", ",", "--out",
                             str(tmp_path / "f.json")], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 2 and time.perf_counter() - start < 60
    assert result.stderr.strip().splitlines()[-1].endswith("argument --methods: ',' holds no names "
                                                            "(expected a comma-separated list)")
    assert "Traceback" not in result.stderr and not (tmp_path / "f.json").exists()


# ------------------------------------------------------------------ python -m attnlib.book.experiments.<name>

EXPERIMENT_CASES = [
    ("speculative", ["--max-iters", "0"], "argument --max-iters: 0 is not a positive integer"),
    ("speculative", ["--new-tokens", "-1"], "argument --new-tokens: -1 is not a positive integer"),
    ("speculative", ["--prompts", "0"], "argument --prompts: 0 is not a positive integer"),
    ("speculative", ["--repeats", "two"], "argument --repeats: 'two' is not an integer"),
    ("speculative", ["--new-tokens", "97"], "argument --new-tokens: 97 + the 32-token prompt exceeds the models' "
                                            "block_size 128 (expected <= 96)"),
    ("long_context", ["--context", "0"], "argument --context: 0 is not a positive integer"),
    ("long_context", ["--max-iters", "-5"], "argument --max-iters: -5 is not a positive integer"),
    ("long_context", ["--stream", "0"], "argument --stream: 0 is not a positive integer"),
    ("long_context", ["--positions", ""], "argument --positions: '' names nothing"),
    ("long_context", ["--positions", "rope,rope"], "argument --positions: 'rope,rope' repeats rope"),
    ("long_context", ["--positions", "rope,xpos"], "argument --positions: xpos not among rope,alibi,learned,nope"),
    ("long_context", ["--context", "4"], "argument --context: 4 leaves no window beside the 4 sinks"),
    ("long_context", ["--seed", "-1"], "argument --seed: -1 is negative"),
    ("long_context", ["--seed", str(2**64)], f"argument --seed: {2**64} is too large (expected a seed, 0 <= seed < 2**64)"),
    ("compare_attention", ["--seeds", "0", str(2**64)], f"argument --seeds: {2**64} is too large"),
    ("beyond_softmax", ["--seeds", "1", "x"], "argument --seeds: 'x' is not an integer"),
    ("compare_attention", ["--variants", "mha,gqa,mha"], "argument --variants: 'mha,gqa,mha' repeats mha"),
    ("compare_attention", ["--variants", ","], "argument --variants: ',': expected comma-separated names"),
    ("compare_attention", ["--max-iters", "0"], "argument --max-iters: 0 is not a positive integer"),
    ("compare_attention", ["--seeds", "1", "1"], "argument --seeds: [1, 1] repeats a seed"),
    ("beyond_softmax", ["--models", "softmax", "linear", "softmax"], "argument --models: softmax linear softmax repeats"),
    ("beyond_softmax", ["--models"], "argument --models: expected at least one argument"),
    ("beyond_softmax", ["--eval-iters", "0"], "argument --eval-iters: 0 is not a positive integer"),
]


@pytest.mark.parametrize(("name", "argv", "message"), EXPERIMENT_CASES,
                         ids=[f"{n} {' '.join(a)}" for n, a, _ in EXPERIMENT_CASES])
def test_experiments_refuse_bad_flags(name, argv, message, tmp_path, capsys, nothing_runs):
    out = tmp_path / "x.json"
    line = _refused(EXPERIMENTS[name].main, [*argv, "--out", str(out)], capsys)
    assert f"python -m attnlib.book.experiments.{name}" in line and "error: " in line and message in line, line
    assert not out.exists()


@pytest.mark.parametrize("name", list(EXPERIMENTS))
def test_every_experiment_refuses_an_out_it_cannot_write(name, tmp_path, capsys, nothing_runs):
    (tmp_path / "a_file").write_text("")
    for out, message in ((tmp_path / "a_file" / "x.json", "exists and is not a directory"),
                         (tmp_path, "is a directory (expected a file name)")):
        line = _refused(EXPERIMENTS[name].main, ["--out", str(out)], capsys)
        assert "argument --out:" in line and str(out) in line and message in line, line


def test_long_context_checks_the_text_before_training(tmp_path, capsys, nothing_runs, monkeypatch):
    """--context x 8 and --stream must fit the validation text: refused after loading it, before any training."""
    corpus = SimpleNamespace(val=torch.zeros(1000, dtype=torch.long), train=None, vocab_size=65)
    monkeypatch.setattr(long_context, "load_char_corpus", lambda: corpus)
    out = str(tmp_path / "x.json")
    line = _refused(long_context.main, ["--context", "125", "--out", out], capsys)
    assert "argument --context: 125 x 8 = 1000 positions is longer than the validation text (1000 tokens)" in line
    line = _refused(long_context.main, ["--stream", "1000", "--out", out], capsys)
    assert "argument --stream: 1000 tokens is longer than the validation text" in line
    # without the RoPE model there is no streaming test: --stream is not checked
    with pytest.raises(AssertionError, match="got past the checks"):
        long_context.main(["--stream", "1000", "--positions", "alibi", "--out", out])


def test_beyond_softmax_topk_only_needs_its_inputs(tmp_path, capsys, nothing_runs):
    out, ckpt = tmp_path / "r.json", tmp_path / "ckpt"
    line = _refused(beyond_softmax.main, ["--topk-only", "--out", str(out), "--checkpoints", str(ckpt)], capsys)
    assert f"argument --out: --topk-only adds to a results file, and there is none at {str(out)!r}" in line
    out.write_text("{}")
    line = _refused(beyond_softmax.main, ["--topk-only", "--out", str(out), "--checkpoints", str(ckpt)], capsys)
    assert f"argument --checkpoints: --topk-only reads the saved models, and {str(ckpt)!r} is not a directory" in line
    ckpt.mkdir()
    line = _refused(beyond_softmax.main, ["--topk-only", "--out", str(out), "--checkpoints", str(ckpt),
                                          "--merge-from", str(tmp_path / "more.json")], capsys)
    assert f"argument --merge-from: no results file at {str(tmp_path / 'more.json')!r}" in line
    line = _refused(beyond_softmax.main, ["--merge-from", str(out), "--out", str(out)], capsys)
    assert "argument --merge-from: only used with --topk-only" in line
    assert out.read_text() == "{}"


# ------------------------------------------------------------------ argument types and the atomic writer


def test_list_types():
    assert _cli.int_list()("64, 32,") == [64, 32] and _cli.name_list(("a", "b"))("b,a") == ["b", "a"]
    assert _cli.int_list(unique=False)("8,8") == [8, 8] and _cli.name_list(("a",), unique=False)("a,a") == ["a", "a"]
    for parse, text, message in ((_cli.int_list(), ",", "',' holds no integers"),
                                 (_cli.int_list(), "4,x", "'x' in '4,x' is not an integer"),
                                 (_cli.int_list(low=2), "4,1", "1 in '4,1' must be >= 2"),
                                 (_cli.int_list(), "4,8,4,8", "'4,8,4,8' repeats 4,8 (expected each once)"),
                                 (_cli.name_list(("a", "b")), " ", "' ' names nothing; choose from a,b"),
                                 (_cli.name_list(("a", "b")), "a,c", "c not among a,b"),
                                 (_cli.name_list(("a", "b")), "a,a", "'a,a' repeats a")):
        with pytest.raises(argparse.ArgumentTypeError, match="^" + re.escape(message)):
            parse(text)


@pytest.mark.parametrize("write_json", [_cli.write_json, bench_write_json], ids=["_cli", "bench"])
def test_atomic_write_keeps_the_old_file(write_json, tmp_path, monkeypatch):
    """A write that fails (a value JSON cannot take, or a failure while writing) leaves the old file, and no temp file."""
    path = tmp_path / "results.json"
    write_json(path, {"rows": [1]})
    old = path.read_text()
    with pytest.raises(TypeError, match="not JSON serializable"):
        write_json(path, {"rows": [1, object()]})
    assert path.read_text() == old and [p.name for p in tmp_path.iterdir()] == ["results.json"]

    def interrupted(src, dst):  # the temporary file is complete, the rename never happens
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_json(path, {"rows": [2]})
    assert path.read_text() == old and [p.name for p in tmp_path.iterdir()] == ["results.json"]
    monkeypatch.undo()
    write_json(path, {"rows": [3]})
    assert json.loads(path.read_text()) == {"rows": [3]} and [p.name for p in tmp_path.iterdir()] == ["results.json"]


def test_write_json_formats_and_creates_directories(tmp_path):
    path = _cli.write_json(tmp_path / "a" / "b.json", {"x": [1]}, indent=None, newline=False)
    assert path.read_text() == '{"x": [1]}'
    assert _cli.write_json(path, {"x": 1}).read_text() == '{\n "x": 1\n}\n'  # the book's committed files: indent=1
