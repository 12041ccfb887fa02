"""Reading a vLLM server's Prometheus ``/metrics`` text: counters, the cache config, capacity, block size.

Pure functions over the text; :class:`~verbatim.engine.http.HttpEngine` fetches it.
"""

from __future__ import annotations

import re

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)")


def parse_prometheus(text: str) -> dict[str, float]:
    """Sum each metric's samples over their labels (one replica's totals)."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            totals[match.group(1)] = totals.get(match.group(1), 0.0) + float(match.group(3))
    return totals


_LABEL = re.compile(r'(\w+)="([^"]*)"')


def cache_config(text: str) -> dict[str, str]:
    """The labels of ``vllm:cache_config_info`` (the server's cache configuration); empty if absent."""
    for line in text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            return dict(_LABEL.findall(line))
    return {}


def capacity_tokens(text: str) -> int:
    """KV cache size in tokens from ``vllm:cache_config_info`` (its num_gpu_blocks and block_size labels)."""
    labels = cache_config(text)
    blocks, block = labels.get("num_gpu_blocks", ""), labels.get("block_size", "")
    return int(blocks) * int(block) if blocks.isdigit() and block.isdigit() else 0


def reported_block_size(text: str) -> int | None:
    """The KV block size from ``vllm:cache_config_info``'s block_size label; None if it has none."""
    block = cache_config(text).get("block_size", "")
    return int(block) if block.isdigit() and int(block) > 0 else None
