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

from megamarl.rollout._http import JSONClient

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
    out = []
    with torch.no_grad():
        for prompt in PROBE_PROMPTS:
            ids = torch.tensor([prompt])
            for _ in range(PROBE_TOKENS):
                next_id = model(ids).logits[0, -1].argmax()
                ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
            out.append(ids[0, len(prompt):].tolist())
    return out


def _completions_probe(client: JSONClient, prompt: list[int], model: str) -> list[int]:
    """vLLM's OpenAI server."""
    reply = client.post("/v1/completions", {
        "model": model, "prompt": list(prompt), "max_tokens": PROBE_TOKENS, "min_tokens": PROBE_TOKENS,
        "temperature": 0.0, "ignore_eos": True, "return_token_ids": True,
    })
    return list(reply["choices"][0]["token_ids"])


def _generate_probe(client: JSONClient, prompt: list[int], model: str) -> list[int]:
    """SGLang's native ``/generate`` (no model name: a server serves one base model)."""
    reply = client.post("/generate", {
        "input_ids": list(prompt),
        "sampling_params": {"temperature": 0.0, "max_new_tokens": PROBE_TOKENS, "min_new_tokens": PROBE_TOKENS,
                            "ignore_eos": True},
    })
    return list(reply["output_ids"])


PROBES = {"vllm": _completions_probe, "sglang": _generate_probe}  # engine backend -> greedy probe


def served_tokens(url: str, model: str, *, backend: str = "vllm") -> list[list[int]]:
    probe = PROBES[backend]
    client = JSONClient(url, timeout_s=120)
    try:
        return [probe(client, prompt, model) for prompt in PROBE_PROMPTS]
    finally:
        client.close()


def verify_replicas(policy: str, model_path: str | Path, weights: dict[str, torch.Tensor], urls: dict[int, str],
                    *, served_model: str, version: int, backend: str = "vllm") -> int:
    """Raises ``WeightSyncMismatch`` naming the replica whose tokens differ; returns how many matched."""
    expected = reference_tokens(model_path, weights)
    for index, url in urls.items():
        got = served_tokens(url, served_model, backend=backend)
        if got != expected:
            raise WeightSyncMismatch(
                f"policy {policy} replica {index} ({url}) after weight version {version}: greedy tokens {got} "
                f"differ from transformers on the pushed weights {expected}"
            )
    return len(urls)
