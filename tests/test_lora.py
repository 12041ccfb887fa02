"""LoRA in the trainer (trainer/lora.py, the learner, checkpoints): the adapter is PEFT's, the base frozen, and
PrefixFlow runs the adapter's layers exactly as the plain forward does, for every family adapter."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from test_adapters import FAMILIES, TOLERANCE, against_hf, family_model
from test_trainer_learner import LR, assert_same_grads, step_rows

from verbatim.bench.prefixflow_exactness import make_group, tiny_llama
from verbatim.errors import CheckpointError, InputError, TrainerError
from verbatim.trainer import lora
from verbatim.trainer.adapters import prefix_lm
from verbatim.trainer.checkpoint import latest_checkpoint
from verbatim.trainer.learner import Learner
from verbatim.trainer.learner_config import LearnerConfig, LoraConfig
from verbatim.trainer.packing import microbatches
from verbatim.trainer.prefixflow import prefixflow_backward

pytestmark = pytest.mark.usefixtures("one_torch_thread")

RANK4 = LoraConfig(rank=4, alpha=8)


def with_adapter(model: torch.nn.Module, config: LoraConfig = RANK4, seed: int = 0) -> torch.nn.Module:
    """``model`` with an adapter whose B is random too (a fresh one's is zero: A would get no gradient)."""
    lora.attach(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    return model


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


IDS = torch.arange(3, 40).reshape(1, -1) % 97


# -- the adapter --------------------------------------------------------------------------------


def test_default_targets_are_each_familys_projections():
    assert lora.default_targets(family_model("llama")) == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                          "up_proj", "down_proj")
    assert set(lora.default_targets(family_model("phi3"))) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    assert lora.default_targets(family_model("qwen3_moe")) == ("q_proj", "k_proj", "v_proj", "o_proj")


def test_a_fresh_adapter_is_the_base_model_and_trains_alone():
    base = tiny_llama(tied=False, seed=0)
    model = lora.attach(copy.deepcopy(base), RANK4)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(lora.is_adapter_name(name) for name in trainable)
    assert len(trainable) == 2 * 7 * base.config.num_hidden_layers  # A and B of every projection of every layer
    assert torch.equal(logits(model, IDS), logits(base, IDS))


def test_a_target_that_names_no_linear_layer_is_refused_naming_those_there_are():
    with pytest.raises(InputError, match=r"--lora-targets qproj: .*\(it has q_proj,k_proj"):
        lora.attach(tiny_llama(tied=False), LoraConfig(rank=4, targets=("q_proj", "qproj")))


@pytest.mark.parametrize("settings,message", [
    (dict(rank=0), "greater than or equal to 1"),
    (dict(rank=8, dropout=0.1), "dropout makes the trainer's π differ"),
    (dict(alpha=16), "add --lora-rank"),
    (dict(rank=8, targets=()), "names no module"),
])
def test_settings_that_would_break_exactness_or_mean_nothing_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        LoraConfig(**settings)


def test_the_peft_folder_loads_with_peft_and_back_into_the_trainer(tmp_path):
    from peft import PeftModel

    base = tiny_llama(tied=False, seed=0)
    model = with_adapter(copy.deepcopy(base))
    lora.write_adapter(tmp_path / "a", model)
    assert lora.is_adapter_folder(tmp_path / "a")
    peft_model = PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path / "a"))
    assert torch.equal(logits(peft_model, IDS), logits(model, IDS))
    again = lora.attach(copy.deepcopy(base), RANK4)
    lora.load_adapter(tmp_path / "a", again)
    assert torch.equal(logits(again, IDS), logits(model, IDS))
    other = lora.attach(copy.deepcopy(base), LoraConfig(rank=8))
    with pytest.raises(CheckpointError, match="has r 4, this run's has 8"):
        lora.load_adapter(tmp_path / "a", other)


def test_merged_weights_are_peft_merge_and_a_plain_model_of_them_computes_the_adapters_function():
    from peft.tuners.lora import LoraLayer

    base = tiny_llama(tied=False, seed=0)
    model = with_adapter(copy.deepcopy(base))
    merged = lora.merged_weights(model)
    assert set(merged) == set(base.state_dict())
    plain = copy.deepcopy(base)
    plain.load_state_dict(merged, strict=True)
    peft_merged = copy.deepcopy(model)
    for module in peft_merged.modules():
        if isinstance(module, LoraLayer):
            module.merge()
    assert torch.equal(logits(plain, IDS), logits(peft_merged, IDS))
    torch.testing.assert_close(logits(plain, IDS), logits(model, IDS), rtol=0, atol=1e-4)
    assert not torch.equal(logits(plain, IDS), logits(base, IDS))


