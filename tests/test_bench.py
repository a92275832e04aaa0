"""attnlib.bench: every benchmark runs at tiny sizes and returns well-formed rows; bad flags exit 2.

No timing is asserted: speed is measured by the benchmarks, not by tests.
"""
import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

from attnlib.bench import (
    TorchGPT,
    format_kv_cache,
    format_memory,
    format_mha,
    format_table,
    format_train,
    kv_cache_rows,
    load_results,
    memory_rows,
    mha_rows,
    mha_summary,
    time_calls,
    train_rows,
)
from attnlib.bench._layers import ScratchMultiHeadAttention
from attnlib.bench.cli import main
from attnlib.models import GPTConfig

TINY_GPT = GPTConfig(vocab_size=64, block_size=32, n_layers=2, n_heads=4, d_model=32, attention="gqa", n_kv_heads=2)
LAYER_IDS = {"layer/reference", "layer/mha_sdpa", "layer/mha_eager", "layer/llms_from_scratch", "layer/wrapper",
             "layer/einsum", "layer/separate_qkv", "layer/bool_mask", "layer/nn_mha", "layer/tiled"}
CORE_IDS = {"core/reference", "core/bool_mask", "core/eager", "core/einsum", "core/tiled"}


def _positive(x):
    return isinstance(x, float) and math.isfinite(x) and x > 0


@pytest.mark.parametrize("backward", [True, False])
def test_mha_rows(backward):
    rows = mha_rows(batch=2, seq_len=12, d_model=16, n_heads=2, device="cpu", backward=backward, repeats=1, warmup=0,
                    tile_size=5, threads=1)
    ids = [row["id"] for row in rows]
    assert len(ids) == len(set(ids)) and set(ids) == LAYER_IDS | CORE_IDS
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
    assert isinstance(summary["eager_within_target"], bool) and _positive(summary["eager_vs_scratch_forward"])
    text = format_mha(rows, dict(batch=2, seq_len=12, d_model=16, n_heads=2, dtype="float32", repeats=1, warmup=0))
    assert "Within 1.02×" in text and "nn.MultiheadAttention" in text and "LLMs from Scratch chapter-3 layer" in text


def test_mha_rows_subset_and_unknown_row():
    rows = mha_rows(batch=1, seq_len=8, d_model=8, n_heads=2, device="cpu", backward=False, repeats=1, warmup=0,
                    threads=1, rows=["layer/mha_eager", "layer/llms_from_scratch"])
    assert [row["id"] for row in rows] == ["layer/reference", "layer/mha_eager", "layer/llms_from_scratch", "core/reference"]
    assert "forward_ratio" not in mha_summary(rows) and "eager_vs_scratch_forward" in mha_summary(rows)
    with pytest.raises(ValueError, match=r"rows=\['layer/flash'\] are not row ids"):
        mha_rows(batch=1, seq_len=8, d_model=8, n_heads=2, device="cpu", rows=["layer/flash"])


def test_scratch_layer_is_the_chapter_3_formula():
    """The LLMs-from-Scratch row against causal attention written out with explicit per-head loops."""
    from attnlib.attention import MultiHeadAttention

    torch.manual_seed(0)
    source = MultiHeadAttention(12, 3)
    layer = ScratchMultiHeadAttention(source, block_size=7).eval()
    assert layer.mask.dtype == torch.bool and layer.mask.shape == (7, 7) and "mask" in dict(layer.named_buffers())
    x = torch.randn(2, 5, 12)
    w, b = source.qkv.weight, source.qkv.bias
    heads = []
    for h in range(3):
        rows = [slice(i * 12 + 4 * h, i * 12 + 4 * h + 4) for i in range(3)]
        q, k, v = (x @ w[r].T + b[r] for r in rows)  # (2, 5, 4) each
        scores = q @ k.transpose(1, 2) / 2.0  # sqrt(head_dim=4)
        scores = scores.masked_fill(torch.ones(5, 5).triu(1).bool(), float("-inf"))
        heads.append(scores.softmax(-1) @ v)
    expected = source.out_proj(torch.cat(heads, dim=-1))
    torch.testing.assert_close(layer(x), expected)


