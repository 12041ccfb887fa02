"""How the trainer steps, as settings: :class:`LearnerConfig` with its :class:`LossConfig` and
:class:`CorrectionConfig`, and the names their choices take.

Apart from the code they configure (:mod:`verbatim.trainer.learner`, :mod:`~verbatim.trainer.objective`,
:mod:`~verbatim.trainer.correction`), so a config can be read, checked and turned into flags without torch.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from verbatim.trainer.modes import KlEstimator, Normaliser, Offload, Precision


class CorrectionConfig(BaseModel):
    """Which corrections to apply; ``None`` turns a mode off (:mod:`verbatim.trainer.correction`)."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    token_tis_cap: float | None = Field(default=2.0, gt=0)
    """Token-level TIS: weight min(pi/mu, cap); 0 (None) turns it off."""

    token_mask_band: tuple[float, float] | None = (0.5, 5.0)
    """Drop tokens whose pi/mu is outside LOW,HIGH; none turns it off."""

    sequence_tis: Literal["product", "geo_mean"] | None = None
    """Sequence-level TIS instead of token-level, over the sequence's model tokens: product | geo_mean (then
    set --token-tis-cap 0)."""

    sequence_tis_cap: float = Field(default=2.0, gt=0)
    """Sequence-level TIS: weight min(ratio, cap) (with --sequence-tis)."""

    sequence_mask_band: tuple[float, float] | None = None
    """Drop sequences whose geometric-mean ratio is outside LOW,HIGH."""

    max_version_lag: int | None = Field(default=None, ge=0)
    """Drop tokens sampled more than this many versions behind the trainer. Default off (a training run
    derives it from its plan's max_lag)."""

    version_lag_mask: bool = True
    """Drop tokens more than --max-lag versions behind the trainer (a training run's max_version_lag); off,
    they are kept and weighted by the other corrections alone (an ablation)."""

    hybrid_window: int = Field(default=32, ge=1)
    """Metrics only: tokens within this many model tokens after a weight update are 'hybrid'."""

    @model_validator(mode="after")
    def _bands_ordered(self) -> CorrectionConfig:
        for name in ("token_mask_band", "sequence_mask_band"):
            band = getattr(self, name)
            if band is not None and not 0 <= band[0] < band[1]:
                raise ValueError(f"--{name.replace('_', '-')} {band[0]:g},{band[1]:g} must satisfy "
                                 "0 <= LOW < HIGH (e.g. 0.5,5, or none)")
        return self

    @model_validator(mode="after")
    def _one_tis_level(self) -> CorrectionConfig:
        if self.token_tis_cap is not None and self.sequence_tis is not None:
            raise ValueError(f"--sequence-tis {self.sequence_tis} replaces token-level TIS, which --token-tis-cap "
                             f"{self.token_tis_cap:g} keeps on: add --token-tis-cap 0 (token_tis_cap=None)")
        return self


class LossConfig(BaseModel):
    """How the step's loss is normalised and clipped."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    normaliser: Normaliser = "token"
    """token: the step's loss is a mean over all its trained tokens (the update's kept tokens); sequence: a
    mean over sequences of each one's token mean."""

    clip_eps: float = Field(default=0.2, gt=0, lt=1)
    """PPO clip range of pi/pi_old (bites only with more than one update per step)."""

    kl_coef: float = Field(default=0.0, ge=0)
    """Beta of a per-token penalty toward the starting model (a frozen copy the trainer keeps); 0: none, and
    no reference model is kept (docs/trainer.md)."""

    kl_estimator: KlEstimator = "k3"
    """k3 (GRPO's; its value estimates KL(pi||ref), its gradient is KL(ref||pi)'s in expectation) | k2 (its
    gradient is KL(pi||ref)'s)."""


