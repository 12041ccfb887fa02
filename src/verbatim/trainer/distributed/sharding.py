"""A model sharded over the learner's ranks with FSDP2, and the same interface for one process.

:class:`ShardedModel` applies ``fully_shard`` to every decoder layer (the classes Hugging Face names in
``_no_split_modules``) and to the whole model (the root: the embedding, the last norm, the output
layer). Between steps each rank holds 1/N of the parameters, of their gradients and of AdamW's state;
during a step, as torchtitan and the other FSDP trainers do:

* a decoder layer's weights are gathered when its forward starts and freed when it ends (reshard after
  forward), gathered again for its backward, and its gradient is reduce-scattered as soon as the
  backward has produced it, summed (divide factor 1: the loss already carries the step's global
  normaliser) into the rank's float32 shard; so a rank holds one layer's whole weights at a time;
* an untied embedding is a unit of its own, gathered during each call as a layer is;
* the root's weights (the output layer, the last norm, and a tied embedding) stay gathered for the whole
  pass (:meth:`ShardedModel.gathered`, :meth:`ShardedModel.update`): PrefixFlow's adapters and the
  chunked log-probabilities call the output layer apart from the model's forward, a number of times
  that differs by rank, where FSDP's hooks would gather it each time; its gradient, whole during every
  backward anyway, accumulates over an update and is reduce-scattered once, at its end;
* AdamW steps on the shards.

Every gather and reduce-scatter is a collective each rank must make in the same order, while a
rank's share of a step is uneven (its own groups, whole): the learner's passes keep the ranks in
lockstep (:mod:`.lockstep`; each rank fills what it lacks with idle calls whose gradient is 0), and
every backward runs through every layer (:func:`~verbatim.trainer.prefixflow.suffix_backward`).

With ``bf16`` the gather is FSDP's mixed precision: bfloat16 weights (half the gather's memory), the
gradient reduced in float32 into the float32 shards.

:class:`WholeModel` is one process: the model as it is, every method a no-op where there is nothing to
share.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from verbatim.errors import TrainerError
from verbatim.trainer import lora
from verbatim.trainer.checkpoint import (
    OPTIMIZER_SHARDS,
    another_optimizer,
    check_fit,
    check_kind,
    checkpoint_state,
    checkpoint_tmp,
    load_checkpoint,
    load_optimizer,
    read_optimizer,
    restore_rng,
    same_memory,
    save_checkpoint,
    sharded_optimizer,
)
from verbatim.trainer.distributed.team import Team
from verbatim.trainer.weight_files import weight_shapes, write_planned


def unique_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with each tensor once: a tied output layer is left to its embedding (what the engine loads)."""
    seen: set[tuple[Any, ...]] = set()
    weights = {}
    for name, tensor in state.items():
        key = same_memory(tensor)
        if key not in seen:
            seen.add(key)
            weights[name] = tensor.detach()
    return weights


