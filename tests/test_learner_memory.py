"""The learner's memory options: log π in chunks of rows, bfloat16 autocast, activation checkpointing.

Chunked log π must be the unchunked computation (values row for row, gradients to float32 rounding) while
never holding more than a chunk of logits, forward or backward (measured with torch's CPU memory
profiler: every allocation and free of the pass). bf16 has its own tolerance against fp32, measured on a
random 3-layer Llama (3 seeds, tied and untied: log π within 2.0e-3, gradients within 1.3e-2 of the
largest entry, parameter by parameter); the tests hold it to 1e-2 and 3e-2. Checkpointing recomputes,
so it changes nothing beyond rounding.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from typer.testing import CliRunner

from verbatim.bench.prefixflow_exactness import VOCAB, tiny_llama
from verbatim.datamodel import Source, TokenColumns
from verbatim.trainer.adapters import trainer_lm
from verbatim.trainer.causal_lm import LearnerLM, chunked_target_logprobs, sequence_logprobs
from verbatim.trainer.learner import Learner
from verbatim.trainer.learner_config import LearnerConfig
from verbatim.trainer.step_input import StepInput

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BF16_LOGPROB_TOL = 1e-2
"""Max |log π_bf16 − log π_fp32| (nats) on the random Llama; measured 1.6e-3 – 2.0e-3."""
BF16_GRAD_TOL = 3e-2
"""Worst parameter's max |g_bf16 − g_fp32| / max |g_fp32|; measured 1.1e-2 – 1.3e-2."""


def softcapped(head: torch.nn.Linear, cap: float = 5.0):
    """An output layer with something after it (Gemma's final soft-cap), as a family's ``logits`` has."""
    return lambda hidden: torch.tanh(head(hidden) / cap) * cap


def logprobs_and_grads(rows: int, head: torch.nn.Linear, hidden: torch.Tensor, targets: torch.Tensor,
                       weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hidden = hidden.detach().requires_grad_(True)
    head.zero_grad(set_to_none=True)
    values = chunked_target_logprobs(softcapped(head), hidden, targets, 0.7, rows)
    (values * weights).sum().backward()
    return values.detach(), hidden.grad, head.weight.grad.clone()


@pytest.mark.parametrize("rows", [1, 7, 64, 300, 1000])
def test_chunked_logprobs_are_the_unchunked_ones_values_and_gradients(rows):
    gen = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, 211, bias=False)
    hidden, targets = torch.randn(300, 16, generator=gen), torch.randint(0, 211, (300,), generator=gen)
    weights = torch.randn(300, generator=gen)
    want = logprobs_and_grads(0, head, hidden, targets, weights)
    got = logprobs_and_grads(rows, head, hidden, targets, weights)
    assert got[0].dtype == torch.float32
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-6 * float(want[1].abs().max()))
    torch.testing.assert_close(got[2], want[2], rtol=0, atol=1e-5 * float(want[2].abs().max()))


def test_without_autograd_chunks_run_plainly():
    head = torch.nn.Linear(8, 50, bias=False)
    hidden, targets = torch.randn(20, 8), torch.randint(0, 50, (20,))
    with torch.no_grad():
        got = chunked_target_logprobs(head, hidden, targets, 1.0, 3)
        want = chunked_target_logprobs(head, hidden, targets, 1.0, 0)
    assert not got.requires_grad
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize(("rows", "calls"), [(20, [20]), (64, [20]), (0, [20]), (8, [8, 8, 4, 4, 8, 8])])
def test_the_output_layer_runs_once_per_chunk_and_again_only_where_chunks_are_recomputed(rows, calls):
    """The backward recomputes the chunks last to first; one chunk is never recomputed."""
    head = torch.nn.Linear(8, 50, bias=False)
    seen: list[int] = []

    def logits(states: torch.Tensor) -> torch.Tensor:
        seen.append(int(states.shape[0]))
        return head(states)

    hidden = torch.randn(20, 8, requires_grad=True)
    chunked_target_logprobs(logits, hidden, torch.randint(0, 50, (20,)), 1.0, rows).sum().backward()
    assert seen == calls


