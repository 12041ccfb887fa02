"""The learner: one training step on exactly the traced tokens, and the weights it hands the engine.

A step takes the rows of the step's trained rollouts (their token columns as written: ids,
sources, sampler logprobs μ, policy versions) with one advantage per row, and:

1. computes π_old, the trainer's log π of every model token before any update (no grad), at the
   temperature the rows were sampled at (``StepInput.temperature``: log_softmax(logits / T)), through
   the model's path (:func:`~verbatim.trainer.adapters.trainer_lm`: PrefixFlow where its family has an
   adapter, else the plain forward), and from the same logits the policy's entropy before each of
   those tokens (the step's ``entropy`` metric: its mean over the model tokens, in nats);
2. corrects π_old against μ and the versions (:func:`~verbatim.trainer.correction.correct`):
   behaviour weights, the rows' kept tokens, and the mismatch metrics of the step's own
   rollouts before the optimizer moves (on a synchronous step this is the engine/trainer
   agreement);
3. splits the rows into ``updates_per_step`` optimizer updates (one per row where fewer); each update's loss is the
   decoupled objective of :mod:`~verbatim.trainer.objective` with one normaliser over the
   update's rows, so its gradient does not depend on the microbatch split or on PrefixFlow;
   with ``loss.kl_coef`` > 0 the loss also pulls toward the reference policy, a frozen copy of the
   starting weights whose log π on the step's tokens is computed like π_old's (the ``kl_ref`` metric:
   k3's estimate of KL(π_old ‖ π_ref) per model token);
   clips the gradient norm and steps AdamW;
4. increments the version.

The learning rate follows ``lr_schedule`` over the run's steps (:func:`scheduled_lr`, a pure
function of the step index, so a resumed run takes the same rate at the same step).

The model is a Hugging Face causal LM in float32 (:func:`~verbatim.trainer.reference.load_model`),
put in train mode; a model with dropout is refused (PrefixFlow runs a group's prompt once). Its weights
stay float32 (the master weights, what :meth:`Learner.engine_weights` hands the engine) and so do the
gradients and AdamW's state; ``dtype="bf16"`` runs the forward in bfloat16 under autocast, log π in
float32 (:class:`~verbatim.trainer.causal_lm.LearnerLM`, which also computes log π ``logprob_chunk``
rows at a time). ``checkpoint_layers`` recomputes each decoder layer's activations in the backward
(:func:`checkpointed_path`).
"""

from __future__ import annotations

import copy
import functools
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from verbatim.errors import InputError, TrainerError
from verbatim.trainer import lora
from verbatim.trainer.adapters import TrainerPath, prefix_lm, trainer_lm
from verbatim.trainer.batch import behaviour_batch
from verbatim.trainer.causal_lm import LearnerLM, PrefixCausalLM, refuse_dropout
from verbatim.trainer.checkpoint import seed_generators
from verbatim.trainer.correction import correct
from verbatim.trainer.distributed.sharding import ShardedModel, WholeModel
from verbatim.trainer.distributed.split import rows_of
from verbatim.trainer.distributed.team import Team
from verbatim.trainer.learner_config import LearnerConfig
from verbatim.trainer.objective import kl_penalty, loss_coefficients
from verbatim.trainer.packing import Microbatching
from verbatim.trainer.passes import Agree
from verbatim.trainer.routing_replay import Flips, counting_flips, mean_gap, row_experts
from verbatim.trainer.step_input import StepInput
from verbatim.trainer.truncation import outside_support
from verbatim.trainer.update import StepBatch, policy_values, row_work, run_work
from verbatim.trainer.weight_files import checkpoint_format


def scheduled_lr(config: LearnerConfig, step: int, steps: int) -> float:
    """The learning rate of step ``step`` (0-based) of ``steps``: from ``lr`` at the first step to
    ``lr * lr_final`` at the last, in a straight line or along half a cosine; ``constant`` keeps ``lr``."""
    if config.lr_schedule == "constant" or steps <= 1:
        return config.lr
    progress = min(max(step / (steps - 1), 0.0), 1.0)
    if config.lr_schedule == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.lr * (config.lr_final + (1.0 - config.lr_final) * shape)


