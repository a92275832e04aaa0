"""Exercise checks 08.3 (the cache's bytes from a config) and 08.4 (chunked prefill); :mod:`ch08` registers them."""
from __future__ import annotations

import torch
from torch import nn

import attnlib
import attnlib.cache
import attnlib.cache.memory
from attnlib.book.exercises._core import (
    NotSolved,
    Wrong,
    case_rng,
    exercise,
    expect,
    expect_close,
    expect_int,
    expect_tensor,
    randint,
)
from attnlib.book.exercises._run import Refuse, run
from attnlib.cache import KVCache
from attnlib.models.config import GPTConfig
from attnlib.models.layers import build_attention

_GPT2 = dict(vocab_size=50257, block_size=1024, n_layers=12, n_heads=12, d_model=768)
_BYTES_CONFIGS = [
    GPTConfig(),  # the book's small model, multi-head (n_kv_heads not given: n_heads)
    GPTConfig(attention="gqa"),  # GQA without n_kv_heads: one kv head per query head
    GPTConfig(n_kv_heads=2, attention="gqa"),
    GPTConfig(attention="mqa"),  # one key/value head (n_kv_heads not given: 1)
    GPTConfig(n_layers=3, kv_latent_dim=24, attention="mla"),
    GPTConfig(n_layers=2, attention="talking_heads"),
    GPTConfig(n_layers=5, n_heads=8, d_model=64, n_kv_heads=2, attention="gqa"),
    GPTConfig(**_GPT2),  # GPT-2 small
    GPTConfig(**_GPT2, n_kv_heads=4, attention="gqa"),
    GPTConfig(**_GPT2, attention="mqa"),
    GPTConfig(**_GPT2, attention="mla"),  # kv_latent_dim not given: the default d_model // 4
]
_BYTES_CALLS = [
    (1, 1, torch.float32),
    (3, 7, torch.bfloat16),
    (64, None, torch.float16),
    (2, 5, torch.float64),
]


_MEASURED: dict[tuple[str, torch.dtype], int] = {}


def _measured_bytes_per_token(config: GPTConfig, dtype: torch.dtype) -> int:
    """:func:`_measure` once per config and dtype (a GPT-2-sized model takes a while, even on meta)."""
    key = (repr(config), dtype)
    if key not in _MEASURED:
        _MEASURED[key] = _measure(config, dtype)
    return _MEASURED[key]


def _measure(config: GPTConfig, dtype: torch.dtype) -> int:
    """Bytes one token of one sequence takes in a KVCache, measured on the buffers.

    The layers are built on the meta device (shapes, no memory) and each runs on a meta
    input with the cache it asks for (``layer.new_cache``); what they allocate is what is measured.
    """
    with torch.device("meta"):
        layers = [build_attention(config, i).to(dtype) for i in range(config.n_layers)]
        x = torch.empty(1, 2, config.d_model, dtype=dtype)
    cache = KVCache([layer.new_cache(config.block_size) for layer in layers])
    for layer, layer_cache in zip(layers, cache.layers):
        layer(x, cache=layer_cache)
    return cache.bytes_per_token()


#: 08.3's rule: the bytes from the config's fields. Building any module (GPT, a layer) runs
#: nn.Module.__init__; the library's estimator is refused under every name it is reached by.
_FROM_CONFIG = Refuse(
    "compute the bytes from the config's fields; do not build a model or an attention layer, and do "
    "not call attnlib's own estimator", nn.Module.__init__, attnlib.cache.memory.kv_cache_bytes)
_RENAMED = {"kv_heads": "n_kv_heads", "latent_dim": "kv_latent_dim"}


def _bytes_call(fn, config: GPTConfig, args: tuple, case: str) -> int:
    """The learner's byte count as a Python int, or a hint that names the mistake (see :func:`call_for_int`)."""
    try:
        got = run(fn, config, *args, what=case, refuse=_FROM_CONFIG)
    except Wrong as e:
        for old, new in _RENAMED.items():
            if f"has no attribute '{old}'" in str(e):
                raise Wrong(f"{e}. attnlib 2.0's config resolves the values its layers use under the fields' own "
                            f"names: config.{new}, not config.{old}") from None
        if "NoneType" in str(e) and "TypeError" in str(e) and config.kv_latent_dim is None:
            raise Wrong(f"{e}. config.kv_latent_dim is None for attention={config.attention!r}: only MLA caches "
                        "a latent. A dict of every variant's formula computes them all; compute only the one for "
                        "config.attention") from None
        raise
    if got is None:
        raise NotSolved("return the number of bytes as an int, not None")
    return expect_int(got, case)


