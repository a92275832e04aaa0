"""Chapter 22's passkey experiment: its rows, its training targets, its readers (whole, cached, bounded) against a
plain forward pass, its merging of seeds and its committed results (no data file: a made-up text; seconds)."""
import json

import pytest
import torch

from attnlib.book import results
from attnlib.book.experiments import retrieval as rt

TEXT_VOCAB = 20
TEXT = torch.randint(0, TEXT_VOCAB, (2000,), generator=torch.Generator().manual_seed(0))


def tiny_model(position: str = "rope", block_size: int = 48) -> rt.Decoder:
    torch.manual_seed(0)
    config = rt.model_config(TEXT_VOCAB, block_size, "rope" if position == "rope" else position)
    return rt.Decoder(config.replace(n_layers=2, d_model=32)).eval()


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 1.0])
def test_passkey_rows_hide_the_key_at_its_depth_and_end_with_it(depth):
    g = torch.Generator().manual_seed(1)
    rows = rt.passkey_batch(TEXT, 6, 40, depth, g, TEXT_VOCAB)
    needle, query, digit0 = rt.special_tokens(TEXT_VOCAB)
    hay = 40 - 2 * (rt.KEY_LEN + 1)
    assert rows.shape == (6, 40) and rows.dtype == torch.int64
    for row in rows:
        at = (row == needle).nonzero().flatten().tolist()
        assert at == [round(depth * hay)]  # the needle's marker, once, at its depth of the haystack
        key = row[at[0] + 1 : at[0] + 1 + rt.KEY_LEN]
        assert ((key >= digit0) & (key < digit0 + 10)).all()
        assert row[-rt.KEY_LEN - 1] == query and torch.equal(row[-rt.KEY_LEN:], key)
        text = torch.cat([row[: at[0]], row[at[0] + 1 + rt.KEY_LEN : -rt.KEY_LEN - 1]])
        assert (text < TEXT_VOCAB).all() and len(text) == hay


def test_passkey_rows_refuse_a_length_without_haystack():
    with pytest.raises(ValueError, match=r"length=10 leaves no haystack \(expected > 10\)"):
        rt.passkey_batch(TEXT, 1, 10, 0.5, torch.Generator(), TEXT_VOCAB)


def test_training_targets_leave_out_what_cannot_be_predicted():
    """-100 exactly on the needle's digits and the query marker; the answer mask on the passkey's digits only."""
    g = torch.Generator().manual_seed(2)
    for _ in range(5):
        x, y, answer = rt.training_batch(TEXT, 4, 48, g, TEXT_VOCAB)
        needle, query, digit0 = rt.special_tokens(TEXT_VOCAB)
        assert x.shape == y.shape == answer.shape == (4, 48)
        assert torch.equal(x[:, 1:][y[:, :-1] != -100], y[:, :-1][y[:, :-1] != -100])  # y is x shifted
        for row_x, row_y, row_a in zip(x, y, answer):
            target = torch.cat([row_x[1:], row_y[-1:]])
            ignored = row_y == -100
            digits = (target >= digit0) & (target < digit0 + 10)
            assert torch.equal(ignored, (digits & ~row_a) | (target == query))
            assert row_a.sum() == rt.KEY_LEN and digits[row_a].all()
            q = (row_x == query).nonzero().item()  # the passkey follows the query marker
            assert row_a.nonzero().flatten().tolist() == list(range(q, q + rt.KEY_LEN))


def test_a_cache_that_keeps_everything_reads_the_passkey_as_one_forward_pass():
    model = tiny_model()
    rows = rt.passkey_batch(TEXT, 5, 40, 0.5, torch.Generator().manual_seed(3), TEXT_VOCAB)
    whole = rt.answer_logits(model, rows)
    with torch.no_grad():
        reference = model(rows)[0][:, 40 - rt.KEY_LEN - 1 : 39]
    torch.testing.assert_close(whole, reference, rtol=0, atol=0)
    for in_prompt in (False, True):
        cached = rt.answer_logits(model, rows, rt.KVCache.for_model(model), query_in_prompt=in_prompt)
        torch.testing.assert_close(cached, reference, rtol=1e-5, atol=1e-5)
        for kind in ("window", "sinks", "h2o", "snapkv"):  # a budget of the whole row drops nothing
            bounded = rt.answer_logits(model, rows, rt.bounded_cache(model, kind, budget=48), in_prompt)
            torch.testing.assert_close(bounded, reference, rtol=1e-4, atol=1e-4)
    hits = rt.found(model, rows)
    assert torch.equal(hits, (reference.argmax(-1) == rows[:, -rt.KEY_LEN:]).all(-1))


