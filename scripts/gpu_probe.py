"""The device check for the first GPU this code meets: what the CPU tests cannot show, in one run, one JSON.

    PYTHONPATH=src python scripts/gpu_probe.py --out probe.json            # on a GPU: the full check (< 10 min)
    PYTHONPATH=src python scripts/gpu_probe.py --small --out probe.json    # anywhere, in seconds (make test runs it)

It needs torch and transformers only (no vLLM, no pydantic: a GPU machine with a bare PyTorch image runs it),
and imports verbatim's trainer code from ``src/`` beside it. On the device it finds (CUDA if torch sees one,
else this CPU) it checks:

1. **cascade attention** (``trainer/cascade.py``) against its explicit-softmax kernel, forward and every
   gradient, in bfloat16 (on CUDA: PyTorch's flash kernels, whose backward gets its own forward's state) and
   float32; bound: 2e-2 of the largest value in bfloat16, 1e-5 in float32;
2. **PrefixFlow against full-sequence training** on a random Qwen3-shaped model: every parameter's gradient
   within the documented tolerances (docs/trainer.md): 1e-5 in float32; in bfloat16 within 3e-2 of full bf16
   and within 2.5× full bf16's own distance from float32;
3. **a device group** as the trainer's team makes it (``team.backend``: ``cpu:gloo,cuda:nccl`` on CUDA) carrying a
   CPU float64 scalar (``Team.total``'s) and a CUDA tensor, one rank;
4. **PrefixFlow's speed and memory** against full training at r = 0.83, G = 8, P = 2,048 (``--small``: P = 64,
   G = 4) on a random Qwen3-0.6B-shaped model in bfloat16 (``--small``: a tiny one), the best of 3 alternating
   repeats, with the FLOP ideal and the peak memory each pass allocates (CUDA's allocator; on a CPU, none).

Exit code 0 when every check holds, 1 otherwise; the JSON says which, with the machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

FLASH_BOUND = {torch.bfloat16: 2e-2, torch.float32: 1e-5}
FP32_BOUND, BF16_BOUND, BF16_TIMES_FULL = 1e-5, 3e-2, 2.5


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-30))


def machine(device: torch.device) -> dict:
    found = {"torch": torch.__version__, "device": device.type, "python": platform.python_version(),
             "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        found.update(gpu=props.name, capability=f"{props.major}.{props.minor}", gpu_memory_gib=round(
            props.total_memory / 2**30, 1), cuda=torch.version.cuda)
    return found


def check_cascade(device: torch.device, dtype: torch.dtype, small: bool) -> dict:
    """The cascade's default kernel against its explicit softmax: output and the five gradients."""
    from verbatim.trainer.cascade import _kernel, cascade_attention

    b, heads, kv, s, p, d = (2, 4, 2, 24, 40, 64) if small else (4, 16, 8, 256, 2048, 128)
    gen = torch.Generator(device="cpu").manual_seed(0)

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype).requires_grad_(True)

    q, k, v, pk, pv = leaf(b, heads, s, d), leaf(b, kv, s, d), leaf(b, kv, s, d), leaf(1, kv, p, d), leaf(1, kv, p, d)
    weight = torch.randn(b, heads, s, d, generator=gen).to(device=device, dtype=dtype)
    results = {}
    for kernel in ("auto", "math"):
        out = cascade_attention(q, k, v, pk, pv, d ** -0.5, kernel)
        grads = torch.autograd.grad((out.float() * weight.float()).sum(), (q, k, v, pk, pv))
        results[kernel] = (out.detach(), *grads)
    names = ("out", "d_query", "d_key", "d_value", "d_prefix_key", "d_prefix_value")
    errors = {name: rel_err(got, want) for name, got, want in zip(names, results["auto"], results["math"])}
    bound = FLASH_BOUND[dtype]
    return {"dtype": str(dtype).removeprefix("torch."), "kernel": _kernel(q, "auto"), "errors": errors,
            "bound": bound, "ok": max(errors.values()) <= bound}


