"""Speculative decoding (chapter 19; Leviathan et al. 2023, Chen et al. 2023). Greedy: the output is the target's
own greedy output, whatever the draft. Sampling: the emitted tokens are distributed as the target's own samples,
checked by chi-square tests (significance level 0.01, fixed seeds, so deterministic) against the target's exact
distribution computed by running the target alone: on the acceptance step with 200,000 simulated rows, and end to
end on tiny models. The statistics are printed with -s."""
import pytest
import torch

from attnlib import GPT, Decoder, DecoderConfig, GPTConfig
from attnlib.generation import speculative_generate, verify_drafts

ALPHA = 0.01  # the significance level of every chi-square test here


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float, int]:
    """Pearson's chi-square statistic of ``counts`` against ``probs`` (cells with expected < 5 pooled), its p-value
    (the chi-square survival function, the regularized upper incomplete gamma Q(df/2, stat/2)) and df."""
    counts, expected = counts.flatten().double(), probs.flatten().double() * counts.sum()
    small = expected < 5
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
    stat = float(((counts - expected) ** 2 / expected).sum())
    df = counts.numel() - 1
    return stat, float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2))), df


def test_chi_square_helper_rejects_a_wrong_distribution():
    g = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.5, 0.3, 0.2])
    draws = torch.multinomial(probs, 5000, replacement=True, generator=g)
    counts = torch.bincount(draws, minlength=3)
    assert chi_square(counts, probs)[1] > ALPHA
    assert chi_square(counts, torch.tensor([0.45, 0.35, 0.2]))[1] < 1e-6


def random_dist(*shape, sharp=2.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (sharp * torch.randn(*shape, generator=g, dtype=torch.float64)).softmax(dim=-1)


def test_the_acceptance_step_keeps_the_target_distribution():
    """Two rounds of the acceptance step, simulated for N rows at once with context-dependent distributions:
    the first two emitted tokens (t1, t2) must follow p1(t1) · P2[t1](t2), the target's own law."""
    V, N = 6, 200_000
    g = torch.Generator().manual_seed(0)
    p1, q1 = random_dist(V, seed=1), random_dist(V, seed=2)
    P2, Q2 = random_dist(V, V, seed=3), random_dist(V, V, seed=4)  # next distributions given the first token
    P3 = random_dist(V, V, V, seed=5)  # the target after two tokens (the bonus token's law)
    d1 = torch.multinomial(q1, N, replacement=True, generator=g)
    d2 = torch.multinomial(Q2[d1], 1, generator=g)[:, 0]
    p = torch.stack([p1.expand(N, V), P2[d1], P3[d1, d2]], dim=1)  # (N, 3, V)
    q = torch.stack([q1.expand(N, V), Q2[d1]], dim=1)  # (N, 2, V)
    n, nxt = verify_drafts(p, q, torch.stack([d1, d2], dim=1), generator=g)
    t1 = torch.where(n >= 1, d1, nxt)
    t2 = torch.where(n >= 2, d2, nxt)
    again = n == 0  # one token only: a second round (k = 1) from context t1
    e = torch.multinomial(Q2[t1[again]], 1, generator=g)[:, 0]
    n2, nxt2 = verify_drafts(torch.stack([P2[t1[again]], P3[t1[again], e]], 1), Q2[t1[again]][:, None], e[:, None],
                             generator=g)
    t2[again] = torch.where(n2 >= 1, e, nxt2)  # round two's first token: the draft if accepted, else its replacement
    counts = torch.bincount(t1 * V + t2, minlength=V * V)
    law = p1[:, None] * P2  # (V, V): the target's joint law of two tokens
    stat, p_value, df = chi_square(counts, law)
    print(f"acceptance step, V={V}, N={N}: chi2={stat:.2f}, df={df}, p={p_value:.3f} (level {ALPHA})")
    assert p_value > ALPHA
    first = chi_square(torch.bincount(t1, minlength=V), p1)
    assert first[1] > ALPHA
    # and the draft's own law is far from it: the test has power
    assert chi_square(torch.bincount(d1, minlength=V), p1)[1] < 1e-6


def test_a_perfect_draft_is_always_accepted_and_a_useless_one_never():
    p = random_dist(1, 3, 5, seed=7)
    drafts = torch.tensor([[2, 4]])
    n, _ = verify_drafts(p, p[:, :2], drafts, generator=torch.Generator().manual_seed(0))
    assert n.tolist() == [2]
    q = torch.zeros(1, 2, 5, dtype=torch.float64)
    q[..., 2] = 1.0
    zero = p.clone()
    zero[0, 0, 2] = 0.0  # the target never says 2 first: draft 2 is rejected, the replacement is never 2
    zero = zero / zero.sum(-1, keepdim=True)
    n, nxt = verify_drafts(zero.expand(1000, 3, 5), q.expand(1000, 2, 5), drafts.expand(1000, 2),
                           generator=torch.Generator().manual_seed(0))
    assert n.eq(0).all() and not nxt.eq(2).any()


def tiny(seed, n_layers, d_model, vocab=4, sharp=4.0, block_size=32):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=vocab, block_size=block_size, n_layers=n_layers, n_heads=2, d_model=d_model))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(sharp)
    return model.eval()


