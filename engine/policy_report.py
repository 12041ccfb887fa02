"""``verbatim bench policies``: run the cache-policy scenario on the bundled engine, write the table."""

from __future__ import annotations

import asyncio
import re
import tempfile
from pathlib import Path

from .checkpoints import perturbed_checkpoint
from .home import verbatim_home
from .inproc import InprocEngine
from .policy_bench import markdown_table, measure_policy
from .protocol import CachePolicy
from .runtime import EngineConfig, vllm_version

_DOC = Path(__file__).resolve().parent.parent / "docs" / "engine.md"
_BEGIN, _END = "<!-- policy-table:begin -->", "<!-- policy-table:end -->"


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
        text = _DOC.read_text()
        block = f"{_BEGIN}\n{table}\n{_END}"
        _DOC.write_text(re.sub(re.escape(_BEGIN) + ".*?" + re.escape(_END), lambda _: block, text, flags=re.S))
    return table
