"""``python -m attnlib.bench flash|serving --small``: the command line runs them and refuses bad flags."""
from __future__ import annotations

import pytest

from attnlib.bench.cli import main


def test_flash_small(tmp_path):
    payload = main(["flash", "--small", "--out", str(tmp_path / "f.json")])
    rows = {(r["method"], r["seq_len"]) for r in payload["rows"]}
    assert {m for m, _ in rows} >= {"naive", "sdpa", "flash"}
    flash = [r for r in payload["rows"] if r["method"] == "flash"]
    assert all(r["max_abs_diff"] < 1e-4 for r in flash)
    # Saved-for-backward bytes: flash keeps no T x T tensor, naive does.
    naive = {r["seq_len"]: r["saved_mib"] for r in payload["rows"] if r["method"] == "naive"}
    assert all(r["saved_mib"] < naive[r["seq_len"]] for r in flash)


def test_serving_small(tmp_path):
    payload = main(["serving", "--small", "--out", str(tmp_path / "s.json")])
    by = {(r["comparison"], r["method"]): r for r in payload["rows"]}
    assert {c for c, _ in by} == {"batching", "memory", "speculative"}
    assert all("same tokens: True" in r["note"] for r in payload["rows"] if r["comparison"] != "memory")
    assert payload["summary"]["memory"] > 1  # pages reserve less than preallocating block_size
    static, continuous = (r for r in payload["rows"] if r["comparison"] == "batching")
    assert static["method"].startswith("static batches of 3") and continuous["method"].startswith("continuous, 3")
    # a static batch waits for its longest request; continuous batching refills the freed slots at once
    assert continuous["decode_steps"] <= static["decode_steps"] < static["baseline_decode_steps"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serving", "--small", "--n-draft", "0"], "argument --n-draft: 0 must be >= 1"),
        (["serving", "--small", "--max-batch", "0"], "argument --max-batch: 0 must be >= 1"),
        (["serving", "--small", "--draft-layers", "9"], "argument --draft-layers: 9 exceeds the target's 4 layers"),
    ],
)
def test_bad_flags(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--out", str(tmp_path / "x.json")])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_serving_rows_refuses_a_bad_max_batch():
    from attnlib.bench.serving import SMALL, serving_rows

    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match=f"max_batch={bad!r} must be an int >= 1"):
            serving_rows(SMALL, max_batch=bad)
