"""What verbatim adds to vLLM's worker (``worker_extension_cls``, one class): the weight receiver
(engine/weight_push.py) and the capture of the experts the MoE routers chose (engine/expert_capture.py).
Their methods are called over vLLM's ``collective_rpc``. vLLM imports this module in each worker before it
builds the model, which is where the CPU LoRA ops are replaced (engine/lora_cpu.py)."""

from __future__ import annotations

from verbatim.engine import lora_cpu
from verbatim.engine.expert_capture import ExpertCapture, records_experts
from verbatim.engine.weight_push import WeightReceiver

lora_cpu.install()


class WorkerExtension(WeightReceiver, ExpertCapture):
    """Mixed into each vLLM worker of an in-process engine and of the servers verbatim starts."""

    def verbatim_extension(self) -> dict[str, bool]:
        """That this worker has verbatim's extension (a client asks a server it did not start), and whether it
        was started to record the routed experts."""
        return {"record_experts": records_experts(self.vllm_config)}


EXTENSION = f"{WorkerExtension.__module__}.{WorkerExtension.__qualname__}"