def peak_allocated(fn) -> int:
    """The most bytes torch's CPU allocator held at once while ``fn`` ran (beyond what it held before)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = top = 0
    for event in events:
        live += event.nbytes()
        top = max(top, live)
    return top


def test_chunked_logprobs_never_hold_more_than_a_chunk_of_logits():
    n, hidden_size, vocab, rows = 2048, 32, 8192, 128
    head = torch.nn.Linear(hidden_size, vocab, bias=False)
    hidden = torch.randn(n, hidden_size, requires_grad=True)
    targets = torch.randint(0, vocab, (n,))

    def step(chunk: int):
        return lambda: chunked_target_logprobs(softcapped(head), hidden, targets, 1.0, chunk).sum().backward()

    logits_bytes, chunk_bytes = n * vocab * 4, rows * vocab * 4
    whole = peak_allocated(step(0))
    chunked = peak_allocated(step(rows))
    weight_bytes = vocab * hidden_size * 4  # the output layer's gradient, whole either way
    assert whole >= 2 * logits_bytes  # logits and their log-softmax, at least
    assert chunked <= 6 * chunk_bytes + 2 * weight_bytes + n * hidden_size * 4, (chunked, chunk_bytes)
    assert chunked < whole / 8


def row_batch(model: torch.nn.Module, seed: int = 0) -> StepInput:
    """Two groups of three rows sharing a prompt, μ unknown (π_old stands in): every model token trains."""
    rng = np.random.default_rng(seed)
    columns, groups = [], []
    for _ in range(2):
        prompt = rng.integers(0, VOCAB, 9)
        groups.append(list(range(len(columns), len(columns) + 3)))
        for _ in range(3):
            ids = np.concatenate([prompt, rng.integers(0, VOCAB, int(rng.integers(4, 12)))]).astype(np.int64)
            source = np.where(np.arange(ids.size) < prompt.size, int(Source.PROMPT), int(Source.MODEL))
            columns.append(TokenColumns(token_id=ids, source=source, logprob=np.full(ids.size, np.nan),
                                        policy_version=np.where(source == int(Source.MODEL), 0, -1),
                                        turn=np.zeros(ids.size)))
    return StepInput(columns=columns, advantages=rng.normal(size=len(columns)), groups=groups,
                     behaviour_from_trainer=True)


def stepped(model: torch.nn.Module, **config) -> tuple[dict[str, torch.Tensor], Learner]:
    """The gradient of one learner step (clipped, as AdamW would take it) and the learner after the step."""
    learner = Learner(copy.deepcopy(model), LearnerConfig(lr=1e-3, max_grad_norm=1e6, **config))
    grads: dict[str, torch.Tensor] = {}
    step = learner.optimizer.step

    def record(*args, **kwargs):
        grads.update({n: p.grad.detach().clone() for n, p in learner.model.named_parameters()})
        return step(*args, **kwargs)

    learner.optimizer.step = record
    learner.train_step(row_batch(model))
    return grads, learner


def worst_rel(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """Worst parameter's max |got − want| / max |want|."""
    return max(float((got[n] - g).abs().max() / g.abs().max()) for n, g in want.items())


@pytest.mark.parametrize("prefixflow", [True, False])
def test_a_learner_step_is_the_same_with_log_pi_in_chunks(prefixflow):
    model = tiny_llama(tied=True, seed=3)
    want, _ = stepped(model, prefixflow=prefixflow, logprob_chunk=0)
    got, _ = stepped(model, prefixflow=prefixflow, logprob_chunk=5)
    assert worst_rel(got, want) <= 1e-5


def test_learner_lm_chunks_the_adapters_own_logits():
    model = tiny_llama(tied=False, seed=4)
    adapter, path = trainer_lm(model, None)
    assert path == "prefixflow"
    calls = []
    adapter.logits = lambda hidden, inner=adapter.logits: calls.append(hidden.shape[0]) or inner(hidden)
    lm = LearnerLM(adapter, logprob_chunk=4)
    ids = torch.randint(0, VOCAB, (2, 9))
    hidden, _ = lm.hidden_states(ids)
    r, t = torch.nonzero(torch.ones(2, 9, dtype=torch.bool)[:, 1:], as_tuple=True)
    t = t + 1
    values = sequence_logprobs(lm, hidden[r, t - 1], r, t, ids[r, t], ids.shape)
    values.sum().backward()
    assert calls == [4] * 8, calls  # 16 rows: four chunks in the forward, each recomputed in the backward


def test_pi_olds_pass_takes_the_entropy_from_the_same_chunks_and_log_pi_unchanged():
    model = tiny_llama(tied=False, seed=4)
    adapter, _ = trainer_lm(model, None)
    calls = []
    adapter.logits = lambda hidden, inner=adapter.logits: calls.append(hidden.shape[0]) or inner(hidden)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    targets = ids[:, 1:].reshape(-1)
    for chunk in (4, 0):
        lm = LearnerLM(adapter, logprob_chunk=chunk)
        with torch.no_grad():
            hidden = lm.hidden_states(ids)[0]
            states = hidden[:, :-1].reshape(-1, hidden.shape[-1])
            want = lm.token_logprobs(states, targets)
        calls.clear()
        logprobs, entropy = lm.token_logprobs_and_entropy(states, targets)
        assert calls == ([4, 4, 4, 4] if chunk else [16]) and not logprobs.requires_grad
        assert torch.equal(logprobs, want)  # what the backward's forward computes, bit for bit
        assert entropy.shape == (16,) and bool((entropy > 0).all())
    chunked = LearnerLM(adapter, logprob_chunk=4).token_logprobs_and_entropy(states, targets)[1]
    torch.testing.assert_close(chunked, LearnerLM(adapter).token_logprobs_and_entropy(states, targets)[1])


