"""Exercise checks for chapter 12 (GPT): counting its parameters and filtering next-token logits.

* 12.1 ``gpt_param_count(config)`` -> int, the parameters of ``attnlib.GPT(config)`` without building it
* 12.2 ``top_k_by_hand(logits, k)`` -> logits with all but the ``k`` largest of each row set to ``-inf``
* 12.3 ``top_p_by_hand(logits, p)`` -> logits outside the nucleus of probability ``p`` set to ``-inf``
* 12.4 ``min_p_filter(logits, p_min)`` -> logits of tokens less likely than ``p_min`` times the
  row's most likely token set to ``-inf`` (min-p sampling, Nguyen et al. 2024)

Every check calls the answer through :func:`run`, draws fresh cases from :func:`case_rng` besides
its fixed edge cases, and refuses what the statement rules out wherever it is reached from: building a
module in 12.1, attnlib's filters and transformers' logits warpers in 12.2-12.4. The reference models
are built on the ``meta`` device inside ``torch.random.fork_rng`` after the answer ran.
"""
from __future__ import annotations

import functools

import torch

from attnlib.book.exercises._core import case_rng, exercise, expect, expect_int, expect_tensor, randint
from attnlib.book.exercises._run import Refuse, run
from attnlib.generation.sampling import sample_next_token, top_k_filter, top_p_filter
from attnlib.models import GPT, GPTConfig

__all__ = ["check_gpt_param_count", "check_top_k_by_hand", "check_top_p_by_hand", "check_min_p_filter"]


# ---------------------------------------------------------------- 12.1

_CONFIGS = [
    ("the chapter's model", GPTConfig()),
    ("bias=False", GPTConfig(bias=False)),
    ("one layer, one head", GPTConfig(vocab_size=10, block_size=8, n_layers=1, n_heads=1, d_model=16)),
    ("GPT-2 small", GPTConfig(vocab_size=50257, block_size=1024, n_layers=12, n_heads=12, d_model=768)),
]


def _configs(g: torch.Generator) -> list[tuple[str, GPTConfig]]:
    cases = list(_CONFIGS)
    for bias in (True, False):  # fresh sizes each run
        n_heads = randint(g, 1, 8)
        config = GPTConfig(vocab_size=randint(g, 2, 500), block_size=randint(g, 1, 256), n_layers=randint(g, 1, 6),
                           n_heads=n_heads, d_model=n_heads * randint(g, 1, 24), bias=bias)
        cases.append((f"a random model, bias={bias}", config))
    return cases


#: "without building the model": no module may be built while the answer runs (GPT, its blocks, nn.Linear, ...)
_NO_MODEL = Refuse("count with a formula: your function may not build the model or any nn.Module",
                   GPT, torch.nn.Module.__init__)


def _reference_count(config: GPTConfig) -> int:
    """``GPT(config).num_parameters()``, built on the meta device (no memory, no random numbers)."""
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        return GPT(config).num_parameters()


def _explain_difference(config: GPTConfig, diff: int) -> str:
    """A hint naming the part of the model that a count off by ``diff`` most likely got wrong."""
    d, L, V, T = config.d_model, config.n_layers, config.vocab_size, config.block_size
    linear_biases = 9 * d * L  # qkv 3d + out_proj d + fc 4d + proj d, per block
    norm_biases = 2 * d * L + d  # ln_1 and ln_2 per block, and ln_f
    known = {
        V * d: "lm_head is tied to tok_emb (the same tensor): count it once",
        -V * d: "the token embedding (vocab_size * d_model) is missing",
        -T * d: "the learned position embedding (block_size * d_model) is missing",
        T * d: "the position embedding was counted twice",
        -4 * d * L: "the two LayerNorms of each block (ln_1 and ln_2) are missing",
    }
    if config.bias:
        known[-2 * d] = "the final LayerNorm ln_f (weight and bias: 2 * d_model) is missing"
        known[-linear_biases] = ("the biases of the Linear layers are missing (per block: qkv 3 * d_model, "
                                 "out_proj d_model, fc 4 * d_model, proj d_model)")
        known[-(linear_biases + norm_biases)] = "the biases are missing (every Linear and every LayerNorm has one)"
        known[-norm_biases] = "the LayerNorm biases are missing (ln_1, ln_2 and ln_f each have d_model)"
    else:
        known[-d] = "the final LayerNorm ln_f (its weight: d_model) is missing"
        known[linear_biases + norm_biases] = (
            "with bias=False no Linear layer and no LayerNorm has a bias (a LayerNorm keeps only its weight)")
        known[norm_biases] = "with bias=False the LayerNorms have no bias either: count only their weight"
        known[linear_biases] = "with bias=False the Linear layers have no bias"
    return known.get(diff, "compare part by part with the parameter table in the chapter")


