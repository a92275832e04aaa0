"""KV-cache quantisation and eviction measured on the book's trained models. Chapter 22.

``python -m attnlib.book.experiments.kv_compression [--max-iters N] [--rows N] [--threads 1] [--out FILE]``
trains two models on Tiny Shakespeare, each as its chapter does (``torch.manual_seed(1337)``, then
:func:`attnlib.train.train` with batch 16, 3000 AdamW steps at lr 1e-3, evaluation every 500 steps on 50
batches, seed 1337):

* ``gpt``: chapter 12's GPT, ``GPTConfig(vocab_size=65)`` (4 layers, 4 heads of 16, d_model 64, context 32,
  learned positions);
* ``llama``: chapter 16's decoder at the same sizes, :meth:`attnlib.DecoderConfig.llama` (RoPE, RMSNorm,
  SwiGLU, an untied head), with grouped-query attention of ``n_heads // 2`` key/value heads.

Each model then reads ``rows`` (128) held-out windows of ``block_size + 1`` validation tokens (random starts drawn
by a generator of seed ``data_seed``) through each cache: a prompt at once, then one teacher-forced token per
step (:func:`attnlib.bench.kv_quant.decode_logits`), and every decode step's logits are compared with those
read through the model's own float32 cache (:func:`attnlib.bench.kv_quant.logit_changes`). The schemes:

* every position kept, in fewer bits: ``bfloat16``; ``int8`` (a scale per token and key/value head);
  ``kivi4``, ``kivi2`` (KIVI, Liu et al. 2024: keys per channel over groups of G tokens, values per token,
  the last R or more tokens in float32), G = R = ``block_size // 4`` (8: the paper's 32 and 128 would
  leave this 32-token context unquantised);
* at a budget of ``block_size // 2`` positions per layer and key/value head: ``window`` (the last positions,
  :meth:`KVCache.streaming` with ``n_sink=0``), ``sinks`` (StreamingLLM: 4 sinks + the rest recent),
  ``h2o`` (H2O, Zhang et al. 2023: half recent, half heavy hitters by accumulated attention), ``snapkv``
  (SnapKV, Li et al. 2024: an observation window of ``block_size // 4`` prompt queries, kernel 5, avgpool).

Two prompts: ``block_size // 8`` tokens (the bounded caches fill while decoding) and ``3 * block_size // 4``
(past the budget, so every decode step reads a full budget; SnapKV compresses only a prompt, so with the
short one it keeps everything). Per model, prompt and scheme: ``bytes_per_token`` (one sequence, all
layers: :meth:`~attnlib.cache.KVCache.bytes_per_token`, scales, positions and H2O's scores included),
``cache_bytes`` (one sequence's cache as allocated at the end of the window), ``loss`` (mean cross-entropy
of the decode steps), ``dloss`` and ``dloss_stderr`` (the standard error of the tokens' paired loss
differences), ``max_abs_dlogit``, ``mean_abs_dlogit``, ``same_argmax``; an eviction scheme
also ``past_budget``: the same over the steps whose query position is >= the budget (before them a bounded
cache changes nothing).

The GPT's learned positions: :meth:`KVCache.streaming` refuses them (its sink cache renumbers positions and
needs RoPE), so the GPT's ``sinks`` row records the refusal, and its ``window`` row reads the GPT's weights in
a copy with ``sliding_window`` = the budget, whose layers keep a ring of that many positions (the same keys,
at their own positions); the row's ``cache`` says so.

The committed run (``attnlib/book/results/kv_compression.json``, read with
``attnlib.book.results.load("kv_compression")``)::

    OMP_NUM_THREADS=1 python -m attnlib.book.experiments.kv_compression
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict

import torch
from torch.nn import functional as F

from attnlib import _cli
from attnlib.bench.kv_quant import SCHEMES as QUANTIZED
from attnlib.bench.kv_quant import decode_logits, logit_changes, scheme_cache
from attnlib.book.experiments.compare_attention import _machine
from attnlib.cache import KVCache
from attnlib.data import get_batch, load_char_corpus
from attnlib.models import Decoder, DecoderConfig, GPTConfig
from attnlib.train import TrainConfig, train

__all__ = ["EVICTING", "MODELS", "QUANTIZED", "SCHEMES", "SIZES", "TRAINING", "build_cache", "main", "measure",
           "model_config", "protocol"]

MODELS = ("gpt", "llama")
EVICTING = ("window", "sinks", "h2o", "snapkv")
#: Every scheme, in the results' order: float32 (the reference) first.
SCHEMES = (*QUANTIZED, *EVICTING)
#: Chapter 12's GPT sizes (``GPTConfig``'s defaults), shared by both models.
SIZES = {name: getattr(GPTConfig, name) for name in ("block_size", "n_layers", "n_heads", "d_model")}
#: Chapter 12's training run (cell "train"), for both models.
TRAINING = dict(batch_size=16, max_iters=3000, eval_interval=500, eval_iters=50, learning_rate=1e-3, seed=1337)
N_SINK = 4
DEFAULT_OUT = "attnlib/book/results/kv_compression.json"


def model_config(name: str, vocab_size: int) -> DecoderConfig:
    """``"gpt"``: chapter 12's ``GPTConfig``; ``"llama"``: the Llama preset at its sizes, ``n_heads // 2`` kv heads.

    Raises:
        ValueError: a name not in :data:`MODELS`.
    """
    if name not in MODELS:
        raise ValueError(f"name={name!r} is not one of {MODELS}")
    if name == "gpt":
        return GPTConfig(vocab_size=vocab_size, **SIZES)
    return DecoderConfig.llama(vocab_size=vocab_size, **SIZES, n_kv_heads=SIZES["n_heads"] // 2)


def protocol(block_size: int) -> dict:
    """The measurement's sizes for a context of ``block_size`` (32: prompts 4 and 24, budget 16, G = R = 8)."""
    return dict(prompts=[max(1, block_size // 8), 3 * block_size // 4], budget=block_size // 2,
                group_size=block_size // 4, residual_length=block_size // 4, n_sink=N_SINK,
                h2o_recent=block_size // 4, snapkv_window=block_size // 4, kernel_size=5, pooling="avgpool")


def _fitted(model: Decoder, cache: KVCache) -> KVCache:
    """``cache``, once every layer's cache has accepted its layer (the check a forward pass runs first)."""
    for layer_cache, block in zip(cache.layers, model.blocks):
        layer_cache.check_layer(block.attn, masked=False)
    return cache


def build_cache(model: Decoder, scheme: str, settings: dict) -> tuple[Decoder, KVCache, str]:
    """``(reader, cache, description)``: an empty cache of ``scheme`` (one of :data:`SCHEMES`) with the sizes of
    ``settings`` (:func:`protocol`'s keys), and the model that reads through it (``model``, except the ring copy
    that serves ``window`` for a model without RoPE; see the module).

    Raises:
        ValueError: an unknown scheme; what the cache refuses (``sinks`` without RoPE), checked here.
    """
    budget = settings["budget"]
    if scheme in QUANTIZED:
        G, R = settings["group_size"], settings["residual_length"]
        kivi = f", group_size={G}, residual_length={R}" if scheme.startswith("kivi") else ""
        return model, scheme_cache(model, scheme, G, R), f"{scheme}{kivi}"
    if scheme == "h2o":
        recent = settings["h2o_recent"]
        return model, KVCache.eviction(model, "h2o", budget=budget, recent=recent), f"h2o, recent={recent}"
    if scheme == "snapkv":
        window, kernel, pooling = settings["snapkv_window"], settings["kernel_size"], settings["pooling"]
        cache = KVCache.eviction(model, "snapkv", budget=budget, window=window, kernel_size=kernel, pooling=pooling)
        return model, cache, f"snapkv, window={window}, kernel_size={kernel}, pooling={pooling}"
    if scheme == "sinks":
        n_sink = settings["n_sink"]
        return (model, _fitted(model, KVCache.streaming(model, window=budget - n_sink, n_sink=n_sink)),
                f"streaming, window={budget - n_sink}, n_sink={n_sink}")
    if scheme != "window":
        raise ValueError(f"scheme={scheme!r} is not one of {SCHEMES}")
    try:
        return (model, _fitted(model, KVCache.streaming(model, window=budget, n_sink=0)),
                f"streaming, window={budget}, n_sink=0")
    except ValueError as refusal:  # no RoPE: the same keys kept by a sliding-window copy's ring caches
        ring = Decoder(model.config.replace(sliding_window=budget)).eval()
        ring.load_state_dict(model.state_dict())
        return ring, ring.new_cache(), f"sliding_window={budget} copy, RingLayerCache (streaming refused: {refusal})"


@torch.no_grad()
def measure(model: Decoder, idx: torch.Tensor, prompt: int, settings: dict,
            schemes: tuple[str, ...] = SCHEMES) -> dict:
    """Per scheme, the row described in the module: ``idx`` ``(rows, T)`` read with a ``prompt``-token prefill,
    then one token per step; ``{"refused": message}`` for a cache the model cannot use.

    Raises:
        ValueError: an unknown scheme (before anything runs); ``prompt`` not in ``[1, T)``.
    """
    unknown = [s for s in schemes if s not in SCHEMES]
    if unknown:
        raise ValueError(f"schemes {unknown} are not among {SCHEMES}")
    if not 1 <= prompt < idx.shape[1]:
        raise ValueError(f"prompt={prompt} must be in [1, {idx.shape[1]}) for windows of {idx.shape[1]} tokens")
    targets = idx[:, prompt:]
    reference = decode_logits(model, model.new_cache(), idx, prompt)
    past = max(0, settings["budget"] + 1 - prompt)  # step i's query is at position prompt - 1 + i
    rows = {}
    for scheme in schemes:
        try:
            reader, cache, how = build_cache(model, scheme, settings)
        except ValueError as refusal:
            rows[scheme] = {"refused": str(refusal)}
            continue
        logits = decode_logits(reader, cache, idx, prompt)
        rows[scheme] = row = dict(cache=how, bytes_per_token=float(cache.bytes_per_token()),
                                  cache_bytes=cache.nbytes() // len(idx), **_changes(logits, reference, targets))
        if scheme in EVICTING:
            row["past_budget"] = None if past >= targets.shape[1] else dict(
                steps=targets.shape[1] - past, **_changes(logits[:, past:], reference[:, past:], targets[:, past:]))
    return rows


def _changes(logits: torch.Tensor, reference: torch.Tensor, targets: torch.Tensor) -> dict:
    """:func:`~attnlib.bench.kv_quant.logit_changes` and ``dloss_stderr``: the standard error of ``dloss``, the
    mean of the tokens' paired loss differences (their standard deviation over the square root of their count)."""
    def token_losses(x: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(x.flatten(0, 1), targets.flatten(), reduction="none")

    d = token_losses(logits) - token_losses(reference)
    stderr = d.std().item() / d.numel() ** 0.5 if d.numel() > 1 else float("nan")
    return dict(logit_changes(logits, reference, targets), dloss_stderr=stderr)


def _train(name: str, corpus, training: TrainConfig) -> tuple[Decoder, dict]:
    torch.manual_seed(training.seed)
    model = Decoder(model_config(name, corpus.vocab_size))
    start = time.perf_counter()
    history = train(model, corpus.train, corpus.val, training, progress=False)
    record = dict(config=model.config.to_dict(), parameters=model.num_parameters(),
                  train_seconds=round(time.perf_counter() - start, 1), steps=history.steps,
                  val_loss=history.val_loss, final_val_loss=history.val_loss[-1])
    return model.eval(), record


def main(argv: list[str] | None = None) -> dict:
    """Command line: train both models, measure every scheme, write the results file (flags checked first)."""
    parser = argparse.ArgumentParser(prog="python -m attnlib.book.experiments.kv_compression", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-iters", type=_cli.positive_int, default=TRAINING["max_iters"],
                        help=f"optimiser steps per model (default {TRAINING['max_iters']}, chapter 12's)")
    parser.add_argument("--rows", type=_cli.positive_int, default=128,
                        help="held-out windows read (default 128)")
    parser.add_argument("--data-seed", type=_cli.seed, default=0, help="seed of the windows' starts (default 0)")
    parser.add_argument("--threads", type=_cli.positive_int, default=1, help="torch threads (default 1)")
    parser.add_argument("--out", type=_cli.output_file, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    block_size = SIZES["block_size"]
    settings = protocol(block_size)
    corpus = load_char_corpus()
    if len(corpus.val) <= block_size + 1:
        parser.error(f"the validation text ({len(corpus.val)} tokens) is not longer than one window of "
                     f"{block_size + 1}")
    training = TrainConfig(**{**TRAINING, "max_iters": args.max_iters}, device="cpu")
    given = sys.argv[1:] if argv is None else argv
    before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        results = {"command": " ".join(["python -m attnlib.book.experiments.kv_compression", *given]),
                   "meta": _machine(), "training": asdict(training), "sizes": dict(SIZES),
                   "protocol": dict(settings, rows=args.rows, data_seed=args.data_seed, window_tokens=block_size + 1,
                                    past_budget="decode steps whose query position is >= budget"),
                   "schemes": list(SCHEMES), "models": {}}
        idx = get_batch(corpus.val, args.rows, block_size + 1, torch.Generator().manual_seed(args.data_seed))[0]
        for name in MODELS:
            model, record = _train(name, corpus, training)
            print(f"{name}: val {record['final_val_loss']:.4f} after {record['train_seconds']:.0f} s", flush=True)
            record["by_prompt"] = {str(p): measure(model, idx, p, settings) for p in settings["prompts"]}
            results["models"][name] = record
            for p, rows in record["by_prompt"].items():
                for scheme, row in rows.items():
                    shown = (f"{row['bytes_per_token']:7.0f} B/token  loss {row['loss']:.4f} ({row['dloss']:+.4f} "
                             f"± {row['dloss_stderr']:.4f})  max|dlogit| {row['max_abs_dlogit']:.2e}"
                             ) if "loss" in row else "refused"
                    print(f"  prompt {p:>3s} {scheme:9s} {shown}", flush=True)
    finally:
        torch.set_num_threads(before)
    _cli.write_json(args.out, results)
    print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
