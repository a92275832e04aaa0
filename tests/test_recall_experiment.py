"""Chapter 21's MQAR experiment: the batch generator's structure, the accuracy, the command line, a tiny run,
and the committed results file against the code that builds the models."""
import json
import math
import os

import pytest
import torch

from attnlib import kv_cache_bytes
from attnlib.book.experiments import recall as rc

needs_data = pytest.mark.skipif(not os.environ.get("ATTNLIB_DATA_DIR"), reason="ATTNLIB_DATA_DIR is not set")


@pytest.mark.parametrize("n", [1, 4, 32])
def test_mqar_batch_lists_distinct_pairs_then_queries_each_answered_by_its_value(n):
    idx, targets = rc.mqar_batch(64, n, torch.Generator().manual_seed(n))
    assert idx.shape == targets.shape == (64, 4 * n) and idx.dtype == targets.dtype == torch.long
    K = rc.MQAR["n_keys"]
    for row, target in zip(idx.tolist(), targets.tolist()):
        keys, values = row[0:2 * n:2], row[1:2 * n:2]
        assert len(set(keys)) == n and all(1 <= k <= K for k in keys)  # distinct keys
        assert all(K < v <= K + rc.MQAR["n_values"] for v in values)
        pairs = dict(zip(keys, values))
        queries, answers = row[2 * n::2], row[2 * n + 1::2]
        assert sorted(queries) == sorted(keys)  # every key asked once
        for j, (q, a) in enumerate(zip(queries, answers)):
            assert a == pairs[q] and target[2 * n + 2 * j] == pairs[q]  # the answer is the paired value
        asked = [t for t in target if t != -100]
        assert len(asked) == n  # nothing else is scored


def test_mqar_batch_pads_longer_rows_repeats_with_the_generator_and_refuses_bad_sizes():
    idx, targets = rc.mqar_batch(3, 4, torch.Generator().manual_seed(1), seq_len=20)
    assert (idx[:, 16:] == rc.PAD).all() and (targets[:, 16:] == -100).all()
    again = rc.mqar_batch(3, 4, torch.Generator().manual_seed(1), seq_len=20)
    assert torch.equal(idx, again[0]) and torch.equal(targets, again[1])
    with pytest.raises(ValueError, match=r"pairs=65 must be an int in \[1, n_keys=64\]"):
        rc.mqar_batch(2, 65, torch.Generator(), seq_len=400)
    with pytest.raises(ValueError, match=r"seq_len=15 must be an int >= 4 · pairs = 16"):
        rc.mqar_batch(2, 4, torch.Generator(), seq_len=15)


def test_recall_accuracy_counts_only_the_queried_positions():
    logits = torch.zeros(1, 4, 3)
    logits[0, 0, 2] = logits[0, 1, 1] = logits[0, 2, 0] = logits[0, 3, 1] = 1.0  # argmax 2, 1, 0, 1
    targets = torch.tensor([[2, -100, 1, 0]])  # right, unscored, wrong, wrong
    assert rc.recall_accuracy(logits, targets) == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="no queried position"):
        rc.recall_accuracy(logits, torch.full((1, 4), -100))
    with pytest.raises(ValueError, match=r"do not match targets"):
        rc.recall_accuracy(logits, targets[:, :3])


def test_designs_differ_only_in_their_attention_layers():
    models = {name: rc.build_model(name, 0, 129, 128) for name in rc.DESIGNS}
    L, F = "linear_attention", "full_attention"
    assert models["hybrid"].config.layer_types == (L, F)
    assert models["linear"].config.layer_types == models["gated_deltanet"].config.layer_types == (L, L)
    assert models["linear"].config.linear_layer == "linear"
    assert models["gated_deltanet"].config.linear_layer == models["hybrid"].config.linear_layer == "gated_deltanet"
    assert models["full"].config.layer_types == (F, F) and models["full"].config.sliding_window is None
    assert models["sliding"].config.sliding_window == rc.WINDOW < models["sliding_32"].config.sliding_window < 128
    assert {type(b.attn).__name__ for b in models["topk"].blocks} == {"TopKAttention"}
    assert {b.attn.top_k for b in models["topk"].blocks} == {rc.TOP_K}
    for m in models.values():
        assert {k: getattr(m.config, k) for k in rc.MODEL} == rc.MODEL and m.config.position == "rope"
    full, topk = models["full"].state_dict(), models["topk"].state_dict()
    assert full.keys() == topk.keys() and all(torch.equal(full[k], topk[k]) for k in full)  # same weights


def test_learning_rate_warms_up_linearly_then_decays_to_zero_and_n_cycles():
    t = dict(rc.TRAINING, max_iters=100, warmup_fraction=0.1, learning_rate=1e-3)
    assert rc._lr(0, t) == pytest.approx(1e-4) and rc._lr(9, t) == pytest.approx(1e-3)
    assert rc._lr(10, t) == pytest.approx(1e-3)  # the peak, then cosine
    assert rc._lr(55, t) == pytest.approx(0.5e-3)  # half-way through the decay
    assert rc._lr(99, t) < 1e-6
    pairs = rc.MQAR["pairs"]
    assert [rc._pairs_at(s) for s in range(2 * len(pairs))] == list(pairs) * 2