class LoraConfig(BaseModel):
    """A LoRA adapter trained in place of the whole model (:mod:`verbatim.trainer.lora`); no rank: the whole model."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    rank: int | None = Field(default=None, ge=1, le=512)
    """Train a LoRA adapter of this rank instead of the whole model: the base weights frozen, only the adapter in
    the optimizer, each push the adapter alone (docs/trainer.md)."""
    alpha: float | None = Field(default=None, gt=0)
    """The adapter's scale is alpha / rank; default: the rank (a scale of 1)."""
    dropout: float = Field(default=0.0, ge=0, lt=1)
    """Dropout on the adapter's input: only 0, since any other makes the trainer's π differ from the sampler's μ
    on the very tokens it trains."""
    targets: tuple[str, ...] | None = None
    """The linear modules the adapter wraps, by name (q_proj, v_proj, …); default: every linear layer of the
    decoder's attention and MLP."""

    @model_validator(mode="after")
    def _exact(self) -> LoraConfig:
        if self.dropout > 0:
            raise ValueError(f"--lora-dropout {self.dropout:g}: dropout makes the trainer's π differ from the "
                             "sampler's μ on the tokens it trains; use 0")
        if self.rank is None and (self.alpha is not None or self.targets is not None):
            raise ValueError("--lora-alpha and --lora-targets shape an adapter: add --lora-rank R")
        if self.targets is not None and not self.targets:
            raise ValueError("--lora-targets names no module: leave it out for the default")
        return self

    @property
    def scale_alpha(self) -> float:
        """The alpha the adapter is built with (the rank where none is given)."""
        return float(self.alpha if self.alpha is not None else self.rank or 0)


class LearnerConfig(BaseModel):
    """How the trainer steps (recorded in the run's config; a resume must match it)."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    lr: float = Field(default=1e-5, gt=0)
    """AdamW learning rate (of the first step)."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """constant | linear | cosine: from --lr at the first step to --lr × --lr-final at the last."""
    lr_final: float = Field(default=0.1, ge=0, le=1)
    """The last step's learning rate as a fraction of --lr (linear and cosine)."""
    weight_decay: float = Field(default=0.0, ge=0)
    """AdamW weight decay."""
    max_grad_norm: float = Field(default=1.0, gt=0)
    """Clip the gradient norm of each update."""
    updates_per_step: int = Field(default=1, ge=1)
    """Optimizer updates per step; above 1 the PPO clip on pi/pi_old applies (pi_old: the trainer at the step's
    start)."""
    microbatch: int = Field(default=4, ge=1)
    """Rollouts per trainer forward/backward (suffix microbatches under PrefixFlow)."""
    microbatch_tokens: int | None = Field(default=None, ge=1)
    """Pack each trainer forward/backward up to this many tokens (rows × its longest row; PrefixFlow's suffixes by
    their own length), longest rows first, instead of --microbatch rows. At least the context length."""
    prefixflow: bool | None = None
    """Run each group's shared prompt through the trainer once per step (PrefixFlow). Default: where the model's
    family has an adapter (docs/trainer.md); --prefixflow requires one, --no-prefixflow trains whole
    sequences."""
    dtype: Precision = "fp32"
    """fp32 | bf16: bf16 runs the trainer's forward under bfloat16 autocast over fp32 weights and fp32 AdamW
    state (log π in fp32; on a team, FSDP gathers the weights in bfloat16 and reduces in float32): less memory;
    faster only on a CPU with bfloat16 instructions (AVX512-BF16, AMX) or a GPU (docs/trainer.md)."""
    checkpoint_layers: bool = False
    """Recompute each decoder layer's activations in the backward instead of keeping them: less memory, about
    one more forward of time."""
    logprob_chunk: int = Field(default=512, ge=0)
    """Tokens whose logits (over the whole vocabulary) the trainer computes at once, forward and backward; 0:
    all of a microbatch's at once."""
    prefix_activations: Offload = "keep"
    """keep | recompute | cpu | disk: under PrefixFlow, where a group's shared prompt's activations wait for
    their backward. recompute keeps none and runs the prompt forward once more: the least memory, about a tenth
    more time (docs/benchmarks.md)."""
    routing_replay: bool = False
    """Rollout Routing Replay: a MoE's routers send each token to the experts the engine recorded for it
    (``--record-routing``; trainer/routing_replay.py); a row without them is refused."""
    lora: LoraConfig = Field(default_factory=LoraConfig)
    """A LoRA adapter instead of the whole model (--lora-rank)."""
    loss: LossConfig = Field(default_factory=LossConfig)
    """How the step's loss is normalised, clipped and penalised."""
    correction: CorrectionConfig = Field(default_factory=CorrectionConfig)
    """How the mismatch between the sampler's μ and the trainer's π is corrected."""
