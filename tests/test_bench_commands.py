"""``python -m attnlib.bench flash|serving|hf-llama|layer-types --small``: the command line runs them and refuses
bad flags."""
from __future__ import annotations

import json

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
    assert {c for c, _ in by} == {"batching", "memory", "speculative", "prefix cache", "chunked prefill"}
    assert all("same tokens: True" in r["note"] for r in payload["rows"] if r["comparison"] != "memory")
    assert payload["summary"]["memory"] > 1  # pages reserve less than preallocating block_size
    static, continuous = (r for r in payload["rows"] if r["comparison"] == "batching")
    assert static["method"].startswith("static batches of 3") and continuous["method"].startswith("continuous, 3")
    # a static batch waits for its longest request; continuous batching refills the freed slots at once
    assert continuous["decode_steps"] <= static["decode_steps"] < static["baseline_decode_steps"]
    # the old rows keep their places (chapter 19 indexes them), the new ones follow
    assert [r["comparison"] for r in payload["rows"]] == ["batching"] * 2 + ["memory", "speculative"] + \
        ["prefix cache"] * 2 + ["chunked prefill"] * 2
    tokens, _, stall, _ = payload["rows"][4:]
    assert set(payload["summary"]) == {"batching", "memory", "speculative", "prefix_cache", "prefix_cache_time",
                                       "chunked_prefill", "chunked_prefill_time"}
    # 6 requests share a 32-token system prompt (2 pages of 16): the 5 after the first take both pages
    b, m = tokens["baseline_stats"], tokens["method_stats"]
    assert m["prefill_tokens_saved"] == 5 * 32 and tokens["baseline_value"] - tokens["method_value"] == 5 * 32
    assert b["prompt_tokens"] == m["prompt_tokens"] == tokens["baseline_value"] and m["pages_held"] == 0
    # chunks of 8: a running request never waits for more than a chunk and a decode step of 3 rows
    assert stall["method_stats"]["longest_stall_tokens"] <= 8 + 3 < stall["baseline_stats"]["longest_stall_tokens"]
    assert payload["settings"]["prefill_chunk"] == 8


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serving", "--small", "--n-draft", "0"], "argument --n-draft: 0 must be >= 1"),
        (["serving", "--small", "--max-batch", "0"], "argument --max-batch: 0 must be >= 1"),
        (["serving", "--small", "--prefill-chunk", "0"], "argument --prefill-chunk: 0 must be >= 1"),
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
        with pytest.raises(ValueError, match=f"prefill_chunk={bad!r} must be an int >= 1"):
            serving_rows(SMALL, prefill_chunk=bad)


# ---------------------------------------------------------------- hf-llama


def test_hf_llama_small(tmp_path, capsys):
    from attnlib.bench.hf_llama import HF_LLAMA_SMALL

    path = tmp_path / "hf.json"
    payload = main(["hf-llama", "--small", "--threads", "1", "--repeats", "2", "--warmup", "0", "--out", str(path)])
    assert json.loads(path.read_text()) == json.loads(json.dumps(payload)) and "load " in capsys.readouterr().out
    assert json.loads(json.dumps(payload["settings"]["config"])) == json.loads(json.dumps(HF_LLAMA_SMALL["config"].to_dict()))
    assert payload["settings"]["small"] is True and len(payload["environment"]["load_average"]) == 3
    train, decode = payload["rows"]
    assert (train["part"], decode["part"]) == ("train", "decode")
    for row in (train, decode):
        assert row["parameters"] == row["transformers_parameters"]  # the same model, untied head counted once
        assert row["logits_max_abs_diff"] < 1e-4
        assert row["ratio"] == pytest.approx(row["attnlib_ms"] / row["transformers_ms"])
    assert train["loss_max_abs_diff"] < 1e-5 and (train["batch"], train["seq_len"]) == (2, 32)
    assert decode["same_tokens"] is True and (decode["prompt_len"], decode["new_tokens"]) == (4, 8)
    assert decode["attnlib_tokens_per_s"] == pytest.approx(8 / (decode["attnlib_ms"] / 1e3))
    assert payload["summary"]["same_tokens"] is True and set(payload["summary"]) >= {"train_ratio", "decode_ratio"}


