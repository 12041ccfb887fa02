"""Phi-3 / Phi-3.5 / Phi-4-mini (``model_type: phi3``): fused qkv and gate/up projections, partial rotary,
an optional sliding window.

All of it lives inside the decoder's modules; the window is applied by the mask over a full cache
(:mod:`.decoder`), as for Mistral. A long-context rotary scaling that depends on the sequence length
(``rope_scaling`` of type ``longrope``) switches its factors at ``original_max_position_embeddings``
from the positions the decoder sees, which are the same in both paths.
"""

from __future__ import annotations

from verbatim.trainer.adapters.decoder import HFDecoderLM

ADAPTERS = {"phi3": HFDecoderLM}