def qwen3(device: torch.device, dtype: torch.dtype, size: str, seed: int = 0) -> torch.nn.Module:
    """A random Qwen3: ``tiny`` (2 layers of 128), ``small`` (4 layers of 256), or ``0.6b`` (Qwen3-0.6B's shape)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    shapes = {"tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=32, vocab_size=512),
              "small": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                            num_key_value_heads=4, head_dim=64, vocab_size=2048),
              "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                           num_key_value_heads=8, head_dim=128, vocab_size=151936)}
    torch.manual_seed(seed)
    config = Qwen3Config(**shapes[size], max_position_embeddings=8192, tie_word_embeddings=size == "0.6b")
    return Qwen3ForCausalLM(config).to(device=device, dtype=dtype)


def on_device(group, device: torch.device):  # noqa: ANN001, ANN201
    from verbatim.trainer.prefixflow import PrefixGroup

    return PrefixGroup(group.prefix.to(device), tuple(s.to(device) for s in group.suffixes),
                       tuple(m.to(device) for m in group.loss_masks))


def check_prefixflow(device: torch.device, small: bool) -> dict:
    """PrefixFlow's gradients against full-sequence training's, float32 and bfloat16, on a random Qwen3."""
    from verbatim.bench.prefixflow_exactness import grads_of as grads
    from verbatim.bench.prefixflow_exactness import make_group, rl_like_loss
    from verbatim.bench.prefixflow_exactness import max_rel_err as worst
    from verbatim.trainer.adapters import prefix_lm
    from verbatim.trainer.packing import microbatches
    from verbatim.trainer.prefixflow import full_sequence_backward, prefixflow_backward

    size, seq = ("tiny", 48) if small else ("small", 512)
    model = qwen3(device, torch.float32, size)
    group = on_device(make_group(8, 0.83, loss_in_prefix=True, seq=seq, vocab=model.config.vocab_size), device)
    lm, loss_fn, splits = prefix_lm(model), rl_like_loss(group), microbatches(8, 3)
    full_sequence_backward(lm, group, loss_fn, splits)
    full32 = grads(model)
    prefixflow_backward(lm, group, loss_fn, splits)
    fp32 = worst(grads(model), full32)
    model.to(torch.bfloat16)
    full_sequence_backward(lm, group, loss_fn, splits)
    full16 = grads(model)
    prefixflow_backward(lm, group, loss_fn, splits)
    flow16 = grads(model)
    bf16, full_gap = worst(flow16, full16), worst(full16, full32)
    bf16_vs_fp32 = worst(flow16, full32)
    return {"model": f"random Qwen3 ({size})", "group_size": 8, "prefix_ratio": 0.83, "tokens": seq,
            "fp32": fp32, "fp32_bound": FP32_BOUND, "bf16_vs_full_bf16": bf16, "bf16_bound": BF16_BOUND,
            "bf16_vs_fp32": bf16_vs_fp32, "full_bf16_vs_fp32": full_gap,
            "ok": fp32 <= FP32_BOUND and bf16 <= BF16_BOUND and bf16_vs_fp32 <= BF16_TIMES_FULL * full_gap}


def check_group(device: torch.device) -> dict:
    """One rank of a group made as the trainer's team makes it: a CPU float64 sum and, on CUDA, a device one."""
    import torch.distributed as dist

    from verbatim.trainer.distributed.team import backend

    chosen = backend(str(device))
    store = dist.HashStore()
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(chosen, store=store, rank=0, world_size=1, **kwargs)
    try:
        scalar = torch.tensor([1.5], dtype=torch.float64)
        dist.all_reduce(scalar)
        found = {"backend": chosen, "cpu_float64_sum": float(scalar.item()) == 1.5}
        if device.type == "cuda":
            tensor = torch.ones(4, device=device)
            dist.all_reduce(tensor)
            found["cuda_sum"] = bool((tensor == 1).all())
        else:
            found["cuda_sum"] = "not run: no CUDA device"
    finally:
        dist.destroy_process_group()
    found["ok"] = all(v is True for k, v in found.items() if k != "backend" and not isinstance(v, str))
    return found


