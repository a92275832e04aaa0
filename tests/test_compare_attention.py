"""The chapter 13 experiment: fair set-up, leaky models really leak, and the committed results are honest."""
import json

import pytest
import torch

from attnlib.attention import ATTENTION_REGISTRY
from attnlib.book.experiments import compare_attention as ca


def future_moves_past(model, T=16) -> bool:
    idx = torch.randint(0, 65, (2, T))
    changed = idx.clone()
    changed[:, T // 2 :] = torch.randint(0, 65, (2, T - T // 2))
    with torch.no_grad():
        return not torch.allclose(model(idx)[0][:, : T // 2], model(changed)[0][:, : T // 2], atol=1e-6)


@pytest.mark.parametrize("variant", [*ca.VARIANTS, *ca.LEAKY_VARIANTS])
def test_build_model_and_leaks(variant):
    before = dict(ATTENTION_REGISTRY)
    model = ca.build_model(variant).eval()
    assert ATTENTION_REGISTRY == before  # leaky classes never stay registered
    assert model.config.attention == variant and model.config.n_kv_heads == 2 and model.config.kv_latent_dim == 16
    assert future_moves_past(model) == (variant in ca.LEAKY_VARIANTS)


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
    if not ca.RESULTS_PATH.is_file():
        pytest.fail(f"{ca.RESULTS_PATH} is missing: chapter 13 reads it")
    return json.loads(ca.RESULTS_PATH.read_text())


def test_committed_results_come_from_the_full_run(committed):
    assert committed["training"]["max_iters"] == 5000 and committed["training"]["eval_interval"] == 100
    assert committed["model"] == {**committed["model"], **ca.MODEL}
    for key in ("cpu", "torch", "commit", "date", "command"):
        assert committed["meta"][key]
    assert set(committed["variants"]) == {*ca.VARIANTS, *ca.LEAKY_VARIANTS}
    for run in committed["variants"].values():
        assert run["steps"] == list(range(0, 5001, 100))


def test_committed_results_are_honest(committed):
    """Causal models of this size land near 1.8 nats/char; only models that see the future go far below."""
    runs = committed["variants"]
    causal = {name: run["final_val_loss"] for name, run in runs.items() if run["causal"]}
    leaky = {name: run["final_val_loss"] for name, run in runs.items() if not run["causal"]}
    assert set(causal) == set(ca.VARIANTS) and set(leaky) == set(ca.LEAKY_VARIANTS)
    assert all(1.6 < loss < 2.2 for loss in causal.values()), causal
    assert all(loss < 1.0 for loss in leaky.values()), leaky
