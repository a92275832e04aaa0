"""``python -m attnlib.bench kv-quant``: KV-cache bytes per token and the error each quantisation scheme adds. Chapter 19.

A small Llama-style :class:`attnlib.Decoder` (float32) is *quickly trained* (``train_steps`` AdamW steps, from
seed 0) on a copy task: each sequence is a random segment of ``segment`` tokens repeated to the context's
length, so after the first segment every token can be read off the keys one segment back (an induction
head's job): the loss then depends on what the cache returns. It then reads held-out sequences of the same
task with each cache: the prompt's ``prompt`` tokens at once, then one token per step, teacher-forced, and
the logits of every decode step are compared with the exact float32 cache's:

* ``float32``: the model's own cache (:class:`~attnlib.cache.LayerCache`), the reference;
* ``bfloat16``: the same, keys and values stored in bfloat16 and read back as float32;
* ``int8``: :class:`~attnlib.cache.Int8LayerCache` (a scale per token and head);
* ``kivi4``, ``kivi2``: :class:`~attnlib.cache.KIVILayerCache` (Liu et al. 2024, KIVI) with ``group_size`` and
  ``residual_length`` (KIVI's G and R).

Columns: bytes per cached position (all layers, one sequence: :meth:`attnlib.cache.KVCache.bytes_per_token`,
the key groups' scales shared out over their tokens), bytes allocated for the batch (residual included) and
their ratio to float32's, max and mean |Δlogit|, the loss (cross-entropy of the decode steps' next tokens) and
its change, and the share of steps whose argmax is unchanged. Scales are float32 here, as the model is: in a
bfloat16 model they take half as much.
"""
from __future__ import annotations

import torch

from attnlib.bench._common import Command, format_table
from attnlib.cache import KVCache, LayerCache
from attnlib.models import Decoder, DecoderConfig

__all__ = ["COMMAND", "KV_QUANT", "KV_QUANT_SMALL", "SCHEMES", "copy_batch", "decode_logits", "format_kv_quant",
           "kv_quant_rows", "logit_changes", "scheme_cache"]

SCHEMES = ("float32", "bfloat16", "int8", "kivi4", "kivi2")
#: 4 layers, 8 heads of 32 (2 key/value heads), a 256-token context; KIVI's G = 32, R = 32 (the paper's R = 128
#: would leave half this context in full precision).
KV_QUANT = dict(config=DecoderConfig.llama(vocab_size=64, block_size=256, n_layers=4, n_heads=8, n_kv_heads=2,
                                           d_model=256),
                segment=32, prompt=32, batch=8, train_steps=300, group_size=32, residual_length=32)
#: ``--small``: 2 layers, 4 heads of 16, a 64-token context, G = R = 8; a few seconds on a laptop CPU.
KV_QUANT_SMALL = dict(config=DecoderConfig.llama(vocab_size=32, block_size=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                                 d_model=64),
                      segment=12, prompt=8, batch=4, train_steps=60, group_size=8, residual_length=8)
COLUMNS = [("scheme", "scheme", "s"), ("bytes_per_token", "B/token", ",.1f"), ("nbytes", "allocated B", ",d"),
           ("smaller", "x smaller", ".2f"), ("max_abs_dlogit", "max |dlogit|", ".2e"),
           ("mean_abs_dlogit", "mean |dlogit|", ".2e"), ("loss", "loss", ".4f"), ("dloss", "dloss", "+.2e"),
           ("same_argmax", "same argmax", ".3f")]


class _Bfloat16LayerCache(LayerCache):
    """Keys and values stored in bfloat16, read back in the dtype given (the new positions as given)."""

    def store(self, new: tuple[torch.Tensor, ...], start: int) -> tuple[torch.Tensor, ...]:
        stored = super().store(tuple(t.to(torch.bfloat16) for t in new), start)
        return tuple(torch.cat([s[..., :start, :].to(t.dtype), t], dim=-2) for s, t in zip(stored, new))