@exercise("12.1")
def check_gpt_param_count(fn) -> None:
    """Check a formula for ``attnlib.GPT(config).num_parameters()`` on several configurations."""
    for what, config in _configs(case_rng()):
        got = expect_int(run(fn, config, what=f"gpt_param_count({what})", refuse=_NO_MODEL),
                         f"gpt_param_count({what})")
        expected = _reference_count(config)
        if got != expected:
            hint = _explain_difference(config, got - expected)
            expect(False, f"{what} ({config}): you counted {got:,}, the model has {expected:,} "
                          f"(off by {got - expected:+,}); {hint}")


# ---------------------------------------------------------------- 12.2 and 12.3

def _random_logits(g: torch.Generator) -> list[torch.Tensor]:
    V = randint(g, 2, 80)
    return [
        torch.randn(7, generator=g) * 2,
        torch.randn(3, 10, generator=g, dtype=torch.float64),
        torch.randn(2, 4, 65, generator=g) * 3,
        torch.randn(randint(g, 1, 4), V, generator=g) * float(torch.empty(()).uniform_(0.5, 4, generator=g)),
    ]


@functools.cache
def _no_filters() -> Refuse:
    """attnlib's filters (also through ``sample_next_token``) and transformers' logits warpers."""
    from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    return Refuse("write the filter by hand, not with attnlib.generation's filters or transformers' logits "
                  "warpers", top_k_filter, top_p_filter, sample_next_token, TopKLogitsWarper, TopPLogitsWarper,
                  MinPLogitsWarper)


def _run_filter(fn, logits: torch.Tensor, arg: float, what: str) -> torch.Tensor:
    """The answer's filtered logits: a new tensor of the same shape and dtype, the input left as it was."""
    out = run(fn, logits, arg, what=what, refuse=_no_filters(), copy_args=False)
    expect_tensor(out, what)
    expect(out.untyped_storage().data_ptr() != logits.untyped_storage().data_ptr() or not logits.numel(),
           f"{what} returned logits itself (or a view of it); return a new tensor (masked_fill, clone), so that "
           "changing the result leaves the caller's logits alone")
    expect(out.dtype == logits.dtype, f"{what} has dtype {out.dtype}; keep the dtype of logits ({logits.dtype})")
    return out


