"""The other layers a Transformer block is made of: normalisation and the feed-forward block.

* :mod:`~attnlib.layers.norms`: LayerNorm and RMSNorm written out (chapter 10);
* :mod:`~attnlib.layers.feedforward`: the GELU MLP (chapters 10, 12) and the gated SwiGLU and GeGLU
  blocks of modern decoders (chapter 16).
"""
from attnlib.layers.feedforward import FEEDFORWARDS, FeedForward, GatedFeedForward, GeGLU, SwiGLU
from attnlib.layers.norms import LayerNorm, RMSNorm

__all__ = ["FEEDFORWARDS", "FeedForward", "GatedFeedForward", "GeGLU", "LayerNorm", "RMSNorm", "SwiGLU"]
