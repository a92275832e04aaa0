"""Chapter 18's experiment: its models are the library's linear-attention presets, and the committed run is
reproduced by the code that builds them today."""
import os

import pytest
import torch

from attnlib import Decoder, DecoderConfig
from attnlib.book.experiments import beyond_softmax as bs

#: The experiment's model name -> the preset's ``linear_layer``.
LINEAR_LAYER = {"linear": "linear", "deltanet": "gated_deltanet"}


@pytest.mark.parametrize("name", sorted(LINEAR_LAYER))
def test_a_gpt_with_its_attention_replaced_is_the_linear_attention_preset(name):
    """``build_model`` builds a GPT and swaps each ``block.attn`` (what made the committed run); the preset
    ``layer_types=("linear_attention",) * n_layers`` builds the same architecture: the same parameter names and
    shapes, and either's weights in the other give the same logits, bit for bit."""
    built = bs.build_model(name, seed=3).eval()
    n_layers = bs.SETTINGS["n_layers"]
    config = DecoderConfig(**bs.SETTINGS, layer_types=("linear_attention",) * n_layers, linear_layer=LINEAR_LAYER[name])
    torch.manual_seed(4)  # other weights than built's: loading must overwrite every one of them
    preset = Decoder(config).eval()
    theirs, ours = built.config.to_dict(), config.to_dict()
    assert {k for k in ours if ours[k] != theirs[k]} <= {"layer_types", "linear_layer"}  # the rest is chapter 13's
    built_state, preset_state = built.state_dict(), preset.state_dict()
    assert list(built_state) == list(preset_state)
    assert {k: v.shape for k, v in built_state.items()} == {k: v.shape for k, v in preset_state.items()}
    assert [type(b.attn) for b in built.blocks] == [type(b.attn) for b in preset.blocks]
    assert not torch.equal(built_state["blocks.0.attn.qkv.weight"], preset_state["blocks.0.attn.qkv.weight"])

    idx = torch.randint(0, bs.SETTINGS["vocab_size"], (3, bs.SETTINGS["block_size"]),
                        generator=torch.Generator().manual_seed(0))
    preset.load_state_dict(built_state)
    with torch.no_grad():
        assert torch.equal(preset(idx)[0], built(idx)[0])
    torch.manual_seed(5)
    other = bs.build_model(name, seed=5).eval()  # and the other way: the preset's weights in the built model
    other.load_state_dict(Decoder(config).state_dict())
    preset.load_state_dict(other.state_dict())
    with torch.no_grad():
        assert torch.equal(other(idx)[0], preset(idx)[0])
    assert preset.num_parameters() == built.num_parameters()
    assert preset.kv_cache_bytes_per_token() == built.kv_cache_bytes_per_token() == 0
    assert bs.state_bytes(preset) == bs.state_bytes(built) > 0


@pytest.mark.parametrize("name", bs.ALL_MODELS)
def test_committed_model_settings_are_the_configs_this_code_builds(name):
    recorded = bs.load_results()["model"]
    config = bs.build_model(name, 0).config.to_dict()
    assert {k: config[k] for k in recorded} == recorded


@pytest.mark.parametrize("seed", bs.load_results()["seeds"])
@pytest.mark.parametrize("name", bs.ALL_MODELS)
def test_step_0_losses_of_the_committed_run_are_reproduced(name, seed):
    """Each model built with each of the committed run's seeds has the losses the file records at step 0: the
    same initial weights, so the same construction and initialisation as the run's.

    The batches are :func:`attnlib.train.estimate_loss`'s (a generator seeded with seed + 1, as ``train`` passes
    it), run as one batch of all of them: float32 sums in another order (last bits), hence rel=1e-6; another
    initialisation moves the loss by more than 1e-3.
    """
    if not os.environ.get("ATTNLIB_DATA_DIR"):
        pytest.skip("ATTNLIB_DATA_DIR is not set")
    from attnlib.data import get_batch, load_char_corpus

    committed = bs.load_results()
    training = committed["training"]
    run = committed["variants"][name]["by_seed"][str(seed)]
    assert run["steps"][0] == 0
    corpus = load_char_corpus()
    model = bs.build_model(name, seed).eval()
    B, T, n = training["batch_size"], model.config.block_size, training["eval_iters"]
    for split, data in (("train", corpus.train), ("val", corpus.val)):
        g = torch.Generator().manual_seed(seed + 1)
        x, y = (torch.cat(t) for t in zip(*(get_batch(data, B, T, g) for _ in range(n))))  # (n * B, T) each
        with torch.no_grad():
            logits, _ = model(x)
        token_losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
        loss = token_losses.view(n, B * T).mean(dim=1).mean().item()  # the mean of the batches' mean losses
        assert loss == pytest.approx(run[f"{split}_loss"][0], rel=1e-6, abs=0), split
