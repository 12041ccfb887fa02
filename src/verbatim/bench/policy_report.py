"""``verbatim bench policies``: run the cache-policy scenario on the bundled engine, write the table."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from verbatim.bench import docsection
from verbatim.bench.policies import markdown_table, measure_policy
from verbatim.engine.checkpoints import perturbed_checkpoint
from verbatim.engine.inproc import InprocEngine
from verbatim.engine.protocol import CachePolicy
from verbatim.engine.runtime import EngineConfig, vllm_version
from verbatim.paths import verbatim_home

_DOC = Path(__file__).resolve().parents[3] / "docs" / "engine.md"  # the checkout's docs/ (src/verbatim/bench/ → root)


def run_policy_report(model: str = "default", *, write_docs: bool = False) -> str:
    async def run() -> str:
        engine = InprocEngine(EngineConfig(model=model, kv_cache_gib=1, max_model_len=2048))
        home = verbatim_home()
        home.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=home) as tmp:
            updated = perturbed_checkpoint(engine.model_dir, Path(tmp) / "perturbed", scale=0.05)
            async with engine:
                rows = [await measure_policy(engine, p, base=engine.model_dir, updated=updated)
                        for p in CachePolicy]
        note = (f"Measured by `verbatim bench policies` (vLLM {vllm_version()}, {engine.model_dir.name}, "
                f"fp32, block size {engine.block_size}; prompt 300 tokens, 24 greedy tokens per turn, "
                "64 new tokens before turn 2; update = seeded 5% weight perturbation).")
        return markdown_table(rows) + "\n\n" + note

    table = asyncio.run(run())
    if write_docs:
        docsection.write_section(_DOC, "policy-table", table)
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
        async with engine:
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
