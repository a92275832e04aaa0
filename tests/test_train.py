"""attnlib.train: the loop learns, is reproducible, and the command line saves a model that loads back."""
import json

import pytest
import torch

from attnlib import GPT, DecoderConfig, GPTConfig
from attnlib.train import History, TrainConfig, load_checkpoint, main, save_checkpoint, train

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


@pytest.mark.parametrize("config", [
    GPTConfig(**CONFIG),
    DecoderConfig.llama(**CONFIG, n_kv_heads=1, sliding_window=4, rope_scaling={"rope_type": "linear", "factor": 2.0}),
], ids=["gpt", "llama-window-scaled-rope"])
def test_a_checkpoint_rebuilds_the_same_model(tmp_path, config):
    """The saved config (its derived sizes, layer types and RoPE scaling too) and weights give back the same model."""
    model = GPT(config).eval()
    save_checkpoint(tmp_path / "model.pt", model, chars="ab")
    loaded, extra = load_checkpoint(tmp_path / "model.pt")
    assert loaded.config == config and extra == {"chars": "ab"}
    idx = torch.randint(0, 16, (2, 8))
    with torch.no_grad():
        assert torch.equal(loaded.eval()(idx)[0], model(idx)[0])


def test_command_line_trains_saves_and_loads(tmp_path, capsys, monkeypatch):
    needs_data()
    history = main(
        ["--max-iters", "20", "--eval-interval", "10", "--eval-iters", "2", "--d-model", "16", "--n-heads", "2",
         "--n-layers", "1", "--device", "cpu", "--max-new-tokens", "20", "--top-k", "5", "--temperature", "0.8",
         "--out", str(tmp_path / "new" / "run")]
    )
    tmp_path = tmp_path / "new" / "run"  # created only when saving
    out = capsys.readouterr().out
    assert "step    20: train loss" in out and "parameters" in out
    assert json.loads((tmp_path / "history.json").read_text())["val_loss"] == history.val_loss
    model, extra = load_checkpoint(tmp_path / "model.pt")
    assert model.config.d_model == 16 and len(extra["chars"]) == 65
    idx = torch.randint(0, 65, (1, 32))
    assert torch.isfinite(model(idx)[0]).all()


# ------------------------------------------------------------------ the command line refuses bad flags up front

def needs_data():
    import os

    if not os.environ.get("ATTNLIB_DATA_DIR"):
        pytest.skip("ATTNLIB_DATA_DIR is not set")


@pytest.fixture
def no_training(monkeypatch):
    """Training must never start when a flag is bad: fail loudly if it does."""
    import attnlib.train

    def refuse(*args, **kwargs):
        raise AssertionError("training started although a flag was bad")

    monkeypatch.setattr(attnlib.train, "train", refuse)


def exits_2(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("python -m attnlib.train: error: ")
    return err.splitlines()[-1]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lr", "-1"], "argument --lr: -1.0 is not > 0"),
        (["--lr", "nan"], "argument --lr: 'nan' is not a finite number"),
        (["--max-iters", "0"], "argument --max-iters: 0 is not a positive integer"),
        (["--batch-size", "2.5"], "argument --batch-size: '2.5' is not an integer"),
        (["--d-model", "-64"], "argument --d-model: -64 is not a positive integer"),
        (["--dropout", "1"], "argument --dropout: 1.0 is not in [0, 1)"),
        (["--temperature", "-0.5"], "argument --temperature: -0.5 is negative"),
        (["--temperature", "inf"], "argument --temperature: 'inf' is not a finite number"),
        (["--top-k", "0"], "argument --top-k: 0 is not a positive integer"),
        (["--top-p", "0"], "argument --top-p: 0.0 is not in (0, 1]"),
        (["--top-p", "1.5"], "argument --top-p: 1.5 is not in (0, 1]"),
        (["--max-new-tokens", "-1"], "argument --max-new-tokens/--sample-tokens: -1 is negative"),
        (["--device", "tpu"], "argument --device: 'tpu' is not a torch device"),
        (["--max-iters"], "argument --max-iters: expected one argument"),
        (["--learning-rate", "1e-3"], "unrecognized arguments: --learning-rate"),
    ],
)
def test_command_line_bad_flag_is_an_argparse_error(argv, message, capsys, no_training):
    assert message in exits_2(argv, capsys)


def test_command_line_refuses_an_output_directory_it_could_not_write(tmp_path, capsys, no_training):
    (tmp_path / "a_file").write_text("")
    line = exits_2(["--out", str(tmp_path / "a_file" / "run")], capsys)
    assert "argument --out:" in line and "exists and is not a directory" in line and str(tmp_path / "a_file") in line


def test_command_line_refuses_cuda_without_a_cuda_device(capsys, no_training):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert "argument --device: 'cuda': this machine has no CUDA device" in exits_2(["--device", "cuda"], capsys)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--n-heads", "3"], "d_model=64 is not divisible by n_heads=3"),
        (["--attention", "flash"], "attention='flash'"),
        (["--top-k", "100"], "argument --top-k: 100 exceeds the vocabulary (65 characters)"),
    ],
)
def test_command_line_model_settings_are_checked_before_training(argv, message, capsys, no_training):
    needs_data()
    assert message in exits_2(argv, capsys)


def test_command_line_bad_data_dir(tmp_path, capsys, no_training):
    line = exits_2(["--data-dir", str(tmp_path)], capsys)
    assert line.startswith("python -m attnlib.train: error: argument --data-dir: Tiny Shakespeare not found")


def test_command_line_bad_flag_from_a_shell_is_one_error_line_not_a_traceback(tmp_path):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "attnlib.train", "--top-p", "2"], capture_output=True, text=True,
                            cwd=tmp_path, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1] == "python -m attnlib.train: error: argument --top-p: 2.0 is not in (0, 1]"
