"""attnlib.bench: every benchmark runs at tiny sizes and returns well-formed rows.

No timing is asserted: speed is measured by the benchmarks, not by tests.
"""
import json
import math

import pytest
import torch

from attnlib.bench import (
    format_kv_cache,
    format_memory,
    format_mha,
    format_table,
    kv_cache_rows,
    load_results,
    memory_rows,
    mha_rows,
    mha_summary,
    time_calls,
)
from attnlib.bench.cli import main
from attnlib.config import GPTConfig

TINY_GPT = GPTConfig(vocab_size=64, block_size=32, n_layers=2, n_heads=4, d_model=32, n_kv_heads=2, kv_latent_dim=8)


def _positive(x):
    return isinstance(x, float) and math.isfinite(x) and x > 0


@pytest.mark.parametrize("backward", [True, False])
def test_mha_rows(backward):
    rows = mha_rows(batch=2, seq_len=12, d_model=16, n_heads=2, device="cpu", backward=backward, repeats=1, warmup=0, block_size=5,
                    threads=1)
    ids = [row["id"] for row in rows]
    assert len(ids) == len(set(ids)) == 14
    assert {"layer/reference", "layer/mha_sdpa", "layer/mha_eager", "layer/wrapper", "layer/einsum", "layer/separate_qkv",
            "layer/nn_mha", "layer/tiled", "core/reference", "core/bool_mask", "core/eager", "core/tiled"} <= set(ids)
    for row in rows:
        assert row["kind"] in ("layer", "core") and row["reference"] == f"{row['kind']}/reference"
        assert row["max_abs_diff"] < 1e-5, row  # every implementation computes the same function
        assert _positive(row["forward_ms"]) and _positive(row["forward_ratio"])
        if backward:
            assert _positive(row["forward_backward_ms"]) and _positive(row["forward_backward_ratio"])
        else:
            assert row["forward_backward_ms"] is None and row["forward_backward_ratio"] is None
        if row["id"].endswith("/reference"):
            assert row["forward_ratio"] == 1.0
    summary = mha_summary(rows)
    assert isinstance(summary["within_tolerance"], bool) and ("forward_backward_ratio" in summary) == backward
    text = format_mha(rows, dict(batch=2, seq_len=12, d_model=16, n_heads=2, dtype="float32", repeats=1, warmup=0))
    assert "Within 1.05×" in text and "nn.MultiheadAttention" in text


def test_kv_cache_rows():
    rows = kv_cache_rows(("mha", "gqa", "mqa", "mla"), tokens=4, prompt_len=3, config=TINY_GPT, device="cpu", repeats=1,
                         warmup_tokens=1, threads=1)
    assert [row["variant"] for row in rows] == ["mha", "gqa", "mqa", "mla"]
    numbers = {row["variant"]: row["numbers_per_token_layer"] for row in rows}
    assert numbers == {"mha": 2 * 4 * 8, "gqa": 2 * 2 * 8, "mqa": 2 * 8, "mla": 8}
    for row in rows:
        assert row["bytes_per_token"] == row["bytes_per_token_formula"] == numbers[row["variant"]] * 2 * 4
        assert row["same_tokens"] is True
        assert _positive(row["cached_tokens_per_s"]) and _positive(row["uncached_tokens_per_s"])
        assert row["speedup"] == pytest.approx(row["cached_tokens_per_s"] / row["uncached_tokens_per_s"])
        assert _positive(row["plain_tokens_per_s"])
        assert row["speedup_vs_plain"] == pytest.approx(row["cached_tokens_per_s"] / row["plain_tokens_per_s"])
    assert "cached/uncached" in format_kv_cache(rows) and "cached/plain" in format_kv_cache(rows)


