"""The names the trainer's choices take, apart from the settings that hold them (trainer/learner_config.py,
pydantic): the modules of a training step import these, so the step's code needs torch and no more
(scripts/gpu_probe.py runs it on a GPU machine that has torch and transformers alone)."""

from __future__ import annotations

from typing import Literal, get_args

Precision = Literal["fp32", "bf16"]
"""The trainer forward's dtype (:mod:`verbatim.trainer.causal_lm`)."""
Offload = Literal["keep", "recompute", "cpu", "disk"]
"""Where a shared prompt's activations wait for PrefixFlow's delayed backward (trainer/prefix_offload.py)."""
OFFLOADS: tuple[str, ...] = get_args(Offload)
Normaliser = Literal["token", "sequence"]
KlEstimator = Literal["k3", "k2"]
