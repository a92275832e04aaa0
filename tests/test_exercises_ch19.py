"""The chapter 19 exercise checks: the solution is correct, plausible mistakes are wrong with a hint naming them."""
import pytest
import torch

from attnlib.book.exercises import CORRECT, NOT_SOLVED, WRONG, ch19, grade  # noqa: F401  (ch19 registers 19.x)
from attnlib.generation import verify_drafts


# ---------------------------------------------------------------- 19.1
def positions_from_mask(mask):
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def positions_in_place(mask):
    out = positions_from_mask(mask)
    mask.fill_(True)
    return out


# ---------------------------------------------------------------- 19.2
def expected_tokens(alpha, k):
    return float(k + 1) if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def simulated_tokens(alpha, k):  # right in the mean, but a noisy estimate
    accepted = (torch.rand(2000, k) < alpha).long().cumprod(-1).sum(-1)
    return (accepted + 1).double().mean().item()


# ---------------------------------------------------------------- 19.3
def pages_needed(prompt_lengths, new_tokens, page_size):
    return sum(-(-(p + n) // page_size) for p, n in zip(prompt_lengths, new_tokens))


# ---------------------------------------------------------------- 19.4
def residual(p, q):
    r = (p - q).clamp(min=0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp(min=1e-300), p)


# ---------------------------------------------------------------- 19.5
def greedy_draft_round(p, drafts, generator=None):  # transformers' assisted generation: sample, keep matches
    t = torch.multinomial(p, 1, generator=generator)[:, 0]  # (k + 1,): the target's own sample at each position
    n = 0
    while n < len(drafts) and t[n] == drafts[n]:
        n += 1
    return torch.cat([drafts[:n], t[n:n + 1]])


def round_by_the_general_rule(p, drafts, generator=None):  # Algorithm 1 with q a point mass on each draft
    q = torch.nn.functional.one_hot(drafts, p.shape[-1]).to(p.dtype)
    n, nxt = verify_drafts(p[None], q[None], drafts[None], generator=generator)
    return torch.cat([drafts[: int(n)], nxt])


def round_variant(p, drafts, g, *, accept="p", replace="residual", bonus_from=None, stop=True, in_place=False):
    """One round with a planted mistake: accept d with probability p(d) ("p"), always ("always") or iff it is
    p's argmax ("argmax"); replace from the residual or from p; the bonus from p[bonus_from]; stop or not at the
    first rejection; build the residual in place or not."""
    k, out = len(drafts), []
    for j in range(k):
        d = int(drafts[j])
        ok = {"p": bool(torch.rand(1, generator=g, dtype=p.dtype) < p[j, d]), "always": True,
              "argmax": d == int(p[j].argmax())}[accept]
        if ok:
            out.append(d)
            continue
        r = p[j] if in_place else p[j].clone()
        if replace == "residual":
            r[d] = 0.0
        out.append(int(torch.multinomial(r, 1, generator=g)))
        if stop:
            return torch.tensor(out)
    if bonus_from is not None:
        out.append(int(torch.multinomial(p[k if bonus_from == "k" else k - 1], 1, generator=g)))
    return torch.tensor(out[: k + 1])


CORRECT_ANSWERS = [
    ("19.1", positions_from_mask),
    ("19.1", lambda m: torch.arange(m.shape[1]) - (~m).sum(-1, keepdim=True)
     + (~m).long() * ((~m).sum(-1, keepdim=True) - torch.arange(m.shape[1]))),
    ("19.2", expected_tokens),
    ("19.2", lambda a, k: sum(a**j for j in range(k + 1))),
    ("19.3", pages_needed),
    ("19.4", residual),
    ("19.5", greedy_draft_round),
    ("19.5", round_by_the_general_rule),
    ("19.5", lambda p, d, g: round_variant(p, d, g, bonus_from="k")),
]


@pytest.mark.parametrize("exercise_id, answer", CORRECT_ANSWERS)
def test_reference_answer_is_correct(exercise_id, answer):
    verdict = grade(exercise_id, answer)
    assert verdict.status == CORRECT, str(verdict)


@pytest.mark.parametrize(
    "exercise_id, answer, hint",
    [
        ("19.1", lambda m: torch.arange(m.shape[1]).expand(m.shape), "count the pads"),
        ("19.1", lambda m: m.long().cumsum(-1), "start at 1"),
        ("19.1", lambda m: m.long().cumsum(-1) - 1, "clamp the pads' positions at 0"),
        ("19.1", lambda m: m.long().flip(-1).cumsum(-1).flip(-1) - 1, "not back from the last"),
        ("19.1", lambda m: (m.cumsum(-1) - 1).clamp(min=0).float(), "integer tensor"),
        ("19.1", positions_in_place, "changed the mask in place"),
        ("19.2", lambda a, k: (1 - a**k) / (1 - a) if a < 1 else float(k), "the target's own token"),
        ("19.2", lambda a, k: 1 + a * k, "not accepted independently"),
        ("19.2", lambda a, k: 1 / (1 - a) if a < 1 else float(k + 1), "infinitely many drafts"),
        ("19.2", lambda a, k: (1 - a ** (k + 1)) / (1 - a), "without dividing by 1 - alpha"),
        ("19.2", lambda a, k: (1 - a ** (k + 1)) / (1 - a) if a < 1 else float("nan"), "returned nan"),
        ("19.2", simulated_tokens, "expected"),
        ("19.3", lambda ps, ns, s: -(-sum(p + n for p, n in zip(ps, ns)) // s), "you rounded the total"),
        ("19.3", lambda ps, ns, s: sum((p + n) // s for p, n in zip(ps, ns)), "round up"),
        ("19.3", lambda ps, ns, s: sum((p + n) // s + 1 for p, n in zip(ps, ns)), "not m + 1"),
        ("19.3", lambda ps, ns, s: sum(-(-p // s) - (n // -s) for p, n in zip(ps, ns)), "together"),
        ("19.3", lambda ps, ns, s: sum(-(-p // s) for p in ps), "count the new tokens"),
        ("19.3", lambda ps, ns, s: float(pages_needed(ps, ns, s)), "Python int"),
        ("19.4", lambda p, q: residual(q, p), "not q - p"),
        ("19.4", lambda p, q: (p - q).clamp(min=0), "divide by its sum"),
        ("19.4", lambda p, q: (p - q).softmax(-1), "clip p - q at zero"),
        ("19.4", lambda p, q: (p - q).clamp(min=0) / (p - q).clamp(min=0).sum(-1, keepdim=True), "not nan"),
        ("19.1", lambda m: (m.long().cumsum(0) - 1).clamp(min=0), "expected"),
        ("19.2", lambda a, k: a * (1 - a**k) / (1 - a) if a < 1 else float(k), "accepted drafts only"),
        ("19.2", lambda a, k: (1 - a ** (k + 2)) / (1 - a) if a < 1 else float(k + 2), "off by one in k"),
        ("19.3", lambda ps, ns, s: sum(-(-n // s) for n in ns), "count the prompt too"),
        ("19.3", lambda ps, ns, s: sum(-(-(p + n - 1) // s) for p, n in zip(ps, ns)), "prompt + new - 1"),
        ("19.4", lambda p, q: residual(p, q) * 2, "sum to 1 over the vocabulary"),
        ("19.4", lambda p, q: (p - q).clamp(min=0) / (p - q).clamp(min=0).sum(0, keepdim=True), "sum to 1"),
        ("19.4", lambda p, q: residual(p.reshape(-1, p.shape[-1]), q.reshape(-1, q.shape[-1])).reshape(6, 7),
         "any leading dimensions"),
        ("19.5", lambda p, d, g: round_variant(p, d, g), "add the bonus token"),
        ("19.5", lambda p, d, g: round_variant(p, d, g, accept="always", bonus_from="k"), "not q / p"),
        ("19.5", lambda p, d, g: round_variant(p, d, g, accept="argmax", bonus_from="k"), "you accept it always"),
        ("19.5", lambda p, d, g: round_variant(p, d, g, replace="p", bonus_from="k"), "you drew from p"),
        ("19.5", lambda p, d, g: round_variant(p, d, g, stop=False, bonus_from="k"), "ends at the first rejection"),
        ("19.5", lambda p, d, g: round_variant(p, d, g, bonus_from="k-1"), "the bonus token must follow p[k]"),
        ("19.5", lambda p, d, g: round_variant(p, d, g, bonus_from="k", in_place=True), "changed p in place"),
        ("19.5", lambda p, d, g: greedy_draft_round(p, d, g).float(), "1-D integer tensor"),
    ],
)
def test_plausible_mistake_is_wrong(exercise_id, answer, hint):
    verdict = grade(exercise_id, answer)
    assert verdict.status == WRONG, str(verdict)
    assert hint in verdict.detail, str(verdict)


@pytest.mark.parametrize("exercise_id", ["19.1", "19.2", "19.3", "19.4", "19.5"])
def test_stub_is_not_solved(exercise_id):
    def stub(*args):
        raise NotImplementedError("write it")

    assert grade(exercise_id, stub).status == NOT_SOLVED
