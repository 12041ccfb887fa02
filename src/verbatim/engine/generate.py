"""One real single-turn generation on the bundled engine (``verbatim generate``)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from verbatim.datamodel import Completion
from verbatim.engine.inproc import InprocEngine, Sampling
from verbatim.engine.runtime import EngineConfig, vllm_version


@dataclass(frozen=True)
class Generation:
    completion: Completion
    prompt_ids: list[int]
    pieces: list[str]
    text: str
    engine_version: str


def generate_once(model: str, user_message: str, *, max_tokens: int = 32,
                  temperature: float = 0.0, seed: int = 0) -> Generation:
    """Render one user message once, sample from its token IDs, decode for display only."""
    from transformers import AutoTokenizer

    engine = InprocEngine(EngineConfig(model=model, max_model_len=2048, kv_cache_gib=1))
    tokenizer = AutoTokenizer.from_pretrained(engine.model_dir)
    prompt_ids = list(tokenizer.apply_chat_template(
        [{"role": "user", "content": user_message}], add_generation_prompt=True,
        tokenize=True, return_dict=False))
    sampling = Sampling(max_tokens=max_tokens, temperature=temperature, seed=seed,
                        stop_token_ids=tuple(_stop_ids(tokenizer)))

    async def run() -> Completion:
        async with engine:
            return await engine.generate(prompt_ids, sampling, session_id="generate")

    completion = asyncio.run(run())
    ids = [int(t) for t in completion.token_ids]
    pieces = [tokenizer.decode([t]) for t in ids]
    return Generation(completion, prompt_ids, pieces, tokenizer.decode(ids), vllm_version())


def _stop_ids(tokenizer) -> list[int]:
    ids = {tokenizer.eos_token_id}
    for token in ("<|im_end|>", "<|endoftext|>"):
        tid = tokenizer.convert_tokens_to_ids(token)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id:
            ids.add(tid)
    return sorted(i for i in ids if i is not None)
