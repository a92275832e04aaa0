"""Chapter 22's KV-compression experiment: a tiny run's keys, the float32 row against a plain forward pass, bounded
caches exact until they fill (and with a budget covering the context), bytes by formula, bad flags, and the
committed results file (no data: a made-up corpus; seconds)."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from torch.nn import functional as F

from attnlib.bench.kv_quant import decode_logits
from attnlib.book import results
from attnlib.book.experiments import kv_compression as kvc
from attnlib.data import CharCorpus, CharTokenizer, train_val_split
from attnlib.models import Decoder, DecoderConfig, GPTConfig

TINY = dict(block_size=16, n_layers=2, n_heads=2, d_model=16)
ROW_KEYS = {"cache", "bytes_per_token", "cache_bytes", "loss", "dloss", "dloss_stderr", "max_abs_dlogit", "mean_abs_dlogit",
            "same_argmax"}


def _tiny_model(name: str, seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    sizes = dict(vocab_size=20, **TINY)
    config = GPTConfig(**sizes) if name == "gpt" else DecoderConfig.llama(**sizes, n_kv_heads=1)
    return Decoder(config).eval()


def _windows(rows: int = 3, T: int = TINY["block_size"] + 1) -> torch.Tensor:
    return torch.randint(20, (rows, T), generator=torch.Generator().manual_seed(1))


def _bytes_per_token(config: dict, scheme: str, group_size: int) -> float:
    """Per token, all layers, one sequence, by formula: codes, scales (and zero points), float32 scales."""
    d = config["head_dim"]
    per_head = {"float32": 2 * d * 4, "bfloat16": 2 * d * 2, "int8": 2 * (d + 4),
                "kivi4": 2 * d / 2 + 2 * d * 4 / group_size + 2 * 4, "kivi2": 2 * d / 4 + 2 * d * 4 / group_size + 2 * 4}
    return config["n_layers"] * config["n_kv_heads"] * per_head[scheme]


def test_a_tiny_run_writes_the_documented_keys(monkeypatch, tmp_path):
    text = "".join(chr(97 + i) for i in torch.randint(12, (3000,), generator=torch.Generator().manual_seed(0)))
    tokenizer = CharTokenizer(text)
    corpus = CharCorpus(text, tokenizer, *train_val_split(torch.tensor(tokenizer.encode(text)), 0.9))
    monkeypatch.setattr(kvc, "SIZES", TINY)
    monkeypatch.setattr(kvc, "TRAINING", {**kvc.TRAINING, "eval_iters": 2})
    monkeypatch.setattr(kvc, "load_char_corpus", lambda: corpus)
    out = tmp_path / "kv.json"
    got = kvc.main(["--max-iters", "2", "--rows", "2", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(got))
    assert got["command"] == f"python -m attnlib.book.experiments.kv_compression --max-iters 2 --rows 2 --out {out}"
    assert got["protocol"]["prompts"] == [2, 12] and got["protocol"]["budget"] == 8
    assert got["training"]["max_iters"] == 2 and got["training"]["eval_iters"] == 2 and got["meta"]["threads"] == 1 and got["schemes"] == list(kvc.SCHEMES)
    assert set(got["models"]) == {"gpt", "llama"}
    for name, model in got["models"].items():
        assert {"config", "parameters", "train_seconds", "steps", "val_loss", "final_val_loss"} <= set(model)
        assert model["config"]["block_size"] == 16 and model["steps"] == [0, 2]
        for prompt, rows in model["by_prompt"].items():
            assert list(rows) == list(kvc.SCHEMES) and prompt in ("2", "12")
            if name == "gpt":  # learned positions: no sink cache; the window read by a ring copy
                assert "no RoPE" in rows.pop("sinks")["refused"] and "sliding_window=8" in rows["window"]["cache"]
            for scheme, row in rows.items():
                assert ROW_KEYS <= set(row), scheme
                assert ("past_budget" in row) == (scheme in kvc.EVICTING)
            assert rows["float32"]["dloss"] == rows["float32"]["max_abs_dlogit"] == 0
            assert rows["float32"]["same_argmax"] == 1
        long = model["by_prompt"]["12"]["h2o"]["past_budget"]  # query positions 11..15 are all >= 8
        assert long["steps"] == 5 and long["loss"] == model["by_prompt"]["12"]["h2o"]["loss"]


@pytest.mark.parametrize("name", kvc.MODELS)
def test_the_float32_row_is_the_models_own_loss(name):
    """The reference row's loss is the cross-entropy of a plain forward pass (no cache) at the decode steps."""
    model, idx, prompt = _tiny_model(name), _windows(), 3
    row = kvc.measure(model, idx, prompt, kvc.protocol(16), schemes=("float32",))["float32"]
    with torch.no_grad():
        plain = model(idx[:, :-1])[0][:, prompt - 1:]
    assert row["loss"] == pytest.approx(F.cross_entropy(plain.flatten(0, 1), idx[:, prompt:].flatten()).item(),
                                        abs=1e-6)


