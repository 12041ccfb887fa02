"""Llama (Llama 2/3.x, SmolLM2, and every model that ships ``model_type: llama``): the decoder as is.

Nothing after the decoder but the output layer; rotary positions come from the explicit positions,
grouped-query attention reads the kept keys/values as the decoder stores them.
"""

from __future__ import annotations

from verbatim.trainer.adapters.decoder import HFDecoderLM

ADAPTERS = {"llama": HFDecoderLM}
