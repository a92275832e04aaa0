"""GPT.attention_weights and the attention explorer of chapter 12."""
import pytest
import torch

from attnlib import GPT, GPTConfig
from attnlib.book.explorer import AttentionExplorer, plot_attention, token_labels
from attnlib.tokenizers import CharTokenizer

VARIANTS = ["mha", "talking_heads", "gqa", "mqa", "mla"]
TOKENIZER = CharTokenizer("abcdefgh ,\n")


def small_gpt(attention="mha", **kw):
    config = GPTConfig(vocab_size=TOKENIZER.vocab_size, block_size=12, n_layers=2, n_heads=4, d_model=16,
                       attention=attention, **kw)
    return GPT(config).eval()


@pytest.mark.parametrize("attention", VARIANTS)
def test_attention_weights_are_each_layers_own(attention):
    model = small_gpt(attention)
    idx = torch.randint(0, TOKENIZER.vocab_size, (2, 9))
    w = model.attention_weights(idx)
    assert w.shape == (2, 2, 4, 9, 9)
    # By hand: run the blocks one at a time and ask each attention layer for its weights.
    x = model.tok_emb(idx) + model.pos_emb(torch.arange(9))
    with torch.no_grad():
        for layer, block in enumerate(model.blocks):
            _, expected = block.attn(block.ln_1(x), return_weights=True)
            torch.testing.assert_close(w[layer], expected, atol=1e-6, rtol=0)
            x = block(x)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 2, 4, 9), atol=1e-5, rtol=0)
    assert torch.equal(w.triu(1), torch.zeros_like(w))  # causal: nothing above the diagonal


def test_attention_weights_leave_the_forward_pass_unchanged():
    model = small_gpt()
    idx = torch.randint(0, TOKENIZER.vocab_size, (1, 7))
    x = model.embed(idx)
    for block in model.blocks:
        y, _ = block(x, return_weights=True)
        torch.testing.assert_close(y, block(x), atol=1e-6, rtol=0)
        x = y


@pytest.mark.parametrize(
    "idx, error, match",
    [
        ([[1, 2]], TypeError, "torch.Tensor"),
        (torch.zeros(1, 13, dtype=torch.long), ValueError, "block_size=12"),
        (torch.full((1, 3), 99), ValueError, "outside the vocabulary"),
        (torch.zeros(3, dtype=torch.long), ValueError, r"shape \(B, T\)"),
    ],
)
def test_attention_weights_bad_input(idx, error, match):
    with pytest.raises(error, match=match):
        small_gpt().attention_weights(idx)


def test_token_labels_show_whitespace():
    ids = TOKENIZER.encode("a b\n,")
    assert token_labels(TOKENIZER, ids) == ["a", "␣", "b", "⏎", ","]


def test_plot_attention_checks_shapes():
    from matplotlib.figure import Figure

    ax = Figure().add_subplot()
    assert plot_attention(torch.eye(3), ["a", "b", "c"], ax, "t") is ax
    assert len(ax.images) == 1 and ax.get_title() == "t"
    with pytest.raises(ValueError, match=r"shape \(T, T\)"):
        plot_attention(torch.ones(2, 3), ["a", "b"], ax)
    with pytest.raises(ValueError, match="labels has 2 entries"):
        plot_attention(torch.eye(3), ["a", "b"], ax)


def test_explorer_draws_every_text_layer_and_head():
    model = small_gpt("gqa", n_kv_heads=2)
    texts = ["abc def", "hag\nbad,"]
    explorer = AttentionExplorer(model, TOKENIZER, texts, dpi=20)
    assert [option[0] for option in explorer.text.options] == ["abc def", "hag ⏎ bad,"]
    assert explorer.text.index == 0 and explorer.maps.selected_index == 0
    assert len(explorer.maps.children) == 2
    for text, text_stack in zip(texts, explorer.maps.children):
        assert len(text_stack.children) == 2  # layers
        assert all(len(layer.children) == 4 for layer in text_stack.children)  # heads
        assert all(img.value[:8] == b"\x89PNG\r\n\x1a\n" for layer in text_stack.children for img in layer.children)
        expected = model.attention_weights(torch.tensor([TOKENIZER.encode(text)]))[:, 0]
        torch.testing.assert_close(explorer.weights[text], expected, atol=0, rtol=0)
    assert model.training is False


def test_explorer_new_text_in_a_kernel():
    model = small_gpt()
    explorer = AttentionExplorer(model, TOKENIZER, ["abc"], dpi=20)
    explorer.new_text.value = "fed cab"
    assert "fed cab" in explorer.weights and explorer.text.index == 1 and len(explorer.maps.children) == 2
    explorer.new_text.value = "a" * 13  # longer than block_size: refused with a message, nothing added
    assert "block_size=12" in explorer.message.value and len(explorer.maps.children) == 2