def test_sampled_tokens_follow_the_target_end_to_end():
    """speculative_generate with tiny models (vocabulary 4), 3 new tokens with n_draft=2: the first two tokens over
    400 runs against the target's exact law, from the target alone (prompt, then each first token)."""
    target, draft = tiny(0, 2, 16), tiny(1, 1, 8)
    prompt, temperature = torch.tensor([[1, 3]]), 0.8
    g = torch.Generator().manual_seed(0)
    runs = [speculative_generate(target, draft, prompt, 3, n_draft=2, temperature=temperature, generator=g)
            for _ in range(400)]
    pairs = torch.stack([r[0, 2:4] for r in runs])
    with torch.no_grad():
        p1 = (target(prompt)[0][0, -1].double() / temperature).softmax(-1)  # (V,)
        follow = torch.cat([prompt.expand(4, 2), torch.arange(4)[:, None]], dim=1)  # each first token
        p2 = (target(follow)[0][:, -1].double() / temperature).softmax(-1)  # (V, V)
    counts = torch.bincount(pairs[:, 0] * 4 + pairs[:, 1], minlength=16)
    stat, p_value, df = chi_square(counts, p1[:, None] * p2)
    print(f"end to end, 400 runs: chi2={stat:.2f}, df={df}, p={p_value:.3f} (level {ALPHA})")
    assert p_value > ALPHA


@pytest.mark.parametrize("n_draft", [1, 3, 8])
def test_greedy_output_is_the_targets_own(n_draft):
    target, draft = tiny(0, 2, 32, vocab=32, block_size=64), tiny(1, 1, 16, vocab=32, block_size=64)
    prompt = torch.tensor([[1, 2, 3]])
    expected = target.generate(prompt, 40, temperature=0.0)
    for d in (draft, target):  # a poor draft (mostly rejected) and a perfect one (always accepted)
        out, stats = speculative_generate(target, d, prompt, 40, n_draft=n_draft, return_stats=True)
        assert out.tolist() == expected.tolist()
        assert stats["target_calls"] == stats["rounds"] and out.shape[1] == 43
    assert stats["acceptance_rate"] == 1.0 and stats["target_calls"] == -(-40 // (n_draft + 1))


def test_greedy_with_a_modern_target_and_a_gpt_draft():
    torch.manual_seed(0)
    target = Decoder(DecoderConfig.llama(vocab_size=32, block_size=48, n_layers=2, n_heads=4, d_model=32, n_kv_heads=2,
                                         sliding_window=8)).eval()
    with torch.no_grad():
        for p in target.parameters():
            p.mul_(4.0)
    draft = tiny(2, 1, 16, vocab=32, block_size=48)
    prompt = torch.tensor([[5, 6, 7, 8]])
    out = speculative_generate(target, draft, prompt, 30, n_draft=4)
    assert out.tolist() == target.generate(prompt, 30, temperature=0.0).tolist()
    assert speculative_generate(target, draft, prompt, 0).tolist() == prompt.tolist()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(draft=tiny(1, 1, 8, vocab=5)), ValueError,
         "draft and target must share a vocabulary; draft vocab_size=5, target vocab_size=4"),
        (dict(n_draft=0), ValueError, "n_draft=0 must be a positive integer"),
        (dict(n_draft=-2), ValueError, "n_draft=-2 must be a positive integer"),
        (dict(n_draft=2.0), TypeError, r"n_draft must be an int; got 2.0"),
        (dict(idx=torch.tensor([[1], [2]])), ValueError, r"idx must have shape \(1, T\) \(one prompt\); got \(2, 1\)"),
        (dict(max_new_tokens=40), ValueError, r"T \+ max_new_tokens = 1 \+ 40 exceeds the target's block_size=32"),
        (dict(temperature=-1.0), ValueError, "temperature=-1.0 must be >= 0"),
        (dict(idx=torch.tensor([[9]])), ValueError, "idx holds token id 9"),
    ],
)
def test_bad_inputs(kwargs, error, match):
    args = dict(target=tiny(0, 1, 8), draft=tiny(1, 1, 8), idx=torch.tensor([[1]]), max_new_tokens=3)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        speculative_generate(**args)