# -- PrefixFlow with an adapter --------------------------------------------------------------------


@pytest.mark.parametrize("model_type", FAMILIES)
def test_prefixflow_runs_the_adapter_as_the_plain_forward_does(model_type):
    """Log-probs and every adapter parameter's gradient against the plain Hugging Face forward/backward, to the
    float32 tolerance of docs/trainer.md; the base weights get no gradient."""
    model = with_adapter(family_model(model_type)).train()
    group = make_group(4, 0.6, loss_in_prefix=True, seed=1)
    lm = prefix_lm(model, 1.0)
    errors = against_hf(model, lm, group, lambda lm, g, f: prefixflow_backward(lm, g, f, microbatches(4, 3)), 1.0)
    assert max(errors) <= TOLERANCE, errors
    assert all(p.grad is None for name, p in model.named_parameters() if not lora.is_adapter_name(name))


def test_the_check_can_fail_an_adapter_prefixflow_skipped_would_be_seen():
    """The reference runs the adapter; PrefixFlow over the same weights without it is far off."""
    model = with_adapter(family_model("llama")).train()
    bare = copy.deepcopy(model)
    from peft.tuners.lora import LoraLayer

    for module in bare.modules():
        if isinstance(module, LoraLayer):
            module.enable_adapters(False)
    bare.requires_grad_(True)  # (something to take the backward's gradient)
    group = make_group(4, 0.6, loss_in_prefix=True, seed=1)
    seen: dict[int, torch.Tensor] = {}

    def record(logprobs, rows):
        for k, row in enumerate(rows.tolist()):
            seen[row] = logprobs[k].detach()
        return logprobs.sum() * 0

    prefixflow_backward(prefix_lm(bare, 1.0), group, record, microbatches(4, 3))
    from test_adapters import seen_logprob_err
    assert seen_logprob_err(model, group, seen, 1.0) > 100 * TOLERANCE


# -- the learner ---------------------------------------------------------------------------------------


def lora_learner(seed: int = 0, **config) -> Learner:
    return Learner(tiny_llama(tied=False, seed=seed), LearnerConfig(**{"lr": LR, "lora": RANK4, **config}))


def test_a_lora_step_moves_the_adapter_alone_and_the_optimizer_holds_only_its_state():
    learner = lora_learner()
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    metrics = learner.train_step(step_rows(learner.model))
    assert metrics["rows"] == 6 and learner.version == 1
    moved = {n for n, p in learner.model.named_parameters() if not torch.equal(p, before[n])}
    assert moved == {n for n in before if ".lora_B." in n}  # B starts at 0, so A's first gradient is 0
    learner.train_step(step_rows(learner.model, seed=1))
    moved = {n for n, p in learner.model.named_parameters() if not torch.equal(p, before[n])}
    assert moved == {n for n in before if lora.is_adapter_name(n)}
    held = [p for g in learner.optimizer.param_groups for p in g["params"]]
    assert len(held) == len(lora.adapter_weights(learner.model)) == len(learner.optimizer.state)
    assert set(learner.engine_weights()) == set(lora.adapter_weights(learner.model))
    assert all(name.startswith(lora.PREFIX) for name in learner.engine_weights())


