"""Chapter 19's experiment: speculative decoding with a trained draft and a trained target.

``python -m attnlib.book.experiments.speculative [--max-iters N] [--out FILE]`` trains two GPTs on
Tiny Shakespeare (characters): a target (4 layers, width 128) and a draft (1 layer, width 32), then,
for prompts from the validation text, measures per ``n_draft`` and temperature: the acceptance rate,
tokens per target pass, tokens/s of plain decoding and of :func:`attnlib.generation.speculative_generate`
(one thread; medians of ``--repeats`` rounds alternating the two), and whether greedy output equals the
target's own. Results go to one JSON file (default:
the package's ``speculative.json``, read by chapter 19 with ``attnlib.book.results.load("speculative")``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from attnlib import _cli
from attnlib.bench._common import time_calls
from attnlib.data import load_char_corpus
from attnlib.generation import speculative_generate
from attnlib.models import GPT, GPTConfig
from attnlib.train import TrainConfig, train

__all__ = ["DRAFT", "TARGET", "main"]

TARGET = dict(n_layers=4, n_heads=4, d_model=128, block_size=128)
DRAFT = dict(n_layers=1, n_heads=2, d_model=32, block_size=128)
#: Tokens of each prompt, cut from the validation text.
PROMPT_LEN = 32


def measure(target, draft, prompts, new_tokens, n_draft, temperature, seed=0, repeats=5) -> dict:
    """Acceptance and speed over ``prompts`` (each ``(1, T)``) for one setting.

    The counts come from one pass over the prompts; the times are medians of ``repeats`` rounds
    that alternate plain and speculative decoding (:func:`attnlib.bench.time_calls`), each round
    with the same seeded generator, so a change in the machine's load hits both alike.
    """

    def plain():
        g = torch.Generator().manual_seed(seed)
        return [target.generate(p, new_tokens, temperature=temperature, generator=g) for p in prompts]

    def speculative():
        g = torch.Generator().manual_seed(seed)
        return [speculative_generate(target, draft, p, new_tokens, n_draft=n_draft, temperature=temperature,
                                     generator=g, return_stats=True) for p in prompts]

    plain_out, spec_out = plain(), speculative()
    totals = {k: sum(st[k] for _, st in spec_out) for k in ("drafted", "accepted", "target_calls")}
    same = all(torch.equal(out, ref) for (out, _), ref in zip(spec_out, plain_out))
    seconds = time_calls({"plain": plain, "speculative": speculative}, repeats=repeats, warmup=0)
    n = len(prompts) * new_tokens
    return dict(n_draft=n_draft, temperature=temperature, acceptance_rate=totals["accepted"] / totals["drafted"],
                tokens_per_target_call=n / totals["target_calls"], plain_tokens_per_s=n / seconds["plain"],
                speculative_tokens_per_s=n / seconds["speculative"], speedup=seconds["plain"] / seconds["speculative"],
                same_as_target_greedy=same if temperature == 0 else None)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m attnlib.book.experiments.speculative",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--max-iters", type=_cli.positive_int, default=1500)
    parser.add_argument("--new-tokens", type=_cli.positive_int, default=64,
                        help=f"tokens generated per prompt (at most {TARGET['block_size'] - PROMPT_LEN}: the "
                             f"{PROMPT_LEN}-token prompts and these must fit block_size {TARGET['block_size']})")
    parser.add_argument("--prompts", type=_cli.positive_int, default=4)
    parser.add_argument("--repeats", type=_cli.positive_int, default=5, help="timed rounds per setting (median)")
    parser.add_argument("--out", type=_cli.output_file, default="attnlib/book/results/speculative.json")
    args = parser.parse_args(argv)
    room = min(TARGET["block_size"], DRAFT["block_size"]) - PROMPT_LEN
    if args.new_tokens > room:  # speculative decoding does not slide the window: refused before training
        parser.error(f"argument --new-tokens: {args.new_tokens} + the {PROMPT_LEN}-token prompt exceeds the models' "
                     f"block_size {room + PROMPT_LEN} (expected <= {room})")
    torch.set_num_threads(1)
    corpus = load_char_corpus()
    vocab = corpus.tokenizer.vocab_size
    models, histories = {}, {}
    for name, shape in (("target", TARGET), ("draft", DRAFT)):
        torch.manual_seed(0)
        models[name] = GPT(GPTConfig(vocab_size=vocab, **shape))
        cfg = TrainConfig(max_iters=args.max_iters, eval_interval=max(1, args.max_iters // 5), eval_iters=20,
                          batch_size=16, device="cpu")
        h = train(models[name], corpus.train, corpus.val, cfg, progress=False)
        histories[name] = dict(parameters=models[name].num_parameters(), val_loss=h.val_loss[-1],
                               train_seconds=h.elapsed_s, **shape)
        models[name].eval()
    starts = torch.linspace(0, len(corpus.val) - 64, args.prompts).long().tolist()
    prompts = [corpus.val[s:s + PROMPT_LEN][None] for s in starts]
    rows = [measure(models["target"], models["draft"], prompts, args.new_tokens, k, temp, repeats=args.repeats)
            for temp in (0.0, 0.8) for k in (1, 2, 4, 6)]
    given = sys.argv[1:] if argv is None else argv
    result = dict(command=" ".join(["python -m attnlib.book.experiments.speculative", *given]),
                  max_iters=args.max_iters, new_tokens=args.new_tokens, prompts=args.prompts, threads=1,
                  repeats=args.repeats, load_average=list(os.getloadavg()),
                  models=histories, rows=rows)
    _cli.write_json(args.out, result, indent=1, newline=False)  # atomic: the old file stays if this fails
    return result


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
