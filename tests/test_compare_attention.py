"""The chapter 13 experiment: fair set-up, leaky models really leak, and the committed results are honest."""
import json

import pytest
import torch

from attnlib.book.experiments import compare_attention as ca
from attnlib.models.layers import ATTENTION_LAYERS


def future_moves_past(model, T=16) -> bool:
    idx = torch.randint(0, 65, (2, T))
    changed = idx.clone()
    changed[:, T // 2 :] = torch.randint(0, 65, (2, T - T // 2))
    with torch.no_grad():
        return not torch.allclose(model(idx)[0][:, : T // 2], model(changed)[0][:, : T // 2], atol=1e-6)


@pytest.mark.parametrize("variant", [*ca.VARIANTS, *ca.LEAKY_VARIANTS])
def test_build_model_and_leaks(variant):
    before = dict(ATTENTION_LAYERS)
    model = ca.build_model(variant).eval()
    assert ATTENTION_LAYERS == before  # leaky classes are never registered
    attention = ca.LEAKY_BASE.get(variant, variant)
    assert model.config.attention == attention
    # n_kv_heads is given to gqa only; the others derive it (MQA: 1, the rest: n_heads = 4)
    assert model.config.n_kv_heads == {"gqa": 2, "mqa": 1}.get(attention, 4)
    assert model.config.kv_latent_dim == (16 if variant == "mla" else None)
    if variant in ca.LEAKY_VARIANTS:
        assert all(type(block.attn) is ca.LEAKY_VARIANTS[variant] for block in model.blocks)
    assert future_moves_past(model) == (variant in ca.LEAKY_VARIANTS)


@pytest.mark.parametrize("variant", sorted(ca.LEAKY_VARIANTS))
def test_a_leaky_model_starts_from_its_base_models_weights(variant):
    torch.manual_seed(0)
    base = ca.build_model(ca.LEAKY_BASE[variant])
    torch.manual_seed(0)
    leaky = ca.build_model(variant)
    base_state, leaky_state = base.state_dict(), leaky.state_dict()
    assert set(leaky_state) - set(base_state) == (
        {f"blocks.{i}.attn.mix_weights_bias" for i in range(len(leaky.blocks))} if variant == "talking_heads_biased" else set()
    )
    for name, tensor in base_state.items():
        assert torch.equal(leaky_state[name], tensor), name


def test_unknown_variant():
    with pytest.raises(ValueError, match="variant='flash'"):
        ca.build_model("flash")


def test_same_seed_and_data_order_for_every_variant(monkeypatch):
    import os

    if not os.environ.get("ATTNLIB_DATA_DIR"):
        pytest.skip("ATTNLIB_DATA_DIR is not set")
    short = {"max_iters": 4, "eval_interval": 2, "eval_iters": 2}
    results = ca.compare(("mha", "talking_heads", "mqa"), short, device="cpu", progress=False)
    runs = results["variants"]
    assert set(runs) == {"mha", "talking_heads", "mqa"} and results["training"]["max_iters"] == 4
    # talking heads starts as multi-head attention (identity mixing): same seed, same weights, same batches
    assert runs["mha"]["val_loss"][0] == runs["talking_heads"]["val_loss"][0]
    assert runs["mqa"]["kv_cache_bytes_per_token"] == 2 * 16 * 4 * 4  # 2 * head_dim * n_layers * fp32
    assert "mha" in ca.format_table(results)


@pytest.fixture
def committed():
    from attnlib.book import results

    path = results.path("compare_attention")  # raises FileNotFoundError when the package lacks it
    assert ca.load_results() == json.loads(path.read_text())
    return ca.load_results()


@pytest.mark.parametrize("variant", [*ca.VARIANTS, *ca.LEAKY_VARIANTS])
def test_committed_results_describe_the_models_this_code_builds(committed, variant):
    """The committed run is stale if today's code builds another model: recount what it stored."""
    run = committed["variants"][variant]
    model = ca.build_model(variant)
    assert run["parameters"] == model.num_parameters()
    assert run["kv_cache_bytes_per_token"] == model.kv_cache_bytes_per_token()
    assert run["causal"] == (variant in ca.VARIANTS)


def test_committed_model_settings_are_the_configs_this_code_builds(committed):
    """The file records the shared settings once (the first run also recorded some config defaults): every
    variant's config has them, compared by ``to_dict()`` on the keys the file records."""
    recorded = committed["model"]
    per_variant = {"attention", "n_kv_heads", "kv_latent_dim"}  # the variant's own; the file holds the shared values
    shared = {k: v for k, v in recorded.items() if k not in per_variant}
    for variant in (*ca.VARIANTS, *ca.LEAKY_VARIANTS):
        config = ca.variant_config(variant).to_dict()
        assert {k: config[k] for k in shared} == shared, variant
    assert ca.variant_config("gqa").n_kv_heads == recorded["n_kv_heads"]
    assert ca.variant_config("mla").kv_latent_dim == recorded["kv_latent_dim"]


def test_load_results_from_a_path_and_a_missing_path(tmp_path):
    (tmp_path / "r.json").write_text('{"variants": {}}')
    assert ca.load_results(tmp_path / "r.json") == {"variants": {}}
    with pytest.raises(FileNotFoundError, match="no results at .*missing.json"):
        ca.load_results(tmp_path / "missing.json")


def test_unknown_results_file():
    from attnlib.book import results

    with pytest.raises(ValueError, match="name='no_such_run' is not a committed results file"):
        results.load("no_such_run")


# ------------------------------------------------------------------ the command line refuses bad flags up front

@pytest.fixture
def no_training(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("training started although a flag was bad")

    monkeypatch.setattr(ca, "compare", refuse)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--variants", "mha,flash"], "argument --variants: 'mha,flash': expected comma-separated names"),
        (["--variants", ","], "argument --variants: ','"),
        (["--max-iters", "0"], "argument --max-iters: 0 is not a positive integer"),
        (["--eval-iters", "-3"], "argument --eval-iters: -3 is not a positive integer"),
        (["--eval-interval", "ten"], "argument --eval-interval: 'ten' is not an integer"),
        (["--device", "gpu"], "argument --device: 'gpu' is not a torch device"),
        (["--out", ""], "argument --out: '' is not a file name"),
        (["--out", "results/"], "argument --out: 'results/' is not a file name"),
        (["--steps", "5"], "unrecognized arguments: --steps"),
    ],
)
def test_command_line_bad_flag_is_an_argparse_error(argv, message, capsys, no_training):
    with pytest.raises(SystemExit) as exit_info:
        ca.main(argv)
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith("python -m attnlib.book.experiments.compare_attention: error: ") and message in last


def test_command_line_refuses_an_output_path_it_could_not_write(tmp_path, capsys, no_training):
    (tmp_path / "a_file").write_text("")
    (tmp_path / "a_dir").mkdir()
    for out, message in ((tmp_path / "a_file" / "r.json", "exists and is not a directory"),
                         (tmp_path / "a_dir", "is a directory (expected a file name)")):
        with pytest.raises(SystemExit) as exit_info:
            ca.main(["--out", str(out)])
        assert exit_info.value.code == 2
        last = capsys.readouterr().err.splitlines()[-1]
        assert "error: argument --out:" in last and message in last


def test_command_line_writes_its_default_path_under_the_current_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(ca, "compare", lambda *a, **k: {"meta": {}, "variants": {}})
    ca.main(["--max-iters", "1"])
    assert json.loads((tmp_path / "results" / "compare_attention.json").read_text())["meta"]["command"].endswith(
        "--max-iters 1")
    assert str(ca.DEFAULT_OUT) == "results/compare_attention.json"


# ------------------------------------------------------------------ several seeds: one entry per variant per seed

def test_seeds_give_one_entry_per_variant_per_seed():
    import os

    if not os.environ.get("ATTNLIB_DATA_DIR"):
        pytest.skip("ATTNLIB_DATA_DIR is not set")
    short = {"max_iters": 2, "eval_interval": 2, "eval_iters": 1}
    seen = []
    results = ca.compare(("mha", "talking_heads_biased"), short, device="cpu", progress=False, seeds=(3, 4),
                         on_run=lambda r: seen.append(sum(len(v["by_seed"]) for v in r["variants"].values())))
    assert results["seeds"] == [3, 4] and results["training"]["seed"] == 3
    assert seen == [1, 2, 3]  # mha@3, leaky@3, mha@4: the leaky model trains with the first seed only
    mha = results["variants"]["mha"]
    assert sorted(mha["by_seed"]) == ["3", "4"]
    assert mha["final_val_loss"] == mha["by_seed"]["3"]["final_val_loss"]  # the top level is the first seed
    assert mha["by_seed"]["3"]["val_loss"] != mha["by_seed"]["4"]["val_loss"]  # another seed, another run
    summary = ca.seed_summary(results)
    losses = [r["final_val_loss"] for r in mha["by_seed"].values()]
    assert summary["mha"]["losses"] == {"3": losses[0], "4": losses[1]}
    assert summary["mha"]["n"] == 2 and summary["mha"]["min"] == min(losses) and summary["mha"]["max"] == max(losses)
    assert summary["mha"]["mean"] == pytest.approx(sum(losses) / 2)
    assert summary["mha"]["std"] == pytest.approx(abs(losses[0] - losses[1]) / 2**0.5)
    assert summary["talking_heads_biased"]["n"] == 1 and summary["talking_heads_biased"]["std"] == 0.0


def test_seed_summary_of_a_file_without_by_seed():
    old = {"training": {"seed": 7}, "variants": {"mha": {"steps": [0, 10], "val_loss": [4.0, 1.5]}}}
    assert ca.seed_summary(old) == {"mha": {"n": 1, "mean": 1.5, "min": 1.5, "max": 1.5, "std": 0.0,
                                            "losses": {"7": 1.5}}}


def _run(steps, val):
    return {"steps": steps, "val_loss": val, "train_loss": val, "final_val_loss": val[-1],
            "final_train_loss": val[-1], "tokens_per_s": 1.0, "elapsed_s": 1.0}


def _results(seeds, max_iters, by_seed, parameters=10):
    return {"meta": {"command": f"run {seeds}"}, "model": dict(ca.MODEL), "seeds": seeds,
            "training": {**ca.TRAINING, "seed": seeds[0], "max_iters": max_iters, "eval_iters": 50},
            "variants": {"mha": {**by_seed[str(seeds[0])], "parameters": parameters, "causal": True,
                                 "by_seed": by_seed}}}


def test_merge_seeds_of_a_shorter_budget_and_summary_at_a_step():
    first = _results([1], 20, {"1": _run([0, 10, 20], [4.0, 2.0, 1.0])})
    del first["variants"]["mha"]["by_seed"]  # a file written before by_seed existed
    more = _results([2, 3], 10, {"2": _run([0, 10], [4.0, 2.5]), "3": _run([0, 10], [4.0, 1.5])})
    merged = ca.merge_seeds(first, more)
    assert merged["seeds"] == [1, 2, 3] and merged["meta"]["merged"] == [more["meta"]]
    assert sorted(merged["variants"]["mha"]["by_seed"]) == ["1", "2", "3"]
    assert merged["variants"]["mha"]["final_val_loss"] == 1.0  # the first run's top level is kept
    assert "by_seed" not in first["variants"]["mha"]  # the inputs are not changed
    at_10 = ca.seed_summary(merged, step=10)["mha"]
    assert at_10["losses"] == {"1": 2.0, "2": 2.5, "3": 1.5} and at_10["mean"] == pytest.approx(2.0)
    assert at_10["std"] == pytest.approx(0.5) and (at_10["min"], at_10["max"]) == (1.5, 2.5)
    with pytest.raises(ValueError, match=r"variant='mha': its runs end at steps \[10, 20\]; pass step="):
        ca.seed_summary(merged)
    with pytest.raises(ValueError, match=r"variant='mha': seed\(s\) \['2', '3'\] have no estimate at step=20"):
        ca.seed_summary(merged, step=20)


@pytest.mark.parametrize("change, message", [
    (lambda r: r["model"].update(d_model=32), "model settings differ"),
    (lambda r: r["training"].update(learning_rate=0.1), "training settings differ"),
    (lambda r: r["variants"]["mha"].update(parameters=11), "variant='mha': 11 parameters, but 10"),
    (lambda r: r["variants"].update(gqa=r["variants"]["mha"]), "variant='gqa' is not in the run"),
    (lambda r: r["variants"]["mha"]["by_seed"].update({"1": _run([0], [1.0])}), "seed 1 is in both runs"),
])
def test_merge_seeds_refuses_what_does_not_fit(change, message):
    first = _results([1], 20, {"1": _run([0, 20], [4.0, 1.0])})
    more = _results([2], 20, {"2": _run([0, 20], [4.0, 1.1])})
    change(more)
    with pytest.raises(ValueError, match=message):
        ca.merge_seeds(first, more)


def test_command_line_merge_with_a_missing_or_unfit_file(tmp_path, capsys, no_training):
    for argv, message in (
        (["--merge-with", str(tmp_path / "none.json")], "argument --merge-with: no results file at"),
        (["--merge-with", str(tmp_path / "r.json"), "--eval-iters", "7"], "training settings differ"),
    ):
        (tmp_path / "r.json").write_text(json.dumps(_results([1], 5000, {"1": _run([0], [1.0])})))
        with pytest.raises(SystemExit) as exit_info:
            ca.main(argv)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err.splitlines()[-1]


@pytest.mark.parametrize("seeds", [(), (1, 1), (-1,)])
def test_bad_seeds_are_refused_before_training(seeds):
    with pytest.raises(ValueError, match=r"seeds=.* must be distinct integers >= 0"):
        ca.compare(("mha",), seeds=seeds, progress=False)


def test_command_line_refuses_repeated_or_negative_seeds(capsys, no_training):
    for argv, message in ((["--seeds", "1", "1"], "argument --seeds: [1, 1] repeats a seed"),
                          (["--seeds", "-2"], "argument --seeds: -2 is negative")):
        with pytest.raises(SystemExit) as exit_info:
            ca.main(argv)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err.splitlines()[-1]


# ------------------------------------------------------------------ the committed run is reproduced

@pytest.mark.parametrize("variant", [*ca.VARIANTS, *ca.LEAKY_VARIANTS])
def test_step_0_losses_of_the_committed_run_are_reproduced(committed, variant):
    """The model built with the committed run's first seed has the losses the file records at step 0: the same
    initial weights, so the same parameter creation order and initialisation.

    The batches are :func:`attnlib.train.estimate_loss`'s (a generator seeded with seed + 1, as ``train`` passes
    it), run as one batch of all of them: float32 sums in another order (last bits), hence rel=1e-6; another
    initialisation moves the loss by more than 1e-3.
    """
    import os

    if not os.environ.get("ATTNLIB_DATA_DIR"):
        pytest.skip("ATTNLIB_DATA_DIR is not set")
    from attnlib.data import get_batch, load_char_corpus

    training, run = committed["training"], committed["variants"][variant]
    assert run["steps"][0] == 0 and training["seed"] == committed["seeds"][0]
    corpus = load_char_corpus()
    torch.manual_seed(training["seed"])  # as compare() does before building each model
    model = ca.build_model(variant).eval()
    B, T, n = training["batch_size"], model.config.block_size, training["eval_iters"]
    for split, data in (("train", corpus.train), ("val", corpus.val)):
        g = torch.Generator().manual_seed(training["seed"] + 1)
        x, y = (torch.cat(t) for t in zip(*(get_batch(data, B, T, g) for _ in range(n))))  # (n * B, T) each
        with torch.no_grad():
            logits, _ = model(x)
        token_losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
        loss = token_losses.view(n, B * T).mean(dim=1).mean().item()  # the mean of the batches' mean losses
        assert loss == pytest.approx(run[f"{split}_loss"][0], rel=1e-6, abs=0), split