def _timed(device: torch.device, step) -> tuple[float, float | None]:  # noqa: ANN001
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    start = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return time.perf_counter() - start, (torch.cuda.max_memory_allocated(device) - base) / 2**20
    return time.perf_counter() - start, None


def time_prefixflow(device: torch.device, small: bool, repeats: int = 3) -> dict:
    """PrefixFlow against full training on one group, bfloat16 weights, the best of ``repeats`` each."""
    from verbatim.bench.prefixflow import Case, bench_group, flop_ideal_speedup, suffixes_per_microbatch
    from verbatim.trainer.adapters import prefix_lm
    from verbatim.trainer.packing import microbatches
    from verbatim.trainer.prefixflow import full_sequence_backward, prefixflow_backward

    prefix, group_size, ratio, micro_batch = (64, 4, 0.83, 1) if small else (2048, 8, 0.83, 2)
    case = Case(ratio, group_size, round(prefix / ratio))
    model = qwen3(device, torch.bfloat16, "tiny" if small else "0.6b")
    lm = prefix_lm(model)
    group, loss_fn = bench_group(case, model.config.vocab_size)
    group = on_device(group, device)
    rows = suffixes_per_microbatch(lm, group, micro_batch)
    passes = {"full": lambda: full_sequence_backward(lm, group, loss_fn, microbatches(group_size, micro_batch)),
              "prefixflow": lambda: prefixflow_backward(lm, group, loss_fn, microbatches(group_size, rows))}
    best: dict[str, float] = {}
    peak: dict[str, float | None] = {}
    for step in passes.values():  # a first call of each, untimed: kernels chosen, memory pools sized
        step()
        model.zero_grad(set_to_none=True)
    for _ in range(repeats):
        for name, step in passes.items():
            took, peak[name] = _timed(device, step)
            model.zero_grad(set_to_none=True)
            best[name] = min(best.get(name, took), took)
    speedup = best["full"] / best["prefixflow"]
    ideal = flop_ideal_speedup(case, model.config)
    return {"model": "random Qwen3 (" + ("tiny" if small else "Qwen3-0.6B's shape") + "), bfloat16 weights",
            "prefix_tokens": case.prefix_tokens, "suffix_tokens": case.suffix_tokens, "group_size": group_size,
            "prefix_ratio": ratio, "micro_batch": micro_batch, "phase_b_rows": rows,
            "full_s": round(best["full"], 4), "prefixflow_s": round(best["prefixflow"], 4),
            "speedup": round(speedup, 3), "flop_ideal_speedup": round(ideal, 3),
            "share_of_ideal": round(speedup / ideal, 3), "peak_mib_full": peak["full"],
            "peak_mib_prefixflow": peak["prefixflow"], "ok": speedup > 0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="Where the JSON goes.")
    parser.add_argument("--small", action="store_true", help="Tiny shapes: seconds on any CPU (make test).")
    args = parser.parse_args(argv)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    started = time.perf_counter()
    report: dict = {"when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "machine": machine(device), "small": args.small}
    checks = {"cascade_bf16": lambda: check_cascade(device, torch.bfloat16, args.small),
              "cascade_fp32": lambda: check_cascade(device, torch.float32, args.small),
              "prefixflow_exactness": lambda: check_prefixflow(device, args.small),
              "group": lambda: check_group(device),
              "timing": lambda: time_prefixflow(device, args.small)}
    for name, check in checks.items():
        try:
            report[name] = check()
        except Exception as exc:  # noqa: BLE001 - a check that fails is a finding, and the others still run
            report[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        print(f"{name}: {'ok' if report[name]['ok'] else 'FAILED'}", file=sys.stderr)
    report["seconds"] = round(time.perf_counter() - started, 1)
    report["ok"] = all(report[name]["ok"] for name in checks)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