def test_explorer_bad_input():
    model = small_gpt()
    with pytest.raises(TypeError, match="attnlib.GPT"):
        AttentionExplorer(torch.nn.Linear(2, 2), TOKENIZER, ["abc"])
    with pytest.raises(ValueError, match="non-empty list"):
        AttentionExplorer(model, TOKENIZER, [])
    with pytest.raises(ValueError, match="non-empty list"):
        AttentionExplorer(model, TOKENIZER, "abc")
    with pytest.raises(ValueError, match="1 to block_size=12"):
        AttentionExplorer(model, TOKENIZER, [""])
    with pytest.raises(TypeError, match="must be a str"):
        AttentionExplorer(model, TOKENIZER, [3])


def test_fit_text_keeps_whole_words():
    from attnlib.book.explorer import fit_text

    assert fit_text("abc def", TOKENIZER, 12) == "abc def"  # fits: unchanged
    assert fit_text("abc def gab hed", TOKENIZER, 12) == "abc def gab"  # 15 characters: cut after "gab"
    assert fit_text("abc def gabhed", TOKENIZER, 12) == "abc def"  # never "abc def gabh"
    assert fit_text("abc\ndefgh bad", TOKENIZER, 12) == "abc\ndefgh"  # a newline is a boundary too
    assert fit_text("ab cdefgh", TOKENIZER, 8) == "ab"  # never "ab cdefg"
    with pytest.raises(ValueError, match="first word alone is more than block_size=4"):
        fit_text("abcdefgh ab", TOKENIZER, 4)
    with pytest.raises(ValueError, match="1 to block_size=4"):
        fit_text("", TOKENIZER, 4)


@pytest.mark.parametrize(
    "text, shortened, label",
    [
        ("abc def", False, "abc def"),
        ("hag\nbad,", False, "hag ⏎ bad,"),
        ("abc def", True, "abc def…"),  # the text itself was cut by fit_text
        ("ROMEO:\nBut soft, what light through yonder window", False, "ROMEO: ⏎ But soft, what light through…"),
        ("a" * 50, False, "a" * 39 + "…"),  # no word boundary at all: cut, and say so
    ],
)
def test_option_label_cuts_at_a_word_boundary(text, shortened, label):
    from attnlib.book.explorer import option_label

    assert option_label(text, width=40, shortened=shortened) == label
    assert len(label) <= 40


def test_plot_attention_has_a_colour_bar_and_readable_ticks():
    from matplotlib.figure import Figure

    from attnlib.book import style

    fig = Figure()
    ax = plot_attention(torch.eye(3), ["a", "b", "c"], fig.add_subplot())
    assert len(fig.axes) == 2 and fig.axes[1].get_ylabel() == "attention weight"
    assert all(label.get_fontsize() >= style.MIN_FONT_PT for label in ax.get_xticklabels() + ax.get_yticklabels())
    assert len(Figure().add_subplot().figure.axes) == 1
    fig = Figure()
    plot_attention(torch.eye(3), ["a", "b", "c"], fig.add_subplot(), colorbar=False)
    assert len(fig.axes) == 1


def test_explorer_fits_a_phone_and_the_column():
    import io

    from PIL import Image

    from attnlib.book import style

    explorer = AttentionExplorer(small_gpt(), TOKENIZER, ["abc def"], dpi=40)
    image = explorer.maps.children[0].children[0].children[0]
    assert image.width == str(round(style.WIDTH * 100))  # shown as a full-column figure, 560 px
    assert image.layout.max_width == "100%" and image.layout.height == "auto"  # scaled down on a phone
    assert Image.open(io.BytesIO(image.value)).size[0] == round(style.WIDTH * 40)  # drawn at dpi
    for control in (explorer.text, explorer.new_text, explorer.layer, explorer.head):
        assert not (control.layout.width or "").endswith("px"), control.layout.width  # no fixed width
        assert control.layout.max_width, control.description
    assert explorer.layer.layout.min_width and explorer.layer.layout.flex  # a track that keeps its width
    sliders = explorer.widget.children[1]
    assert sliders.children == (explorer.layer, explorer.head) and sliders.layout.flex_flow == "row wrap"


def test_explorer_says_a_new_text_needs_a_kernel():
    explorer = AttentionExplorer(small_gpt(), TOKENIZER, ["abc"], dpi=20)
    assert explorer.kernel_note in explorer.widget.children
    assert "needs a running Python kernel" in explorer.kernel_note.value


def test_explorer_cuts_long_texts_at_a_word_boundary():
    explorer = AttentionExplorer(small_gpt(), TOKENIZER, ["abc def gab hed bag"], dpi=20)
    assert list(explorer.weights) == ["abc def gab"]
    assert explorer.weights["abc def gab"].shape[-1] == 11
    assert explorer.text.options[0][0] == "abc def gab…"
    explorer.new_text.value = "hag bad fedcab"  # typed in a kernel: cut the same way
    assert "hag bad" in explorer.weights and explorer.text.options[1][0] == "hag bad…"
