"""``verbatim export-model``: a training run's checkpoint as a model folder of its own, outside the run.

The source is a run folder (its newest complete checkpoint) or one checkpoint folder. A whole model's checkpoint
is written as the Hugging Face folder it is (weights, config, tokenizer); a LoRA run's as its PEFT folder
(``adapter_config.json``, ``adapter_model.safetensors``), or with ``merge`` as the base model with the adapter
folded in (W + scale·B·A), a Hugging Face folder any tool loads without peft (``verbatim run --model DIR``). The
optimizer, RNG and run state stay behind. The folder is written under a temporary name and renamed into place.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from verbatim.durable import staged_folder
from verbatim.errors import InputError

LEFT_BEHIND = ("optimizer.pt", "optimizer", "rng.pt", "state.json")
"""What a checkpoint holds that is the run's, not the model's."""


def export_model(source: str, out: str, *, merge: bool = False, force: bool = False) -> Path:
    """Write the model of ``source`` (a run folder or a checkpoint) to ``out``; returns the folder written."""
    from verbatim.jobs.compose import checkpoint_model
    from verbatim.trainer import lora

    folder = Path(checkpoint_model(source))
    if not (folder / "state.json").is_file():
        raise InputError(f"{source} is neither a training run's folder nor one of its checkpoints",
                         hint="give RUN_DIR or RUN_DIR/checkpoints/step-N")
    adapter = lora.is_adapter_folder(folder)
    if merge and not adapter:
        raise InputError(f"--merge: {folder} holds a whole model, no adapter to merge", hint="drop --merge")
    target = _free(Path(out), force)
    with staged_folder(target, ".tmp-export-") as tmp:
        if merge:
            _write_merged(folder, tmp)
        else:
            for item in folder.iterdir():
                if item.name not in LEFT_BEHIND and item.is_file():
                    shutil.copy2(item, tmp / item.name)
    return target


def _free(out: Path, force: bool) -> Path:
    """``out`` if nothing is there (or ``force``); refused in one line otherwise."""
    out = out.expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise InputError(f"--out {out} already holds files", hint="pass --force to replace it, or another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


def _write_merged(folder: Path, tmp: Path) -> None:
    """The adapter in ``folder`` folded into its base model, written to ``tmp`` as a Hugging Face folder."""
    from verbatim.engine.checkpoints import model_files
    from verbatim.trainer import lora
    from verbatim.trainer.checkpoint import deduplicated
    from verbatim.trainer.reference import load_model
    from verbatim.trainer.weight_files import write_weights

    base_dir = lora.read_adapter_config(folder).get("base_model_name_or_path")
    if not base_dir or not Path(base_dir).is_dir():
        raise InputError(f"the adapter in {folder} names base model {base_dir!r}, which is not a folder here",
                         hint="merge it where the run's base model is")
    base = load_model(base_dir)
    weights = lora.merged_model(folder, base)
    write_weights(tmp, *deduplicated(weights))
    for item in model_files(base_dir):
        shutil.copy2(item, tmp / item.name)
