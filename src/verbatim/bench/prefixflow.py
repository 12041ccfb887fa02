"""``verbatim bench prefixflow``: actor-side time and peak memory, PrefixFlow versus full sequences.

For each (prefix ratio r, group size G) on a sequence length N: P = round(r·N) shared
tokens, G suffixes of S = N − P tokens, the loss on the suffix tokens (an RL-style
policy-gradient loss with per-sequence advantages). One forward + backward of the G
whole sequences (the baseline, in microbatches of M sequences) and one PrefixFlow pass
over the same group from the same weights; the maximum per-parameter relative gradient error
between them; and two ideal speedups:

* the token ideal G(P+S)/(P+G·S), the ratio of tokens processed;
* the FLOP ideal (:func:`flop_ideal_speedup`), the ratio of the two passes' floating-point
  operations on this model: the linear layers per token, the attention per (query, key) pair
  (a suffix token attends over the whole prefix) and the output layer on every loss token
  (the same in both passes), so tokens are not equal.

Phase B's microbatches get the memory budget of a baseline microbatch, not its token count
(:func:`suffixes_per_microbatch`): the bytes autograd saves for the backward of one baseline
microbatch's forward, measured, over those of one more suffix row (at least M rows).

PrefixFlow runs in up to three settings (:data:`SETTINGS`): as fast as it goes (the prefix's activations
kept for phase C, phase B by the memory budget); with the prefix's activations kept and phase B in
microbatches of M suffixes (``kept``); and at its least memory (``low memory``: the prefix recomputed in
phase C, so during phase B it holds only its keys/values, and phase B in microbatches of M suffixes).
Holding the prefix's activations costs no work and recomputing them costs a prefix forward; the
markdown's second table shows each setting's time and memory side by side.

Peak memory is the rise of the process's peak resident set (VmHWM, Linux) over its
resident size at the start of the pass, after glibc has handed its free memory back
(``malloc_trim``); the gradients the pass allocates count. glibc's malloc raises its mmap threshold
each time a large block is freed, so later blocks of that size come from the heap and stay resident
after they are freed: the resident set then holds the allocator's retained memory beside the live
tensors, more for a pass that frees and allocates many large blocks. ``mmap_threshold_mib``
(:func:`fix_mmap_threshold`) pins the threshold, so every large block is mapped and unmapped on its
own and the resident set follows the live tensors (at the cost of page faults: every pass is slower).
"""

from __future__ import annotations

import contextlib
import ctypes
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from verbatim.errors import InputError
from verbatim.trainer.adapters import prefix_lm
from verbatim.trainer.causal_lm import PrefixCausalLM
from verbatim.trainer.packing import microbatches
from verbatim.trainer.prefixflow import (
    LossFn,
    PrefixGroup,
    PrefixState,
    encode_prefix,
    full_sequence_backward,
    prefixflow_backward,
)
from verbatim.trainer.reference import load_model

KEYS = ("prefix_ratio", "group_size", "prefix_tokens", "suffix_tokens", "micro_batch", "baseline_s", "prefixflow_s",
        "speedup", "ideal_speedup", "flop_ideal_speedup", "phase_b_rows", "flop_ideal_speedup_recompute",
        "grad_max_rel_err", "peak_mb_baseline", "peak_mb_prefixflow",
        "prefixflow_kept_s", "speedup_kept", "peak_mb_prefixflow_kept",
        "prefixflow_low_memory_s", "speedup_low_memory", "peak_mb_prefixflow_low_memory")
"""The keys of one result object, in order (the last six None without ``--low-memory``)."""

SETTINGS = {"prefixflow": ("fast", "kept"), "kept": ("phase B at M", "kept"),
            "low_memory": ("low memory", "recomputed")}
"""Each PrefixFlow pass's key: (its name in the settings table, what happens to the prefix's activations)."""


@dataclass(frozen=True)
class Case:
    prefix_ratio: float
    group_size: int
    seq_len: int

    @property
    def prefix_tokens(self) -> int:
        return min(self.seq_len - 1, max(1, round(self.prefix_ratio * self.seq_len)))

    @property
    def suffix_tokens(self) -> int:
        return self.seq_len - self.prefix_tokens

    @property
    def ideal_speedup(self) -> float:
        p, s, g = self.prefix_tokens, self.suffix_tokens, self.group_size
        return g * (p + s) / (p + g * s)


