"""Chapter 17's experiment: how positions generalise past the training context.

``python -m attnlib.book.experiments.long_context [--max-iters N] [--out FILE]`` trains small
:class:`attnlib.Decoder` models (:meth:`~attnlib.DecoderConfig.llama`) on Tiny Shakespeare at a short context ``L`` (the same
size and optimiser budget as chapter 13's variants: 4 layers, width 64, 4 heads, batch 16)
with RoPE, ALiBi, learned positions and none ("nope"), then measures:

* validation loss by position at ``L``, ``2L``, ``4L`` and ``8L`` tokens, for RoPE without
  scaling and with linear (position interpolation), dynamic NTK and YaRN scaling (applied at
  evaluation only, no fine-tuning), and for ALiBi and no positions as trained (learned
  positions have no table past ``L``);
* a stream far longer than ``L`` through the RoPE model: loss with a window-only cache, with
  4 attention sinks + the window (StreamingLLM), and with recomputation of the last ``L``
  tokens at every step (the costly reference).

Everything is written to one JSON file (default: the package's ``long_context.json``, read by
chapter 17 with ``attnlib.book.results.load("long_context")``).
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from attnlib import _cli
from attnlib.cache import KVCache
from attnlib.data import get_batch, load_char_corpus
from attnlib.models import Decoder, DecoderConfig
from attnlib.train import TrainConfig, train

__all__ = ["POSITION_KINDS", "SCALINGS", "loss_by_position", "main", "model_config", "rope_scaling_for", "stream_losses"]

POSITION_KINDS = ("rope", "alibi", "learned", "nope")
SCALINGS = ("none", "linear", "dynamic", "yarn")
#: Evaluation lengths, in multiples of the training context; sinks of the streaming test.
FACTORS, STREAM_SINKS = (1, 2, 4, 8), 4
MODEL = dict(n_layers=4, n_heads=4, d_model=64)
#: The committed run's models were attnlib 1.x's ``ModernConfig``, whose defaults differ from
#: :meth:`DecoderConfig.llama`'s in RMSNorm's epsilon; given here with the rest of its choices.
MODERN = dict(norm_eps=1e-6, tie_embeddings=False, bias=False, dropout=0.0, rope_base=10000.0, qk_norm=False)


def model_config(vocab_size: int, block_size: int, position: str) -> DecoderConfig:
    """The configuration of the model trained with ``position`` at context ``block_size``."""
    return DecoderConfig.llama(vocab_size=vocab_size, block_size=block_size, position=position, **MODEL, **MODERN)


def rope_scaling_for(kind: str, factor: float, trained: int) -> dict | None:
    """The ``rope_scaling`` dict of ``kind`` for evaluating at ``factor`` times the trained context."""
    if kind == "none" or factor <= 1:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "dynamic":  # base grows with the sequence once it passes `trained` (max_position_embeddings)
        return {"rope_type": "dynamic", "factor": 1.0}
    return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": trained}


def _evaluator(model: Decoder, T: int, scaling: dict | None) -> Decoder:
    """The trained weights in a model of context ``T`` (and RoPE scaling); RoPE's buffers are not weights."""
    config = model.config.replace(block_size=T, rope_scaling=scaling)
    evaluator = Decoder(config).eval()
    evaluator.load_state_dict(model.state_dict())
    if scaling is not None and scaling["rope_type"] == "dynamic":  # dynamic NTK keys off the trained length
        evaluator.rope.max_position_embeddings = model.config.block_size  # (the layers share this module)
    return evaluator


@torch.no_grad()
def loss_by_position(model: Decoder, data: torch.Tensor, T: int, batches: int = 8, batch_size: int = 8,
                     seed: int = 0) -> list[float]:
    """Mean cross-entropy (nats) at each position ``0..T-1`` of ``batches`` random windows of ``data``."""
    generator = torch.Generator().manual_seed(seed)
    total = torch.zeros(T)
    for _ in range(batches):
        x, y = get_batch(data, batch_size, T, generator)
        logits = model(x)[0]
        total += torch.nn.functional.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(0)
    return (total / batches).tolist()


@torch.no_grad()
def stream_losses(model: Decoder, tokens: torch.Tensor, window: int, n_sink: int) -> list[float]:
    """Per-token loss of ``tokens`` (1-D) read one token at a time through a sink (or window-only) cache."""
    cache = KVCache.streaming(model, window=window, n_sink=n_sink, block_size=len(tokens) + 1)
    losses = []
    for t in range(len(tokens) - 1):
        logits = model(tokens[t : t + 1].view(1, 1), cache=cache)[0][0, -1]
        losses.append(torch.nn.functional.cross_entropy(logits, tokens[t + 1]).item())
    return losses


