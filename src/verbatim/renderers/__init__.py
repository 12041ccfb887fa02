"""Token-exact chat rendering per model family: render, bridge (append-only), parse_completion.

See docs/renderers.md. Heavy dependencies (transformers, tokenizer files) load only when a
renderer or tokenizer is first requested.
"""

from verbatim.renderers.base import PREAMBLE, ChatFormat, RenderedTokens, Renderer
from verbatim.renderers.registry import get_renderer, renderer_names

__all__ = ["PREAMBLE", "ChatFormat", "RenderedTokens", "Renderer", "get_renderer", "renderer_names"]
