"""Training in two CPU processes (DistributedDataParallel over gloo) equals one process on the same global batch."""
import json
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from attnlib import GPT, GPTConfig
from attnlib.train import TrainConfig, train

CONFIG = dict(vocab_size=16, block_size=8, n_layers=2, n_heads=2, d_model=16)
TRAINING = dict(batch_size=8, max_iters=6, eval_interval=3, eval_iters=2, learning_rate=3e-3, device="cpu")
TOLERANCE = 1e-5  # float sums in another order: gradients averaged across processes vs one batch mean


def data():
    return torch.arange(3000) % 13


class CountingGPT(GPT):
    """Records how many rows each training step feeds this process."""

    def forward(self, idx, targets=None, cache=None):
        if self.training:
            self.rows_seen.append(idx.shape[0])
        return super().forward(idx, targets, cache)


def run():
    torch.manual_seed(0)
    model = CountingGPT(GPTConfig(**CONFIG))
    model.rows_seen = []
    history = train(model, data()[:2500], data()[2500:], TrainConfig(**TRAINING), progress=False)
    return history, model


def worker(rank, world_size, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    history, model = run()
    state = {k: v.tolist() for k, v in model.state_dict().items()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"step_loss": history.step_loss, "val_loss": history.val_loss, "state": state,
                   "rows_seen": model.rows_seen}, f)
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_two_processes_equal_one(tmp_path):
    mp.spawn(worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    single, model = run()
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert model.rows_seen == [8] * 6
    for r in ranks:
        assert r["rows_seen"] == [4] * 6  # each process trains on its half of the global batch
        assert r["step_loss"] == pytest.approx(single.step_loss, abs=TOLERANCE)
        assert r["val_loss"] == pytest.approx(single.val_loss, abs=TOLERANCE)
    # the processes stay in sync, and with the single-process model
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(torch.tensor(ranks[0]["state"][name]), tensor, atol=TOLERANCE, rtol=0)
        assert ranks[0]["state"][name] == ranks[1]["state"][name]


def test_batch_must_split_evenly(monkeypatch):
    monkeypatch.setattr("attnlib.train.distributed_context", lambda device: (0, 3))
    with pytest.raises(ValueError, match="batch_size=8 is not divisible by the 3 processes"):
        run()
