"""Caches: what each layer keeps from past tokens, behind one protocol. Chapters 08, 17, 18, 19.

* :class:`LayerCache` (:mod:`~attnlib.cache.layer`): every position, contiguous (chapter 08); the protocol;
* :class:`RingLayerCache`, :class:`SinkLayerCache`, :class:`ChunkedLayerCache`
  (:mod:`~attnlib.cache.windowed`): a window, StreamingLLM's sinks + a window, the current chunk
  (chapter 17);
* :class:`PagedLayerCache`, :class:`PagedKVCache`, :class:`PageAllocator` (:mod:`~attnlib.cache.paged`):
  vLLM's pages shared by many sequences (chapter 19); the free list and block tables in
  :mod:`~attnlib.cache.allocator`; :class:`PrefixPageAllocator` (:mod:`~attnlib.cache.prefix`): the full pages of
  equal prefixes shared between sequences (prefix caching, SGLang / vLLM; chapter 19);
* :class:`RecurrentState` (:mod:`~attnlib.cache.recurrent`): a linear-attention layer's fixed state (chapter 18);
* :class:`SharedLayerCache`, :class:`ForwardLayerCache` (:mod:`~attnlib.cache.shared`): a layer that attends
  with another layer's keys and values keeps none (cross-layer KV sharing, Gemma 4; chapter 20);
* :class:`Int8LayerCache`, :class:`KIVILayerCache` (:mod:`~attnlib.cache.quantized`): keys and values in 8, 4
  or 2 bits (KIVI, Liu et al. 2024; :meth:`KVCache.quantized`; chapter 19);
* :class:`H2OLayerCache`, :class:`SnapKVLayerCache` (:mod:`~attnlib.cache.eviction`): keys kept by their
  attention, a fixed budget per head (H2O, Zhang et al. 2023; SnapKV, Li et al. 2024; :meth:`KVCache.eviction`;
  chapter 17);
* :class:`CompressedLayerCache` (:mod:`~attnlib.cache.compressed`): a window, compressed entries every m tokens
  and the pending group (DeepSeek-V4's CSA / HCA; :func:`compressed_cache_bytes` against :func:`mla_cache_bytes`;
  chapter 21);
* :class:`KVCache` (:mod:`~attnlib.cache.model`): one of the above per layer of a decoder;
* :func:`kv_cache_bytes` (:mod:`~attnlib.cache.memory`): the memory a cache will need, before allocating it.
"""
from attnlib.cache.compressed import CompressedLayerCache, compressed_cache_bytes, mla_cache_bytes
from attnlib.cache.eviction import H2OLayerCache, SnapKVLayerCache
from attnlib.cache.layer import LayerCache
from attnlib.cache.memory import kv_cache_bytes, layer_cache_lengths, layer_windows
from attnlib.cache.model import KVCache
from attnlib.cache.paged import OutOfPages, PageAllocator, PagedKVCache, PagedLayerCache
from attnlib.cache.prefix import PrefixPageAllocator
from attnlib.cache.quantized import Int8LayerCache, KIVILayerCache
from attnlib.cache.recurrent import RecurrentState
from attnlib.cache.shared import ForwardLayerCache, SharedLayerCache, forward_caches
from attnlib.cache.windowed import ChunkedLayerCache, RingLayerCache, SinkLayerCache

__all__ = [
    "ChunkedLayerCache",
    "CompressedLayerCache",
    "ForwardLayerCache",
    "H2OLayerCache",
    "Int8LayerCache",
    "KIVILayerCache",
    "KVCache",
    "LayerCache",
    "OutOfPages",
    "PageAllocator",
    "PagedKVCache",
    "PagedLayerCache",
    "PrefixPageAllocator",
    "RecurrentState",
    "RingLayerCache",
    "SharedLayerCache",
    "SinkLayerCache",
    "SnapKVLayerCache",
    "compressed_cache_bytes",
    "forward_caches",
    "kv_cache_bytes",
    "layer_cache_lengths",
    "layer_windows",
    "mla_cache_bytes",
]
