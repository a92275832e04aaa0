"""An attention explorer: pick a text, a layer and a head, see the attention weights (chapter 12).

:class:`AttentionExplorer` draws one heatmap per (text, layer, head) with matplotlib and puts
them in ipywidgets ``Stack`` containers whose selection is linked to the controls in the
browser (``jslink``). The page therefore stays interactive without a running kernel: a book
page built from the executed notebook embeds the widget state, and the dropdown and sliders
switch between the stored heatmaps. With a kernel, typing a new text adds it; the page says
that this needs a kernel.

Sizes follow :mod:`attnlib.book.style`: each heatmap is a full-column figure
(:data:`~attnlib.book.style.WIDTH` inches, shown 560 CSS px wide and never wider than its
column) drawn at ``dpi`` = 200, twice the pixel density, with a colour bar and tick labels of
:data:`~attnlib.book.style.MIN_FONT_PT` points (about 9 px when a phone shows the figure 350 px
wide). The PNGs are stored with a 256-colour palette, a third of their size in full colour.
Texts are cut at a word boundary (:func:`fit_text`), never in the middle of a word.

Usage::

    from attnlib.book.explorer import AttentionExplorer
    AttentionExplorer(model, tokenizer, ["ROMEO:\\nBut soft, what light"])  # shows itself in Jupyter
"""
from __future__ import annotations

import html
import io
import re
from collections.abc import Sequence

import ipywidgets as widgets
import matplotlib as mpl
import torch
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from attnlib.book import style
from attnlib.models import GPT

__all__ = ["AttentionExplorer", "fit_text", "option_label", "plot_attention", "token_labels"]

#: Shown under the text box: where typing a text cannot work, the reader knows why.
KERNEL_NOTE = (
    "Typing a new text runs the model, so it needs a running Python kernel: this notebook in "
    "Jupyter, or opened with the page's Binder or Colab button. On the book's page, choose one of "
    "the texts above."
)
#: Width in CSS pixels at which a heatmap is shown (a full-column figure at 100 dpi).
IMAGE_WIDTH_PX = round(style.WIDTH * 100)

# Characters a tick label cannot show as themselves.
_VISIBLE = {" ": "␣", "\n": "⏎", "\t": "⇥"}


def token_labels(tokenizer, ids: Sequence[int]) -> list[str]:
    """One printable label per token id: ``tokenizer.decode([id])`` with space, newline and
    tab shown as ``␣``, ``⏎`` and ``⇥``."""
    return ["".join(_VISIBLE.get(ch, ch) for ch in tokenizer.decode([i])) for i in ids]


def fit_text(text: str, tokenizer, block_size: int) -> str:
    """``text`` itself if it encodes to at most ``block_size`` tokens, else its longest prefix
    that ends at the end of a word (before a space or newline) and fits.

    Raises:
        ValueError: ``text`` encodes to no token, or no prefix ending at a word boundary fits
            (a first word longer than ``block_size`` tokens).
    """
    n = len(tokenizer.encode(text))
    if n == 0:
        raise ValueError(f"text {text!r} is 0 tokens; the model takes 1 to block_size={block_size}")
    if n <= block_size:
        return text
    for match in sorted(re.finditer(r"\S(?=\s)", text), key=lambda m: -m.end()):
        prefix = text[: match.end()]
        if len(tokenizer.encode(prefix)) <= block_size:
            return prefix
    raise ValueError(
        f"text {text!r} is {n} tokens and its first word alone is more than block_size={block_size}: "
        "it cannot be cut at a word boundary"
    )


def option_label(text: str, width: int = 40, shortened: bool = False) -> str:
    """The one-line label of ``text`` in the explorer's dropdown: newlines as ``⏎``, cut at a word
    boundary to at most ``width`` characters, ``…`` where anything was left out (also when
    ``shortened``: the text itself was cut by :func:`fit_text`)."""
    line = text.replace("\n", " ⏎ ")
    if len(line) > width:
        cut = line[: width - 1]
        if cut[-1] != " " and line[width - 1] != " " and " " in cut:  # the cut falls inside a word
            cut = cut[: cut.rfind(" ")]
        line, shortened = cut.rstrip(" ⏎"), True
    return line + "…" if shortened else line