def test_a_small_budget_changes_what_the_answer_reads():
    model = tiny_model()
    rows = rt.passkey_batch(TEXT, 5, 40, 0.0, torch.Generator().manual_seed(4), TEXT_VOCAB)
    reference = rt.answer_logits(model, rows)
    for kind in ("window", "h2o", "snapkv"):
        bounded = rt.answer_logits(model, rows, rt.bounded_cache(model, kind, budget=12))
        assert (bounded - reference).abs().max() > 1e-3, kind


def test_budget_loss_of_the_full_cache_is_the_forward_pass_loss():
    model = tiny_model()
    loss = rt.budget_loss(model, TEXT, None, budget=16, n=3, prompt=4, seed=5)
    starts = torch.randint(len(TEXT) - 48 - 1, (3,), generator=torch.Generator().manual_seed(5))
    rows = torch.stack([TEXT[s : s + 49] for s in starts.tolist()])
    with torch.no_grad():
        logits = model(rows[:, :-1])[0][:, 16:]
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), rows[:, 17:].flatten()).item()
    assert loss == pytest.approx(expected, abs=1e-5)
    with pytest.raises(ValueError, match=r"budget=48 must be in \[prompt, block_size\) = \[4, 48\)"):
        rt.budget_loss(model, TEXT, "window", budget=48, n=3, prompt=4, seed=5)


def test_training_lowers_the_passkey_loss():
    model = tiny_model(block_size=32).train()
    log = rt.train_passkey(model, TEXT, TEXT_VOCAB, max_iters=30, seed=0, log_every=10)
    assert log["steps"] == [10, 20, 30]
    assert log["answer_loss"][-1] < log["answer_loss"][0]


def test_merge_adds_seeds_and_refuses_what_differs():
    run = {"command": "a", "context": 64, "by_seed": {"1": {"x": 1}}}
    merged = rt.merge(run, [{"command": "b", "context": 64, "by_seed": {"2": {"x": 2}}}])
    assert merged["by_seed"] == {"1": {"x": 1}, "2": {"x": 2}} and merged["commands"] == ["a", "b"]
    with pytest.raises(ValueError, match=r"context=32 differs from 64"):
        rt.merge(run, [{"command": "b", "context": 32, "by_seed": {"2": {}}}])
    with pytest.raises(ValueError, match=r"seeds \['1'\] are in both runs"):
        rt.merge(run, [{"command": "b", "context": 64, "by_seed": {"1": {}}}])


@pytest.mark.parametrize(("argv", "message"), [
    (["--context", "32"], "argument --context: 32 is not above the caches' budget of 32"),
    (["--models", "rope,relative"], "argument --models"),
    (["--trials", "0"], "argument --trials"),
    (["--merge-with", "no/such/file.json"], "argument --merge-with: no results file at no/such/file.json"),
])
def test_bad_arguments_are_refused_before_training(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        rt.main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_the_committed_results():
    committed = results.load("retrieval")
    assert len(committed["by_seed"]) == 3 and committed["context"] == 64
    assert committed["factors"] == list(rt.FACTORS) and committed["depths"] == list(rt.DEPTHS)
    for run in committed["by_seed"].values():
        assert set(run["accuracy"]) == set(rt.METHODS)
        for table in run["accuracy"].values():
            assert len(table) == len(rt.FACTORS) and all(len(r) == len(rt.DEPTHS) for r in table)
            assert all(0 <= a <= 1 for r in table for a in r)
        assert set(run["budget_loss"]) == {"full", "window", "sinks", "h2o", "snapkv", "int8", "kivi4", "kivi2"}
        for name in rt.MODELS:  # at the training length every model finds the passkey at every depth
            assert min(run["accuracy"][name][rt.FACTORS.index(1)]) >= 0.9, name
    json.dumps(committed)  # plain JSON
