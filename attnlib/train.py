"""Training a language model with AdamW: the loop, loss estimates, a history to plot, and a command line.

Chapter 12. The full run of the book's small configuration::

    python -m attnlib.train --max-iters 5000 --out runs/gpt

Batches come from a seeded ``torch.Generator``, so two runs with the same seed
see the same data in the same order (whatever the model).

Several processes (``torchrun --nproc_per_node N -m attnlib.train ...``): every
process draws the same global batch and trains on its own ``batch_size / N`` rows;
DistributedDataParallel averages the gradients, so each step equals the
single-process step on the whole batch (gloo on CPU, NCCL on GPUs).
"""
from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from attnlib._checks import eval_mode, finite_number, positive_int
from attnlib._device import check_device
from attnlib._device import device as default_device
from attnlib.checkpoint import load_checkpoint, save_checkpoint
from attnlib.data import get_batch, token_tensor
from attnlib.history import History

__all__ = [
    "History",
    "TrainConfig",
    "distributed_context",
    "estimate_loss",
    "load_checkpoint",
    "main",
    "save_checkpoint",
    "train",
]


@dataclass
class TrainConfig:
    """Optimisation settings; the defaults are the book's small Tiny Shakespeare run (chapter 12).

    Attributes:
        batch_size: sequences per step.
        max_iters: optimizer steps.
        eval_interval: estimate train/val loss every this many steps (and after the last).
        eval_iters: batches averaged per loss estimate.
        learning_rate: AdamW learning rate (constant).
        weight_decay: AdamW weight decay (PyTorch's default, 0.01).
        grad_clip: clip the gradient norm to this value; ``None`` = no clipping.
        seed: seed of the batch sampler.
        device: ``None`` = :func:`attnlib.device`; else ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or ``"mps"``
            (whether this machine has it is checked by :func:`train`).

    Raises:
        TypeError: a size or ``seed`` that is not an int, a rate that is not a number, a ``device``
            that is not a str / ``torch.device``.
        ValueError: a size < 1, ``learning_rate`` or ``grad_clip`` <= 0, a negative ``weight_decay``,
            a non-finite rate, or a ``device`` string that names no device attnlib runs on.
    """

    batch_size: int = 16
    max_iters: int = 5000
    eval_interval: int = 100
    eval_iters: int = 200
    learning_rate: float = 1e-3
    weight_decay: float = 0.01
    grad_clip: float | None = None
    seed: int = 1337
    device: str | None = None

    def __post_init__(self) -> None:
        for name in ("batch_size", "max_iters", "eval_interval", "eval_iters"):
            positive_int(name, getattr(self, name))
        finite_number("learning_rate", self.learning_rate)
        finite_number("weight_decay", self.weight_decay)
        if self.grad_clip is not None:
            finite_number("grad_clip", self.grad_clip)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"seed must be an int; got {self.seed!r} ({type(self.seed).__name__})")
        if self.device is not None:
            check_device("device", self.device, available=False)  # whether this machine has it: train()
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate={self.learning_rate} must be > 0")
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay={self.weight_decay} must be >= 0")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(f"grad_clip={self.grad_clip} must be > 0 (or None for no clipping)")


def _token_data(name: str, data: object, block_size: int) -> None:
    """Raise unless ``data`` is a 1-D integer tensor longer than ``block_size`` (one training window)."""
    token_tensor(name, data)
    if data.dim() != 1 or len(data) <= block_size:
        raise ValueError(f"{name} must be 1-D and longer than block_size={block_size}; got shape {tuple(data.shape)}")


@torch.no_grad()
def estimate_loss(
    model: nn.Module,
    splits: dict[str, torch.Tensor],
    batch_size: int,
    block_size: int,
    eval_iters: int,
    seed: int = 0,
    device: torch.device | str | None = None,
) -> dict[str, float]:
    """Mean loss over ``eval_iters`` random batches of each split, in eval mode.

    The batches come from a generator seeded with ``seed``: every call sees the
    same batches, so successive estimates differ only because the model changed.

    Returns:
        ``{split name: mean loss}``.
    """
    positive_int("eval_iters", eval_iters)
    out = {}
    with eval_mode(model):  # the modes come back even if a batch raises
        for name, data in splits.items():
            generator = torch.Generator().manual_seed(seed)
            losses = torch.empty(eval_iters)
            for i in range(eval_iters):
                x, y = get_batch(data, batch_size, block_size, generator, device)
                losses[i] = model(x, y)[1].item()
            out[name] = losses.mean().item()
    return out