@pytest.mark.parametrize("name", kvc.MODELS)
def test_a_budget_that_covers_the_context_changes_nothing(name):
    """Budget = block_size: every eviction cache keeps every position, so the loss is the full cache's (the
    evicting caches attend with the eager function, hence the float32 tolerance); no step is past the budget."""
    model, idx = _tiny_model(name), _windows()
    settings = kvc.protocol(16) | {"budget": 16}
    for prompt in (2, 12):
        rows = kvc.measure(model, idx, prompt, settings)
        for scheme in kvc.EVICTING:
            if name == "gpt" and scheme == "sinks":
                continue
            assert rows[scheme]["max_abs_dlogit"] < 1e-5, (scheme, prompt)
            assert rows[scheme]["loss"] == pytest.approx(rows["float32"]["loss"], abs=1e-6)
            assert rows[scheme]["past_budget"] is None


@pytest.mark.parametrize("name", kvc.MODELS)
def test_bounded_caches_are_exact_until_the_budget(name):
    """At budget 8 with a 2-token prompt, steps whose query position is below 8 read what the full cache does;
    the row's ``past_budget`` starts at the first step that can differ, and the window does differ there."""
    model, idx, prompt, settings = _tiny_model(name), _windows(), 2, kvc.protocol(16)
    reference = decode_logits(model, model.new_cache(), idx, prompt)
    past = settings["budget"] + 1 - prompt
    for scheme in ("window", "sinks", "h2o", "snapkv"):
        if name == "gpt" and scheme == "sinks":
            with pytest.raises(ValueError, match="no RoPE"):
                kvc.build_cache(model, scheme, settings)
            continue
        reader, cache, _ = kvc.build_cache(model, scheme, settings)
        logits = decode_logits(reader, cache, idx, prompt)
        torch.testing.assert_close(logits[:, :past], reference[:, :past], rtol=0, atol=1e-5)
        if scheme == "window":
            assert (logits[:, past] - reference[:, past]).abs().max() > 1e-3
    row = kvc.measure(model, idx, prompt, settings, schemes=("window",))["window"]
    assert row["past_budget"]["steps"] == idx.shape[1] - 1 - settings["budget"]


def test_quantisation_error_grows_as_bits_fall():
    """On a random tiny Llama (logits up to 0.31), int8's logits stay within 1e-3 of the float32 cache's and
    int8 < kivi4 < kivi2 in mean |dlogit| (measured max: 1.0e-4, 7.0e-4, 5.0e-3; mean: 1.4e-5, 7.0e-5, 4.0e-4);
    bytes per token as the formula gives."""
    model, idx, settings = _tiny_model("llama"), _windows(4), kvc.protocol(16)
    rows = kvc.measure(model, idx, 2, settings, schemes=kvc.QUANTIZED)
    assert rows["int8"]["max_abs_dlogit"] < 1e-3
    errors = [rows[s]["mean_abs_dlogit"] for s in ("int8", "kivi4", "kivi2")]
    assert 0 < errors[0] < errors[1] < errors[2], errors
    for scheme in kvc.QUANTIZED:
        assert rows[scheme]["bytes_per_token"] == _bytes_per_token(model.config.to_dict(), scheme, 4), scheme


