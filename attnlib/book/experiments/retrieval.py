"""Chapter 22's experiment: can a small model still find a fact far back (a passkey retrieval test)?

``python -m attnlib.book.experiments.retrieval [--seeds S ...] [--max-iters N] [--out FILE]`` trains
small Llama-style :class:`attnlib.Decoder` models (chapter 17's size: 4 layers, width 64, 4 heads) on Tiny
Shakespeare in which a *needle* is hidden: a marker token and a passkey of :data:`KEY_LEN` digits, placed
at a random depth of the text; later a query marker asks for the passkey, and the model must write its
digits (the task of Mohtashami & Jaggi 2023, "Landmark Attention", §4.2, and of the needle-in-a-haystack
tests). The passkey's digits and the two markers are tokens of their own, after the corpus's characters.

Training (:func:`training_batch`): sequences of the training context ``L`` (default 64); the query ends
at a random position, the needle sits at a random depth before it, text fills the rest. The loss is the
mean next-character cross-entropy of the text plus the mean cross-entropy of the answer's digits (the
needle's own digits and the query marker, which cannot be predicted, are left out).

Models (:data:`MODELS`), each trained from every seed: RoPE (base 10,000), RoPE with its base raised to
500,000 *before* training (as Llama 3 and Qwen do), ALiBi and no positions (NoPE).

Evaluation (:func:`passkey_batch`): the haystack is validation text, the needle at depth ``d`` (the share of
the haystack before it: 0 = first, 1 = just before the query), the query at the end; the lengths are
``L/2 .. 8L`` and a trial counts as found when every digit is the argmax (teacher-forced, which equals
greedy decoding's exact match). :data:`METHODS` lists what is compared:

* the trained models as they are, and RoPE with linear, dynamic-NTK and YaRN scaling applied at
  evaluation only (chapter 17);
* the RoPE model reading through a cache of :data:`BUDGET` positions per layer (chapter 17's window, 4
  sinks + a window; H2O and SnapKV, chapter 22): the haystack is read first (the prompt), the query and
  the answer are decoded one token at a time (the question comes after the cache was compressed);
  ``*_query_in_prompt`` put the query in the prompt instead (the setting SnapKV was designed for);
* the RoPE model through quantised caches (int8 per token and head; KIVI with 4 and 2 bits).

With the caches it also measures the next-character loss of plain validation text read one character at a
time past the budget (:func:`budget_loss`). Everything goes to one JSON file (default: the package's
``retrieval.json``, read by chapter 22 with ``attnlib.book.results.load("retrieval")``). The committed run
(about 12 minutes a seed on one thread; the seeds ran side by side, then were merged)::

    python -m attnlib.book.experiments.retrieval --seeds 1337 --out s1337.json
    python -m attnlib.book.experiments.retrieval --seeds 1338 --out s1338.json
    python -m attnlib.book.experiments.retrieval --seeds 1339 --merge-with s1337.json s1338.json \
        --out attnlib/book/results/retrieval.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F

from attnlib import _cli
from attnlib.book.experiments.long_context import MODEL, MODERN, _evaluator, rope_scaling_for
from attnlib.cache import KVCache
from attnlib.data import load_char_corpus
from attnlib.models import Decoder, DecoderConfig

__all__ = ["BUDGET", "DEPTHS", "KEY_LEN", "METHODS", "MODELS", "answer_logits", "bounded_cache", "budget_loss", "found", "main", "merge", "model_config",
           "passkey_batch", "special_tokens", "train_passkey", "training_batch"]

KEY_LEN = 4
#: The models trained: (position, rope_base).
MODELS = {"rope": ("rope", 10_000.0), "rope_base": ("rope", 500_000.0), "alibi": ("alibi", 10_000.0),
          "nope": ("nope", 10_000.0)}
#: Needle depths (share of the haystack before the needle) and lengths (multiples of the context L).
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
FACTORS = (0.5, 1, 2, 4, 8)
#: Positions per layer kept by the window, sink and eviction caches (half the training context by default).
BUDGET = 32
SINKS = 4
#: Every method: (model, RoPE scaling, cache).
METHODS = {
    "rope": ("rope", "none", None), "rope_linear": ("rope", "linear", None),
    "rope_dynamic": ("rope", "dynamic", None), "rope_yarn": ("rope", "yarn", None),
    "rope_base": ("rope_base", "none", None), "rope_base_yarn": ("rope_base", "yarn", None),
    "alibi": ("alibi", "none", None), "nope": ("nope", "none", None),
    "window": ("rope", "none", "window"), "sinks": ("rope", "none", "sinks"),
    "h2o": ("rope", "none", "h2o"), "snapkv": ("rope", "none", "snapkv"),
    "h2o_query_in_prompt": ("rope", "none", "h2o"), "snapkv_query_in_prompt": ("rope", "none", "snapkv"),
    "int8": ("rope", "none", "int8"), "kivi4": ("rope", "none", "kivi4"), "kivi2": ("rope", "none", "kivi2"),
}
TRAINING = dict(batch_size=16, learning_rate=1e-3, weight_decay=0.1, grad_clip=1.0)


def special_tokens(text_vocab: int) -> tuple[int, int, int]:
    """The needle marker, the query marker and the first digit's token ids after ``text_vocab`` characters."""
    return text_vocab, text_vocab + 1, text_vocab + 2


