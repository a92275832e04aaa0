"""``python -m attnlib.bench kv-quant --small``: one row per scheme, bytes by formula, error ordered by bits; bad flags."""
from __future__ import annotations

import json

import pytest

from attnlib.bench.cli import main
from attnlib.bench.kv_quant import KV_QUANT_SMALL, kv_quant_rows


def test_kv_quant_small(tmp_path):
    out = tmp_path / "q.json"
    payload = main(["kv-quant", "--small", "--out", str(out)])
    assert json.loads(out.read_text())["rows"] == payload["rows"]
    by = {r["scheme"]: r for r in payload["rows"]}
    assert list(by) == ["float32", "bfloat16", "int8", "kivi4", "kivi2"]
    c, s = KV_QUANT_SMALL["config"], payload["settings"]
    assert s["group_size"] == 8 and s["residual_length"] == 8 and s["train_steps"] == 60
    per_layer_head = {"float32": 2 * c.head_dim * 4, "bfloat16": 2 * c.head_dim * 2, "int8": 2 * (c.head_dim + 4),
                      "kivi4": 2 * c.head_dim // 2 + 2 * c.head_dim * 4 / 8 + 2 * 4,  # codes, key groups', values'
                      "kivi2": 2 * c.head_dim // 4 + 2 * c.head_dim * 4 / 8 + 2 * 4}
    for scheme, n in per_layer_head.items():
        assert by[scheme]["bytes_per_token"] == c.n_layers * c.n_kv_heads * n, scheme
    assert by["float32"]["max_abs_dlogit"] == 0 and by["float32"]["dloss"] == 0
    errors = [by[s]["mean_abs_dlogit"] for s in ("int8", "kivi4", "kivi2")]
    assert 0 < errors[0] < errors[1] < errors[2], errors
    assert by["int8"]["smaller"] > by["bfloat16"]["smaller"] > 1


@pytest.mark.parametrize(("argv", "message"), [
    (["--group-size", "0"], "argument --group-size: 0 must be >= 1"),
    (["--residual-length", "-1"], "argument --residual-length: -1 must be >= 0"),
    (["--train-steps", "-2"], "argument --train-steps: -2 must be >= 0"),
])
def test_kv_quant_bad_flags(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["kv-quant", "--small", *argv, "--out", str(tmp_path / "x.json")])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_kv_quant_rows_refuses_an_unknown_scheme():
    with pytest.raises(ValueError, match=r"schemes \['int4'\] are not among"):
        kv_quant_rows(**KV_QUANT_SMALL, schemes=("int8", "int4"))
