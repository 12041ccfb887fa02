"""``verbatim bench policies`` and ``bench logprobs``: the cache-policy scenario and engine/trainer logprob agreement.

Each writes its table (``--write PATH``) into its own marked section of a document.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from verbatim.bench import docsection, machine
from verbatim.bench.engines import engine_log, started
from verbatim.bench.policies import markdown_table, measure_policy
from verbatim.engine.checkpoints import perturbed_checkpoint
from verbatim.engine.inproc import InprocEngine
from verbatim.engine.protocol import CachePolicy
from verbatim.engine.runtime import EngineConfig, vllm_version
from verbatim.paths import verbatim_home

POLICY_SECTION = "policy-table"
LOGPROB_SECTION = "bench-logprobs"


def run_policy_report(model: str = "default", *, write: Path | None = None) -> str:
    """The policy table; also written into ``write``'s ``policy-table`` section when given."""
    async def run() -> str:
        engine = InprocEngine(EngineConfig(model=model, kv_cache_gib=1, max_model_len=2048))
        home = verbatim_home()
        home.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=home) as tmp:
            updated = perturbed_checkpoint(engine.model_dir, Path(tmp) / "perturbed", scale=0.05)
            async with started(engine, engine_log("policies")):
                rows = [await measure_policy(engine, p, base=engine.model_dir, updated=updated)
                        for p in CachePolicy]
        note = (f"Measured by `verbatim bench policies` (vLLM {vllm_version()}, {engine.model_dir.name}, "
                f"fp32, block size {engine.block_size}; prompt 300 tokens, 24 greedy tokens per turn, "
                "64 new tokens before turn 2; update = seeded 5% weight perturbation).")
        return markdown_table(rows) + "\n\n" + note

    table = asyncio.run(run())
    if write is not None:
        docsection.write_section(write, POLICY_SECTION, table, libraries=machine.ENGINE_LIBRARIES)
    return table


def logprob_agreement(model: str = "default", dtype: str = "float32", *, prompts: int = 4,
                      max_tokens: int = 48) -> dict[str, float]:
    """Sample on vLLM in ``dtype``; recompute each sampled token's logprob with transformers in fp32."""
    import numpy as np
    import torch
    from transformers import AutoTokenizer

    from verbatim.engine.protocol import Sampling
    from verbatim.trainer.reference import load_model, reference_logprobs

    engine = InprocEngine(EngineConfig(model=model, dtype=dtype, kv_cache_gib=1, max_model_len=2048))
    tokenizer = AutoTokenizer.from_pretrained(engine.model_dir)
    questions = ["Write one sentence about the sea.", "List three prime numbers.",
                 "What is a prefix cache?", "Describe a cat in five words."][:prompts]
    rendered = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False) for q in questions]

    async def sample() -> list:
        async with started(engine, engine_log("logprobs")):
            return [await engine.generate(p, Sampling(max_tokens=max_tokens, temperature=1.0, seed=i))
                    for i, p in enumerate(rendered)]

    completions = asyncio.run(sample())
    reference = load_model(engine.model_dir)
    diffs = []
    for prompt, done in zip(rendered, completions):
        ids = list(prompt) + done.token_ids.tolist()
        with torch.no_grad():
            expected = reference_logprobs(reference, ids, range(len(prompt), len(ids))).cpu().numpy()
        diffs.append(np.abs(expected - done.logprobs))
    flat = np.concatenate(diffs)
    return {"dtype": dtype, "tokens": int(flat.size), "max_abs": float(flat.max()),
            "mean_abs": float(flat.mean()), "p99_abs": float(np.quantile(flat, 0.99))}


def agreement_table(results: list[dict], model_name: str, command: str, *, prompts: int = 4,
                    max_tokens: int = 48) -> str:
    """Markdown rows of :func:`logprob_agreement` results, one per engine dtype, and how they were measured."""
    import time

    lines = ["| engine dtype | sampled tokens | mean \\|Δ logprob\\| | p99 | max |", "|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['dtype']} | {r['tokens']} | {r['mean_abs']:.2g} | {r['p99_abs']:.2g} | "
                     f"{r['max_abs']:.2g} |")
    return "\n".join(lines) + (
        f"\n\nMeasured by `{command}` ({time.strftime('%Y-%m-%d')}, {model_name}; {prompts} chat prompts × up to "
        f"{max_tokens} tokens at temperature 1, one run per dtype; reference: transformers in float32 on the "
        "same weights).")


def write_agreement(doc: Path, table: str) -> None:
    docsection.write_section(doc, LOGPROB_SECTION, table, libraries=machine.ENGINE_LIBRARIES)
