"""``python -m attnlib.bench long-context``: the windowed and sink caches stay flat, the full cache grows."""
from __future__ import annotations

import pytest

from attnlib.bench.cli import main


def test_small_run(tmp_path, capsys):
    payload = main(["long-context", "--small", "--out", str(tmp_path / "lc.json")])
    rows = payload["rows"]
    held = {kind: [r["bytes_held"] for r in rows if r["cache"] == kind] for kind in ("full", "window", "sinks")}
    lengths = [r["length"] for r in rows if r["cache"] == "full"]
    assert len(set(held["window"])) == 1 and len(set(held["sinks"])) == 1
    # The full cache holds every position: bytes proportional to the length.
    assert [h / n for h, n in zip(held["full"], lengths)] == [held["full"][0] / lengths[0]] * len(lengths)
    # 4 sinks + a 16-position window against a 16-position ring: 20 / 16 of its bytes.
    assert held["sinks"][0] * 16 == held["window"][0] * 20
    assert (tmp_path / "lc.json").exists() and "window: cache held x1.0" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--n-sink", "99"], "argument --n-sink: 99 must be between 0 and the window 16"),
        (["--lengths", "a,b"], "argument --lengths: 'a,b' is not a comma-separated list of integers"),
        (["--window", "0"], "must be >= 1"),
    ],
)
def test_bad_flags(flags, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main(["long-context", "--small", "--out", str(tmp_path / "x.json"), *flags])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
