"""End tokens: every family stops on every eos id of its official generation_config.json, and bridges alike."""

from __future__ import annotations

from pathlib import Path

import pytest

from verbatim.datamodel import Message
from verbatim.renderers.registry import FAMILIES, get_renderer

OFFICIAL = {  # eos_token_id of each family's generation_config.json on the Hugging Face hub
    "smollm2": (2,), "qwen2.5": (151645, 151643), "qwen3": (151645, 151643), "qwen3-instruct-2507": (151645, 151643),
    "llama3": (128001, 128008, 128009), "mistral-v3": (2,), "mistral-v7-tekken": (2,), "gemma3": (1, 106),
    "phi3": (32000, 32001, 32007), "phi3.5": (32007, 32001, 32000), "phi4": (100265,), "phi4-mini": (200020, 199999),
    "deepseek-v3": (1,), "deepseek-r1": (1,), "gpt-oss": (200002, 199999, 200012),
    "qwen3.6": (248046, 248044), "qwq": (151645, 151643), "glm-4.5": (151329, 151336, 151338), "kimi-k2": (163586,),
    "deepseek-v3.1": (1,), "deepseek-v3.1-thinking": (1,), "mistral-nemo": (2,), "gemma2": (1, 107),
}
USER = Message(role="user", content="Weather in Paris?")
OPENING = {"deepseek-r1": "ok\n</think>\n\n", "gpt-oss": "<|channel|>final<|message|>",  # before the reply text
           "qwen3.6": "ok\n</think>\n\n", "qwq": "ok\n</think>\n\n", "deepseek-v3.1-thinking": "ok</think>"}
NEXT_OPENER = {"glm-4.5"}  # its end tokens open the next turn: tests/test_renderers_glm_kimi_qwen.py


def test_every_family_ships_its_official_end_tokens() -> None:
    assert set(OFFICIAL) == set(FAMILIES)
    for name, ids in OFFICIAL.items():
        assert tuple(i for i, _ in FAMILIES[name].load().end_tokens) == ids, name


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_tokenizer_gives_the_official_ids(name: str, default_model_dir: Path) -> None:
    renderer = get_renderer(name, model_dir=default_model_dir)
    stand_in = FAMILIES[name].tokenizer.startswith("stand-in:")
    assert len(renderer.stop_token_ids) == len(OFFICIAL[name])
    if not stand_in:  # a stand-in vocabulary numbers the same tokens differently
        assert renderer.stop_token_ids == OFFICIAL[name]


@pytest.mark.parametrize("name", sorted(set(FAMILIES) - NEXT_OPENER))
def test_any_end_token_ends_the_turn_and_bridges_like_the_template(name: str, default_model_dir: Path) -> None:
    renderer = get_renderer(name, model_dir=default_model_dir)
    prompt = list(renderer.render([USER], add_generation_prompt=True).token_ids)
    reply = renderer.encode(OPENING.get(name, "") + "Hello there.")
    nxt = [Message(role="user", content="And tomorrow?")]
    bridges = set()
    stand_in = FAMILIES[name].tokenizer.startswith("stand-in:")
    for end in renderer.stop_token_ids if stand_in else OFFICIAL[name]:
        parsed = renderer.parse_completion(reply + [end])
        assert parsed.problems == () and parsed.content.strip() == "Hello there.", (end, parsed)
        bridges.add(tuple(renderer.bridge(prompt + reply + [end], nxt)))
    assert len(bridges) == 1  # whichever end token the model sampled, the template's turn close follows
    (bridged,) = bridges
    close = renderer.encode(renderer.close_text)
    assert list(bridged[:len(close)]) != close  # never a second close after the sampled end token
    cut = renderer.bridge(prompt + reply, nxt)  # no end token: the bridge closes the turn first
    assert cut[:len(close)] == close and tuple(cut[len(close):]) == bridged