def test_kv_cache_rows():
    rows = kv_cache_rows(("mha", "gqa", "mqa", "mla"), tokens=4, prompt_len=3, config=TINY_GPT, device="cpu", repeats=1,
                         warmup_tokens=1, threads=1)
    assert [row["variant"] for row in rows] == ["mha", "gqa", "mqa", "mla"]
    numbers = {row["variant"]: row["numbers_per_token_layer"] for row in rows}
    # head_dim 8: MHA 4 heads; GQA the config's 2; MQA 1; MLA the default latent d_model // 4 = 8
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
    from attnlib.models import GPT

    torch.manual_seed(0)
    model = GPT(TINY_GPT).eval()
    prompt = torch.randint(0, TINY_GPT.vocab_size, (2, 5))
    expected = model.generate(prompt, 40, temperature=0.0, use_cache=False)  # 45 > block_size: the window slides
    assert torch.equal(generate_plain(model, prompt, 40), expected)
    with pytest.raises(ValueError, match="unknown variant 'nope'"):
        kv_cache_rows(("nope",), tokens=1, config=TINY_GPT, device="cpu", repeats=1)


def _check_memory_rows(rows, methods, seq_lens):
    assert [(row["seq_len"], row["method"]) for row in rows] == [(T, m) for T in seq_lens for m in methods]
    for row in rows:
        assert isinstance(row["peak_mib"], float) and row["peak_mib"] >= 0
        assert _positive(row["time_ms"]) and isinstance(row["memory_method"], str)
        assert row["scores_mib"] == 1 * 2 * row["seq_len"] ** 2 * 4 / 2**20


def test_memory_rows_in_process():
    rows = memory_rows(seq_lens=(64, 32), n_heads=2, head_dim=8, device="cpu", repeats=1, tile_size=16, isolate=False,
                       threads=1)
    _check_memory_rows(rows, ("naive", "sdpa", "tiled"), (32, 64))
    assert "peak extra" in format_memory(rows)


def test_memory_rows_in_a_fresh_process_from_another_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the child finds attnlib through the parent's import path, not the directory
    rows = memory_rows(seq_lens=(16, 32), methods=("tiled",), n_heads=2, head_dim=8, device="cpu", repeats=1, tile_size=8,
                       threads=1)
    _check_memory_rows(rows, ("tiled",), (16, 32))
    assert all("fresh process" in row["memory_method"] for row in rows)


def test_memory_rows_rejects_unknown_method_and_device():
    with pytest.raises(ValueError, match="unknown method 'flash'"):
        memory_rows(seq_lens=(16,), methods=("flash",), device="cpu")
    with pytest.raises(ValueError, match="cpu or cuda; got device meta"):
        memory_rows(seq_lens=(16,), device="meta")