def plot_attention(weights: torch.Tensor, labels: Sequence[str], ax: Axes, title: str | None = None,
                   colorbar: bool = True) -> Axes:
    """Draw one head's attention weights as a heatmap on ``ax``, with a colour bar.

    Tick labels are :data:`attnlib.book.style.MIN_FONT_PT` points, monospace.

    Args:
        weights: ``(T, T)`` float, row ``i`` = the weights query position ``i`` gives to each key.
        labels: ``T`` tick labels (see :func:`token_labels`).
        ax: the matplotlib axes to draw on.
        title: optional title.
        colorbar: add a colour bar (0 to 1, "attention weight") beside ``ax``.

    Returns:
        ``ax``.

    Raises:
        ValueError: ``weights`` is not square ``(T, T)`` or ``labels`` has not ``T`` entries.
    """
    if weights.dim() != 2 or weights.shape[0] != weights.shape[1]:
        raise ValueError(f"weights must have shape (T, T); got {tuple(weights.shape)}")
    if len(labels) != weights.shape[0]:
        raise ValueError(f"labels has {len(labels)} entries; weights has T={weights.shape[0]}")
    T = weights.shape[0]
    image = ax.imshow(weights.detach().cpu().float().numpy(), cmap="viridis", vmin=0.0, vmax=1.0,
                      interpolation="nearest")
    ax.set_xticks(range(T), labels, fontsize=style.MIN_FONT_PT, fontfamily="monospace")
    ax.set_yticks(range(T), labels, fontsize=style.MIN_FONT_PT, fontfamily="monospace")
    ax.tick_params(length=0)
    ax.grid(False)
    ax.set_xlabel("key position (attended to)")
    ax.set_ylabel("query position")
    if title:
        ax.set_title(title)
    if colorbar:
        ax.figure.colorbar(image, ax=ax, shrink=0.9, label="attention weight")
    return ax