@pytest.mark.parametrize("argv, message", [
    (["--seeds", "1", "1"], "--seeds: [1, 1] repeats a seed"),
    (["--seeds", "-1"], "--seeds: -1 is negative"),
    (["--max-iters", "0"], "--max-iters: 0 is not a positive integer"),
    (["--shakespeare-iters", "-1"], "--shakespeare-iters: -1 is negative"),
    (["--designs", "full", "full"], "--designs: full full repeats a design"),
    (["--designs", "mamba"], "--designs: invalid choice: 'mamba'"),
    (["--merge-with", "no/such/file.json"], "--merge-with: no results file at 'no/such/file.json'"),
    (["--merge-only"], "--merge-only: needs --merge-with FILE"),
    (["--out", "/"], "--out: '/' is not a file name"),
    (["--threads", "0"], "--threads: 0 is not a positive integer"),
])
def test_bad_flags_are_refused_before_training_naming_the_flag_and_the_value(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        rc.main(argv)
    assert exit_.value.code == 2
    assert f"argument {message}" in capsys.readouterr().err


def _tiny(monkeypatch):
    monkeypatch.setitem(rc.TRAINING, "eval_sequences", 4)
    monkeypatch.setitem(rc.TRAINING, "batch_size", 2)
    monkeypatch.setitem(rc.SHAKESPEARE, "eval_iters", 1)
    monkeypatch.setitem(rc.SHAKESPEARE, "batch_size", 2)


@needs_data
def test_a_tiny_run_writes_every_key_and_merges(tmp_path, monkeypatch, capsys):
    _tiny(monkeypatch)
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    rc.main(["--designs", "full", "hybrid", "--seeds", "5", "--max-iters", "2", "--shakespeare-iters", "1",
             "--out", str(a)])
    rc.main(["--designs", "full", "--seeds", "6", "--max-iters", "2", "--shakespeare-iters", "1", "--out", str(b)])
    res = json.loads(a.read_text())
    assert set(res) == {"meta", "model", "mqar", "training", "shakespeare", "seeds", "designs"}
    assert res["meta"]["complete"] and res["meta"]["command"].endswith(str(a)) and res["meta"]["threads"] == 1
    for d in res["designs"].values():
        assert set(d) == {"config", "parameters", "state_bytes", "bytes_at", "by_seed"}
        run = d["by_seed"]["5"]
        assert set(run) == {"accuracy", "step_loss", "train_s", "eval_s", "shakespeare"}
        assert set(run["accuracy"]) == {str(n) for n in rc.MQAR["pairs"]}
        assert math.isfinite(run["shakespeare"]["val_loss"])
    merged = rc.main(["--merge-with", str(a), str(b), "--merge-only", "--out", str(tmp_path / "m.json")])
    assert set(merged["designs"]["full"]["by_seed"]) == {"5", "6"} and merged["seeds"] == [5, 6]
    with pytest.raises(SystemExit) as exit_:  # the same run twice
        rc.main(["--merge-with", str(a), str(a), "--merge-only", "--out", str(tmp_path / "x.json")])
    assert exit_.value.code == 2 and "design='full': seed 5 is in both runs" in capsys.readouterr().err


def test_committed_results_hold_every_design_n_and_seed():
    res = rc.load_results()
    assert res["meta"]["complete"] and len(res["seeds"]) == 3
    assert set(res["designs"]) == set(rc.DESIGNS)
    for name, d in res["designs"].items():
        assert set(d["by_seed"]) == {str(s) for s in res["seeds"]}, name
        for run in d["by_seed"].values():
            assert set(run["accuracy"]) == {str(n) for n in res["mqar"]["pairs"]}
            assert all(0.0 <= a <= 1.0 for a in run["accuracy"].values())
            assert math.isfinite(run["shakespeare"]["val_loss"])
    s = rc.summary(res)
    assert set(s) == set(rc.DESIGNS)
    # the file was made by this code's settings
    assert res["model"] == dict(rc.MODEL, window=rc.WINDOW, top_k=rc.TOP_K)
    assert res["training"] == json.loads(json.dumps(rc.TRAINING)) and res["mqar"] == json.loads(json.dumps(rc.MQAR))
    assert {name: d["config"] for name, d in res["designs"].items()} == json.loads(json.dumps(rc.DESIGNS))


def test_committed_bytes_are_the_caches_the_designs_allocate():
    res = rc.load_results()
    T = 4 * max(res["mqar"]["pairs"])
    heads, head_dim, layers = 4, 32, 2
    kv = dict(n_kv_heads=heads, head_dim=head_dim, dtype=torch.float32)
    full = kv_cache_bytes(n_layers=layers, seq_len=T, **kv)
    assert full == layers * 2 * T * heads * head_dim * 4  # keys and values, float32
    assert res["designs"]["full"]["state_bytes"] == res["designs"]["topk"]["state_bytes"] == full
    for name in ("sliding", "sliding_32"):
        window = rc.DESIGNS[name]["sliding_window"]
        assert res["designs"][name]["state_bytes"] == kv_cache_bytes(n_layers=layers, seq_len=T,
                                                                     sliding_window=window, **kv)
        assert res["designs"][name]["state_bytes"] == layers * 2 * window * heads * head_dim * 4
    delta = heads * head_dim * head_dim * 4  # n_heads · head_dim² float32 per gated-DeltaNet layer
    assert res["designs"]["gated_deltanet"]["state_bytes"] == layers * delta
    assert res["designs"]["linear"]["state_bytes"] == layers * (heads * head_dim * (head_dim + 1) * 4)  # S and z
    assert res["designs"]["hybrid"]["state_bytes"] == delta + full // layers
    for name, d in res["designs"].items():  # the formula at every N, measured at the longest
        assert d["bytes_at"][str(max(res["mqar"]["pairs"]))] == d["state_bytes"], name
