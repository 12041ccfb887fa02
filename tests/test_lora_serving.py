"""Which adapter a request names, and when an adapter leaves the engine (engine/lora_serving.py). The bookkeeping is
pure; a stand-in loader records the loads and removals (the real engine: tests/test_lora_engine.py)."""

from __future__ import annotations

import asyncio

import pytest

from verbatim.engine.lora_serving import ServedAdapters
from verbatim.engine.protocol import Adapter, adapter_name
from verbatim.errors import InputError


class Loras:
    """Records the loads and removals (a :class:`~verbatim.engine.lora_serving.Loader`)."""

    def __init__(self) -> None:
        self.loaded: dict[int, str] = {}
        self.removed: list[int] = []

    async def load(self, held) -> None:
        self.loaded[held.lora_id] = held.name

    async def unload(self, held) -> None:
        self.removed.append(held.lora_id)
        del self.loaded[held.lora_id]


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "adapter_config.json").write_text("{}")
    return tmp_path


def push(served: ServedAdapters, llm: Loras, folder, version: int, rank: int = 8) -> None:
    asyncio.run(served.add(llm, Adapter(folder=str(folder), rank=rank), version))


def test_a_request_names_the_newest_adapter_and_keeps_it_while_newer_ones_arrive(folder):
    served, llm = ServedAdapters(8), Loras()
    assert served.take() is None  # version 0: the base model, no adapter
    push(served, llm, folder, 1)
    first = served.take()
    assert first.version == 1 and first.name == adapter_name(1, first.lora_id)
    push(served, llm, folder, 2)
    push(served, llm, folder, 3)
    assert served.take().version == 3
    assert sorted(llm.loaded.values()) == [adapter_name(1, 1), adapter_name(3, 3)]  # 2: nobody used it
    served.give(first)
    assert served.unused() == [1]
    push(served, llm, folder, 4)
    assert sorted(llm.loaded.values()) == [adapter_name(3, 3), adapter_name(4, 4)]  # 3 still held by a request


def test_every_load_gets_its_own_lora_id_so_vllm_never_serves_a_stale_adapter_under_an_old_id(folder):
    served, llm = ServedAdapters(8), Loras()
    push(served, llm, folder, 1)
    push(served, llm, folder, 1)  # a resumed run pushes version 1 again, perhaps other weights
    assert len(set(llm.removed) | set(llm.loaded)) == 2


def test_the_kv_key_is_the_salt_and_the_adapter_as_vllm_keys_blocks(folder):
    served, llm = ServedAdapters(8), Loras()
    assert served.kv_key("s", None) == "s"
    push(served, llm, folder, 2)
    held = served.take()
    assert served.kv_key(None, held) != served.kv_key("s", held) != served.kv_key("s", None)


@pytest.mark.parametrize("rank,adapter_rank,message", [
    (None, 8, "started without LoRA"),
    (8, 16, "rank 16 is above the 8"),
])
def test_an_adapter_the_engine_cannot_serve_is_refused(folder, rank, adapter_rank, message):
    with pytest.raises(InputError, match=message):
        ServedAdapters(rank).check(Adapter(folder=str(folder), rank=adapter_rank))


def test_a_rank_between_vllms_ranks_is_served_by_the_next_one_up(folder, tmp_path):
    ServedAdapters(4).check(Adapter(folder=str(folder), rank=8))  # started for 4: vLLM's 8 serves 8 too
    with pytest.raises(InputError, match="not a PEFT adapter folder"):
        ServedAdapters(8).check(Adapter(folder=str(tmp_path / "none"), rank=8))


def test_a_family_vllm_serves_no_lora_for_is_refused_in_one_line(tmp_path, default_model_dir):
    from transformers import GPT2Config

    from verbatim.engine.lora_serving import check_family

    check_family(default_model_dir)  # Llama: vLLM's class supports LoRA
    GPT2Config(n_layer=1, n_embd=32, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    with pytest.raises(InputError, match="vLLM serves no LoRA adapter for GPT2LMHeadModel"):
        check_family(tmp_path)
