"""Mistral (7B v0.1–v0.3, Small, Nemo as ``model_type: mistral``): sliding-window attention.

The window is the mask's business: phase A keeps every prefix token's keys/values (a full cache,
:mod:`.decoder`), and the decoder's sliding-window mask, built from the explicit positions, hides the
keys more than a window behind each query, as in the full forward. The exactness test runs sequences
longer than the window.
"""

from __future__ import annotations

from verbatim.trainer.adapters.decoder import HFDecoderLM

ADAPTERS = {"mistral": HFDecoderLM}
