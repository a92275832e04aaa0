"""attnlib.train: the loop learns, is reproducible, and the command line saves a model that loads back."""
import json

import pytest
import torch

from attnlib import GPT, GPTConfig
from attnlib.train import History, TrainConfig, load_checkpoint, main, train

CONFIG = dict(vocab_size=16, block_size=8, n_layers=1, n_heads=2, d_model=16)


def periodic_data(n=2000):
    """A sequence with an easy pattern (i mod 16) so that a short run must learn it."""
    return torch.arange(n) % 16


def run(seed=0, iters=60):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**CONFIG))
    data = periodic_data()
    cfg = TrainConfig(batch_size=8, max_iters=iters, eval_interval=20, eval_iters=4, learning_rate=3e-3, device="cpu")
    return train(model, data[:1800], data[1800:], cfg, progress=False)


def test_training_learns_and_records_history():
    history = run()
    assert history.steps == [0, 20, 40, 60]
    assert len(history.train_loss) == len(history.val_loss) == 4
    assert history.val_loss[-1] < 0.5 * history.val_loss[0]
    assert history.tokens_per_s > 0 and history.elapsed_s > 0


def test_training_is_reproducible():
    assert run().val_loss == run().val_loss


def test_history_json_round_trip(tmp_path):
    h = History(steps=[0, 1], train_loss=[2.0, 1.0], val_loss=[2.5, 1.5], elapsed_s=1.0, tokens_per_s=10.0)
    h.to_json(tmp_path / "h.json")
    assert History.from_json(tmp_path / "h.json") == h


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_iters=0), "max_iters=0"),
        (dict(learning_rate=0), "learning_rate=0"),
        (dict(weight_decay=-0.1), "weight_decay=-0.1"),
        (dict(grad_clip=0.0), "grad_clip=0.0"),
    ],
)
def test_train_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**kwargs)


def test_train_rejects_a_model_without_block_size():
    with pytest.raises(TypeError, match="config.block_size"):
        train(torch.nn.Linear(2, 2), periodic_data(), periodic_data(), TrainConfig(max_iters=1), progress=False)


def test_command_line_trains_saves_and_loads(tmp_path, capsys, monkeypatch):
    import os

    if not os.environ.get("ATTNLIB_DATA_DIR"):
        pytest.skip("ATTNLIB_DATA_DIR is not set")
    history = main(
        ["--max-iters", "20", "--eval-interval", "10", "--eval-iters", "2", "--d-model", "16", "--n-heads", "2",
         "--n-layers", "1", "--device", "cpu", "--sample-tokens", "20", "--out", str(tmp_path)]
    )
    out = capsys.readouterr().out
    assert "step    20: train loss" in out and "parameters" in out
    assert json.loads((tmp_path / "history.json").read_text())["val_loss"] == history.val_loss
    model, extra = load_checkpoint(tmp_path / "model.pt")
    assert model.config.d_model == 16 and len(extra["chars"]) == 65
    idx = torch.randint(0, 65, (1, 32))
    assert torch.isfinite(model(idx)[0]).all()