def without_aliases(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` without the second name of a tied parameter (gathered copies no longer share memory)."""
    aliases = _aliases(model)
    return {name: tensor for name, tensor in state.items() if name not in aliases}


def _aliases(model: nn.Module) -> dict[str, str]:
    """The second name of each tied parameter → its first."""
    first = {id(param): name for name, param in reversed(list(model.named_parameters(remove_duplicate=False)))}
    return {name: first[id(param)] for name, param in model.named_parameters(remove_duplicate=False)
            if first[id(param)] != name}


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded tensor gathered whole (a collective every rank makes); a plain one (a buffer) as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


class WholeModel:
    """The model in one process."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.team = Team()

    def gathered(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def update(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def grad_norm(self, max_norm: float) -> float:
        params = [p for p in self.model.parameters() if p.requires_grad]
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def weights(self) -> dict[str, torch.Tensor]:
        return unique_weights(self.model.state_dict())

    def adapter_weights(self) -> dict[str, torch.Tensor]:
        return lora.adapter_weights(self.model)

    def merged_weights(self) -> dict[str, torch.Tensor]:
        return unique_weights(lora.merged_weights(self.model))

    def save(self, optimizer: torch.optim.Optimizer, root: Path, step: int, state: dict[str, Any], keep: int,
             model_files: Sequence[Path]) -> Path:
        return save_checkpoint(root, step, self.model, optimizer, state, keep, model_files)

    def restore(self, optimizer: torch.optim.Optimizer, path: Path) -> dict[str, Any]:
        """A checkpoint of one process or of a team, weights and RNG, then its optimizer state."""
        saved = load_checkpoint(path, self.model, None)
        restore_optimizer(self.model, optimizer, path, group=None)
        return saved


def restore_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, path: Path, group: Any) -> None:
    """The optimizer state of the checkpoint at ``path`` into ``optimizer`` of this team (``group``; None: one
    process), whichever wrote it: a team's shards (resharded), or one file keyed by index (one process's,
    loaded as such in one process) or by parameter name. An empty state stays empty: torch's loaders would
    first give the optimizer a fake step (its step count 1)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    shards = sharded_optimizer(path)
    if shards is not None:
        _load_shards(model, optimizer, shards, group)
        return
    moments = read_optimizer(path)
    if group is None and not _by_name(moments):
        load_optimizer(path, optimizer, moments)
    elif moments.get("state"):
        set_optimizer_state_dict(model, optimizer, _named(moments, model),
                                 options=StateDictOptions(full_state_dict=True))


def _load_shards(model: nn.Module, optimizer: torch.optim.Optimizer, shards: Path, group: Any) -> None:
    """An ``optimizer/`` folder of ``torch.distributed.checkpoint`` into ``optimizer``, resharded for this team
    (``group``; None: one process, whole tensors). The state it is read into is the optimizer's own, made by
    ``get_optimizer_state_dict`` (which gives a fresh optimizer its state's tensors first)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    moments = get_optimizer_state_dict(model, optimizer)
    try:
        dcp.load(moments, checkpoint_id=str(shards), process_group=group, no_dist=group is None)
    except (RuntimeError, ValueError, KeyError) as exc:
        raise another_optimizer(shards.parent, exc) from exc
    set_optimizer_state_dict(model, optimizer, moments)


def _by_name(optimizer_state: dict[str, Any]) -> bool:
    """Whether an optimizer state is keyed by parameter name (a team's) rather than by index (one process's)."""
    return any(isinstance(key, str) for key in optimizer_state.get("state", {}))


def _named(optimizer_state: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    """One process's optimizer state (parameters by index, in the model's order) keyed by parameter name."""
    if _by_name(optimizer_state):
        return optimizer_state
    names = [name for name, _ in model.named_parameters()]
    groups = [group | {"params": [names[i] for i in group["params"]]} for group in optimizer_state["param_groups"]]
    return {"state": {names[i]: value for i, value in optimizer_state["state"].items()}, "param_groups": groups}


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers: the module classes Hugging Face keeps whole (``_no_split_modules``), found
    by their own class or one it derives from (FSDP2 gives a sharded module a subclass: ``FSDPLlamaDecoderLayer``)."""
    kinds = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules()
              if m is not model and any(kind.__name__ in kinds for kind in type(m).__mro__)]
    if not layers:
        raise TrainerError(f"{type(model).__name__} names no decoder layer class (_no_split_modules), so FSDP "
                           "cannot shard it layer by layer", hint="train it in one process (--trainer-procs 1)")
    return layers


def separate_units(model: nn.Module) -> list[nn.Module]:
    """The modules sharded as units of their own, gathered only during their own calls: the decoder layers, and
    an untied embedding (called once a forward; a tied one is the output layer's weight, which stays in the
    root, gathered for the whole pass)."""
    layers = decoder_layers(model)
    embedding, output = model.get_input_embeddings(), model.get_output_embeddings()
    tied = output is not None and output.weight is embedding.weight
    return layers if tied else [embedding, *layers]


def unit_parameters(model: nn.Module) -> tuple[int, list[int]]:
    """How many parameters the root keeps and each separate unit holds (each parameter counted once): what a
    rank gathers at once during a step (jobs/placement.py's accounting)."""
    units = [sum(p.numel() for p in unit.parameters()) for unit in separate_units(model)]
    return sum(p.numel() for p in model.parameters()) - sum(units), units


class ShardedModel:
    """``model`` sharded with FSDP2 over ``team``: every rank builds the same model, then calls this. A model
    built on the meta device (:func:`~.loading.empty_model`) is given its shards' memory on ``device`` and
    filled from ``weights`` (the model folder's files, :func:`~.loading.weight_files`), each rank reading its
    own rows only."""

    def __init__(self, model: nn.Module, team: Team, dtype: str = "fp32", device: str | None = None,
                 weights: dict[str, Path] | None = None) -> None:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

        self.model = model
        self.team = team
        empty = next(model.parameters()).is_meta
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.group = team.group or dist.group.WORLD  # the team's own group: its timeout
        mesh = DeviceMesh.from_group(self.group, self.device.type)
        # bf16: the weights gathered in bfloat16 (half the gather's memory), gradients reduced in float32
        mixed = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if dtype == "bf16"
                 else MixedPrecisionPolicy())
        for layer in separate_units(model):
            fully_shard(layer, mesh=mesh, reshard_after_forward=True, mp_policy=mixed)
        fully_shard(model, mesh=mesh, mp_policy=mixed)  # the root: not resharded after its forward
        self.units: list[FSDPModule] = [m for m in model.modules() if isinstance(m, FSDPModule)]
        self.root: FSDPModule = model  # type: ignore[assignment]
        for unit in self.units:
            unit.set_gradient_divide_factor(1.0)  # a sum: the loss carries the step's global normaliser
            unit.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum
            unit.set_reduce_scatter_unused_params(True)  # every rank reduces the same tensors
        self.root.set_reshard_after_backward(False, recurse=False)  # gathered for the whole pass
        if empty:
            self._fill(weights)
        with torch.no_grad():  # the first forward through the root makes it FSDP's root
            self.model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=self.device))
        self._reshard()  # the optimizer is built on the shards

    def _reshard(self) -> None:
        for unit in self.units:
            unit.reshard()

    def _fill(self, weights: dict[str, Path] | None) -> None:
        """Memory for this rank's shards on the device (the buffers kept as built), then its rows of the weights."""
        from verbatim.trainer.distributed.loading import load_shards

        if weights is None:
            raise TrainerError("a model built on the meta device needs its weight files to be sharded")
        buffers = {name: buffer.clone() for name, buffer in self.model.named_buffers()}
        self.model.to_empty(device=self.device)
        with torch.no_grad():
            for name, buffer in self.model.named_buffers():
                buffer.copy_(buffers[name])
        load_shards(self.model, weights)

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """A pass: the root's weights gathered throughout, each layer's during its own forward and backward."""
        self.root.unshard()
        try:
            yield
        finally:
            self._reshard()

    @contextlib.contextmanager
    def update(self) -> Iterator[None]:
        """One optimizer update's backward on this rank's rows. Each backward reduce-scatters the layers'
        gradients as it produces them; the root's, held whole through every backward anyway, accumulates
        over the update and is reduce-scattered once on leaving it, by a backward of one token with a loss of
        zero that every rank makes. Leaving it, every rank holds its shard of the update's whole gradient. An
        error inside skips that collective (the other ranks stop at the run's timeout)."""
        self.root.unshard()
        self.root.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
            self.root.set_requires_gradient_sync(True, recurse=False)
            logits = self.model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=self.device)).logits
            (logits.sum() * 0.0).backward()
        finally:
            self.root.set_requires_gradient_sync(True, recurse=False)
            self._reshard()

    def grad_norm(self, max_norm: float) -> float:
        """Clip the sharded gradient to ``max_norm`` (its norm over every rank's shard); return the norm."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def weights(self) -> dict[str, torch.Tensor]:
        """The whole weights on rank 0 (gathered tensor by tensor into CPU memory), nothing on the others.
        Every rank must call it: each gather is a collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return without_aliases(self.model, full) if self.team.leader else {}

    def adapter_weights(self) -> dict[str, torch.Tensor]:
        """A LoRA adapter's tensors whole on rank 0 (gathered one by one: the adapter alone crosses the team),
        nothing on the others. Every rank must call it."""
        gathered = {lora.saved_name(name): _whole(param.detach()).cpu()
                    for name, param in self.model.named_parameters() if lora.is_adapter_name(name)}
        return gathered if self.team.leader else {}

    def merged_weights(self) -> dict[str, torch.Tensor]:
        raise TrainerError("a team's LoRA adapter is pushed as an adapter only: its engine must serve LoRA",
                           hint="start the engine for the run's --lora-rank (verbatim serve --lora-rank R)")

    def save(self, optimizer: torch.optim.Optimizer, root: Path, step: int, state: dict[str, Any], keep: int,
             model_files: Sequence[Path]) -> Path | None:
        """A checkpoint every rank writes, into the folder rank 0 makes and names to the others: the weights
        gathered to rank 0 one file at a time (:meth:`write_weights`), the optimizer's state as each rank's
        shards (``torch.distributed.checkpoint``); rank 0 finishes the folder as one process does and publishes
        it. Every rank calls it (only rank 0's ``root`` and ``step`` count); a rank lost before the end leaves no
        checkpoint."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        box = [str(checkpoint_tmp(Path(root), step)) if self.team.leader else None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        tmp = Path(box[0])
        try:
            if lora.has_adapter(self.model):  # the adapter alone, gathered to rank 0
                weights = self.adapter_weights()
                if self.team.leader:
                    lora.write_adapter(tmp, weights=weights, settings=lora.adapter_settings(self.model))
            else:
                self.write_weights(tmp)
            if optimizer.state:  # (get_optimizer_state_dict would give an empty state a fake step)
                dcp.save(get_optimizer_state_dict(self.model, optimizer), checkpoint_id=str(tmp / OPTIMIZER_SHARDS),
                         process_group=self.group)
        except BaseException:
            if self.team.leader:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        if not self.team.leader:
            return None
        # no update yet (every row so far failed): the empty state written as one process writes it
        return save_checkpoint(root, step, None, None if optimizer.state else optimizer, state, keep, model_files,
                               tmp=tmp)

    def write_weights(self, folder: Path) -> None:
        """The whole weights into ``folder`` as a Hugging Face folder, each file's weights gathered to rank 0
        (which alone writes) just before it is written and freed after: rank 0 holds at most one file's
        weights (:data:`~verbatim.trainer.weight_files.FILE_BYTES`) beyond its shard, the others one
        tensor. Every rank calls it: each gather is a collective."""
        state = self.model.state_dict()
        aliases = _aliases(self.model)

        def gathered(names: list[str]) -> dict[str, torch.Tensor] | None:
            tensors = {}
            for name in names:
                whole = _whole(state[name])  # on every rank; kept by rank 0 alone
                if self.team.leader:
                    tensors[name] = whole.detach().to("cpu").contiguous()
                del whole
            return tensors if self.team.leader else None

        sizes = [(name, t.numel() * t.element_size()) for name, t in state.items() if name not in aliases]
        write_planned(folder, sizes, aliases, gathered)

    def restore(self, optimizer: torch.optim.Optimizer, path: Path) -> dict[str, Any]:
        """Every rank reads its own rows of the checkpoint's weights (of a team or of one process: the run folder is
        on a file system every rank sees), a team's optimizer shards resharded to this team's size; rank 0
        restores its RNG."""
        from verbatim.trainer.distributed.loading import load_shards, weight_files

        check_kind(path, self.model)
        saved = checkpoint_state(path)
        if lora.has_adapter(self.model):  # the base is the model folder's, as loaded: the adapter alone
            lora.load_adapter(path, self.model)
        else:
            check_fit(path, weight_shapes(path), self.model.state_dict())  # the headers: nothing loaded
            load_shards(self.model, weight_files(path))
        if self.team.leader:
            restore_rng(path)
        restore_optimizer(self.model, optimizer, path, group=self.group)
        return saved