def test_hf_llama_pair_is_one_model_and_the_check_can_fail():
    """The loaded Decoder equals transformers' model (an independent forward pass), and the guard that stops
    the benchmark refuses two models that differ."""
    import torch

    from attnlib.bench.hf_llama import HF_LLAMA_SMALL, _logits_diff, hf_llama_pair

    config = HF_LLAMA_SMALL["config"]
    ours, theirs = hf_llama_pair(config, seed=3)
    assert type(theirs).__name__ == "LlamaForCausalLM" and theirs.config._attn_implementation == "sdpa"
    assert ours.config == config and not ours.config.tie_embeddings and ours.config.norm_eps == 1e-5
    idx = torch.randint(config.vocab_size, (2, config.block_size))
    assert _logits_diff(ours, theirs, idx, 1e-5) <= 1e-5
    with torch.no_grad():
        ours.blocks[1].mlp.down.weight[0, 0] += 0.5
    with pytest.raises(RuntimeError, match="logits differ by .* nothing timed"):
        _logits_diff(ours, theirs, idx, 1e-4)


def test_hf_llama_rows_refuses_before_any_work():
    import torch

    from attnlib.bench.hf_llama import HF_LLAMA_SMALL, hf_llama_rows

    config = HF_LLAMA_SMALL["config"]
    with pytest.raises(ValueError, match=r"\['infer'\] not among"):
        hf_llama_rows(config, parts=["train", "infer"])
    with pytest.raises(ValueError, match="prompt_len=30 \\+ tokens=8 exceeds block_size=32"):
        hf_llama_rows(config, prompt_len=30, tokens=8)
    with pytest.raises(ValueError, match="dtype=torch.bfloat16 is not one of"):
        hf_llama_rows(config, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="not a plain DecoderConfig.llama: it differs in {'qk_norm': True"):
        hf_llama_rows(config.replace(qk_norm=True), prompt_len=4, tokens=8)


def test_hf_llama_without_transformers(monkeypatch, tmp_path, capsys):
    import importlib.util

    from attnlib.bench.hf_llama import HF_LLAMA_SMALL, hf_llama_rows

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else find_spec(name, *a))
    with pytest.raises(SystemExit) as exit_info:
        main(["hf-llama", "--out", str(tmp_path / "x.json")])  # full size: it would take long if it started
    assert exit_info.value.code == 2 and "transformers, which is not installed" in capsys.readouterr().err
    with pytest.raises(ModuleNotFoundError, match="pip install transformers"):
        hf_llama_rows(HF_LLAMA_SMALL["config"], prompt_len=4, tokens=8)
    assert not (tmp_path / "x.json").exists()


# ---------------------------------------------------------------- layer-types


def test_layer_types_small(tmp_path):
    path = tmp_path / "lt.json"
    payload = main(["layer-types", "--small", "--threads", "1", "--repeats", "2", "--out", str(path)])
    assert json.loads(path.read_text()) == json.loads(json.dumps(payload))
    rows = {r["pattern"]: r for r in payload["rows"]}
    assert list(rows) == ["full", "sliding", "gemma3", "alternating", "chunked", "deltanet"]
    assert payload["settings"]["check"] is True and payload["summary"]["same_tokens"] is True
    assert list(payload["settings"]["layer_types"]["gemma3"]) == ["sliding_attention"] * 5 + ["full_attention"]
    # --small: 6 layers, 2 key/value heads of 8, float32: 2 * 2 * 8 * 4 = 128 bytes per position per layer;
    # context 48, window 8, chunk 16; a DeltaNet state is 4 heads x 8 x 8 floats = 1024 bytes.
    per = 128
    expected_held = {
        "full": 6 * 48 * per,
        "sliding": 6 * 8 * per,
        "gemma3": 5 * 8 * per + 48 * per,
        "alternating": 3 * 8 * per + 3 * 48 * per,
        "chunked": 5 * 16 * per + 48 * per,  # c, c, c, full, c, c
        "deltanet": 5 * 1024 + 48 * per,
    }
    expected_growth = {"full": 6 * per, "sliding": 0, "gemma3": per, "alternating": 3 * per, "chunked": per,
                       "deltanet": per}
    for name, row in rows.items():
        assert row["held_bytes"] == expected_held[name] == row["held_formula"], name
        assert row["bytes_per_token"] == pytest.approx(expected_held[name] / 48)
        assert row["growth_per_token"] == expected_growth[name], name
        assert row["nbytes"] == row["nbytes_formula"] >= row["held_bytes"]
        assert row["same_tokens_each_run"] is True and row["same_tokens_as_uncached"] is True, name
        assert row["held_vs_full"] == pytest.approx(row["held_bytes"] / expected_held["full"])
        assert row["tokens_per_s"] == pytest.approx(8 / (row["decode_ms"] / 1e3))
    assert rows["full"]["nbytes"] == 6 * (48 + 8) * per  # pre-allocated to block_size = context + tokens
    assert rows["deltanet"]["cache_bytes_per_token"] == per and rows["full"]["cache_bytes_per_token"] == 6 * per