def copy_batch(batch: int, length: int, segment: int, vocab_size: int, generator: torch.Generator) -> torch.Tensor:
    """``(batch, length)`` int64: a random segment of ``segment`` tokens per row, repeated to ``length``."""
    seg = torch.randint(vocab_size, (batch, segment), generator=generator)
    return seg.repeat(1, -(-length // segment))[:, :length]


def scheme_cache(model: Decoder, scheme: str, group_size: int, residual_length: int) -> KVCache:
    """An empty cache of ``scheme`` (one of :data:`SCHEMES`) for ``model``; KIVI's G and R as given."""
    if scheme == "float32":
        return model.new_cache()
    if scheme == "bfloat16":
        return KVCache([_Bfloat16LayerCache(model.config.block_size) for _ in model.blocks])
    return KVCache.quantized(model, scheme, group_size=group_size, residual_length=residual_length)


@torch.no_grad()
def decode_logits(model: Decoder, cache: KVCache, idx: torch.Tensor, prompt: int) -> torch.Tensor:
    """Logits ``(B, T - prompt, vocab)`` predicting tokens ``prompt … T-1`` of ``idx`` ``(B, T)``: the prompt read
    at once into ``cache`` (its last position's logits), then one teacher-forced token per step."""
    steps = [model(idx[:, :prompt], cache=cache, last_only=True)[0][:, -1]]
    steps += [model(idx[:, t:t + 1], cache=cache)[0][:, -1] for t in range(prompt, idx.shape[1] - 1)]
    return torch.stack(steps, 1)  # (B, T - prompt, vocab)


def kv_quant_rows(config: DecoderConfig, segment: int, prompt: int, batch: int, train_steps: int, group_size: int,
                  residual_length: int, schemes: tuple[str, ...] = SCHEMES, device: torch.device | str = "cpu",
                  seed: int = 0) -> list[dict]:
    """One row per scheme: bytes and the logits' and loss's change against the float32 cache (see the module).

    Raises:
        ValueError: an unknown scheme (before anything runs); what :meth:`attnlib.cache.KVCache.quantized` refuses.
    """
    unknown = [s for s in schemes if s not in SCHEMES]
    if unknown:
        raise ValueError(f"schemes {unknown} are not among {SCHEMES}")
    torch.manual_seed(seed)
    model = Decoder(config).to(device)
    g = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    for _ in range(train_steps):  # a quick training run: the copy task
        idx = copy_batch(16, config.block_size, segment, config.vocab_size, g).to(device)
        loss = model(idx[:, :-1], idx[:, 1:])[1]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    model.eval()
    idx = copy_batch(batch, config.block_size, segment, config.vocab_size, g).to(device)  # held out
    targets = idx[:, prompt:]
    logits, rows = {}, []
    for scheme in dict.fromkeys(("float32", *schemes)):
        cache = scheme_cache(model, scheme, group_size, residual_length)
        logits[scheme] = decode_logits(model, cache, idx, prompt)
        rows.append(dict(scheme=scheme, bytes_per_token=float(cache.bytes_per_token()), nbytes=cache.nbytes(),
                         **logit_changes(logits[scheme], logits["float32"], targets)))
    for row in rows:
        row["smaller"] = rows[0]["nbytes"] / row["nbytes"]
    return [r for r in rows if r["scheme"] in schemes]


def logit_changes(logits: torch.Tensor, reference: torch.Tensor, targets: torch.Tensor) -> dict:
    """The loss of ``logits`` ``(B, S, vocab)`` on ``targets`` ``(B, S)`` (mean cross-entropy, nats) and what changed
    against ``reference`` (same shape): ``loss``, ``dloss``, ``max_abs_dlogit``, ``mean_abs_dlogit``, ``same_argmax``
    (the share of steps whose argmax is unchanged)."""
    def loss_of(x: torch.Tensor) -> float:
        return torch.nn.functional.cross_entropy(x.flatten(0, 1), targets.flatten()).item()

    d, loss = (logits - reference).abs(), loss_of(logits)
    return dict(loss=loss, dloss=loss - loss_of(reference), max_abs_dlogit=d.max().item(),
                mean_abs_dlogit=d.mean().item(),
                same_argmax=(logits.argmax(-1) == reference.argmax(-1)).float().mean().item())


def format_kv_quant(rows: list[dict], settings: dict | None = None) -> str:
    """The table and how it was measured."""
    parts = []
    if settings:
        c = settings["config"]
        parts.append(f"Llama-style Decoder, float32: {c['n_layers']} layers, {c['n_heads']} heads ({c['n_kv_heads']} "
                     f"key/value) of {c['head_dim']}, context {c['block_size']}; trained {settings['train_steps']} steps "
                     f"on a copy task (a random {settings['segment']}-token segment repeated); {settings['batch']} held-out "
                     f"sequences, a {settings['prompt']}-token prompt then one teacher-forced token per step; KIVI "
                     f"G={settings['group_size']}, R={settings['residual_length']}.")
    parts.append("dlogit, dloss, same argmax: against the float32 cache at every decode step; B/token: one sequence, "
                 "all layers (scales shared out over their groups); allocated: the batch's cache, residual included.")
    parts.append(format_table(rows, COLUMNS))
    return "\n".join(parts)


def _add_arguments(parser) -> None:
    parser.add_argument("--train-steps", type=int, default=None, help="AdamW steps on the copy task (default 300; 60 "
                        "with --small; 0: an untrained model)")
    parser.add_argument("--group-size", type=int, default=None, help="KIVI's G (default 32; 8 with --small)")
    parser.add_argument("--residual-length", type=int, default=None, help="KIVI's R (default 32; 8 with --small)")
    parser.add_argument("--seed", type=int, default=0, help="weights, training data and held-out data (default 0)")


def _check(parser, args) -> None:
    defaults = KV_QUANT_SMALL if args.small else KV_QUANT
    for flag, name, low in (("--train-steps", "train_steps", 0), ("--group-size", "group_size", 1),
                            ("--residual-length", "residual_length", 0)):
        value = getattr(args, name)
        if value is None:
            setattr(args, name, defaults[name])
        elif value < low:
            parser.error(f"argument {flag}: {value} must be >= {low}")
    for name in ("config", "segment", "prompt", "batch"):
        setattr(args, name, defaults[name])


def _run(args, device):
    settings = dict(config=args.config.to_dict(), segment=args.segment, prompt=args.prompt, batch=args.batch,
                    train_steps=args.train_steps, group_size=args.group_size, residual_length=args.residual_length,
                    seed=args.seed)
    rows = kv_quant_rows(args.config, args.segment, args.prompt, args.batch, args.train_steps, args.group_size,
                         args.residual_length, device=device, seed=args.seed)
    by = {r["scheme"]: r for r in rows}
    summary = {f"{s}_{key}": by[s][key] for s in SCHEMES[1:] for key in ("smaller", "max_abs_dlogit", "dloss")}
    return settings, rows, format_kv_quant(rows, settings), summary


COMMAND = Command(help="KV-cache bytes per token and the logits' and loss's change of int8 and KIVI-4/2 caches",
                  add_arguments=_add_arguments, check=_check, run=_run, repeats=1, warmup=0)