def row_logprobs(logp: torch.Tensor, loss_mask: torch.Tensor, lengths: torch.Tensor,
                 keep: torch.Tensor) -> list[tuple[np.ndarray, np.ndarray]]:
    """Padded (B, T) log π and the correction's keep mask → per row, float32 log π (NaN off the row's model
    tokens) and the keep mask, each as long as the row: what the trainer logprob files hold."""
    logp, loss_mask, keep = logp.detach().float().cpu().numpy(), loss_mask.cpu().numpy(), keep.cpu().numpy()
    rows = []
    for i, n in enumerate(lengths.tolist()):
        model = loss_mask[i, :n].astype(bool)
        rows.append((np.where(model, logp[i, :n], np.nan).astype(np.float32), keep[i, :n].astype(bool) & model))
    return rows


class Learner:
    """A causal LM, its AdamW optimizer and its policy version; with a ``team`` of more than one rank, the
    model is sharded over the ranks (FSDP2, :mod:`verbatim.trainer.distributed`), each rank trains the rows
    of its own groups, and every rank makes the same update one process would."""

    def __init__(self, model: nn.Module | ShardedModel, config: LearnerConfig, version: int = 0,
                 team: Team | None = None, seed: int | None = None, reference: ShardedModel | None = None) -> None:
        """``seed``: the run's, for the process's generators (none of the step's work draws from them; seeded,
        a checkpoint's ``rng.pt`` repeats too). ``model``: a whole model (sharded here on a team), or one a
        team already sharded as it loaded it (:mod:`~verbatim.trainer.distributed.loading`), whose KL penalty
        then needs its ``reference`` loaded the same way."""
        placement = model if isinstance(model, ShardedModel) else None
        model = placement.model if placement is not None else model
        refuse_dropout(model)
        if config.lora.rank is not None and not lora.has_adapter(model) and placement is not None:
            raise TrainerError("a team's LoRA model gets its adapter as it loads, before it is sharded")
        if seed is not None:
            seed_generators(seed)
        if placement is not None and config.loss.kl_coef > 0 and reference is None:
            raise TrainerError("a learner sharded as it loaded needs its KL reference loaded the same way")
        self.reference = (reference.model.eval().requires_grad_(False) if reference is not None
                          else frozen_copy(model) if config.loss.kl_coef > 0 else None)
        """The policy a KL penalty pulls toward: the weights the learner starts from (a resumed run's
        too: a learner is built from the run's model, then restored), sharded over a team as the model is."""
        if config.lora.rank is not None and not lora.has_adapter(model):
            lora.attach(model, config.lora, base=getattr(model.config, "_name_or_path", None), seed=seed or 0)
        elif config.lora.rank is None and lora.has_adapter(model):
            raise TrainerError("the model carries a LoRA adapter but the learner is configured without one",
                               hint="pass --lora-rank R")
        self.model = model.train()
        self.config = config
        if config.prefixflow:
            prefix_lm(model)  # PrefixFlow required: a family without an adapter is refused now, not at a step
        self.path_options = checkpointed_path(model, config) if config.checkpoint_layers else {}
        self.version = version
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        self.team = team or Team()
        self.placement = placement or (ShardedModel(model, self.team, config.dtype) if self.team.size > 1
                                       else WholeModel(model))
        shard_reference = self.reference is not None and self.team.size > 1
        self.reference_placement = reference or (ShardedModel(self.reference, self.team, config.dtype)
                                                 if shard_reference else WholeModel(self.reference))
        self.microbatching = Microbatching(config.microbatch, config.microbatch_tokens)
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.lr,
                                           weight_decay=config.weight_decay)  # LoRA: the adapter's alone

    # -- the step ------------------------------------------------------------------------------

    def train_step(self, step: StepInput, at: tuple[int, int] = (0, 1)) -> dict[str, Any]:
        """One step (see the module docstring); ``at`` is (this step, the run's steps) for the learning-rate
        schedule. Returns the step's metrics, and under ``row_logprobs`` each row's π_old and keep mask
        (:func:`row_logprobs`); the version moves by one."""
        started = time.perf_counter()
        lr = scheduled_lr(self.config, *at)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        rows = len(step.columns)
        if rows == 0:
            self.version += 1  # nothing to learn from: the policy is unchanged but the step counts
            return {"rows": 0, "loss": 0.0, "grad_norm": 0.0, "updates": 0, "train_s": 0.0, "correction": None,
                    "lr": lr, "ranks": self.team.size, "padding_tokens": 0}
        batch = behaviour_batch(step.columns)
        self._check_vocab(batch.token_ids, batch.lengths)
        device = next(self.model.parameters()).device  # the batch goes where the model is (CPU or a GPU)
        ids, mask = batch.token_ids.to(device), batch.loss_mask.to(device)
        sequences = tuple(ids[i, : int(batch.lengths[i])] for i in range(rows))
        lm, path = self.trainer_lm(step.temperature)
        here = rows_of(step.groups, batch.lengths.tolist(), self.team.size, self.team.rank)
        ours = torch.zeros(rows, dtype=torch.bool, device=device)
        ours[here] = True
        agree = functools.partial(self.team.agree, device=device)  # every rank makes each pass's calls together
        shared = {"groups": step.groups, "prefixflow": path == "prefixflow"}  # a group's prompt runs once
        experts = row_experts(step.columns, device) if self.config.routing_replay else None
        replay: dict[str, Any] = {}
        with self.placement.gathered():
            with counting_flips() as flips:
                old = policy_values(lm, sequences, mask & ours[:, None], self.microbatching, agree, **shared,
                                    experts=experts)
            logp_old = self.team.sum_(old.logprobs)
            if experts is not None:
                replay = self._replay_metrics(lm, sequences, (mask, ours), batch.logp_mu.to(device), logp_old,
                                              flips, agree, shared)
            entropy = self.team.total(float(old.entropy.sum(dtype=torch.float64)))  # each rank's rows
            support = (int(self.team.total(outside_support(lm, sequences, mask & ours[:, None], *step.truncation,
                                                           self.microbatching, self.config.logprob_chunk, agree,
                                                           experts)))
                       if step.truncation is not None else None)  # each rank counts its own rows
        logp_ref = None
        if self.reference is not None:
            with self.reference_placement.gathered():
                logp_ref = self.team.sum_(policy_values(self.reference_lm(step.temperature), sequences,
                                                        mask & ours[:, None], self.microbatching, agree,
                                                        **shared).logprobs)
        fix = correct(logp_old, self._behaviour(step, batch.logp_mu.to(device), logp_old, mask), mask,
                      batch.versions.to(device), self.version, self.config.correction)
        advantages = torch.as_tensor(np.asarray(step.advantages, dtype=np.float64), dtype=torch.float32,
                                     device=device)
        per_row = row_logprobs(logp_old, mask, batch.lengths, fix.keep)
        updating = time.perf_counter()  # the actor update from here: forward, backward and optimizer step
        loss, padded = 0.0, 0
        norms = []
        for update_rows in self.update_splits(rows):
            loss_u, norm, padded_u = self._update(lm, path, sequences, fix.weights, fix.keep, (logp_old, logp_ref),
                                                  advantages, step.groups, update_rows, set(here), agree, experts)
            loss += loss_u
            padded += padded_u
            norms.append(norm)
        self.version += 1
        metrics = {"rows": rows, "lr": lr, "loss": loss, "grad_norm": float(np.mean(norms)),
                   "grad_norm_max": float(max(norms)), "updates": len(norms), "trainer_path": path,
                   "temperature": step.temperature, "kept_tokens": int(fix.keep.sum()),
                   "model_tokens": int(batch.loss_mask.sum()), "correction": fix.metrics.as_dict(),
                   "entropy": entropy / max(int(batch.loss_mask.sum()), 1), "ranks": self.team.size,
                   "padding_tokens": int(self.team.total(padded)),
                   "policy_s": updating - started, "update_s": time.perf_counter() - updating}
        if support is not None:
            metrics["outside_support"] = support
        metrics |= replay
        if logp_ref is not None:  # k3's value, an estimate of KL(π_old ‖ π_ref) per model token (0 off the mask)
            k3 = kl_penalty(logp_old.double(), logp_ref.double(), "k3")
            metrics["kl_ref"] = float(k3.sum()) / max(int(batch.loss_mask.sum()), 1)
        return metrics | {"train_s": time.perf_counter() - started, "row_logprobs": per_row}

    def trainer_lm(self, temperature: float = 1.0) -> tuple[LearnerLM, TrainerPath]:
        """The model's path at ``temperature`` as the config runs it (chunked log π, its dtype, its checkpointing)."""
        lm, path = trainer_lm(self.model, self.config.prefixflow, temperature, **self.path_options)
        return LearnerLM(lm, self.config.logprob_chunk, self.config.dtype), path

    def reference_lm(self, temperature: float) -> LearnerLM:
        """The reference policy's path at ``temperature``, run as the learner runs its own (chunks, dtype)."""
        lm, _ = trainer_lm(self.reference, self.config.prefixflow, temperature)
        return LearnerLM(lm, self.config.logprob_chunk, self.config.dtype)

    def update_splits(self, rows: int) -> list[list[int]]:
        """The rows of each optimizer update: consecutive (a group stays together where it can). A step with
        fewer rows than ``updates_per_step`` (its errors left fewer) takes one update per row."""
        count = min(self.config.updates_per_step, rows)
        return [list(map(int, part)) for part in np.array_split(np.arange(rows), count)]

    def _update(self, lm: PrefixCausalLM, path: TrainerPath, sequences: tuple[torch.Tensor, ...], weights: torch.Tensor,
                keep: torch.Tensor, logp: tuple[torch.Tensor, torch.Tensor | None], advantages: torch.Tensor,
                groups: Sequence[Sequence[int]], rows: list[int], here: set[int],
                agree: Agree, experts: tuple[torch.Tensor, ...] | None = None) -> tuple[float, float, int]:
        """One optimizer update over ``rows``; ``logp`` is (π_old's, the reference's or None) log-probabilities.
        Returns its loss, its gradient's norm and this rank's padded token slots."""
        loss_config = self.config.loss
        coef = torch.zeros_like(weights)
        coef[rows] = loss_coefficients(weights[rows], keep[rows], loss_config.normaliser)
        # a zero advantage gives zero gradient, unless a KL penalty pulls: skip its forward
        trained = keep if loss_config.kl_coef > 0 else keep & (advantages != 0)[:, None]
        batch = StepBatch(sequences=sequences, keep=trained, coef=coef, logp_old=logp[0], advantages=advantages,
                          groups=tuple(tuple(g) for g in groups), logp_ref=logp[1], kl_coef=loss_config.kl_coef,
                          kl_estimator=loss_config.kl_estimator, experts=experts)
        work = row_work(batch, [r for r in rows if r in here], path == "prefixflow", self.microbatching)
        with self.placement.update():  # this rank's rows; leaving it, the gradient is the update's whole one
            loss = run_work(lm, batch, work, self.config.loss.clip_eps, self.config.prefix_activations, agree)
        loss = self.team.total(loss)
        norm = self.placement.grad_norm(self.config.max_grad_norm)
        if not np.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise TrainerError(f"the gradient norm is {norm} at version {self.version}",
                               hint="lower --lr, or check the rewards and advantages")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss, norm, work.padding

    def _replay_metrics(self, lm: LearnerLM, sequences: tuple[torch.Tensor, ...], masks: tuple[torch.Tensor, ...],
                        logp_mu: torch.Tensor, logp_old: torch.Tensor, flips: Flips, agree: Agree,
                        shared: dict[str, Any]) -> dict[str, Any]:
        """Under routing replay: the share of token-layers the trainer's own router would have sent elsewhere,
        and the mean |log π − log μ| with the replay and without it (π_old once more, routed by the trainer)."""
        mask, ours = masks
        own = self.team.sum_(policy_values(lm, sequences, mask & ours[:, None], self.microbatching, agree,
                                           **shared).logprobs)
        (replayed, tokens), (unreplayed, _) = mean_gap(logp_old, logp_mu, mask), mean_gap(own, logp_mu, mask)
        token_layers = self.team.total(flips.replayed)
        return {"routing_flip_rate": self.team.total(flips.flipped) / token_layers if token_layers else None,
                "mismatch_replayed": replayed / tokens if tokens else None,
                "mismatch_unreplayed": unreplayed / tokens if tokens else None}

    def _check_vocab(self, token_ids: torch.Tensor, lengths: torch.Tensor) -> None:
        """Refuse a token id the model has no embedding for (past its vocabulary, or negative)."""
        rows = [token_ids[i, : int(n)] for i, n in enumerate(lengths) if int(n)]
        top = max((int(r.max()) for r in rows), default=0)
        bottom = min((int(r.min()) for r in rows), default=0)
        bad = top if top >= self.vocab_size else bottom
        if top >= self.vocab_size or bottom < 0:
            raise InputError(f"the traces hold token id {bad}, outside the trainer model's vocabulary of "
                             f"{self.vocab_size}", hint="train the model that played the rollouts (--model)")

    @staticmethod
    def _behaviour(step: StepInput, logp_mu: torch.Tensor, logp_old: torch.Tensor,
                   mask: torch.Tensor) -> torch.Tensor:
        """μ of every model token: the trace's, or π_old where the rows have none (``behaviour_from_trainer``)."""
        missing = torch.isnan(logp_mu) & mask
        if not bool(missing.any()):
            return logp_mu
        if not step.behaviour_from_trainer:
            raise TrainerError(f"{int(missing.sum())} model tokens of the step have no sampler logprob",
                               hint="train on traces written by verbatim run/train (every sampled token "
                                    "carries its logprob)")
        return torch.where(missing, logp_old.detach().to(logp_mu.dtype), logp_mu)

    # -- weights for the engine ---------------------------------------------------------------

    @property
    def trains_adapter(self) -> bool:
        """Whether the learner trains a LoRA adapter (the base frozen) rather than the whole model."""
        return lora.has_adapter(self.model)

    def engine_weights(self) -> dict[str, torch.Tensor]:
        """The model's weights by name, each once (a tied output layer is left to its embedding), as the family's
        checkpoints name and lay them out (:func:`~verbatim.trainer.weight_files.checkpoint_format`). Sharded,
        every rank must call it, and rank 0 alone receives them. A LoRA learner's are its adapter's alone, under
        PEFT's names (:func:`~verbatim.trainer.lora.adapter_weights`)."""
        if self.trains_adapter:
            return self.placement.adapter_weights()
        return checkpoint_format(self.model, self.placement.weights())

    def merged_weights(self) -> dict[str, torch.Tensor]:
        """A LoRA learner's weights with the adapter folded in (W + scale·B·A), each once, as :meth:`engine_weights`
        gives a whole model's: what an engine that serves no LoRA is pushed instead of the adapter."""
        return checkpoint_format(self.model, self.placement.merged_weights())

    def write_adapter(self, folder: Path) -> Path:
        """The adapter as a PEFT folder at ``folder`` (a LoRA learner), what the engine loads as a new LoRA."""
        weights = self.engine_weights()
        return lora.write_adapter(folder, weights=weights, settings=lora.adapter_settings(self.model))

    def save(self, root: Path, step: int, state: dict[str, Any], keep: int = 2,
             model_files: Sequence[Path] = ()) -> Path | None:
        """Checkpoint the learner as step ``step`` (:func:`~verbatim.trainer.checkpoint.save_checkpoint`); a
        sharded learner's ranks all call it and rank 0 writes."""
        return self.placement.save(self.optimizer, root, step, state, keep, model_files)

    def restore(self, path: Path) -> dict[str, Any]:
        """Load the checkpoint at ``path`` (weights, optimizer state, RNG); returns its state.json."""
        return self.placement.restore(self.optimizer, path)

    def keep_weights_in(self, views: dict[str, torch.Tensor]) -> int:
        """Let each parameter named in ``views`` live in its view (equal values, shape and dtype: the engine's
        shared buffer, engine/weight_push.py), so pushing the weights copies nothing. The parameters stay the
        optimizer's own objects; returns how many moved."""
        if self.team.size > 1:
            raise TrainerError("a sharded learner's parameters cannot live in the engine's buffer",
                               hint="push its weights by copy (the in-memory push is for one process)")
        moved = 0
        for name, param in self.model.named_parameters():
            view = views.get(name)
            if view is None:
                continue
            if view.shape != param.shape or view.dtype != param.dtype or not torch.equal(view, param.detach()):
                raise TrainerError(f"{name}: the shared view is not the parameter ({tuple(view.shape)} {view.dtype})")
            param.data = view
            moved += 1
        return moved


def frozen_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` that never trains: eval mode, no gradients."""
    return copy.deepcopy(model).eval().requires_grad_(False)


def checkpointed_path(model: nn.Module, config: LearnerConfig) -> dict[str, Any]:
    """Turn on activation checkpointing for the path ``config`` trains ``model`` on; returns the keywords
    :func:`~verbatim.trainer.adapters.trainer_lm` takes for it.

    The plain path uses Hugging Face's own (``gradient_checkpointing_enable``, non-reentrant): its decoder
    layers drop a cache, which the plain path never keeps. PrefixFlow keeps and reads a prefix's
    keys/values, so its adapters checkpoint each decoder layer themselves (``checkpoint_layers=True``).
    """
    _, path = trainer_lm(model, config.prefixflow)
    if path == "plain":
        if not getattr(model, "supports_gradient_checkpointing", False):
            raise TrainerError(f"activation checkpointing: {type(model).__name__} does not support it",
                               hint="drop --activation-checkpointing")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return {}
    return {"checkpoint_layers": True}