def flop_ideal_speedup(case: Case, config: object, recompute: bool = False) -> float:
    """Full training's FLOPs over PrefixFlow's for a dense decoder's ``config``: linear layers per token,
    attention per causal (query, key) pair, the output layer per loss token (the suffix tokens, in both);
    a backward is twice its forward in both. ``recompute``: the prefix runs forward a second time in
    phase C (``--prefix-activations recompute``)."""
    p, s, g = case.prefix_tokens, case.suffix_tokens, case.group_size
    linear, pair, output = _flops_per_token(config)

    def pairs(n: int) -> int:
        return n * (n + 1) // 2

    prefix = p * linear + pairs(p) * pair
    full = g * ((p + s) * linear + pairs(p + s) * pair + s * output)
    flow = prefix * (4 / 3 if recompute else 1) + g * (s * linear + (s * p + pairs(s)) * pair + s * output)
    return full / flow


def _flops_per_token(config: object) -> tuple[float, float, float]:
    """(linear layers per token, attention per (query, key) pair, output layer per loss token), forward."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim  # q, o; k, v
    projections = attention + 3 * hidden * config.intermediate_size  # gate, up, down
    return 2.0 * layers * projections, 4.0 * layers * heads * head_dim, 2.0 * hidden * config.vocab_size


def bench_group(case: Case, vocab_size: int, seed: int = 0) -> tuple[PrefixGroup, LossFn]:
    """Random tokens (the cost does not depend on them) and a policy-gradient loss on the suffixes."""
    gen = torch.Generator().manual_seed(seed)
    p, s, g = case.prefix_tokens, case.suffix_tokens, case.group_size
    prefix = torch.randint(0, vocab_size, (p,), generator=gen)
    suffixes = tuple(torch.randint(0, vocab_size, (s,), generator=gen) for _ in range(g))
    mask = torch.cat([torch.zeros(p, dtype=torch.bool), torch.ones(s, dtype=torch.bool)])
    advantages = torch.randn(g, generator=gen)
    total = float(g * s)

    def loss_fn(logprobs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return -(advantages[rows, None].to(logprobs) * logprobs).sum() / total  # logprobs' dtype and device

    return PrefixGroup(prefix, suffixes, tuple(mask for _ in range(g))), loss_fn


def run_case(model: torch.nn.Module, case: Case, micro_batch: int, low_memory: bool = True,
             repeats: int = 1) -> dict:
    """Time and measure one configuration; returns the JSON object of :data:`KEYS`.

    The passes alternate ``repeats`` times; each time is the fastest of its repeats (other work on the
    machine only ever slows a pass down). Peak memory comes from the first repeat; the gradient error is
    the worst of the PrefixFlow passes' against the baseline's, from the first repeat.
    """
    lm = prefix_lm(model)
    group, loss_fn = bench_group(case, model.config.vocab_size)
    splits = microbatches(case.group_size, micro_batch)
    rows = suffixes_per_microbatch(lm, group, micro_batch)
    passes: dict[str, Callable[[], float]] = {
        "baseline": lambda: full_sequence_backward(lm, group, loss_fn, splits),
        "prefixflow": lambda: prefixflow_backward(lm, group, loss_fn, microbatches(case.group_size, rows)),
    }
    if low_memory:
        passes["kept"] = lambda: prefixflow_backward(lm, group, loss_fn, splits)
        passes["low_memory"] = lambda: prefixflow_backward(lm, group, loss_fn, splits, offload="recompute")
    seconds, peaks, err, want = {}, {}, 0.0, None
    for name, step in passes.items():
        seconds[name], peaks[name], grads = _measure(model, step)
        if want is None:
            want = grads
        else:
            err = max(err, max_rel_err(grads, want))
        del grads
    del want
    for _ in range(repeats - 1):
        for name, step in passes.items():
            seconds[name] = min(seconds[name], _measure(model, step, keep=False)[0])
    result = {
        "prefix_ratio": case.prefix_ratio, "group_size": case.group_size,
        "prefix_tokens": case.prefix_tokens, "suffix_tokens": case.suffix_tokens, "micro_batch": micro_batch,
        "baseline_s": round(seconds["baseline"], 6), "prefixflow_s": round(seconds["prefixflow"], 6),
        "speedup": round(seconds["baseline"] / seconds["prefixflow"], 4), "ideal_speedup": round(case.ideal_speedup, 3),
        "flop_ideal_speedup": round(flop_ideal_speedup(case, model.config), 3), "phase_b_rows": rows,
        "flop_ideal_speedup_recompute": round(flop_ideal_speedup(case, model.config, recompute=True), 3),
        "grad_max_rel_err": err, "peak_mb_baseline": peaks["baseline"], "peak_mb_prefixflow": peaks["prefixflow"],
    }
    for name in ("kept", "low_memory"):
        took = seconds.get(name)
        result[f"prefixflow_{name}_s"] = None if took is None else round(took, 6)
        result[f"speedup_{name}"] = None if took is None else round(seconds["baseline"] / took, 4)
        result[f"peak_mb_prefixflow_{name}"] = peaks.get(name)
    return result


def suffixes_per_microbatch(lm: PrefixCausalLM, group: PrefixGroup, micro_batch: int) -> int:
    """Phase B gets the memory budget of a baseline microbatch: as many suffix rows as fit in the bytes one
    baseline microbatch's forward saves for its backward, measured (rows beyond the first cost what the
    second adds; at least ``micro_batch``, at most the group). The group's sequences are of one length, as here."""
    if group.size == 1:
        return 1
    budget = saved_bytes(lm, lambda: _full_forward(lm, group, list(range(min(micro_batch, group.size)))))
    state = encode_prefix(lm, group)
    try:
        one = saved_bytes(lm, lambda: _suffix_forward(lm, group, state, [0]))
        two = saved_bytes(lm, lambda: _suffix_forward(lm, group, state, [0, 1]))
    finally:
        state.store.close()
    row = max(two - one, 1)
    fits = 1 + (budget - one) // row if budget >= one else 1
    return int(min(group.size, max(micro_batch, fits)))