def _expect_filtered(out: object, logits: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Shared checks of a filtered logits tensor: its type, its shape, and -inf (not 0) for removed tokens."""
    expect(tuple(out.shape) == tuple(logits.shape), f"{what} has shape {tuple(out.shape)}; keep the shape of "
                                                    f"logits {tuple(logits.shape)}")
    removed = torch.isinf(expected)
    # an answer that kept every logit as it was has a counting mistake, named by the caller
    if not torch.isinf(out).any() and removed.any() and not torch.equal(out[removed], logits[removed]):
        expect(False, f"{what}: removed tokens must get -inf (so softmax gives them probability 0), not 0 or a "
                      f"small number")


def _expect_same_tokens(out: torch.Tensor, logits: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """With the right count per row: the right tokens kept, their logits unchanged."""
    removed = torch.isinf(expected)
    if not torch.equal(torch.isinf(out), removed):
        expect(False, f"{what} keeps the right number of tokens per row but not the right ones: keep the most "
                      f"likely tokens, in vocabulary order (undo any sorting)")
    expect(torch.equal(out, expected) or not torch.equal(out.sort(-1).values, expected.sort(-1).values),
           f"{what} keeps the right logits but not in vocabulary order: put each kept logit back at its "
           f"token's index (undo any sorting)")
    expect(bool(torch.equal(out[~removed], logits[~removed])),
           f"{what} changes the logits it keeps; leave them as they are")


def _kept(logits: torch.Tensor) -> torch.Tensor:
    """How many tokens of each row survive a filter (are not -inf)."""
    return (~torch.isinf(logits)).sum(-1)


@exercise("12.2")
def check_top_k_by_hand(fn) -> None:
    """Check top-k filtering against ``attnlib.generation.top_k_filter``."""
    g = case_rng()
    cases = []
    for logits in _random_logits(g):
        V = logits.shape[-1]
        cases += [(logits, 1), (logits, randint(g, 1, V)), (logits, V), (logits, V + 5)]
    cases.append((torch.tensor([[1.0, 3.0, 2.0, 3.0, 0.5], [4.0, 4.0, 4.0, 1.0, 0.0]]), 2))  # ties at the k-th value
    for logits, k in cases:
        what = f"top_k_by_hand(logits of shape {tuple(logits.shape)}, k={k})"
        out = _run_filter(fn, logits, k, what)
        expected = top_k_filter(logits, k)
        _expect_filtered(out, logits, expected, what)
        kept, want = _kept(out), _kept(expected)
        if torch.equal(kept, want):
            _expect_same_tokens(out, logits, expected, what)
            continue
        if k > logits.shape[-1]:
            expect(False, f"{what}: k is larger than the vocabulary ({logits.shape[-1]}), so every token stays")
        if logits.dim() > 1 and kept.sum().item() == k:
            expect(False, f"{what} keeps {k} tokens in total; keep k tokens in every row (work on dim=-1)")
        if bool((kept < want).any()) and bool((kept >= min(k, logits.shape[-1])).all()):
            expect(False, f"{what}: tokens tied with the k-th largest logit must stay too; compare every logit "
                          f"with the k-th largest value (>=) instead of keeping the indices topk returns")
        if torch.equal(kept, want - 1):
            expect(False, f"{what} keeps one token too few per row: keep the logits >= the k-th largest (not >)")
        expect(False, f"{what}: keep the k largest logits of each row; expected {want.tolist()} kept per row, "
                      f"got {kept.tolist()}")


@exercise("12.3")
def check_top_p_by_hand(fn) -> None:
    """Check nucleus (top-p) filtering against ``attnlib.generation.top_p_filter``."""
    g = case_rng()
    cases = []
    for logits in _random_logits(g):
        cases += [(logits, p) for p in (0.05, 0.5, 0.9, 1.0, float(torch.rand((), generator=g)) * 0.9 + 0.05)]
    # probabilities 0.15, 0.5, 0.05, 0.3 (scrambled): the nucleus of 0.7 is {0.5, 0.3}, of 0.4 just {0.5}
    scrambled = torch.tensor([0.15, 0.5, 0.05, 0.3]).log()
    cases += [(scrambled, 0.7), (scrambled, 0.4), (scrambled, 0.95)]
    outs = []
    for logits, p in cases:
        what = f"top_p_by_hand(logits of shape {tuple(logits.shape)}, p={p})"
        outs.append(_run_filter(fn, logits, p, what))
        _expect_filtered(outs[-1], logits, top_p_filter(logits, p), what)

    def in_vocabulary_order(logits: torch.Tensor, p: float) -> torch.Tensor:
        probs = logits.double().softmax(-1)
        return probs.cumsum(-1) - probs >= p  # removed: the running sum in vocabulary order

    if any(not torch.equal(torch.isinf(out), torch.isinf(top_p_filter(lg, p))) for (lg, p), out in zip(cases, outs)):
        expect(not all(torch.equal(torch.isinf(out), in_vocabulary_order(lg, p)) for (lg, p), out in zip(cases, outs)),
               "top_p_by_hand takes the running sum in vocabulary order: sort the probabilities in decreasing "
               "order first, so that the nucleus holds the most likely tokens")
    for (logits, p), out in zip(cases, outs):
        what = f"top_p_by_hand(logits of shape {tuple(logits.shape)}, p={p})"
        expected = top_p_filter(logits, p)
        kept, want = _kept(out), _kept(expected)
        if torch.equal(torch.isinf(out), torch.isinf(expected)):
            _expect_same_tokens(out, logits, expected, what)
            continue
        probs = logits.double().softmax(-1)
        ranks = probs.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)  # 0 = the most likely token
        if not torch.equal(~torch.isinf(out), ranks < kept[..., None]):  # not the most likely tokens
            expect(not torch.equal(torch.isinf(out), in_vocabulary_order(logits, p)),
                   f"{what} takes the running sum in vocabulary order: sort the probabilities in decreasing "
                   f"order first, so that the nucleus holds the most likely tokens")
            if torch.equal(kept, want):
                _expect_same_tokens(out, logits, expected, what)
        expect(not bool((kept == 0).any()),
               f"{what} removes every token of a row: the most likely token always stays, even when its "
               f"probability alone exceeds p")
        expect(p < 1, f"{what} drops tokens: with p = 1 every token stays (a float32 running sum can reach 1 "
                      f"before the last tokens; handle p = 1 apart, or sum in float64)")
        if bool((kept <= want).all()) and bool((kept == want - 1).any()):
            expect(False, f"{what} drops the token that makes the running sum reach p; keep it (drop a token only "
                          f"when the tokens before it already sum to p)")
        if bool((kept >= want).all()) and bool((kept == want + 1).any()):
            expect(False, f"{what} keeps one token too many: stop at the first token whose running sum reaches p")
        expect(False, f"{what}: sort the probabilities (softmax of the logits) in decreasing order and keep the "
                      f"shortest prefix whose sum reaches p; expected {want.tolist()} kept per row, got "
                      f"{kept.tolist()}")


# ---------------------------------------------------------------- 12.4

def _min_p_reference(logits: torch.Tensor, p_min: float) -> torch.Tensor:
    """Min-p filtering (Nguyen et al. 2024): keep tokens whose probability is >= p_min * the row's top one."""
    probs = torch.softmax(logits.double(), dim=-1)
    keep = probs >= p_min * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(~keep, float("-inf"))


def _min_p_mistakes(logits: torch.Tensor, p_min: float) -> dict[str, torch.Tensor]:
    """What plausible wrong answers keep, each with the hint that names its mistake."""
    probs = torch.softmax(logits.double(), dim=-1)
    top = probs.amax(dim=-1, keepdim=True)
    inf = float("-inf")
    return {
        "the threshold scales with the row's top probability: keep p >= p_min * max(p), not p >= p_min":
            logits.masked_fill(probs < p_min, inf),
        "compare probabilities (the softmax of the logits), not the logits themselves":
            logits.masked_fill(logits < p_min * logits.amax(dim=-1, keepdim=True), inf),
        "take the top probability of each row (amax over dim=-1, keepdim=True), not of the whole tensor":
            logits.masked_fill(probs < p_min * probs.amax(), inf),
        "keep the tokens whose probability equals the threshold too (>=, not >): with p_min = 1 the most "
        "likely token must stay": logits.masked_fill(probs <= p_min * top, inf),
    }


@exercise("12.4")
def check_min_p_filter(fn) -> None:
    """Check min-p filtering against a reference; attnlib's filters raise while the answer runs."""
    g = case_rng()
    cases = []
    for logits in _random_logits(g):
        cases += [(logits, p) for p in (0.02, 0.1, 0.3, 1.0, float(torch.rand((), generator=g)) * 0.5 + 0.01)]
    cases.append((torch.tensor([[2.0, 2.0, 0.0, -1.0], [0.5, 1.5, 1.5, 1.0]]), 1.0))  # ties at the top
    outs = []
    for logits, p_min in cases:
        what = f"min_p_filter(logits of shape {tuple(logits.shape)}, p_min={p_min})"
        out = _run_filter(fn, logits, p_min, what)
        expected = _min_p_reference(logits, p_min)
        _expect_filtered(out, logits, expected, what)
        if torch.equal(torch.isinf(out), torch.isinf(expected)):
            _expect_same_tokens(out, logits, expected, what)
        outs.append(out)
    removed = [torch.isinf(out) for out in outs]
    if all(torch.equal(r, torch.isinf(_min_p_reference(lg, p))) for r, (lg, p) in zip(removed, cases)):
        return
    mistakes = [_min_p_mistakes(lg, p) for lg, p in cases]
    for hint in mistakes[0]:
        if all(torch.equal(r, torch.isinf(m[hint])) for r, m in zip(removed, mistakes)):
            expect(False, hint)
    for (logits, p_min), out in zip(cases, outs):
        what = f"min_p_filter(logits of shape {tuple(logits.shape)}, p_min={p_min})"
        expected = _min_p_reference(logits, p_min)
        if torch.equal(torch.isinf(out), torch.isinf(expected)):
            continue
        expect(not bool((_kept(out) == 0).any()), f"{what} removes every token of a row: the most likely token "
                                                  f"always stays (its probability is the top one)")
        expect(False, f"{what}: keep exactly the tokens with probability >= p_min * (the row's top probability); "
                      f"expected {_kept(expected).tolist()} kept per row, got {_kept(out).tolist()}")