def distributed_context(device: torch.device) -> tuple[int, int]:
    """``(rank, world_size)``; joins the process group when launched by ``torchrun`` with several processes.

    Uses the ``env://`` variables torchrun sets (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``); NCCL for CUDA devices, gloo otherwise. ``(0, 1)`` for a single process.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1 or not dist.is_available():
        return 0, 1
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size()


def train(
    model: nn.Module,
    train_data: torch.Tensor,
    val_data: torch.Tensor,
    config: TrainConfig | None = None,
    progress: bool = True,
) -> History:
    """Train ``model`` with AdamW on random windows of ``train_data``.

    Args:
        model: an :class:`attnlib.GPT`, or any module with ``forward(idx, targets) -> (logits, loss)``
            and a ``config.block_size`` (the window length); moved to the device in place.
        train_data, val_data: 1-D int64 token tensors.
        config: a :class:`TrainConfig` (defaults if ``None``).
        progress: show a tqdm progress bar with the latest losses.

    Under ``torchrun`` with several processes (see the module docstring), each process
    trains on its share of every batch and the model is wrapped in
    DistributedDataParallel; on CUDA, process ``LOCAL_RANK`` uses GPU ``LOCAL_RANK``.

    Returns:
        The :class:`History` of the run (the same on every process).

    Raises:
        TypeError: ``config`` is not a :class:`TrainConfig`, ``model`` has no ``config.block_size``,
            or ``train_data`` / ``val_data`` is not an integer tensor.
        ValueError: the data is not 1-D or not longer than ``block_size``; ``config.device`` (or
            ``ATTNLIB_DEVICE``) is a device this machine lacks (e.g. ``"cuda"`` without CUDA);
            when distributed, a ``batch_size`` not divisible by the number of processes.
            All of these are checked before any work.
        FloatingPointError: if the loss becomes NaN or infinite.
    """
    config = TrainConfig() if config is None else config
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig or None; got {type(config).__name__}")
    block_size = getattr(getattr(model, "config", None), "block_size", None)
    if block_size is None:
        raise TypeError(f"model must have a config.block_size (as attnlib.GPT has); got {type(model).__name__}")
    _token_data("train_data", train_data, block_size)
    _token_data("val_data", val_data, block_size)
    dev = check_device("device", config.device) if config.device else default_device()
    if dev.type == "cuda" and "LOCAL_RANK" in os.environ:
        dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    rank, world_size = distributed_context(dev)
    if config.batch_size % world_size:
        raise ValueError(f"batch_size={config.batch_size} is not divisible by the {world_size} processes")
    shard = slice(rank * config.batch_size // world_size, (rank + 1) * config.batch_size // world_size)
    model.to(dev)
    ddp_model = DistributedDataParallel(model) if world_size > 1 else model
    progress = progress and rank == 0
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay)
    generator = torch.Generator().manual_seed(config.seed)
    history = History()
    splits = {"train": train_data, "val": val_data}

    def evaluate(step: int) -> None:
        losses = estimate_loss(model, splits, config.batch_size, block_size, config.eval_iters, config.seed + 1, dev)
        history.steps.append(step)
        history.train_loss.append(losses["train"])
        history.val_loss.append(losses["val"])
        bar.set_postfix(train=f"{losses['train']:.3f}", val=f"{losses['val']:.3f}")

    start, eval_time = time.perf_counter(), 0.0
    model.train()
    with tqdm(range(config.max_iters), desc="training", disable=not progress, mininterval=2.0, ncols=90) as bar:
        for step in bar:
            if step % config.eval_interval == 0:
                t0 = time.perf_counter()
                evaluate(step)
                eval_time += time.perf_counter() - t0
            x, y = get_batch(train_data, config.batch_size, block_size, generator, dev)  # the global batch
            _, loss = ddp_model(x[shard], y[shard])  # this process's rows
            batch_loss = loss.detach()
            if world_size > 1:
                dist.all_reduce(batch_loss)
                batch_loss /= world_size  # equal shards: the mean of the means is the batch mean
            history.step_loss.append(batch_loss.item())
            if not math.isfinite(history.step_loss[-1]):
                raise FloatingPointError(f"loss became {history.step_loss[-1]} at step {step}; try a lower learning_rate")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DistributedDataParallel averages the gradients across processes here
            if config.grad_clip is not None:
                nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
            optimizer.step()
        t0 = time.perf_counter()
        evaluate(config.max_iters)
        eval_time += time.perf_counter() - t0
    history.elapsed_s = time.perf_counter() - start
    train_time = history.elapsed_s - eval_time
    history.tokens_per_s = config.max_iters * config.batch_size * block_size / max(train_time, 1e-9)
    return history


def _parser() -> argparse.ArgumentParser:
    from attnlib import _cli
    from attnlib.models.config import GPTConfig

    m, t = GPTConfig(), TrainConfig()
    p = argparse.ArgumentParser(prog="python -m attnlib.train", description=main.__doc__)
    for flag, kind, default in [
        ("--attention", str, m.attention), ("--d-model", _cli.positive_int, m.d_model),
        ("--n-heads", _cli.positive_int, m.n_heads), ("--n-kv-heads", _cli.positive_int, None),
        ("--n-layers", _cli.positive_int, m.n_layers), ("--block-size", _cli.positive_int, m.block_size),
        ("--dropout", _cli.fraction, m.dropout), ("--batch-size", _cli.positive_int, t.batch_size),
        ("--max-iters", _cli.positive_int, t.max_iters), ("--eval-interval", _cli.positive_int, t.eval_interval),
        ("--eval-iters", _cli.positive_int, t.eval_iters), ("--lr", _cli.positive_float, t.learning_rate),
        ("--seed", _cli.nonnegative_int, t.seed), ("--device", _cli.device, None),
        ("--temperature", _cli.nonnegative_float, 1.0), ("--top-k", _cli.positive_int, None),
        ("--top-p", _cli.top_p, None),
    ]:
        p.add_argument(flag, type=kind, default=default, help=f"default: {default}")
    p.add_argument("--max-new-tokens", "--sample-tokens", dest="max_new_tokens", type=_cli.nonnegative_int,
                   default=300, help="characters to sample after training (default: 300)")
    p.add_argument("--data-dir", default=None, help="directory holding tinyshakespeare.txt")
    p.add_argument("--out", type=_cli.output_dir, default=None, help="directory for model.pt and history.json")
    return p


def main(argv: list[str] | None = None) -> History:
    """Command line: train a character GPT on Tiny Shakespeare, print losses and a sample.

    Every flag (sizes, rates, sampling, device, output directory) is checked before training: exit 2.
    """
    from attnlib.data import FILENAME, load_char_corpus
    from attnlib.models.config import GPTConfig
    from attnlib.models.decoder import GPT

    p = _parser()
    args = p.parse_args(argv)
    try:
        if args.data_dir is not None and not (Path(args.data_dir) / FILENAME).is_file():
            raise FileNotFoundError(f"Tiny Shakespeare not found: no {FILENAME} in {args.data_dir}")
        corpus = load_char_corpus(args.data_dir)
    except (OSError, ValueError) as e:
        p.error(f"argument --data-dir: {e}")
    if args.top_k is not None and args.top_k > corpus.vocab_size:
        p.error(f"argument --top-k: {args.top_k} exceeds the vocabulary ({corpus.vocab_size} characters)")
    try:
        model_config = GPTConfig(vocab_size=corpus.vocab_size, block_size=args.block_size, n_layers=args.n_layers,
                                 n_heads=args.n_heads, d_model=args.d_model, n_kv_heads=args.n_kv_heads,
                                 dropout=args.dropout, attention=args.attention)
        config = TrainConfig(batch_size=args.batch_size, max_iters=args.max_iters, eval_interval=args.eval_interval,
                             eval_iters=args.eval_iters, learning_rate=args.lr, seed=args.seed, device=args.device)
    except (TypeError, ValueError) as e:
        p.error(str(e))
    torch.manual_seed(args.seed)
    model = GPT(model_config)
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        print(f"{model.num_parameters():,} parameters; training on {config.device or default_device()}")
    history = train(model, corpus.train, corpus.val, config)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    if rank != 0:
        return history
    for step, tr, va in zip(history.steps, history.train_loss, history.val_loss):
        print(f"step {step:5d}: train loss {tr:.4f}, val loss {va:.4f}")
    print(f"{history.elapsed_s:.1f} s, {history.tokens_per_s:,.0f} training tokens/s")
    if args.out:  # saved before sampling: the trained model is kept whatever happens next
        args.out.mkdir(parents=True, exist_ok=True)
        save_checkpoint(args.out / "model.pt", model.cpu(), chars="".join(corpus.tokenizer.chars))
        history.to_json(args.out / "history.json")
        print(f"saved {args.out / 'model.pt'} and {args.out / 'history.json'}")
    start = torch.tensor([corpus.tokenizer.encode("\n")], device=next(model.parameters()).device)
    sample = model.generate(start, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, generator=torch.Generator(start.device).manual_seed(args.seed))
    print(corpus.tokenizer.decode(sample[0].tolist()))
    return history


if __name__ == "__main__":
    main()