class AttentionExplorer:
    """Heatmaps of a GPT's attention weights, chosen by text, layer and head with ipywidgets.

    Every heatmap is drawn when a text is added, so the controls work in a static page too
    (their links to the ``Stack`` selections run in the browser). With a running kernel the
    text box adds a new text.

    Args:
        model: an :class:`attnlib.GPT` (any attention variant; run on its device in eval mode).
        tokenizer: has ``encode(str) -> list[int]`` and ``decode(list[int]) -> str`` (chapter 11).
        texts: the texts to show first; a text longer than ``block_size`` tokens is cut at a word
            boundary (:func:`fit_text`) and its label ends with ``…``.
        dpi: pixels per inch of the heatmaps' PNGs (the figure is :data:`~attnlib.book.style.WIDTH`
            inches wide, shown at 100 dpi: 200 is twice the screen's pixel density).

    Attributes:
        weights: ``{text as drawn: (n_layers, n_heads, T, T) float tensor}``, what each heatmap shows.
        widget: the ``ipywidgets.VBox`` to display.

    Raises:
        TypeError: ``model`` is not a GPT.
        ValueError: no texts, or a text that encodes to no token or cannot be cut at a word
            boundary to ``block_size`` tokens.
    """

    def __init__(self, model: GPT, tokenizer, texts: Sequence[str], dpi: int = 200) -> None:
        if not isinstance(model, GPT):
            raise TypeError(f"model must be an attnlib.GPT; got {type(model).__name__}")
        if isinstance(texts, str) or not texts:
            raise ValueError(f"texts must be a non-empty list of strings; got {texts!r}")
        self.model, self.tokenizer, self.dpi = model, tokenizer, dpi
        cfg = model.config
        self.weights: dict[str, torch.Tensor] = {}
        # Every control is as wide as the column allows (a phone's included), never wider: the
        # sliders' tracks keep a usable width and wrap onto their own rows on a narrow screen.
        described = {"description_width": "4.5em"}
        self.text = widgets.Dropdown(options=[], description="text", style=described,
                                     layout=widgets.Layout(width="100%", max_width="36em"))
        slider = {"style": described, "layout": widgets.Layout(flex="1 1 16em", min_width="12em", max_width="26em")}
        self.layer = widgets.IntSlider(0, min=0, max=cfg.n_layers - 1, description="layer", **slider)
        self.head = widgets.IntSlider(0, min=0, max=cfg.n_heads - 1, description="head", **slider)
        self.new_text = widgets.Text(
            placeholder="type a text, press Enter",
            description="new text",
            continuous_update=False,
            style=described,
            layout=widgets.Layout(width="100%", max_width="36em"),
        )
        self.new_text.observe(self._on_new_text, names="value")
        self.kernel_note = widgets.HTML(f"<small>{html.escape(KERNEL_NOTE)}</small>",
                                        layout=widgets.Layout(max_width="36em"))
        self.message = widgets.HTML()  # why a typed text was refused
        self.maps = widgets.Stack([])  # one child per text: a Stack over layers of Stacks over heads
        widgets.jslink((self.text, "index"), (self.maps, "selected_index"))
        caption = widgets.HTML(
            "Row <i>i</i>: how the character at position <i>i</i> spreads its attention over positions "
            "0…<i>i</i> (each row sums to 1; above the diagonal is 0, the future).",
            layout=widgets.Layout(max_width="36em"),
        )
        sliders = widgets.HBox([self.layer, self.head], layout=widgets.Layout(flex_flow="row wrap", width="100%"))
        self.widget = widgets.VBox(
            [self.text, sliders, self.maps, caption, self.new_text, self.kernel_note, self.message],
            layout=widgets.Layout(width="100%", max_width=f"{IMAGE_WIDTH_PX + 40}px"),
        )
        for text in texts:
            self.add_text(text)
        self._select(0)

    def add_text(self, text: str) -> None:
        """Compute and draw every layer's and head's attention for ``text`` and select it; a text
        longer than ``block_size`` tokens is cut at a word boundary first (:func:`fit_text`).

        Raises:
            TypeError / ValueError: ``text`` not a string, or it encodes to no token or cannot
                be cut at a word boundary to ``block_size`` tokens.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str; got {type(text).__name__}")
        fitted = fit_text(text, self.tokenizer, self.model.config.block_size)
        shortened, text = fitted != text, fitted
        ids = self.tokenizer.encode(text)
        device = next(self.model.parameters()).device
        was_training = self.model.training
        self.model.eval()
        try:
            w = self.model.attention_weights(torch.tensor([ids], device=device))[:, 0].cpu()  # (n_layers, n_heads, T, T)
        finally:
            self.model.train(was_training)
        self.weights[text] = w
        labels = token_labels(self.tokenizer, ids)
        layers = []
        for layer in range(w.shape[0]):
            heads = [self._image(w[layer, head], labels, f"layer {layer}, head {head}") for head in range(w.shape[1])]
            layer_stack = widgets.Stack(heads, selected_index=self.head.value)
            widgets.jslink((self.head, "value"), (layer_stack, "selected_index"))
            layers.append(layer_stack)
        text_stack = widgets.Stack(layers, selected_index=self.layer.value)
        widgets.jslink((self.layer, "value"), (text_stack, "selected_index"))
        self.maps.children = (*self.maps.children, text_stack)
        label = option_label(text, shortened=shortened)
        self.text.options = (*self.text.options, (label, len(self.text.options)))
        self._select(len(self.text.options) - 1)

    def _select(self, index: int) -> None:
        # The jslinks keep the selections in step in the browser; this keeps the kernel's copy
        # (and so the state stored in the notebook) the same.
        self.text.index = self.maps.selected_index = index

    def _image(self, weights: torch.Tensor, labels: list[str], title: str) -> widgets.Image:
        from PIL import Image  # matplotlib's own dependency

        with mpl.rc_context(style.RC):
            fig = Figure(figsize=style.size(1, 5.0), dpi=self.dpi, layout="constrained")
            plot_attention(weights, labels, fig.add_subplot(), title)
            buffer = io.BytesIO()
            FigureCanvasAgg(fig).print_png(buffer)
        png = io.BytesIO()
        Image.open(buffer).convert("RGB").quantize(colors=256).save(png, format="png", optimize=True)
        return widgets.Image(value=png.getvalue(), format="png", width=str(IMAGE_WIDTH_PX),
                             layout=widgets.Layout(max_width="100%", height="auto"))

    def _on_new_text(self, change: dict) -> None:
        text = change["new"]
        if text and text not in self.weights:
            try:
                self.add_text(text)
                self.message.value = ""
            except ValueError as err:
                self.message.value = f"<span style='color: #b00'>{html.escape(str(err))}</span>"

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)