def bf16_and_fp32(model: torch.nn.Module, prefixflow: bool) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (3, 40), generator=gen)
    advantages = torch.randn(3, 1, generator=gen)
    r, t = (x.flatten() for x in torch.meshgrid(torch.arange(3), torch.arange(1, 40), indexing="ij"))
    out = []
    for dtype in ("fp32", "bf16"):
        lm = LearnerLM(trainer_lm(model, prefixflow)[0], logprob_chunk=16, dtype=dtype)
        hidden, _ = lm.hidden_states(ids)
        values = sequence_logprobs(lm, hidden[r, t - 1], r, t, ids[r, t], ids.shape)
        model.zero_grad(set_to_none=True)
        (-(advantages * values).sum() / values.numel()).backward()
        out.append((values.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    return out


@pytest.mark.parametrize("seed,tied", [(0, True), (1, False)])
@pytest.mark.parametrize("prefixflow", [True, False])
def test_bf16_logprobs_and_gradients_are_within_their_tolerance_of_fp32(seed, tied, prefixflow):
    model = tiny_llama(tied=tied, seed=seed).train()
    (want, want_grads), (got, got_grads) = bf16_and_fp32(model, prefixflow)
    assert got.dtype == torch.float32  # log π in float32 under bf16 autocast
    assert 0 < float((got - want).abs().max()) <= BF16_LOGPROB_TOL  # bf16 did run, within its tolerance
    worst = max(float((got_grads[n] - g).abs().max() / g.abs().max()) for n, g in want_grads.items())
    assert worst <= BF16_GRAD_TOL


@pytest.mark.parametrize("prefixflow", [True, False])
def test_a_bf16_step_keeps_fp32_master_weights_and_optimizer_state(prefixflow):
    model = tiny_llama(tied=True, seed=5)
    got, learner = stepped(model, dtype="bf16", prefixflow=prefixflow)
    want, _ = stepped(model, dtype="fp32", prefixflow=prefixflow)
    assert all(p.dtype == torch.float32 for p in learner.model.parameters())
    states = [s for state in learner.optimizer.state.values() for s in state.values()
              if isinstance(s, torch.Tensor) and s.is_floating_point() and s.dim()]
    assert states and all(s.dtype == torch.float32 for s in states)
    assert all(w.dtype == torch.float32 for w in learner.engine_weights().values())
    assert 0 < worst_rel(got, want) <= BF16_GRAD_TOL  # the bf16 step is the fp32 step, to bf16 rounding


def test_activation_checkpointing_on_the_plain_path_changes_nothing():
    model = tiny_llama(tied=False, seed=6)
    want, _ = stepped(model, prefixflow=False)
    got, learner = stepped(model, prefixflow=False, checkpoint_layers=True)
    assert learner.model.is_gradient_checkpointing
    assert worst_rel(got, want) <= 1e-5


def test_activation_checkpointing_on_prefixflow_changes_nothing():
    model = tiny_llama(tied=False, seed=7)
    want, _ = stepped(model, prefixflow=True)
    got, _ = stepped(model, prefixflow=True, checkpoint_layers=True)
    assert worst_rel(got, want) <= 1e-5


def test_a_recomputed_prefix_changes_nothing_and_reaches_prefixflow(monkeypatch):
    from verbatim.trainer.prefix_offload import DormantStore

    model = tiny_llama(tied=False, seed=8)
    want, _ = stepped(model, prefixflow=True)
    seen, init = [], DormantStore.__init__
    monkeypatch.setattr(DormantStore, "__init__",
                        lambda self, where, *a, **k: seen.append(where) or init(self, where, *a, **k))
    got, _ = stepped(model, prefixflow=True, prefix_activations="recompute")
    assert seen and set(seen) == {"recompute"}
    assert worst_rel(got, want) <= 1e-5


@pytest.mark.parametrize("flags,needle", [
    (["--trainer-dtype", "fp16"], "--trainer-dtype fp16 must be 'fp32' or 'bf16'"),
    (["--logprob-chunk", "-1"], "--logprob-chunk -1 must be at least 0"),
    (["--prefix-activations", "gpu"], "--prefix-activations gpu must be 'keep', 'recompute', 'cpu' or 'disk'"),
])
def test_bad_memory_flags_are_one_line(tmp_path, monkeypatch, flags, needle):
    from verbatim.cli.app import app

    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["train", "--env", "guess", *flags, "--out", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], result.output
