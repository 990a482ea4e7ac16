"""Attention over the paged cache: the interface transformers calls per layer, its backends
(varlen, native, reference), the native kernel and the attention of cached prefixes."""
