"""Qwen2 / Qwen2.5, Qwen3 and Qwen3-MoE.

* Qwen2's optional sliding window (``use_sliding_window``) and Qwen3's per-head q/k norms run inside the
  decoder; the kept cache is a full one (:mod:`.decoder`), the mask applies any window.
* Qwen3-MoE: a token's router sees only that token's hidden state, so PrefixFlow routes every token as
  the full forward does; its top-k is the same function of the same inputs, and the exactness test
  checks the gradients through the router and the experts. The load-balancing loss is not part of the
  RL objective (the trainer runs the decoder, not ``output_router_logits``), in either path.
"""

from __future__ import annotations

from verbatim.trainer.adapters.decoder import HFDecoderLM

ADAPTERS = {"qwen2": HFDecoderLM, "qwen3": HFDecoderLM, "qwen3_moe": HFDecoderLM}
