"""An attention explorer: pick a text, a layer and a head, see the attention weights (chapter 12).

:class:`AttentionExplorer` draws one heatmap per (text, layer, head) with matplotlib and puts
them in ipywidgets ``Stack`` containers whose selection is linked to the controls in the
browser (``jslink``). The page therefore stays interactive without a running kernel: a book
page built from the executed notebook embeds the widget state, and the dropdown and sliders
switch between the stored heatmaps. With a kernel, typing a new text adds it.

Usage::

    from attnlib.book.explorer import AttentionExplorer
    AttentionExplorer(model, tokenizer, ["ROMEO:\\nBut soft, what light"])  # shows itself in Jupyter
"""
from __future__ import annotations

import html
import io
from collections.abc import Sequence

import ipywidgets as widgets
import torch
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from attnlib.model import GPT

__all__ = ["AttentionExplorer", "plot_attention", "token_labels"]

# Characters a tick label cannot show as themselves.
_VISIBLE = {" ": "␣", "\n": "⏎", "\t": "⇥"}


def token_labels(tokenizer, ids: Sequence[int]) -> list[str]:
    """One printable label per token id: ``tokenizer.decode([id])`` with space, newline and
    tab shown as ``␣``, ``⏎`` and ``⇥``."""
    return ["".join(_VISIBLE.get(ch, ch) for ch in tokenizer.decode([i])) for i in ids]


def plot_attention(weights: torch.Tensor, labels: Sequence[str], ax: Axes, title: str | None = None) -> Axes:
    """Draw one head's attention weights as a heatmap on ``ax``.

    Args:
        weights: ``(T, T)`` float, row ``i`` = the weights query position ``i`` gives to each key.
        labels: ``T`` tick labels (see :func:`token_labels`).
        ax: the matplotlib axes to draw on.
        title: optional title.

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
    ax.imshow(weights.detach().cpu().float().numpy(), cmap="viridis", vmin=0.0, vmax=1.0)
    ax.set_xticks(range(T), labels, fontsize=7, fontfamily="monospace")
    ax.set_yticks(range(T), labels, fontsize=7, fontfamily="monospace")
    ax.tick_params(length=0)
    ax.set_xlabel("key position (attended to)")
    ax.set_ylabel("query position")
    if title:
        ax.set_title(title, fontsize=9)
    return ax


class AttentionExplorer:
    """Heatmaps of a GPT's attention weights, chosen by text, layer and head with ipywidgets.

    Every heatmap is drawn when a text is added, so the controls work in a static page too
    (their links to the ``Stack`` selections run in the browser). With a running kernel the
    text box adds a new text.

    Args:
        model: an :class:`attnlib.GPT` (any attention variant; run on its device in eval mode).
        tokenizer: has ``encode(str) -> list[int]`` and ``decode(list[int]) -> str`` (chapter 11).
        texts: the texts to show first; each must encode to 1 … ``block_size`` tokens.
        dpi: resolution of the heatmaps (dots per inch; the figure is 4.4 × 4.2 inches).

    Attributes:
        weights: ``{text: (n_layers, n_heads, T, T) float tensor}``, what each heatmap shows.
        widget: the ``ipywidgets.VBox`` to display.

    Raises:
        TypeError: ``model`` is not a GPT.
        ValueError: no texts, or a text that encodes to no token or to more than ``block_size``.
    """

    def __init__(self, model: GPT, tokenizer, texts: Sequence[str], dpi: int = 72) -> None:
        if not isinstance(model, GPT):
            raise TypeError(f"model must be an attnlib.GPT; got {type(model).__name__}")
        if isinstance(texts, str) or not texts:
            raise ValueError(f"texts must be a non-empty list of strings; got {texts!r}")
        self.model, self.tokenizer, self.dpi = model, tokenizer, dpi
        cfg = model.config
        self.weights: dict[str, torch.Tensor] = {}
        self.text = widgets.Dropdown(options=[], description="text", layout=widgets.Layout(width="28em"))
        self.layer = widgets.IntSlider(0, min=0, max=cfg.n_layers - 1, description="layer")
        self.head = widgets.IntSlider(0, min=0, max=cfg.n_heads - 1, description="head")
        self.new_text = widgets.Text(
            placeholder="type a text, press Enter (needs a running kernel)",
            description="new text",
            continuous_update=False,
            layout=widgets.Layout(width="28em"),
        )
        self.new_text.observe(self._on_new_text, names="value")
        self.message = widgets.HTML()  # why a typed text was refused
        self.maps = widgets.Stack([])  # one child per text: a Stack over layers of Stacks over heads
        widgets.jslink((self.text, "index"), (self.maps, "selected_index"))
        caption = widgets.HTML(
            "Row <i>i</i>: how the character at position <i>i</i> spreads its attention over positions "
            "0…<i>i</i> (each row sums to 1; above the diagonal is 0, the future)."
        )
        self.widget = widgets.VBox(
            [self.text, widgets.HBox([self.layer, self.head]), self.maps, caption, self.new_text, self.message]
        )
        for text in texts:
            self.add_text(text)
        self._select(0)

    def add_text(self, text: str) -> None:
        """Compute and draw every layer's and head's attention for ``text`` and select it.

        Raises:
            TypeError / ValueError: ``text`` not a string, or it encodes to no token or more
                than ``block_size`` tokens.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str; got {type(text).__name__}")
        ids = self.tokenizer.encode(text)
        block_size = self.model.config.block_size
        if not 1 <= len(ids) <= block_size:
            raise ValueError(f"text {text!r} is {len(ids)} tokens; the model takes 1 to block_size={block_size}")
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
        label = text if len(text) <= 40 else text[:39] + "…"
        self.text.options = (*self.text.options, (label.replace("\n", " ⏎ "), len(self.text.options)))
        self._select(len(self.text.options) - 1)

    def _select(self, index: int) -> None:
        # The jslinks keep the selections in step in the browser; this keeps the kernel's copy
        # (and so the state stored in the notebook) the same.
        self.text.index = self.maps.selected_index = index

    def _image(self, weights: torch.Tensor, labels: list[str], title: str) -> widgets.Image:
        fig = Figure(figsize=(4.4, 4.2), dpi=self.dpi, layout="constrained")
        plot_attention(weights, labels, fig.add_subplot(), title)
        buffer = io.BytesIO()
        FigureCanvasAgg(fig).print_png(buffer)
        return widgets.Image(value=buffer.getvalue(), format="png")

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