def saved_bytes(lm: PrefixCausalLM, step: Callable[[], object]) -> int:
    """Bytes autograd saves for the backward while ``step`` runs: distinct storages, parameters left out."""
    parameters = {param.untyped_storage().data_ptr() for param in lm.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        step()
    return sum(seen.values())


def _full_forward(lm: PrefixCausalLM, group: PrefixGroup, rows: list[int]) -> torch.Tensor:
    ids = torch.stack([group.sequence(i) for i in rows])
    hidden, _ = lm.hidden_states(ids)
    p = group.prefix_len
    return lm.token_logprobs(hidden[:, p - 1:-1].reshape(-1, hidden.shape[-1]), ids[:, p:].reshape(-1))


def _suffix_forward(lm: PrefixCausalLM, group: PrefixGroup, state: PrefixState, rows: list[int]) -> torch.Tensor:
    ids = torch.stack([group.suffixes[i] for i in rows])
    hidden, _ = lm.hidden_states(ids, start=group.prefix_len, past=state.kv)
    return lm.token_logprobs(hidden.reshape(-1, hidden.shape[-1]), ids.reshape(-1))


def warm_up(model: torch.nn.Module) -> None:
    """One small pass of each kind, so first-call costs stay out of the timings."""
    lm = prefix_lm(model)
    group, loss_fn = bench_group(Case(0.5, 2, 16), model.config.vocab_size)
    full_sequence_backward(lm, group, loss_fn, [[0, 1]])
    prefixflow_backward(lm, group, loss_fn, [[0, 1]])
    model.zero_grad(set_to_none=True)


def max_rel_err(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """Worst parameter's max |got − want| / max |want|."""
    worst = 0.0
    for name, reference in want.items():
        scale = float(reference.abs().max())
        diff = float((got[name] - reference).abs().max())
        worst = max(worst, diff / scale if scale > 0 else diff)
    return worst


def _measure(model: torch.nn.Module, step: Callable[[], float],
             keep: bool = True) -> tuple[float, float | None, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with peak_rss_mb() as peak:
        start = time.perf_counter()
        step()
        seconds = time.perf_counter() - start
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()} if keep else {}
    model.zero_grad(set_to_none=True)
    return seconds, peak.mb, grads


class _Peak:
    mb: float | None = None


@contextlib.contextmanager
def peak_rss_mb() -> Iterator[_Peak]:
    """Peak resident-set rise (MiB) inside the block; ``mb`` stays None off Linux."""
    peak = _Peak()
    status, clear = Path("/proc/self/status"), Path("/proc/self/clear_refs")
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
    try:
        clear.write_text("5")  # reset VmHWM to the current resident size
        start = _status_kb(status, "VmRSS")
    except OSError:
        start = None
    yield peak
    if start is not None:
        peak.mb = round((_status_kb(status, "VmHWM") - start) / 1024, 1)


M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameter for the mmap threshold (malloc.h); setting it turns the dynamic threshold off."""


def fix_mmap_threshold(mib: int) -> None:
    """Pin glibc's mmap threshold at ``mib`` MiB for this process: blocks of that size or more are mapped
    and unmapped on their own, so the resident set follows the live tensors (every pass pays page faults)."""
    libc = _glibc()
    if libc is None or not libc.mallopt(M_MMAP_THRESHOLD, mib << 20):
        raise InputError(f"--mmap-threshold {mib}: glibc's mallopt refused it or is not here (glibc only)")


def _glibc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def _status_kb(status: Path, field: str) -> int:
    for line in status.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise OSError(f"{field} not in {status}")


def run_bench(model_path: Path, ratios: list[float], group_sizes: list[int], seq_len: int,
              micro_batch: int, low_memory: bool = True, repeats: int = 1, threads: int | None = None,
              progress: Callable[[dict], None] | None = None, mmap_threshold_mib: int | None = None) -> list[dict]:
    """Every (ratio, group size) configuration on the model at ``model_path``, in float32.

    ``threads`` sets torch's intra-op threads (default: torch's choice). On a machine shared
    with other work, one thread keeps timings honest: a descheduled worker thread stalls
    every operation of a multi-threaded pass at its barrier. ``mmap_threshold_mib``: see
    :func:`fix_mmap_threshold` (set before the model loads, for the whole process).
    """
    if mmap_threshold_mib is not None:
        fix_mmap_threshold(mmap_threshold_mib)
    if threads is not None:
        torch.set_num_threads(threads)
    model = load_model(model_path).train()
    warm_up(model)
    results = []
    for ratio in ratios:
        for size in group_sizes:
            result = run_case(model, Case(ratio, size, seq_len), micro_batch, low_memory, repeats)
            results.append(result)
            if progress is not None:
                progress(result)
    return results


def markdown_table(results: list[dict]) -> str:
    """The configurations with the fast PrefixFlow; then, where more settings ran, every setting's row."""
    head = ("| r | G | P | S | phase B rows | full (s) | PrefixFlow (s) | speedup | token ideal | % of token ideal "
            "| FLOP ideal | % of FLOP ideal | grad max rel err | peak MB full | peak MB PrefixFlow (vs full) |")
    lines = [head, "|" + "---:|" * 15]
    for r in results:
        lines.append(
            f"| {r['prefix_ratio']} | {r['group_size']} | {r['prefix_tokens']} | {r['suffix_tokens']} "
            f"| {r['phase_b_rows']} | {r['baseline_s']:.2f} | {r['prefixflow_s']:.2f} | {r['speedup']:.2f}x "
            f"| {r['ideal_speedup']:.2f}x | {_pct(r['speedup'], r['ideal_speedup'])} | {r['flop_ideal_speedup']:.2f}x "
            f"| {_pct(r['speedup'], r['flop_ideal_speedup'])} | {r['grad_max_rel_err']:.1e} "
            f"| {_mb(r['peak_mb_baseline'])} | {_share(r['peak_mb_prefixflow'], r['peak_mb_baseline'])} |")
    settings = [_setting_row(r, key) for r in results for key in SETTINGS
                if key == "prefixflow" or r[f"speedup_{key}"] is not None]
    if len(settings) > len(results):
        head = ("| r | G | PrefixFlow setting | prefix activations | phase B rows | PrefixFlow (s) | speedup "
                "| % of token ideal | its FLOP ideal | % of it | peak MB (vs full) |")
        lines += ["", head, "|---:|---:|---|---|" + "---:|" * 7, *settings]
    return "\n".join(lines)


def _setting_row(r: dict, key: str) -> str:
    name, activations = SETTINGS[key]
    fast = key == "prefixflow"
    suffix = "" if fast else f"_{key}"
    took, speedup, peak = r[f"prefixflow{suffix}_s"], r["speedup" + suffix], r[f"peak_mb_prefixflow{suffix}"]
    rows = r["phase_b_rows"] if fast else min(r["group_size"], r["micro_batch"])
    flops = r["flop_ideal_speedup_recompute" if key == "low_memory" else "flop_ideal_speedup"]
    return (f"| {r['prefix_ratio']} | {r['group_size']} | {name} | {activations} | {rows} | {took:.2f} "
            f"| {speedup:.2f}x | {_pct(speedup, r['ideal_speedup'])} | {flops:.2f}x | {_pct(speedup, flops)} "
            f"| {_share(peak, r['peak_mb_baseline'])} |")


def _pct(value: float, ideal: float) -> str:
    return f"{100 * value / ideal:.0f}%"


def _mb(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f}"


def _share(value: float | None, full: float | None) -> str:
    if value is None:
        return "n/a"
    return _mb(value) if not full else f"{value:.0f} ({value / full:.2f}x)"


SECTION = "bench-prefixflow"


def section_text(results: list[dict], model_name: str, command: str, mmap_threshold_mib: int | None = None) -> str:
    """The table and how it was measured, for the section ``--write`` replaces."""
    allocator = ("" if mmap_threshold_mib is None else
                 f", glibc's mmap threshold pinned at {mmap_threshold_mib} MiB: peaks follow the live tensors")
    return (markdown_table(results) + f"\n\nMeasured by `{command}` ({time.strftime('%Y-%m-%d')}, {model_name}, "
            f"float32, torch threads: {torch.get_num_threads()}{allocator}).")