def test_bad_names_are_refused():
    with pytest.raises(ValueError, match=r"schemes \['int4'\] are not among"):
        kvc.measure(_tiny_model("llama"), _windows(), 2, kvc.protocol(16), schemes=("int8", "int4"))
    with pytest.raises(ValueError, match="prompt=17 must be in"):
        kvc.measure(_tiny_model("llama"), _windows(), 17, kvc.protocol(16))
    with pytest.raises(ValueError, match="name='gpt2' is not one of"):
        kvc.model_config("gpt2", 65)


@pytest.mark.parametrize(("flag", "value", "expected"), [("--max-iters", "0", "0 is not a positive integer"),
                                                       ("--rows", "-1", "-1 is not a positive integer"),
                                                       ("--threads", "x", "'x' is not an integer"),
                                                       ("--data-seed", "-3", "-3"), ("--out", "/", "'/'")])
def test_bad_flags_are_argparse_errors_naming_the_flag(flag, value, expected, capsys):
    with pytest.raises(SystemExit) as exit_info:
        kvc.main([flag, value])  # refused before the corpus is read or anything trains
    error = capsys.readouterr().err.splitlines()[-1]
    assert exit_info.value.code == 2
    assert f"kv_compression: error: argument {flag}: " in error and expected in error, error


def test_the_models_are_chapter_12s_gpt_and_its_llama():
    gpt, llama = kvc.model_config("gpt", 65), kvc.model_config("llama", 65)
    assert gpt == GPTConfig(vocab_size=65)  # chapter 12's cell, sizes included
    assert (llama.position, llama.norm, llama.feedforward, llama.n_kv_heads) == ("rope", "rmsnorm", "swiglu", 2)
    assert all(getattr(llama, k) == getattr(gpt, k) for k in ("block_size", "n_layers", "n_heads", "d_model"))


def test_the_committed_results_file():
    """Every scheme for both models and prompts, finite; bytes as the formula gives, float32 > bfloat16 > int8 >=
    kivi4 > kivi2 (at head_dim 16 and G = 8, KIVI-4's float32 key scales cost what its 4 bits save: a tie)."""
    committed = results.load("kv_compression")
    assert committed["command"] == "python -m attnlib.book.experiments.kv_compression"
    assert committed["training"] == {**kvc.TRAINING, "weight_decay": 0.01, "grad_clip": None, "device": "cpu"}
    assert committed["meta"]["threads"] == 1 and committed["protocol"]["rows"] == 128
    settings = committed["protocol"]
    assert {k: settings[k] for k in kvc.protocol(32)} == kvc.protocol(32)
    for name in kvc.MODELS:
        model = committed["models"][name]
        current = json.loads(json.dumps(kvc.model_config(name, 65).to_dict()))
        assert {k: current[k] for k in model["config"]} == model["config"]  # the committed run's model
        defaults = {f.name: f.default for f in dataclasses.fields(DecoderConfig)}
        assert all(current[k] == defaults[k] for k in set(current) - set(model["config"]))  # fields added since
        assert math.isfinite(model["final_val_loss"]) and model["final_val_loss"] < 2.1 and model["train_seconds"] > 0
        for prompt in ("4", "24"):
            rows = model["by_prompt"][prompt]
            assert list(rows) == list(kvc.SCHEMES)
            if name == "gpt":
                assert "no RoPE" in rows["sinks"]["refused"]
            measured = [(s, r) for s, r in rows.items() if "refused" not in r]
            for scheme, row in measured:
                numbers = [row[k] for k in ROW_KEYS - {"cache"}] + list((row.get("past_budget") or {}).values())
                assert all(math.isfinite(x) for x in numbers), (name, prompt, scheme)
            for scheme in kvc.QUANTIZED:
                assert rows[scheme]["bytes_per_token"] == _bytes_per_token(model["config"], scheme, 8), scheme
            b = [rows[s]["bytes_per_token"] for s in kvc.QUANTIZED]
            assert b[0] > b[1] > b[2] >= b[3] > b[4], b
            assert rows["float32"]["dloss"] == rows["float32"]["max_abs_dlogit"] == 0
            assert all(rows[s]["past_budget"] is not None for s, _ in measured if s in kvc.EVICTING)