def _bytes_configs(g: torch.Generator) -> list[GPTConfig]:
    """The fixed configs and a fresh one of each variant (sizes drawn with ``g``)."""
    configs = list(_BYTES_CONFIGS)
    for attention in ("mha", "gqa", "mqa", "mla"):
        n_kv = randint(g, 1, 3)
        n_heads = n_kv * randint(g, 2, 3)
        extra = dict(n_kv_heads=n_kv) if attention == "gqa" else {}
        if attention == "mla" and randint(g, 0, 1):
            extra = dict(kv_latent_dim=randint(g, 3, 40))
        configs.append(GPTConfig(n_layers=randint(g, 1, 7), n_heads=n_heads, d_model=n_heads * 2 * randint(g, 2, 8),
                                 block_size=64, attention=attention, **extra))
    return configs


@exercise("08.3")
def check_kv_cache_bytes(kv_cache_bytes) -> None:
    """Check ``kv_cache_bytes(config, batch_size, context, dtype) -> int``.

    The expected value is measured: bytes per token of a KVCache filled by the layers
    (meta device), times batch_size * context.
    """
    g = case_rng()
    failures = []  # (case, {mistake: hint} of the mistakes that explain it)
    for config in _bytes_configs(g):
        measured = {}
        calls = _BYTES_CALLS + [(randint(g, 3, 9), randint(g, 1, 64), torch.bfloat16)]
        for batch_size, context, dtype in calls:
            context = config.block_size if context is None else context
            case = (
                f"kv_cache_bytes(attention={config.attention!r}, n_layers={config.n_layers}, "
                f"n_heads={config.n_heads}, n_kv_heads={config.n_kv_heads}, "
                f"head_dim={config.head_dim}, kv_latent_dim={config.kv_latent_dim}; "
                f"batch_size={batch_size}, context={context}, {dtype})"
            )
            got = _bytes_call(kv_cache_bytes, config, (batch_size, context, dtype), case)
            if dtype not in measured:
                measured[dtype] = _measured_bytes_per_token(config, dtype)
            size = dtype.itemsize
            tokens = batch_size * context
            expected = measured[dtype] * tokens
            if got == expected:
                continue
            per_layer = measured[dtype] // (config.n_layers * size)  # numbers per token, layer
            case = f"{case} = {got:,}, expected {expected:,}"
            every = config.n_layers * tokens * size
            mistakes = [
                ("layers", per_layer * tokens * size, "multiply by n_layers: every layer has its own cache"),
                (
                    "batch",
                    per_layer * config.n_layers * context * size,
                    "multiply by batch_size: every sequence has its own cache",
                ),
                (
                    "context",
                    per_layer * config.n_layers * batch_size * size,
                    "multiply by context: one entry per token",
                ),
                (
                    "bits",
                    expected * 8,
                    "that is bits, not bytes: dtype.itemsize is already in bytes "
                    f"({dtype} takes {size})",
                ),
                (
                    "itemsize",
                    per_layer * config.n_layers * tokens,
                    f"multiply by the bytes of one number: {dtype} takes {size} "
                    "(dtype.itemsize)",
                ),
                (
                    "four",
                    per_layer * config.n_layers * tokens * 4,
                    f"{dtype} takes {size} bytes per number, not 4 (dtype.itemsize)",
                ),
                (
                    "reserved",
                    per_layer * config.n_layers * batch_size * config.block_size * size,
                    "count the context tokens, not the block_size positions that KVCache "
                    "reserves up front",
                ),
            ]
            name = config.attention
            all_heads = 2 * config.n_heads * config.head_dim * every
            if name == "mqa":
                mistakes.append(
                    ("all_heads", all_heads, "MQA has one key/value head (config.n_kv_heads is 1), not n_heads")
                )
            if name == "gqa":
                mistakes.append(
                    ("all_heads", all_heads, "GQA caches n_kv_heads key/value heads, not n_heads")
                )
            if name == "mla":
                mistakes += [
                    (
                        "mla_twice",
                        2 * config.kv_latent_dim * every,
                        "MLA caches the latent once: keys and values are both decoded from it",
                    ),
                    (
                        "mla_rope",
                        (config.kv_latent_dim + config.head_dim // 2) * every,
                        "attnlib's MLA has no decoupled RoPE key (DeepSeek-V2's d_h^R): it "
                        "caches config.kv_latent_dim numbers per token and layer",
                    ),
                    (
                        "all_heads",
                        all_heads,
                        "MLA caches only the latent, config.kv_latent_dim numbers per token "
                        "and layer",
                    ),
                ]
            if name in ("mha", "talking_heads", "gqa", "mqa"):
                mistakes.append(
                    ("factor_2", per_layer // 2 * every, "keys AND values are cached: a factor 2")
                )
            explained = {
                key: hint
                for key, value, hint in mistakes
                if value == got and value != expected
            }
            failures.append((case, explained))
    if not failures:
        return
    # name a mistake only if it explains every failing case
    common = set.intersection(*(set(explained) for _, explained in failures))
    case, explained = failures[0]
    for key in explained:
        if key in common:
            raise Wrong(f"{case}: {explained[key]}")
    raise Wrong(
        f"{case}. Numbers per token per layer: 'mha' and 'talking_heads' "
        "2*n_heads*head_dim, 'gqa' 2*n_kv_heads*head_dim, 'mqa' 2*head_dim, "
        "'mla' kv_latent_dim"
    )


# ---------------------------------------------------------------- 08.4
_CHUNK_CASES = [  # (attention, overrides, B, T, chunk_size)
    ("mha", {}, 2, 11, 4),
    ("gqa", dict(n_kv_heads=2), 1, 9, 3),  # T a multiple of the chunk
    ("mla", {}, 2, 7, 2),
    ("mqa", {}, 1, 6, 1),  # one token per call
    ("mha", {}, 2, 5, 8),  # one chunk holds the whole prompt
]


def _chunk_cases(g: torch.Generator) -> list:
    chunk = randint(g, 2, 5)  # T <= 5 * 2 + 4 = 14: the check also runs T + 1 tokens, within block_size 16
    return _CHUNK_CASES + [(("mha", "gqa", "mla")[randint(g, 0, 2)], {}, randint(g, 1, 2),
                            chunk * randint(g, 1, 2) + randint(g, 1, chunk - 1), chunk)]


@exercise("08.4")
def check_chunked_prefill(chunked_prefill) -> None:
    """Check ``chunked_prefill(model, idx, chunk_size) -> (logits, cache)`` on several GPTs.

    Every call of the model is recorded, and every batch of tokens its embedding sees: none may
    hold more than chunk_size tokens. The logits must equal one forward pass of the whole
    prompt, and the cache must go on decoding as if the prompt had been prefilled at once.
    """
    from attnlib import GPT

    g = case_rng()
    base = GPTConfig(vocab_size=13, block_size=16, n_layers=2, n_heads=4, d_model=32)
    for name, overrides, B, T, chunk in _chunk_cases(g):
        config = base.replace(attention=name, **overrides)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=g)))
            model = GPT(config).eval()
        idx = torch.randint(0, config.vocab_size, (B, T), generator=g)
        nxt = torch.randint(0, config.vocab_size, (B, 1), generator=g)
        with torch.no_grad():
            reference, _ = model(idx)
            after, _ = model(torch.cat([idx, nxt], dim=1))
        case = f"chunked_prefill({name} GPT, idx of shape {(B, T)}, chunk_size={chunk})"

        calls, embedded = [], []
        forward = model.forward

        def recording_forward(idx_in, *args, _calls=calls, _forward=forward, **kwargs):
            cache = kwargs.get("cache", args[1] if len(args) > 1 else None)
            _calls.append((idx_in.shape[-1], cache))
            return _forward(idx_in, *args, **kwargs)

        model.forward = recording_forward  # the calls and their caches, for the hints
        hook = model.tok_emb.register_forward_hook(lambda m, i, o, _e=embedded: _e.append(i[0].shape[-1]))
        try:
            with torch.no_grad():
                out = run(chunked_prefill, model, idx, chunk, what=case, copy_args=False)
        finally:
            del model.forward
            hook.remove()
        if out is None:
            raise NotSolved("return (logits, cache), not None")
        expect(type(out) is tuple and len(out) == 2, f"{case}: return a pair (logits, cache); got {type(out).__name__}")
        logits, cache = out
        expect(embedded, f"{case}: the model was never called; feed the chunks through model(...)")
        expect(max(embedded) <= chunk,
               f"{case}: a forward call got {max(embedded)} tokens, more than chunk_size={chunk}; "
               "feed idx[:, s : s + chunk_size] for s = 0, chunk_size, 2 * chunk_size, ...")
        expect(all(c is not None for _, c in calls),
               f"{case}: a forward call got no cache; pass the same KVCache to every chunk so "
               "that each chunk sees the chunks before it")
        expect(len({id(c) for _, c in calls}) <= 1,
               f"{case}: the chunks went through different caches; create ONE KVCache (model.new_cache()) and "
               "pass it to every chunk, so that each chunk sees the chunks before it")
        expect_tensor(logits, f"{case}: the logits")
        expect(type(cache) is KVCache, f"{case}: return the KVCache the chunks filled; got {type(cache).__name__}")
        expect(cache.length == T,
               f"{case}: the cache holds {cache.length} positions, expected T={T}: the chunks overlap or leave "
               "tokens out")
        expect(tuple(logits.shape) == tuple(reference.shape),
               f"{case}: logits of shape {tuple(logits.shape)}, expected (B, T, vocab_size) = "
               f"{tuple(reference.shape)}: concatenate the logits of every chunk on dim 1")
        expect_close(logits, reference, f"{case}: the logits")
        with torch.no_grad():
            next_logits, _ = model(nxt, cache=cache)
        expect_close(next_logits, after[:, -1:], f"{case}: a decode step after the chunked prefill")
