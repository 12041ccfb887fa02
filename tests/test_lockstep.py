"""The calls of a pass the ranks agree on (trainer/distributed/lockstep.py), and the idle calls that fill a
rank's share (trainer/passes.py): a gradient of 0 through every layer."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from verbatim.bench.prefixflow_exactness import tiny_llama
from verbatim.errors import TrainerError
from verbatim.trainer.adapters import prefix_lm
from verbatim.trainer.causal_lm import PlainCausalLM
from verbatim.trainer.distributed.lockstep import CallShape, agree, as_numbers, from_numbers, idle_calls
from verbatim.trainer.passes import idle_backward, idle_forward, idle_group

shapes = st.builds(lambda flows, plain: CallShape(tuple(sorted(flows, reverse=True)), plain),
                   st.lists(st.integers(1, 6), max_size=5), st.integers(0, 8))


@given(st.lists(shapes, min_size=1, max_size=6))
def test_the_agreed_shape_covers_every_ranks_calls_and_pads_no_more_than_the_busiest(ranks):
    agreed = agree(ranks)
    assert agreed == agree(list(reversed(ranks)))  # every rank computes the same
    for mine in ranks:
        assert len(agreed.flows) >= len(mine.flows) and agreed.plain >= mine.plain
        assert all(a >= m for a, m in zip(agreed.flows, mine.flows))
        assert idle_calls(mine, agreed) >= 0
    assert agreed.calls <= sum(shape.calls for shape in ranks)
    assert from_numbers(as_numbers(agreed, len(agreed.flows) + 2)) == agreed


def test_a_shape_is_its_groups_most_microbatches_first():
    assert agree([CallShape((3, 1), 0), CallShape((2, 2, 2), 5), CallShape()]) == CallShape((3, 2, 2), 5)
    with pytest.raises(TrainerError, match="most suffix microbatches first"):
        CallShape((1, 2))
    with pytest.raises(TrainerError, match="cannot be negative"):
        CallShape((0,))


@pytest.mark.parametrize("path", ["prefixflow", "plain"])
@pytest.mark.parametrize("offload", ["keep", "recompute", "cpu"])
def test_an_idle_call_adds_a_gradient_of_zero_to_every_layer(path, offload):
    """The idle calls reach every decoder layer (forward and backward: FSDP's collectives) and change nothing."""
    model = tiny_llama(seed=3).train()
    lm = prefix_lm(model) if path == "prefixflow" else PlainCausalLM(model)
    forwards: list[str] = []
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(lambda module, args, i=i: forwards.append(str(i)))
    with torch.no_grad():
        idle_forward(lm)
    layers = [str(i) for i in range(model.config.num_hidden_layers)]
    assert forwards == layers
    idle_backward(lm)
    if path == "prefixflow":
        idle_group(lm, 3, offload)  # phase A, three suffix calls, phase C (again in it when recomputed)
    reached = {name.split(".")[2] for name, p in model.named_parameters() if ".layers." in name and p.grad is not None}
    assert reached == set(layers)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    assert len(forwards) == len(layers) * (2 + (4 + (offload == "recompute") if path == "prefixflow" else 0))
