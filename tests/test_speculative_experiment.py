"""Chapter 19's experiment: its measurement of one setting on small untrained models (no data, seconds)."""
import torch

from attnlib import GPT, GPTConfig
from attnlib.book.experiments.speculative import measure


def _models():
    torch.manual_seed(0)
    target = GPT(GPTConfig(vocab_size=16, block_size=32, n_layers=2, n_heads=2, d_model=16)).eval()
    draft = GPT(GPTConfig(vocab_size=16, block_size=32, n_layers=1, n_heads=1, d_model=8)).eval()
    return target, draft


def test_greedy_setting_counts_and_times():
    target, draft = _models()
    prompts = [torch.randint(16, (1, 5), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    row = measure(target, draft, prompts, new_tokens=6, n_draft=3, temperature=0.0, repeats=2)
    assert row["same_as_target_greedy"] is True  # greedy speculative decoding is the target's greedy decoding
    assert 0.0 <= row["acceptance_rate"] <= 1.0
    assert 1.0 <= row["tokens_per_target_call"] <= 3 + 1  # from one token per pass up to k + 1
    assert row["plain_tokens_per_s"] > 0 and row["speculative_tokens_per_s"] > 0
    assert abs(row["speedup"] - row["speculative_tokens_per_s"] / row["plain_tokens_per_s"]) < 1e-9


def test_sampling_setting_is_repeatable():
    """Each round reseeds its generator: the counts do not depend on how many rounds are timed."""
    target, draft = _models()
    prompts = [torch.randint(16, (1, 4), generator=torch.Generator().manual_seed(7))]
    one = measure(target, draft, prompts, new_tokens=8, n_draft=2, temperature=0.8, repeats=1)
    three = measure(target, draft, prompts, new_tokens=8, n_draft=2, temperature=0.8, repeats=3)
    assert one["same_as_target_greedy"] is None
    assert (one["acceptance_rate"], one["tokens_per_target_call"]) == \
        (three["acceptance_rate"], three["tokens_per_target_call"])