@torch.no_grad()
def recompute_losses(model: Decoder, tokens: torch.Tensor) -> list[float]:
    """Per-token loss when every step re-reads the last ``block_size`` tokens from scratch (the reference)."""
    L, losses = model.config.block_size, []
    for t in range(len(tokens) - 1):
        logits = model(tokens[max(0, t + 1 - L) : t + 1].view(1, -1), last_only=True)[0][0, -1]
        losses.append(torch.nn.functional.cross_entropy(logits, tokens[t + 1]).item())
    return losses


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m attnlib.book.experiments.long_context", description=__doc__)
    parser.add_argument("--context", type=_cli.positive_int, default=32,
                        help="training context L (default 32, the committed run's; chapter 12's block_size)")
    parser.add_argument("--max-iters", type=_cli.positive_int, default=5000,
                        help="optimiser steps per model (chapter 13: 5000)")
    parser.add_argument("--positions", type=_cli.name_list(POSITION_KINDS), default=list(POSITION_KINDS),
                        help=f"comma-separated models to train (default {','.join(POSITION_KINDS)})")
    parser.add_argument("--stream", type=_cli.positive_int, default=1024, help="tokens in the streaming test")
    parser.add_argument("--seed", type=_cli.seed, default=1337)
    parser.add_argument("--out", type=_cli.output_file, default="attnlib/book/results/long_context.json")
    args = parser.parse_args(argv)
    kinds = args.positions
    if "rope" in kinds and args.context <= STREAM_SINKS:  # the sink cache keeps 4 sinks + a window of L - 4
        parser.error(f"argument --context: {args.context} leaves no window beside the {STREAM_SINKS} sinks of the "
                     f"streaming test (expected > {STREAM_SINKS} with rope)")
    corpus = load_char_corpus()
    longest = args.context * max(FACTORS)
    if longest >= len(corpus.val):  # checked before any training
        parser.error(f"argument --context: {args.context} x {max(FACTORS)} = {longest} positions is longer than the "
                     f"validation text ({len(corpus.val)} tokens)")
    if "rope" in kinds and args.stream >= len(corpus.val):
        parser.error(f"argument --stream: {args.stream} tokens is longer than the validation text "
                     f"({len(corpus.val)} tokens; expected < {len(corpus.val)})")
    L, factors = args.context, FACTORS
    given = sys.argv[1:] if argv is None else argv
    results = {"command": " ".join(["python -m attnlib.book.experiments.long_context", *given]),
               "context": L, "factors": list(factors), "model": MODEL, "max_iters": args.max_iters,
               "threads": torch.get_num_threads(), "curves": {}, "train_seconds": {}, "final_val_loss": {}}
    models = {}
    for kind in kinds:
        torch.manual_seed(args.seed)
        model = Decoder(model_config(corpus.vocab_size, L, kind))
        start = time.perf_counter()
        history = train(model, corpus.train, corpus.val, TrainConfig(max_iters=args.max_iters, eval_interval=500,
                                                                      eval_iters=50, seed=args.seed), progress=False)
        results["train_seconds"][kind] = round(time.perf_counter() - start, 1)
        results["final_val_loss"][kind] = history.val_loss[-1]
        models[kind] = model.eval()
        print(f"{kind}: val {history.val_loss[-1]:.3f} in {results['train_seconds'][kind]:.0f} s", flush=True)
    for kind, model in models.items():
        for f in factors:
            scalings = SCALINGS if kind == "rope" and f > 1 else ("none",)
            if kind == "learned" and f > 1:
                continue  # no position table past L
            for scaling in scalings:
                evaluator = _evaluator(model, L * f, rope_scaling_for(scaling, f, L))
                curve = loss_by_position(evaluator, corpus.val, L * f)
                results["curves"][f"{kind}/{scaling}/{f}"] = curve
                print(f"{kind:7s} {scaling:8s} x{f}: mean {sum(curve) / len(curve):.3f}", flush=True)
    if "rope" in models:
        tokens = corpus.val[: args.stream + 1]
        model = models["rope"]
        results["stream"] = {
            "tokens": args.stream,
            "window_only": stream_losses(model, tokens, window=L, n_sink=0),
            "sinks": stream_losses(model, tokens, window=L - STREAM_SINKS, n_sink=STREAM_SINKS),
            "recompute": recompute_losses(model, tokens),
        }
    _cli.write_json(args.out, results, indent=None, newline=False)  # atomic: the old file stays if this fails
    print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