def test_generate_plain_is_greedy_generation_without_a_cache():
    from attnlib.bench.kv_cache import generate_plain
    from attnlib.model import GPT

    torch.manual_seed(0)
    model = GPT(TINY_GPT).eval()
    prompt = torch.randint(0, TINY_GPT.vocab_size, (2, 5))
    expected = model.generate(prompt, 40, temperature=0.0, use_cache=False)  # 45 > block_size: the window slides
    assert torch.equal(generate_plain(model, prompt, 40), expected)
    with pytest.raises(ValueError, match="unknown variant"):
        kv_cache_rows(("nope",), tokens=1, config=TINY_GPT, device="cpu", repeats=1)


def _check_memory_rows(rows, methods, seq_lens):
    assert [(row["seq_len"], row["method"]) for row in rows] == [(T, m) for T in seq_lens for m in methods]
    for row in rows:
        assert isinstance(row["peak_mib"], float) and row["peak_mib"] >= 0
        assert _positive(row["time_ms"]) and isinstance(row["memory_method"], str)
        assert row["scores_mib"] == 1 * 2 * row["seq_len"] ** 2 * 4 / 2**20


def test_memory_rows_in_process():
    rows = memory_rows(seq_lens=(64, 32), n_heads=2, head_dim=8, device="cpu", repeats=1, block_size=16, isolate=False,
                       threads=1)
    _check_memory_rows(rows, ("naive", "sdpa", "tiled"), (32, 64))
    assert "peak extra" in format_memory(rows)


def test_memory_rows_in_a_fresh_process():
    rows = memory_rows(seq_lens=(16, 32), methods=("tiled",), n_heads=2, head_dim=8, device="cpu", repeats=1, block_size=8,
                       threads=1)
    _check_memory_rows(rows, ("tiled",), (16, 32))
    assert all("fresh process" in row["memory_method"] for row in rows)


def test_memory_rows_rejects_unknown_method_and_device():
    with pytest.raises(ValueError, match="unknown method"):
        memory_rows(seq_lens=(16,), methods=("flash",), device="cpu")
    with pytest.raises(ValueError, match="cpu or cuda"):
        memory_rows(seq_lens=(16,), device="meta")


def test_cli_writes_json_and_load_results_reads_it(tmp_path, capsys):
    path = tmp_path / "bench_mha.json"
    payload = main(["mha", "--batch", "1", "--seq-len", "8", "--d-model", "8", "--n-heads", "2", "--repeats", "1",
                    "--warmup", "0", "--no-backward", "--device", "cpu", "--threads", "1", "--json", str(path)])
    out = capsys.readouterr().out
    assert "torch " in out and "1 threads" in out and "Within 1.05×" in out and "wrote" in out
    assert payload["environment"]["threads"] == 1 and payload["settings"]["backward"] is False
    assert load_results(path) == json.loads(json.dumps(payload))
    with pytest.raises(FileNotFoundError, match="python -m attnlib.bench"):
        load_results(tmp_path / "missing.json")


def test_cli_kv_cache_and_memory_small_options(capsys):
    payload = main(["memory", "--seq-lens", "16,32", "--n-heads", "2", "--head-dim", "8", "--repeats", "1",
                    "--methods", "naive,sdpa", "--no-isolate", "--device", "cpu", "--threads", "1"])
    assert [row["method"] for row in payload["rows"]] == ["naive", "sdpa", "naive", "sdpa"]
    assert "one TxT tensor MiB" in capsys.readouterr().out


def test_time_calls_and_format_table():
    seconds = time_calls({"a": lambda: torch.zeros(3), "b": lambda: torch.ones(3)}, repeats=2, warmup=1)
    assert set(seconds) == {"a", "b"} and all(_positive(s) for s in seconds.values())
    with pytest.raises(ValueError, match="repeats"):
        time_calls({"a": lambda: None}, repeats=0)
    table = format_table([{"name": "x", "v": 1.5}, {"name": "longer", "v": None}], [("name", "name", "s"), ("v", "value", ".1f")])
    assert table.splitlines() == ["name    value", "------  -----", "x         1.5", "longer      -"]