def model_config(text_vocab: int, block_size: int, name: str) -> DecoderConfig:
    """The configuration of model ``name`` (a key of :data:`MODELS`): chapter 17's, 12 more tokens."""
    position, base = MODELS[name]
    return DecoderConfig.llama(vocab_size=text_vocab + 12, block_size=block_size, position=position, **MODEL,
                               **{**MODERN, "rope_base": base})


def _needle_rows(text: torch.Tensor, n: int, hay: int, depth: torch.Tensor, generator: torch.Generator,
                 text_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` rows of ``hay`` characters of ``text`` with a needle inserted at ``depth`` of each, then the
    query marker and the passkey: ``(n, hay + 2 * (KEY_LEN + 1))`` tokens and the ``(n, KEY_LEN)`` keys."""
    needle, query, digit0 = special_tokens(text_vocab)
    starts = torch.randint(len(text) - hay, (n,), generator=generator)
    keys = digit0 + torch.randint(10, (n, KEY_LEN), generator=generator)
    offsets = (depth * hay).round().long()
    rows = []
    for start, key, offset in zip(starts.tolist(), keys, offsets.tolist()):
        haystack = text[start : start + hay]
        mark = torch.tensor([needle]), torch.tensor([query])
        rows.append(torch.cat([haystack[:offset], mark[0], key, haystack[offset:], mark[1], key]))
    return torch.stack(rows), keys


def passkey_batch(text: torch.Tensor, n: int, length: int, depth: float, generator: torch.Generator,
                  text_vocab: int) -> torch.Tensor:
    """``(n, length)`` int64 evaluation rows: haystack, needle at ``depth``, query marker, passkey last."""
    hay = length - 2 * (KEY_LEN + 1)
    if hay < 1:
        raise ValueError(f"length={length} leaves no haystack (expected > {2 * (KEY_LEN + 1)})")
    return _needle_rows(text, n, hay, torch.full((n,), float(depth)), generator, text_vocab)[0]


def training_batch(text: torch.Tensor, batch_size: int, L: int, generator: torch.Generator,
                   text_vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One training batch: inputs ``(B, L)``, targets ``(B, L)`` (-100 where unpredictable) and a bool
    ``(B, L)`` mask of the targets that are the answer's digits."""
    block = 2 * (KEY_LEN + 1)
    end = int(torch.randint(block + 8, L + 2, (1,), generator=generator))  # one query end per batch
    hay = end - block
    rows, _ = _needle_rows(text, batch_size, hay, torch.rand(batch_size, generator=generator), generator,
                           text_vocab)
    tail_starts = torch.randint(len(text) - L, (batch_size,), generator=generator)
    tail = torch.stack([text[s : s + L + 1 - end] for s in tail_starts.tolist()])
    seq = torch.cat([rows, tail], dim=1)  # (B, L + 1)
    x, y = seq[:, :-1], seq[:, 1:].clone()
    needle, query, digit0 = special_tokens(text_vocab)
    answer = torch.zeros_like(y, dtype=torch.bool)
    answer[:, end - KEY_LEN - 1 : end - 1] = True
    is_digit = y >= digit0
    y[(is_digit & ~answer) | (y == query)] = -100  # the needle's own digits and the query: unpredictable
    return x, y, answer


def train_passkey(model: Decoder, text: torch.Tensor, text_vocab: int, max_iters: int, seed: int,
                  log_every: int = 0) -> dict:
    """Train ``model`` on :func:`training_batch` es; returns the losses logged every ``log_every`` steps."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=TRAINING["learning_rate"],
                                  weight_decay=TRAINING["weight_decay"])
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, TRAINING["learning_rate"], total_steps=max_iters,
                                                   pct_start=0.05, final_div_factor=10.0)
    L, log = model.config.block_size, {"steps": [], "text_loss": [], "answer_loss": []}
    model.train()
    for step in range(1, max_iters + 1):
        x, y, answer = training_batch(text, TRAINING["batch_size"], L, generator, text_vocab)
        logits = model(x)[0]
        text_loss = F.cross_entropy(logits[~answer], y[~answer], ignore_index=-100)
        answer_loss = F.cross_entropy(logits[answer], y[answer])
        optimizer.zero_grad(set_to_none=True)
        (text_loss + answer_loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), TRAINING["grad_clip"])
        optimizer.step()
        schedule.step()
        if log_every and (step % log_every == 0 or step == max_iters):
            log["steps"].append(step)
            log["text_loss"].append(round(text_loss.item(), 4))
            log["answer_loss"].append(round(answer_loss.item(), 4))
    return log


def bounded_cache(model: Decoder, kind: str, budget: int = BUDGET, block_size: int | None = None) -> KVCache:
    """The cache ``kind`` of the methods: ``"window"`` (``budget`` recent positions), ``"sinks"`` (:data:`SINKS`
    sinks and ``budget - SINKS`` recent), ``"h2o"``, ``"snapkv"`` (``budget`` positions per layer and head; SnapKV's
    observation window 8) or ``"int8"``, ``"kivi4"``, ``"kivi2"`` (every position; KIVI's G = R = 16)."""
    block_size = model.config.block_size if block_size is None else block_size
    if kind == "window":
        return KVCache.streaming(model, window=budget, n_sink=0, block_size=block_size)
    if kind == "sinks":
        return KVCache.streaming(model, window=budget - SINKS, n_sink=SINKS, block_size=block_size)
    if kind in ("h2o", "snapkv"):
        return KVCache.eviction(model, kind, budget=budget, window=8, block_size=block_size)
    return KVCache.quantized(model, kind, group_size=16, residual_length=16, block_size=block_size)


@torch.no_grad()
def answer_logits(model: Decoder, rows: torch.Tensor, kv: KVCache | None = None,
                  query_in_prompt: bool = False) -> torch.Tensor:
    """``(n, KEY_LEN, vocab)``: the logits predicting the passkey of ``rows`` (from :func:`passkey_batch`).

    Without ``kv`` one forward pass; with a cache, the prompt (the haystack, and the query marker when
    ``query_in_prompt``) is read at once into it, then the rest one token at a time.
    """
    T = rows.shape[1]
    if kv is None:
        return model(rows)[0][:, T - KEY_LEN - 1 : T - 1]
    prompt = T - KEY_LEN - (0 if query_in_prompt else 1)
    steps = [model(rows[:, :prompt], cache=kv)[0][:, -1:]]
    steps += [model(rows[:, t : t + 1], cache=kv)[0] for t in range(prompt, T - 1)]
    return torch.cat(steps, dim=1)[:, -KEY_LEN:]


def found(model: Decoder, rows: torch.Tensor, cache: str | None = None, budget: int = BUDGET,
          query_in_prompt: bool = False) -> torch.Tensor:
    """``(n,)`` bool: every passkey digit of ``rows`` is the argmax, read whole (``cache=None``) or through
    :func:`bounded_cache` ``(cache, budget)`` as :func:`answer_logits` reads it."""
    kv = None if cache is None else bounded_cache(model, cache, budget)
    logits = answer_logits(model, rows, kv, query_in_prompt)
    return (logits.argmax(-1) == rows[:, -KEY_LEN:]).all(-1)


@torch.no_grad()
def budget_loss(model: Decoder, text: torch.Tensor, cache: str | None, budget: int = BUDGET, n: int = 16,
                prompt: int = 8, seed: int = 0) -> float:
    """Mean next-character loss (nats) of ``n`` windows of ``text`` of the model's context, read ``prompt``
    characters at once and then one at a time through ``cache`` (``None``: the full cache), over the
    positions past ``budget`` (where a bounded cache has dropped something).

    Raises:
        ValueError: ``budget`` outside ``[prompt, block_size)`` (no position would be past it).
    """
    L = model.config.block_size
    if not prompt <= budget < L:
        raise ValueError(f"budget={budget} must be in [prompt, block_size) = [{prompt}, {L}): the loss is taken "
                         "past the budget")
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(len(text) - L - 1, (n,), generator=generator)
    rows = torch.stack([text[s : s + L + 1] for s in starts.tolist()])
    kv = KVCache.for_model(model) if cache is None else bounded_cache(model, cache, budget, L)
    logits = [model(rows[:, :prompt], cache=kv)[0]]
    logits += [model(rows[:, t : t + 1], cache=kv)[0] for t in range(prompt, L)]
    logits = torch.cat(logits, dim=1)[:, budget:]
    return F.cross_entropy(logits.flatten(0, 1), rows[:, budget + 1 :].flatten()).item()


def evaluate(models: dict[str, Decoder], text: torch.Tensor, text_vocab: int, L: int, trials: int,
             seed: int, methods: list[str]) -> dict:
    """Accuracy per method: ``{method: [[share found at each depth] for each length]}``."""
    accuracy = {}
    for name in methods:
        kind, scaling, cache = METHODS[name]
        if kind not in models:
            continue
        table = []
        for factor in FACTORS:
            T = int(L * factor)
            rope = MODELS[kind][0] == "rope"
            scaled = rope_scaling_for(scaling, factor, L) if rope else None
            evaluator = _evaluator(models[kind], max(T, L), scaled)
            row = []
            for i, depth in enumerate(DEPTHS):
                generator = torch.Generator().manual_seed(seed * 1000 + int(factor * 16) * 10 + i)
                rows = passkey_batch(text, trials, T, depth, generator, text_vocab)
                hits = found(evaluator, rows, cache, query_in_prompt=name.endswith("query_in_prompt"))
                row.append(round(hits.float().mean().item(), 4))
            table.append(row)
        accuracy[name] = table
        print(f"  {name:24s} " + "  ".join(f"{sum(r) / len(r):.2f}" for r in table), flush=True)
    return accuracy


#: What may differ between merged runs.
_RUN_FREE = ("command", "by_seed", "threads", "commands")


def merge(first: dict, others: list[dict]) -> dict:
    """``first`` with the seeds of ``others`` added; every setting but the command and threads must agree.

    Raises:
        ValueError: a setting that differs (named), or a seed that two runs both hold.
    """
    merged = {**first, "by_seed": dict(first["by_seed"]),
              "commands": [*first.get("commands", [first["command"]])]}
    for other in others:
        for key in sorted(set(first) | set(other)):
            if key not in _RUN_FREE and first.get(key) != other.get(key):
                raise ValueError(f"cannot merge: {key}={other.get(key)!r} differs from {first.get(key)!r}")
        twice = sorted(set(merged["by_seed"]) & set(other["by_seed"]))
        if twice:
            raise ValueError(f"cannot merge: seeds {twice} are in both runs")
        merged["by_seed"].update(other["by_seed"])
        merged["commands"] += other.get("commands", [other["command"]])
    return merged


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m attnlib.book.experiments.retrieval", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=_cli.positive_int, default=64, help="training context L (default 64)")
    parser.add_argument("--max-iters", type=_cli.positive_int, default=2000, help="optimiser steps per model")
    parser.add_argument("--models", type=_cli.name_list(list(MODELS)), default=list(MODELS),
                        help=f"comma-separated models to train (default {','.join(MODELS)})")
    parser.add_argument("--seeds", type=_cli.seed, nargs="+", default=[1337, 1338, 1339])
    parser.add_argument("--trials", type=_cli.positive_int, default=32,
                        help="passkeys per (length, depth) cell and seed (default 32)")
    parser.add_argument("--threads", type=_cli.positive_int, default=1,
                        help="torch threads (default 1: several runs side by side on a busy machine)")
    parser.add_argument("--merge-with", type=Path, nargs="+", default=[], metavar="FILE",
                        help="results of other seeds (same settings) to add to this run's file")
    parser.add_argument("--out", type=_cli.output_file, default="attnlib/book/results/retrieval.json")
    args = parser.parse_args(argv)
    if args.context <= BUDGET:
        parser.error(f"argument --context: {args.context} is not above the caches' budget of {BUDGET} positions "
                     f"(expected > {BUDGET})")
    missing = [str(f) for f in args.merge_with if not f.is_file()]
    if missing:
        parser.error(f"argument --merge-with: no results file at {', '.join(missing)}")
    torch.set_num_threads(args.threads)
    corpus = load_char_corpus()
    text_vocab, L = corpus.vocab_size, args.context
    given = sys.argv[1:] if argv is None else argv
    results = {"command": " ".join(["python -m attnlib.book.experiments.retrieval", *given]), "context": L,
               "factors": list(FACTORS), "depths": list(DEPTHS), "key_len": KEY_LEN, "budget": BUDGET,
               "sinks": SINKS, "model": MODEL, "training": {**TRAINING, "max_iters": args.max_iters},
               "trials": args.trials, "threads": args.threads, "by_seed": {}}
    for seed in args.seeds:
        run = {"train_seconds": {}, "log": {}, "val_loss": {}}
        models = {}
        for name in args.models:
            torch.manual_seed(seed)
            model = Decoder(model_config(text_vocab, L, name))
            start = time.perf_counter()
            run["log"][name] = train_passkey(model, corpus.train, text_vocab, args.max_iters, seed, log_every=100)
            run["train_seconds"][name] = round(time.perf_counter() - start, 1)
            models[name] = model.eval()
            run["val_loss"][name] = budget_loss(models[name], corpus.val, None)
            print(f"seed {seed} {name}: answer loss {run['log'][name]['answer_loss'][-1]:.3f}, "
                  f"val {run['val_loss'][name]:.3f} in {run['train_seconds'][name]:.0f} s", flush=True)
        run["accuracy"] = evaluate(models, corpus.val, text_vocab, L, args.trials, seed, list(METHODS))
        if "rope" in models:
            run["budget_loss"] = {kind: budget_loss(models["rope"], corpus.val, None if kind == "full" else kind)
                                  for kind in ("full", "window", "sinks", "h2o", "snapkv", "int8", "kivi4",
                                               "kivi2")}
            print("  budget loss " + ", ".join(f"{k} {v:.3f}" for k, v in run["budget_loss"].items()), flush=True)
        results["by_seed"][str(seed)] = run
        _cli.write_json(args.out, results, indent=None, newline=False)  # after each seed: a partial file
    if args.merge_with:
        results = merge(results, [json.loads(Path(f).read_text()) for f in args.merge_with])
        _cli.write_json(args.out, results, indent=None, newline=False)
    print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
