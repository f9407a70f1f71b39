"""L2 serving rules: which LoRA adapters a policy's engines serve, and what an engine must be started
with to serve them (``LoraServing``). One place for the rule, used by the in-process factory, the server
command line, the weight push and the export."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from megamarl.models.lora import hf_target_modules

if TYPE_CHECKING:
    from megamarl.config import RunConfig


@dataclass
class LoraServing:
    num_adapters: int
    rank: int
    # HF module names the adapters adapt (``policies.<p>.lora.targets`` mapped): SGLang sizes its LoRA
    # buffers from them when started without adapters (--lora-target-modules; it refuses to start without)
    target_modules: tuple[str, ...] = ()

    @property
    def vllm_max_rank(self) -> int:
        """vLLM's ``max_lora_rank`` for adapters of ``rank``: it accepts only the values of
        ``vllm.config.lora.MaxLoRARanks`` (0.32), so the smallest of them that holds ``rank``."""
        fits = [r for r in VLLM_LORA_RANKS if r >= self.rank]
        if not fits:
            raise ValueError(
                f"policies.<p>.lora.rank={self.rank} exceeds vLLM's largest max_lora_rank "
                f"{VLLM_LORA_RANKS[-1]}"
            )
        return fits[0]


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm.config.lora.MaxLoRARanks


def policy_adapters(cfg: RunConfig, policy: str) -> list[str]:
    """L2: the LoRA adapter names the agents of ``policy`` sample from (sorted, unique). ``cfg``: the
    run config (``agents.<a>.policy`` / ``agents.<a>.lora``)."""
    return sorted({a.lora for a in cfg.agents.values() if a.policy == policy and a.lora})


def lora_serving(cfg: RunConfig, policy: str) -> LoraServing | None:
    """What ``policy``'s engines must be started with to serve its adapters (None: no L2 adapters)."""
    lora = cfg.policies[policy].lora
    adapters = policy_adapters(cfg, policy)
    if lora is None or not adapters:
        return None
    return LoraServing(
        num_adapters=len(adapters), rank=lora.rank, target_modules=tuple(hf_target_modules(lora))
    )


# SGLang's LoRA kernels are CUDA/Triton; its torch_native LoRA backend was not verified on CPU.
SGLANG_CPU_LORA = (
    "policies.{policy}.lora with engine.backend=sglang on CPU: SGLang serves LoRA adapters on GPU "
    "only here; use engine.backend=vllm (vLLM-CPU serves them) or drop the lora"
)


def check_lora_backends(cfg: RunConfig, *, on_gpu: bool) -> None:
    """Refuse, before anything loads, L2 adapters on an engine that cannot serve them on this node
    (the launch's preflight; a dry run of a GPU config on a CPU machine does not call it)."""
    for name, policy in cfg.policies.items():
        if policy.engine.backend == "sglang" and not on_gpu and lora_serving(cfg, name) is not None:
            raise ValueError(SGLANG_CPU_LORA.format(policy=name))