def test_pattern_config_tiles_the_period():
    from attnlib.bench.layer_types import LAYER_TYPES_MODEL, pattern_config

    gemma = pattern_config(LAYER_TYPES_MODEL, "gemma3", 512, 1024)
    assert [i for i, t in enumerate(gemma.layer_types) if t == "full_attention"] == [5, 11]
    assert gemma.sliding_window == 512 and gemma.attention_chunk_size is None
    llama4 = pattern_config(LAYER_TYPES_MODEL, "chunked", 512, 1024)
    assert llama4.nope_layers == (3, 7, 11) and llama4.attention_chunk_size == 1024 and llama4.sliding_window is None
    oss = pattern_config(LAYER_TYPES_MODEL, "alternating", 128, 1024)
    assert oss.layer_types[:2] == ("sliding_attention", "full_attention") and oss.layer_types.count("full_attention") == 6
    qwen = pattern_config(LAYER_TYPES_MODEL, "deltanet", 512, 1024)
    assert qwen.layer_types.count("linear_attention") == 9 and qwen.linear_layer == "gated_deltanet"
    assert pattern_config(LAYER_TYPES_MODEL, "full", 512, 1024).layer_types == ("full_attention",) * 12
    with pytest.raises(ValueError, match="pattern='jamba' is not one of"):
        pattern_config(LAYER_TYPES_MODEL, "jamba", 512, 1024)


def test_layer_types_rows_refuses_before_any_work():
    from attnlib.bench.layer_types import layer_types_rows

    with pytest.raises(ValueError, match="pattern='mamba' is not one of"):
        layer_types_rows(["full", "mamba"])
    with pytest.raises(ValueError, match="window=0 must be an int >= 1"):
        layer_types_rows(["full"], window=0)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["hf-llama", "--parts", "train,infer"], "argument --parts: infer not among train,decode"),
        (["hf-llama", "--parts", ","], "argument --parts: ',' names nothing"),
        (["hf-llama", "--batch", "0"], "argument --batch: 0 must be >= 1"),
        (["hf-llama", "--tokens", "0"], "argument --tokens: 0 must be >= 1"),
        (["hf-llama", "--decode-batch", "0"], "argument --decode-batch: 0 must be >= 1"),
        (["hf-llama", "--prompt-len", "100", "--tokens", "200"],
         "--prompt-len 100 + --tokens 200 exceeds the model's block_size 256"),
        (["hf-llama", "--small", "--prompt-len", "30"], "--prompt-len 30 + --tokens 8 exceeds the model's block_size 32"),
        (["hf-llama", "--dtype", "bfloat16"], "invalid choice: 'bfloat16'"),
        (["hf-llama", "--batch", "two"], "argument --batch: invalid int value: 'two'"),
        (["layer-types", "--patterns", "full,jamba"], "argument --patterns: jamba not among full,sliding,gemma3"),
        (["layer-types", "--patterns", ","], "argument --patterns: ',' names nothing"),
        (["layer-types", "--context", "0"], "argument --context: 0 must be >= 1"),
        (["layer-types", "--window", "-1"], "argument --window: -1 must be >= 1"),
        (["layer-types", "--chunk-size", "0"], "argument --chunk-size: 0 must be >= 1"),
        (["layer-types", "--batch", "0"], "argument --batch: 0 must be >= 1"),
        (["layer-types", "--dtype", "int8"], "invalid choice: 'int8'"),
    ],
)
def test_new_commands_refuse_bad_flags(argv, message, tmp_path, capsys):
    out = tmp_path / "x.json"
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--out", str(out)])  # full sizes: a flag that slipped through would start a long run
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not out.exists()
