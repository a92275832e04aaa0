"""Chapter 20's experiment: its command line (flags checked before training), a tiny run, merging, and the
committed results file against the code that builds the models."""
import json
import os

import pytest
import torch

from attnlib.book.experiments import layer_patterns as lp

needs_data = pytest.mark.skipif(not os.environ.get("ATTNLIB_DATA_DIR"), reason="ATTNLIB_DATA_DIR is not set")


def test_patterns_are_the_layer_lists_of_the_chapter():
    c = {name: lp.pattern_config(name) for name in lp.available()}
    S, F = "sliding_attention", "full_attention"
    assert c["full"].layer_types == (F,) * 6
    assert c["local_global_5_1"].layer_types == (S,) * 5 + (F,)
    assert c["alternating"].layer_types == (S, F) * 3
    assert c["nope_every_4th"].nope_layers == (3,) and c["nope_every_4th"].layer_types == (F,) * 6
    assert c["chunked_nope"].layer_types[3] == F and c["chunked_nope"].attention_chunk_size == lp.WINDOW
    for config in c.values():  # one model: the same sizes everywhere
        assert {k: getattr(config, k) for k in lp.MODEL} == lp.MODEL
        assert config.position == "rope" and config.feedforward == "swiglu"


def test_same_seed_same_initial_weights_where_shapes_agree():
    a, b = lp.build_model("full", 3), lp.build_model("local_global_5_1", 3)
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), name


def test_a_pattern_whose_field_is_missing_is_refused_by_name(monkeypatch):
    monkeypatch.setitem(lp.PATTERNS, "future", {"no_such_field": True})
    with pytest.raises(ValueError, match=r"pattern='future' needs the DecoderConfig field\(s\) \['no_such_field'\]"):
        lp.pattern_config("future")
    assert "future" not in lp.available()
    with pytest.raises(ValueError, match="pattern='nope' is not one of"):
        lp.pattern_config("nope")


@pytest.mark.parametrize("argv, message", [
    (["--seeds", "1", "1"], "repeats a seed"),
    (["--seeds", "-1"], "negative"),
    (["--max-iters", "0"], "--max-iters"),
    (["--patterns", "full", "full"], "repeats a pattern"),
    (["--patterns", "gemma"], "invalid choice"),
    (["--merge-with", "no/such/file.json"], "no results file"),
    (["--out", "/"], "not a file name"),
    (["--threads", "0"], "--threads"),
])
def test_bad_flags_are_refused_before_training(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        lp.main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_a_pattern_this_attnlib_cannot_build_is_refused_on_the_command_line(monkeypatch, capsys):
    monkeypatch.setitem(lp.PATTERNS, "kv_sharing", {"no_such_field": 2})
    with pytest.raises(SystemExit):
        lp.main(["--patterns", "kv_sharing"])
    assert "needs the DecoderConfig field(s) ['no_such_field']" in capsys.readouterr().err


@needs_data
def test_tiny_run_then_merge(tmp_path, capsys):
    out = tmp_path / "run.json"
    tiny = ["--max-iters", "3", "--eval-interval", "3", "--eval-iters", "1"]
    threads = torch.get_num_threads()
    first = lp.main(["--patterns", "full", "alternating", "--seeds", "5", *tiny, "--out", str(out), "--threads", "1"])
    assert first["meta"]["complete"] and json.loads(out.read_text()) == first
    assert first["meta"]["threads"] == 1 and torch.get_num_threads() == threads  # trained on 1, the caller's restored
    run = first["variants"]["alternating"]
    assert run["by_seed"]["5"]["steps"] == [0, 3]
    model = lp.build_model("alternating", 0)
    assert run["parameters"] == model.num_parameters()
    assert run["cache_bytes_at_block_size"] == lp.cache_bytes_at(model) < first["variants"]["full"][
        "cache_bytes_at_block_size"]
    merged = lp.main(["--patterns", "full", "--seeds", "6", *tiny, "--merge-with", str(out), "--out", str(out)])
    assert sorted(merged["variants"]["full"]["by_seed"]) == ["5", "6"] and merged["seeds"] == [5, 6]
    assert list(merged["variants"]["alternating"]["by_seed"]) == ["5"]
    assert "--merge-with" in merged["meta"]["merged"][0]["command"]
    with pytest.raises(SystemExit):  # the same pattern and seed twice
        lp.main(["--patterns", "full", "--seeds", "6", *tiny, "--merge-with", str(out), "--out", str(out)])
    assert "already holds full/6" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # other settings
        lp.main(["--patterns", "full", "--seeds", "7", "--max-iters", "4", "--eval-interval", "3",
                 "--eval-iters", "1", "--merge-with", str(out), "--out", str(out)])
    assert "training settings differ" in capsys.readouterr().err


def test_committed_results_match_the_code():
    results = lp.load_results()
    assert results["model"] == dict(lp.MODEL, window=lp.WINDOW)
    for name, run in results["variants"].items():
        model = lp.build_model(name, 0)
        assert run["parameters"] == model.num_parameters(), name
        assert run["cache_bytes_at_block_size"] == lp.cache_bytes_at(model), name
        assert run["config"] == json.loads(json.dumps(lp.PATTERNS[name])), name