def moving(gradients: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The gradients that are not 0: B's, in a fresh adapter's first step (A's are 0 there, B being 0; the
    adapters' exactness test above holds A's gradients too, with a B that is not 0)."""
    assert all(not g.any() for name, g in gradients.items() if ".lora_A." in name)
    return {name: g for name, g in gradients.items() if ".lora_B." in name}


def stepped_gradients(learner: Learner) -> list[dict[str, torch.Tensor]]:
    """The gradients AdamW steps on, per update, recorded from now on (AdamW's own first step is about ±lr wherever
    a gradient is not 0, however small: its moves are no measure of two gradients' agreement)."""
    names = {id(p): n for n, p in learner.model.named_parameters()}
    updates: list[dict[str, torch.Tensor]] = []
    learner.optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: updates.append({names[id(p)]: p.grad.clone() for g in opt.param_groups
                                                  for p in g["params"] if p.grad is not None}))
    return updates


def test_prefixflow_and_the_plain_path_take_the_same_lora_step():
    flow, plain = lora_learner(prefixflow=True), lora_learner(prefixflow=False)
    mine, theirs = stepped_gradients(flow), stepped_gradients(plain)
    rows = step_rows(flow.model, groups=2, size=3)
    assert flow.train_step(rows)["trainer_path"] == "prefixflow"
    assert plain.train_step(rows)["trainer_path"] == "plain"
    assert len(mine) == len(theirs) == 1
    assert_same_grads(moving(mine[0]), moving(theirs[0]))


def test_a_lora_checkpoint_is_a_peft_folder_and_restores_adapter_and_optimizer_bit_for_bit(tmp_path):
    from peft import PeftModel

    learner = lora_learner()
    learner.train_step(step_rows(learner.model))
    (tmp_path / "config.json").write_text("{}")  # the model folder's files, which a PEFT folder leaves out
    learner.save(tmp_path / "checkpoints", 1, {"version": learner.version}, model_files=[tmp_path / "config.json"])
    folder = latest_checkpoint(tmp_path / "checkpoints")
    assert lora.is_adapter_folder(folder) and not (folder / "model.safetensors").exists()
    assert not (folder / "config.json").exists()
    assert lora.read_adapter_config(folder)["r"] == 4
    peft_model = PeftModel.from_pretrained(tiny_llama(tied=False, seed=0), str(folder))
    assert torch.equal(logits(peft_model, IDS), logits(learner.model, IDS))

    again = lora_learner()
    again.restore(folder)
    for name, value in learner.engine_weights().items():
        assert torch.equal(again.engine_weights()[name], value), name
    mine, theirs = learner.optimizer.state_dict(), again.optimizer.state_dict()
    assert mine["state"].keys() == theirs["state"].keys()
    for key, state in mine["state"].items():
        for field, value in state.items():
            assert torch.equal(theirs["state"][key][field], value), (key, field)
    rows = step_rows(learner.model, seed=3)  # and they go on alike
    learner.train_step(rows)
    again.train_step(rows)
    for name, value in learner.engine_weights().items():
        assert torch.equal(again.engine_weights()[name], value), name


def test_a_whole_model_checkpoint_is_refused_by_a_lora_learner_and_the_other_way(tmp_path):
    whole = Learner(tiny_llama(tied=False, seed=0), LearnerConfig(lr=LR))
    whole.save(tmp_path / "whole", 0, {})
    with pytest.raises(CheckpointError, match="holds a whole model's weights"):
        lora_learner().restore(latest_checkpoint(tmp_path / "whole"))
    lora_learner().save(tmp_path / "adapter", 0, {})
    with pytest.raises(CheckpointError, match="holds a LoRA adapter"):
        Learner(tiny_llama(tied=False, seed=0), LearnerConfig(lr=LR)).restore(latest_checkpoint(tmp_path / "adapter"))


def test_a_model_with_an_adapter_needs_a_lora_learner():
    with pytest.raises(TrainerError, match="carries a LoRA adapter"):
        Learner(lora.attach(tiny_llama(tied=False), RANK4), LearnerConfig(lr=LR))


def test_a_kl_reference_of_a_lora_learner_is_the_base_model():
    learner = lora_learner(loss={"kl_coef": 0.1})
    assert not lora.has_adapter(learner.reference)
    assert np.isfinite(learner.train_step(step_rows(learner.model))["kl_ref"])


# -- export-model ----------------------------------------------------------------------------------------


@pytest.fixture
def lora_run(tmp_path):
    """A run folder's checkpoint of a LoRA learner on a tiny Llama saved as a model folder (the adapter names it)."""
    from verbatim.trainer.reference import load_model

    tiny_llama(tied=True, seed=0).save_pretrained(tmp_path / "base")
    learner = Learner(load_model(tmp_path / "base"), LearnerConfig(lr=LR, lora=RANK4))
    learner.train_step(step_rows(learner.model))
    learner.train_step(step_rows(learner.model, seed=1))
    learner.save(tmp_path / "run" / "checkpoints", 2, {"version": learner.version})
    return tmp_path, learner


def export(*args: str):
    from typer.testing import CliRunner

    from verbatim.cli.app import app

    return CliRunner().invoke(app, ["export-model", *args])


def test_export_model_merge_writes_the_base_with_the_adapter_folded_in(lora_run):
    from verbatim.trainer.reference import load_model

    tmp_path, learner = lora_run
    checkpoint = tmp_path / "run" / "checkpoints" / "step-000002"
    result = export(str(checkpoint), "--merge", "--out", str(tmp_path / "merged"))
    assert result.exit_code == 0, result.output
    merged = load_model(tmp_path / "merged")
    assert not lora.has_adapter(merged) and merged.config.tie_word_embeddings
    torch.testing.assert_close(logits(merged, IDS), logits(learner.model.eval(), IDS), rtol=0, atol=1e-4)
    assert not torch.equal(logits(merged, IDS), logits(load_model(tmp_path / "base"), IDS))

    result = export(str(checkpoint), "--out", str(tmp_path / "adapter"))  # without --merge: the PEFT folder
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == [lora.CONFIG_FILE, lora.WEIGHTS_FILE]


def test_export_model_refuses_an_occupied_out_and_a_merge_of_a_whole_model(lora_run):
    tmp_path, _ = lora_run
    checkpoint = str(tmp_path / "run" / "checkpoints" / "step-000002")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    result = export(checkpoint, "--out", str(tmp_path / "full"))
    assert result.exit_code == 2 and "already holds files" in result.output
    whole = Learner(tiny_llama(tied=False), LearnerConfig(lr=LR))
    whole.save(tmp_path / "whole" / "checkpoints", 1, {})
    result = export(str(tmp_path / "whole" / "checkpoints" / "step-000001"), "--merge", "--out", str(tmp_path / "m"))
    assert result.exit_code == 2 and "no adapter to merge" in result.output


@pytest.mark.parametrize("prefixflow", [True, False])
def test_activation_checkpointing_and_chunked_log_probs_take_the_same_lora_step(prefixflow):
    """Recomputing each layer in the backward, and log π a few rows at a time, change nothing of a LoRA step."""
    plain = lora_learner(prefixflow=prefixflow, logprob_chunk=0)
    saving = lora_learner(prefixflow=prefixflow, logprob_chunk=4, checkpoint_layers=True)
    mine, theirs = stepped_gradients(saving), stepped_gradients(plain)
    rows = step_rows(plain.model)
    plain.train_step(rows)
    saving.train_step(rows)
    assert len(mine) == len(theirs) == 1
    assert_same_grads(moving(mine[0]), moving(theirs[0]))


def test_a_bf16_lora_step_stays_near_the_fp32_one():
    """Autocast runs the adapter's layers in bfloat16 over float32 weights; the step moves the adapter as fp32's
    does, to bfloat16's rounding."""
    full, half = lora_learner(), lora_learner(dtype="bf16")
    rows = step_rows(full.model)
    full.train_step(rows)
    half.train_step(rows)
    moved = [n for n, v in full.engine_weights().items() if ".lora_B." in n and v.abs().max() > 0]
    assert moved
    for name in moved:
        agree = torch.sign(half.engine_weights()[name]) == torch.sign(full.engine_weights()[name])
        assert float(agree.float().mean()) > 0.9, name  # AdamW's first step: ±lr where the gradient's sign agrees


def test_a_lora_checkpoint_loads_as_its_base_with_the_adapter_and_no_engine_is_started_on_it(lora_run):
    """``load_model`` (what ``verbatim mismatch`` computes π with) takes a PEFT folder as the base it names with the
    adapter; ``--model`` of a LoRA checkpoint for a run or an evaluation is one line naming ``export-model --merge``."""
    from verbatim.errors import InputError
    from verbatim.jobs.compose import playable_model
    from verbatim.trainer.reference import load_model

    tmp_path, learner = lora_run
    checkpoint = tmp_path / "run" / "checkpoints" / "step-000002"
    loaded = load_model(checkpoint)
    assert lora.has_adapter(loaded)
    assert torch.equal(logits(loaded, IDS), logits(learner.model.eval(), IDS))
    with pytest.raises(InputError, match="is a LoRA adapter, not a model an engine can start on"):
        playable_model(str(checkpoint))


def test_a_fresh_adapter_is_drawn_from_its_seed_alone():
    """The same seed gives the same A wherever the adapter is attached (one process, or each rank of a team: its
    shard of the same draw); B starts at zero."""
    first = lora.attach(tiny_llama(tied=False, seed=0), RANK4, seed=3)
    again = lora.attach(tiny_llama(tied=False, seed=9), RANK4, seed=3)
    other = lora.attach(tiny_llama(tied=False, seed=0), RANK4, seed=4)
    for name, value in lora.adapter_weights(first).items():
        assert torch.equal(value, lora.adapter_weights(again)[name]), name
        if ".lora_B." in name:
            assert not value.any()
    a = next(n for n in lora.adapter_weights(first) if ".lora_A." in n)
    assert not torch.equal(lora.adapter_weights(first)[a], lora.adapter_weights(other)[a])