def test_torch_gpt_matches_a_hand_written_pre_ln_causal_block():
    """The train benchmark's reference model is the GPT it claims: pre-LN, GELU, causal, tied head."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=11, block_size=6, n_layers=1, n_heads=2, d_model=8)
    model = TorchGPT(config).eval()
    assert model.lm_head.weight is model.tok_emb.weight
    idx = torch.randint(0, 11, (2, 6))
    layer = model.layers[0]
    x = model.tok_emb(idx) + model.pos_emb(torch.arange(6))
    h = layer.norm1(x)
    q, k, v = (F.linear(h, layer.self_attn.in_proj_weight, layer.self_attn.in_proj_bias)
               .view(2, 6, 3, 2, 4).permute(2, 0, 3, 1, 4))  # 3 x (B, heads, T, head_dim)
    scores = (q @ k.transpose(-2, -1) / 2.0).masked_fill(torch.ones(6, 6).triu(1).bool(), float("-inf"))
    a = (scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 6, 8)
    x = x + layer.self_attn.out_proj(a)
    x = x + layer.linear2(F.gelu(layer.linear1(layer.norm2(x))))
    expected = model.ln_f(x) @ model.tok_emb.weight.T
    logits, loss = model(idx, idx)
    torch.testing.assert_close(logits, expected)
    torch.testing.assert_close(loss, F.cross_entropy(expected.flatten(0, 1), idx.flatten()))


def test_train_rows():
    sizes = {"a": (GPTConfig(vocab_size=16, block_size=8, n_layers=1, n_heads=2, d_model=8), 2)}
    rows = train_rows(sizes, device="cpu", repeats=1, warmup=0, threads=1)
    assert len(rows) == 1 and rows[0]["size"] == "a" and rows[0]["batch"] == 2
    assert rows[0]["parameters"] == rows[0]["torch_parameters"]  # the same model, two codebases
    assert _positive(rows[0]["attnlib_ms"]) and _positive(rows[0]["torch_ms"])
    assert rows[0]["ratio"] == pytest.approx(rows[0]["attnlib_ms"] / rows[0]["torch_ms"])
    assert "TransformerEncoderLayer" in format_train(rows)


def test_train_rows_with_the_modern_decoder():
    from attnlib.bench.train import modern_config
    from attnlib.models import Decoder

    config = GPTConfig(vocab_size=16, block_size=8, n_layers=2, n_heads=2, d_model=16)
    rows = train_rows({"a": (config, 2)}, device="cpu", repeats=1, warmup=0, threads=1, modern=True)
    row = rows[0]
    modern = modern_config(config)
    assert (modern.n_layers, modern.n_heads, modern.n_kv_heads, modern.d_model) == (2, 2, 2, 16)
    assert modern.tie_embeddings and not modern.attention_bias and not modern.mlp_bias
    # chapter 16's modern decoder: RoPE, RMSNorm (eps 1e-6, as the committed bench_modern.json's), SwiGLU 8/3 d_model
    assert (modern.position, modern.norm, modern.norm_eps, modern.feedforward, modern.d_ff) == ("rope", "rmsnorm", 1e-6,
                                                                                                "swiglu", 48)
    assert row["modern_parameters"] == Decoder(modern).num_parameters()
    assert _positive(row["modern_ms"]) and row["modern_ratio"] == pytest.approx(row["modern_ms"] / row["attnlib_ms"])
    assert _positive(row["nope_ms"]) and row["nope_ratio"] == pytest.approx(row["nope_ms"] / row["attnlib_ms"])
    text = format_train(rows)
    assert "Llama decoder" in text and "target <= 1.05" in text and "ratio without RoPE" in text
    assert "modern_ms" not in train_rows({"a": (config, 2)}, device="cpu", repeats=1, warmup=0, threads=1)[0]


def test_the_10m_size_has_about_10m_parameters():
    from attnlib.bench import TRAIN_SIZES
    from attnlib.models import GPT

    config, _ = TRAIN_SIZES["10M"]
    with torch.device("meta"):
        assert 10_000_000 <= GPT(config).num_parameters() <= 11_000_000


@pytest.mark.parametrize(
    ("name", "extra", "expected_rows"),  # not "benchmark": pytest-benchmark's fixture has that name
    [
        ("mha", [], 15),
        ("kv-cache", ["--variants", "mha,gqa"], 2),
        ("memory", ["--no-isolate"], 6),
        ("train", [], 1),
    ],
)
def test_cli_small_runs_write_their_results(name, extra, expected_rows, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the default --out is relative to the current directory
    payload = main([name, "--small", "--device", "cpu", "--threads", "1", *extra])
    out = capsys.readouterr().out
    path = tmp_path / f"bench_{name.replace('-', '_')}.json"
    assert f"wrote {path.name}" in out and "load " in out
    assert load_results(path) == json.loads(json.dumps(payload))
    assert payload["benchmark"] == name and payload["settings"]["small"] is True
    assert len(payload["rows"]) == expected_rows and len(payload["environment"]["load_average"]) == 3


def test_cli_out_path_and_load_results(tmp_path, capsys):
    path = tmp_path / "new" / "dir" / "mha.json"  # directories are created
    payload = main(["mha", "--batch", "1", "--seq-len", "8", "--d-model", "8", "--n-heads", "2", "--repeats", "1",
                    "--warmup", "0", "--no-backward", "--device", "cpu", "--threads", "1", "--out", str(path),
                    "--rows", "layer/mha_sdpa"])
    assert "1 threads" in capsys.readouterr().out and path.is_file()
    assert payload["settings"]["backward"] is False and [r["id"] for r in payload["rows"]][1] == "layer/mha_sdpa"
    with pytest.raises(FileNotFoundError, match="python -m attnlib.bench <name> --out"):
        load_results(tmp_path / "missing.json")


def _exit_2(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err
    return err


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["mha", "--batch", "0"], "argument --batch: 0 must be positive"),
        (["mha", "--seq-len", "-3"], "argument --seq-len: -3 must be positive"),
        (["mha", "--d-model", "ten"], "argument --d-model: 'ten' is not an integer"),
        (["mha", "--d-model", "10", "--n-heads", "4"], "--d-model: 10 is not divisible by --n-heads 4"),
        (["mha", "--repeats", "-1"], "argument --repeats: -1 must be positive"),
        (["mha", "--warmup", "-2"], "argument --warmup: -2 must be >= 0"),
        (["mha", "--threads", "0"], "argument --threads: 0 must be positive"),
        (["mha", "--tile-size", "0"], "argument --tile-size: 0 must be positive"),
        (["mha", "--dtype", "float8"], "invalid choice: 'float8'"),
        (["mha", "--rows", "layer/flash"], "argument --rows: layer/flash not among"),
        (["mha", "--device", "tpu"], "argument --device: 'tpu' is not a torch device"),
        (["mha", "--device", "meta"], "argument --device: 'meta': attnlib runs on cpu, cuda or mps"),
        (["kv-cache", "--variants", "mha,foo"], "argument --variants: foo not among mha,gqa,mqa,mla"),
        (["kv-cache", "--variants", ","], "argument --variants: ',' names nothing"),
        (["kv-cache", "--tokens", "0"], "argument --tokens: 0 must be positive"),
        (["kv-cache", "--small", "--prompt-len", "33"], "argument --prompt-len: 33 exceeds the model's block_size 32"),
        (["memory", "--seq-lens", "256,-1"], "argument --seq-lens: -1 must be positive"),
        (["memory", "--seq-lens", "256,x"], "argument --seq-lens: 'x' is not an integer"),
        (["memory", "--methods", "flash"], "argument --methods: flash not among naive,sdpa,tiled"),
        (["memory", "--head-dim", "0"], "argument --head-dim: 0 must be positive"),
        (["train", "--sizes", "1B"], "argument --sizes: 1B not among book,10M"),
        (["train", "--batch", "0"], "argument --batch: 0 must be positive"),
        (["fused"], "invalid choice: 'fused'"),
    ],
)
def test_cli_bad_flags_exit_2_naming_the_value(argv, named, capsys):
    assert named in _exit_2(argv, capsys)


def test_cli_unavailable_cuda_is_refused(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert "argument --device: 'cuda': this machine has no CUDA device" in _exit_2(["train", "--device", "cuda"], capsys)


def test_cli_unwritable_out_is_refused_before_any_measurement(tmp_path, capsys):
    afile = tmp_path / "a_file"
    afile.write_text("")
    err = _exit_2(["mha", "--small", "--out", str(afile / "x.json")], capsys)
    assert f"cannot write {str(afile / 'x.json')!r}" in err and "is not a directory" in err
    assert f"argument --out: {str(tmp_path)!r} is a directory" in _exit_2(["train", "--out", str(tmp_path)], capsys)
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("running as root: permissions are not enforced")
        err = _exit_2(["memory", "--small", "--out", str(locked / "sub" / "m.json")], capsys)
        assert "is not writable" in err and str(locked) in err
    finally:
        locked.chmod(0o700)


def test_time_calls_and_format_table():
    seconds = time_calls({"a": lambda: torch.zeros(3), "b": lambda: torch.ones(3)}, repeats=2, warmup=1)
    assert set(seconds) == {"a", "b"} and all(_positive(s) for s in seconds.values())
    with pytest.raises(ValueError, match="repeats=0 must be a positive int"):
        time_calls({"a": lambda: None}, repeats=0)
    table = format_table([{"name": "x", "v": 1.5}, {"name": "longer", "v": None}], [("name", "name", "s"), ("v", "value", ".1f")])
    assert table.splitlines() == ["name    value", "------  -----", "x         1.5", "longer      -"]


def test_write_json_is_atomic(tmp_path):
    """A payload that cannot be written leaves the old results file as it was, and no temporary file behind."""
    from attnlib.bench._common import write_json

    path = tmp_path / "bench_x.json"
    write_json(path, {"rows": [1]})
    with pytest.raises(TypeError, match="not JSON serializable"):
        write_json(path, {"rows": [object()]})
    assert json.loads(path.read_text()) == {"rows": [1]} and [p.name for p in tmp_path.iterdir()] == ["bench_x.json"]
    write_json(path, {"rows": [2]})  # replaced in one step
    assert load_results(path) == {"rows": [2]} and [p.name for p in tmp_path.iterdir()] == ["bench_x.json"]


def test_time_after_setup_times_each_call_after_its_own_setup():
    from attnlib.bench._common import time_after_setup

    state, seen = {}, []

    def setup(name):
        return lambda: state.__setitem__(name, [])  # a fresh state for every call

    def call(name):
        def run():
            seen.append((name, len(state[name])))  # what the call found: always the fresh state
            state[name].append(1)

        return run

    seconds = time_after_setup({"a": call("a"), "b": call("b")}, {"a": setup("a"), "b": setup("b")}, repeats=3, warmup=1)
    assert set(seconds) == {"a", "b"} and all(_positive(s) for s in seconds.values())
    assert seen == [("a", 0), ("b", 0)] + [("a", 0), ("b", 0)] * 3  # warm-up, then rounds that alternate
    with pytest.raises(ValueError, match=r"setups names \['a'\]; expected one per function \['a', 'b'\]"):
        time_after_setup({"a": call("a"), "b": call("b")}, {"a": setup("a")})
    with pytest.raises(ValueError, match="repeats=0 must be a positive int"):
        time_after_setup({"a": call("a")}, {"a": setup("a")}, repeats=0)


def test_cli_train_modern_records_the_llama_configs(tmp_path):
    payload = main(["train", "--modern", "--small", "--device", "cpu", "--threads", "1", "--out", str(tmp_path / "m.json")])
    modern = payload["settings"]["modern_configs"]["tiny"]
    gpt = payload["settings"]["sizes"]["tiny"]["config"]
    assert (modern["position"], modern["norm"], modern["norm_eps"], modern["feedforward"]) == ("rope", "rmsnorm", 1e-6,
                                                                                              "swiglu")
    assert modern["tie_embeddings"] is True and modern["attention_bias"] is False and modern["mlp_bias"] is False
    assert {k: modern[k] for k in ("vocab_size", "block_size", "n_layers", "n_heads", "d_model")} == \
        {k: gpt[k] for k in ("vocab_size", "block_size", "n_layers", "n_heads", "d_model")}
    assert payload["rows"][0]["modern_ratio"] == pytest.approx(payload["summary"]["max_modern_ratio"])
