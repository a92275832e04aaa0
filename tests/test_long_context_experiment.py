"""Chapter 17's experiment: the models it builds are the committed run's, and its streaming caches read a stream as
the model does from scratch while the stream fits the context (no data, seconds)."""
import pytest
import torch

from attnlib.book import results
from attnlib.book.experiments import long_context as lc


@pytest.mark.parametrize("position", lc.POSITION_KINDS)
def test_the_models_are_the_committed_runs(position):
    """The committed run recorded its context and sizes; its models were attnlib 1.x's ModernConfig, a Llama
    layout with RMSNorm's eps 1e-6 (not the llama preset's 1e-5), no biases and an untied head."""
    committed = results.load("long_context")
    config = lc.model_config(65, committed["context"], position)
    recorded = {**committed["model"], "block_size": committed["context"]}
    assert {k: config.to_dict()[k] for k in recorded} == recorded
    assert (config.position, config.norm, config.norm_eps, config.feedforward) == (position, "rmsnorm", 1e-6, "swiglu")
    assert (config.bias, config.attention_bias, config.mlp_bias, config.tie_embeddings) == (False, False, False, False)
    assert (config.n_kv_heads, config.head_dim, config.d_ff, config.qk_norm) == (4, 16, 176, False)  # d_ff: 8/3 d, to 8
    assert config.attn_fn == ("eager" if position == "alibi" else "sdpa")


def test_streaming_caches_equal_recomputation_while_the_stream_fits():
    """Through a window-only cache and a sinks + window cache, the first ``L`` tokens see what the model sees
    from scratch; past ``L`` the caches keep other tokens than recomputation (the experiment's point)."""
    torch.manual_seed(0)
    L = 8
    model = lc.Decoder(lc.model_config(65, L, "rope").replace(n_layers=2, d_model=32)).eval()
    tokens = torch.randint(0, 65, (3 * L,), generator=torch.Generator().manual_seed(1))
    reference = torch.tensor(lc.recompute_losses(model, tokens))
    window_only = torch.tensor(lc.stream_losses(model, tokens, window=L, n_sink=0))
    sinks = torch.tensor(lc.stream_losses(model, tokens, window=L - 4, n_sink=4))
    assert len(reference) == len(window_only) == len(sinks) == 3 * L - 1
    torch.testing.assert_close(window_only[:L], reference[:L], rtol=0, atol=1e-5)
    torch.testing.assert_close(sinks[:L], reference[:L], rtol=0, atol=1e-5)
    assert not torch.allclose(window_only[L:], reference[L:], atol=1e-3)  # another context from there on
