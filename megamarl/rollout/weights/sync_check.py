"""Check that a weight push arrived intact: every replica decodes fixed prompts greedily and must
produce the tokens transformers produces on the exact tensors that were pushed (vLLM servers are
probed through ``/v1/completions``, SGLang servers through ``/generate``)
(``policies.<p>.engine.verify_sync``; costs one model load and a few greedy decodes per push on the
sending rank, so it is a debugging and CI guard, off by default).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from megamarl.rollout.engines._http import JSONClient

PROBE_PROMPTS = ([1, 17, 42, 99, 7], [2, 300, 5, 11])  # token ids: no tokenizer needed
PROBE_TOKENS = 8


class WeightSyncMismatch(RuntimeError):
    pass


def reference_tokens(model_path: str | Path, weights: dict[str, torch.Tensor]) -> list[list[int]]:
    """Greedy continuations of ``PROBE_PROMPTS`` by transformers on ``weights`` (HF names), in fp32."""
    config = AutoConfig.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    missing, _ = model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]
    if missing:
        raise WeightSyncMismatch(f"the pushed weights lack {missing[:5]}")
    if config.tie_word_embeddings:
        model.tie_weights()
    return _greedy(model)


def adapter_reference_tokens(model_path: str | Path, adapter_dir: str | Path) -> list[list[int]]:
    """The same continuations by the base model with the PEFT adapter in ``adapter_dir`` merged, in fp32."""
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return _greedy(PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload().eval())


def _greedy(model) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for prompt in PROBE_PROMPTS:
            ids = torch.tensor([prompt])
            for _ in range(PROBE_TOKENS):
                next_id = model(ids).logits[0, -1].argmax()
                ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
            out.append(ids[0, len(prompt) :].tolist())
    return out


def _completions_probe(client: JSONClient, prompt: list[int], model: str, lora: str | None) -> list[int]:
    """vLLM's OpenAI server (an adapter is served under its own model name)."""
    reply = client.post(
        "/v1/completions",
        {
            "model": lora or model,
            "prompt": list(prompt),
            "max_tokens": PROBE_TOKENS,
            "min_tokens": PROBE_TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    return list(reply["choices"][0]["token_ids"])


def _generate_probe(client: JSONClient, prompt: list[int], model: str, lora: str | None) -> list[int]:
    """SGLang's native ``/generate`` (no model name: a server serves one base model; ``lora_path``
    names an adapter)."""
    reply = client.post(
        "/generate",
        {
            **({"lora_path": lora} if lora else {}),
            "input_ids": list(prompt),
            "sampling_params": {
                "temperature": 0.0,
                "max_new_tokens": PROBE_TOKENS,
                "min_new_tokens": PROBE_TOKENS,
                "ignore_eos": True,
            },
        },
    )
    return list(reply["output_ids"])


PROBES = {"vllm": _completions_probe, "sglang": _generate_probe}  # engine backend -> greedy probe


def served_tokens(url: str, model: str, *, backend: str = "vllm", lora: str | None = None) -> list[list[int]]:
    probe = PROBES[backend]
    client = JSONClient(url, timeout_s=120)
    try:
        return [probe(client, prompt, model, lora) for prompt in PROBE_PROMPTS]
    finally:
        client.close()


def verify_replicas(
    policy: str,
    model_path: str | Path,
    weights: dict[str, torch.Tensor],
    urls: dict[int, str],
    *,
    served_model: str,
    version: int,
    backend: str = "vllm",
) -> int:
    """Raises ``WeightSyncMismatch`` naming the replica whose tokens differ; returns how many matched."""
    expected = reference_tokens(model_path, weights)
    for index, url in urls.items():
        got = served_tokens(url, served_model, backend=backend)
        if got != expected:
            raise WeightSyncMismatch(
                f"policy {policy} replica {index} ({url}) after weight version {version}: greedy tokens "
                f"{got} "
                f"differ from transformers on the pushed weights {expected}"
            )
    return len(urls)


def verify_adapter(
    policy: str,
    adapter: str,
    model_path: str | Path,
    adapter_dir: str | Path,
    urls: dict[int, str],
    *,
    version: int,
    served_model: str,
    backend: str = "vllm",
) -> int:
    """L2: every replica serving ``adapter`` (under its own model name) decodes what transformers
    decodes with the adapter directory it was told to load. Returns how many matched."""
    expected = adapter_reference_tokens(model_path, adapter_dir)
    for index, url in urls.items():
        got = served_tokens(url, served_model, backend=backend, lora=adapter)
        if got != expected:
            raise WeightSyncMismatch(
                f"policy {policy} adapter {adapter} replica {index} ({url}) after version {version}: greedy "
                "tokens "
                f"{got} differ from transformers with {adapter_dir} {expected}"
            )
    return len(urls)
