"""``hf`` engine: a transformers causal LM with batched KV-cache decoding; no extra install.

Concurrent ``generate`` calls are merged by a ``MicroBatcher`` into one left-padded static batch;
every row keeps its own sampling parameters, and stop strings are matched on the decoded response as
vLLM does. Logprobs follow vLLM's ``processed_logprobs``: the sampled token's log-probability under the
distribution it was drawn from (``log_softmax(logits / T)`` restricted to the top-k/top-p support);
greedy reports ``log_softmax(logits)``. Sleep level 1 offloads weights to host memory; level 2 frees
the base's storage, so the next ``update_weights`` must carry every base tensor. Multi-LoRA through
PEFT: ``add_lora(name, path)``, ``generate(..., lora=name)`` (one decode per adapter group of a
micro-batch), ``update_weights(..., lora=name)`` in place, stamping ``lora_versions[name]``.
Details: docs/design-notes.md, "megamarl/rollout/engines/hf.py".
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable
from itertools import groupby
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from megamarl.parallel.hardware import DTYPES, resolve_dtype
from megamarl.rollout.engines.base import ENGINES, EngineTraits, Generation, InProcessEngine, SamplingParams
from megamarl.rollout.engines.batching import MicroBatcher

if TYPE_CHECKING:
    from megamarl.config import EngineConfig

BASE_LAYER = ".base_layer."  # PEFT wraps each adapted linear: its base weight moves under this name


@ENGINES.register(
    "hf", traits=EngineTraits(configurable=True, in_process=True, can_sleep=True, serves_lora=True)
)
class HFEngine(InProcessEngine):
    """Serve one HF causal LM (a directory path or an already-built ``PreTrainedModel``) and, after
    ``add_lora``, its LoRA adapters."""

    def __init__(
        self,
        model: str | Path | torch.nn.Module,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        max_batch_rows: int = 32,
        max_wait_ms: float = 5.0,
        eos_token_ids: Iterable[int] | None = None,
        seed: int = 0,
        num_threads: int = 0,
        tokenizer=None,
    ) -> None:
        """``num_threads`` > 0: CPU threads each batch decodes with (set on the batch's thread);
        ``tokenizer``: decodes responses for stop strings (None: the model directory's, when needed)."""
        super().__init__()
        self.num_threads = num_threads
        if isinstance(model, torch.nn.Module):
            self.model_path = None
            self.model = model
        else:
            from transformers import AutoModelForCausalLM

            self.model_path = Path(model)
            self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=dtype)
        self._tokenizer = tokenizer
        self.base_model = self.model  # self.model becomes a PeftModel around it with the first adapter
        self.device = torch.device(device)
        self.model.to(self.device).eval()
        self.eos_token_ids = frozenset(eos_token_ids if eos_token_ids is not None else _model_eos(self.model))
        self.pad_token_id = min(self.eos_token_ids) if self.eos_token_ids else 0
        self.weight_version = 0
        self._rng = torch.Generator(device=self.device).manual_seed(seed)
        # Held while a batch decodes and while weights change: an update waits for the running
        # batch (drain) and no batch ever sees half-loaded weights.
        self._model_lock = threading.Lock()
        self._offloaded = False
        self._discarded: dict[int, tuple[torch.nn.Parameter, torch.Size]] | None = None
        self._weights_valid = True
        self._closed = False
        self.batcher = MicroBatcher(self._run_batch, max_batch_rows=max_batch_rows, max_wait_ms=max_wait_ms)

    # -- generation ------------------------------------------------------------------------------

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, *, lora: str | None = None
    ) -> list[Generation]:
        if lora is not None and lora not in self.lora_versions:
            raise ValueError(
                f"unknown LoRA adapter '{lora}'; registered: {sorted(self.lora_versions) or 'none'}"
            )
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        await self._admitted()
        return await self.batcher.submit((list(prompt_ids), sampling, lora), num_rows=sampling.n)

    def _run_batch(
        self, requests: list[tuple[list[int], SamplingParams, str | None]]
    ) -> list[list[Generation]]:
        results: list[list[Generation]] = [[] for _ in requests]
        num_rows = sum(sp.n for _, sp, _ in requests)
        if self.num_threads > 0:  # this batch thread's OpenMP team (torch._C: vLLM may patch the wrapper)
            torch._C.set_num_threads(self.num_threads)
        with self._model_lock:
            if self._closed:
                raise RuntimeError("HFEngine was shut down")
            if not self._weights_valid:
                raise RuntimeError("weights were discarded by sleep(level=2); call update_weights first")
            by_adapter = sorted(range(len(requests)), key=lambda i: requests[i][2] or "")
            for lora, grouped in groupby(by_adapter, key=lambda i: requests[i][2]):
                group = list(grouped)
                rows = [(i, j) for i in group for j in range(requests[i][1].n)]
                with self._adapter(lora):
                    tokens, logprobs, reasons = self._decode(
                        [requests[i][0] for i, _ in rows],
                        [requests[i][1] for i, _ in rows],
                        [self._row_generator(requests[i][1], j) for i, j in rows],
                    )
                version = self.version_for(lora)
                for r, (i, _) in enumerate(rows):
                    meta = {"batch_rows": num_rows}
                    results[i].append(Generation(tokens[r], logprobs[r], reasons[r], version, meta))
        return results

    def _decoder(self):
        """ids -> text, for stop strings: the given tokenizer or the model directory's."""
        if self._tokenizer is None:
            if self.model_path is None:
                raise ValueError(
                    "sampling.stop needs the engine's tokenizer: build HFEngine(..., tokenizer=...)"
                )
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        return lambda ids: self._tokenizer.decode(ids, skip_special_tokens=False)

    def _adapter(self, lora: str | None):
        """Context: forwards use adapter ``lora`` (None: the bare base model)."""
        if not self.lora_versions:
            return contextlib.nullcontext()
        if lora is None:
            return self.model.disable_adapter()
        self.model.set_adapter(lora)
        return contextlib.nullcontext()

    def _row_generator(self, sampling: SamplingParams, sample_index: int) -> torch.Generator:
        if sampling.seed is None:
            return self._rng
        return torch.Generator(device=self.device).manual_seed(sampling.seed + sample_index)

    @torch.no_grad()
    def _decode(
        self, prompts: list[list[int]], params: list[SamplingParams], generators: list[torch.Generator]
    ) -> tuple[list[list[int]], list[list[float]], list[str]]:
        num_rows, dev = len(prompts), self.device
        max_len = max(len(p) for p in prompts)
        input_ids = torch.full((num_rows, max_len), self.pad_token_id, dtype=torch.long, device=dev)
        attention_mask = torch.zeros((num_rows, max_len), dtype=torch.long, device=dev)
        for r, prompt in enumerate(prompts):  # left padding: every row's last token is at -1
            input_ids[r, max_len - len(prompt) :] = torch.tensor(prompt, device=dev)
            attention_mask[r, max_len - len(prompt) :] = 1
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        sampler = _RowSampler(params, generators, dev)
        stop_ids = [self.eos_token_ids | set(sp.stop_token_ids) for sp in params]
        stop_texts = [sp.stop for sp in params]
        decode = self._decoder() if any(stop_texts) else None
        max_new = [sp.max_tokens for sp in params]

        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1,
        )
        tokens: list[list[int]] = [[] for _ in prompts]
        logprobs: list[list[float]] = [[] for _ in prompts]
        reasons: list[str | None] = [None] * num_rows
        for _ in range(max(max_new)):
            next_tokens, next_logprobs = sampler(out.logits[:, -1, :].float())
            for r in range(num_rows):
                if reasons[r] is not None:
                    continue
                tok = int(next_tokens[r])
                tokens[r].append(tok)
                logprobs[r].append(float(next_logprobs[r]))
                # decode is set when any row has stop texts
                if tok in stop_ids[r] or stop_texts[r] and _has_stop(decode(tokens[r]), stop_texts[r]):  # type: ignore[misc]
                    reasons[r] = "stop"
                elif len(tokens[r]) >= max_new[r]:
                    reasons[r] = "length"
            if all(reason is not None for reason in reasons):
                break
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((num_rows, 1))], dim=1)
            position_ids = position_ids[:, -1:] + 1
            out = self.model(
                input_ids=next_tokens[:, None],
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=out.past_key_values,
                use_cache=True,
            )
        return tokens, logprobs, [reason or "length" for reason in reasons]

    # -- weights and lifecycle -------------------------------------------------------------------

    def update_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int, lora: str | None = None
    ) -> None:
        """Copy HF-named tensors into the model (any subset of its state dict) and stamp ``version``;
        with ``lora``, PEFT-named tensors into that adapter (stamping its version)."""
        with self._model_lock:
            if lora is None:
                self._rematerialize()
                _copy_named(weights, self._base_targets(), what="this model")
                self._weights_valid = True
                self.weight_version = version
            else:
                if lora not in self.lora_versions:
                    raise ValueError(
                        f"update_weights: unknown LoRA adapter '{lora}'; add it with add_lora first"
                    )
                _copy_named(weights, self._lora_targets(lora), what=f"LoRA adapter '{lora}'")
                self.lora_versions[lora] = version

    def _base_targets(self) -> dict[str, torch.Tensor]:
        """HF name -> tensor of the base model (tied weights appear under both names)."""
        targets = {}
        for name, tensor in self.base_model.state_dict(keep_vars=True).items():
            if ".lora_" not in name:
                targets[name.replace(BASE_LAYER, ".")] = tensor
        return targets

    def _lora_targets(self, lora: str) -> dict[str, torch.Tensor]:
        """PEFT adapter-file name (``...q_proj.lora_A.weight``) -> that tensor of adapter ``lora``."""
        targets = {}
        for name, tensor in self.model.state_dict(keep_vars=True).items():
            for part in (".lora_A.", ".lora_B."):
                if f"{part}{lora}." in name:
                    targets[name.replace(f"{part}{lora}.", part)] = tensor
        return targets

    # -- LoRA ------------------------------------------------------------------------------------

    @classmethod
    def from_config(
        cls, cfg: EngineConfig, path: Path, *, replica: int, seed: int, lora=None, num_threads: int = 0
    ) -> HFEngine:
        dtype = DTYPES[resolve_dtype(cfg.dtype)]
        return cls(path, seed=seed, max_batch_rows=cfg.max_num_seqs, dtype=dtype, num_threads=num_threads)

    def add_lora(self, name: str, path: str | Path) -> None:
        """Load the PEFT adapter directory ``path`` as adapter ``name`` (replacing one of that name)."""
        from peft import PeftModel

        if not (Path(path) / "adapter_config.json").is_file():
            raise ValueError(
                f"LoRA '{name}': {path} is not a PEFT adapter directory (no adapter_config.json)"
            )
        with self._model_lock:
            if not isinstance(self.model, PeftModel):
                self.model = PeftModel.from_pretrained(self.base_model, str(path), adapter_name=name)
            else:
                if name in self.model.peft_config:
                    self.model.delete_adapter(name)
                self.model.load_adapter(str(path), adapter_name=name)
            self.model.to(self.device).eval()
            self.lora_versions[name] = 0

    def sleep(self, *, level: int = 1) -> None:
        """Level 1: offload weights to host memory. Level 2: free the weights (re-sent on update)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        self._awake.close()
        with self._model_lock:
            if level == 1 and self.device.type != "cpu":
                self.model.to("cpu")
                self._offloaded = True
            elif level == 2 and self._discarded is None:
                self._discarded = {}
                for name, param in self.base_model.named_parameters():  # deduplicates tied parameters
                    if ".lora_" in name:
                        continue  # adapters stay: a base update does not carry them
                    self._discarded[id(param)] = (param, param.shape)
                    param.data = torch.empty(0, dtype=param.dtype, device=param.device)
                self._weights_valid = False
                self.weight_version = -1  # holds no version: the next push is a full one (delta_sync)

    def wake(self) -> None:
        with self._model_lock:
            if self._offloaded:
                self.model.to(self.device)
                self._offloaded = False
            self._rematerialize()
        self._awake.open()

    def _rematerialize(self) -> None:
        if self._discarded is None:
            return
        for param, shape in self._discarded.values():
            param.data = torch.empty(shape, dtype=param.dtype, device=self.device)
        self._discarded = None

    def health(self) -> bool:
        return not self._closed

    def shutdown(self) -> None:
        with self._model_lock:
            self._closed = True


def _copy_named(
    weights: Iterable[tuple[str, torch.Tensor]], targets: dict[str, torch.Tensor], *, what: str
) -> None:
    with torch.no_grad():
        for name, tensor in weights:
            if name not in targets:
                raise KeyError(f"update_weights: '{name}' is not a weight of {what}")
            target = targets[name]
            if target.shape != tensor.shape:
                raise ValueError(
                    f"update_weights: '{name}' has shape {tuple(tensor.shape)}, "
                    f"{what} expects {tuple(target.shape)}"
                )
            target.copy_(tensor.to(device=target.device, dtype=target.dtype))


class _RowSampler:
    """Per-row temperature / top-k / top-p sampling with per-row generators over [B, V] logits."""

    def __init__(self, params: list[SamplingParams], generators: list[torch.Generator], device) -> None:
        self.generators = generators
        self.greedy = torch.tensor([sp.temperature == 0 for sp in params], device=device)
        temps = [sp.temperature if sp.temperature > 0 else 1.0 for sp in params]
        self.temperature = torch.tensor(temps, device=device)[:, None]  # [B, 1]
        self.top_k = torch.tensor([sp.top_k for sp in params], device=device)
        self.top_p = torch.tensor([sp.top_p for sp in params], device=device)
        self.truncate = any(sp.top_k > 0 or sp.top_p < 1 for sp in params)
        self.allowed = [tuple(sp.allowed_token_ids) for sp in params]

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [B, V] -> [B], [B]
        scaled = logits / self.temperature
        if any(self.allowed):
            keep = torch.zeros_like(scaled, dtype=torch.bool)
            for row, ids in enumerate(self.allowed):
                if ids:
                    keep[row, list(ids)] = True
                else:
                    keep[row] = True
            scaled = scaled.masked_fill(~keep, float("-inf"))
            logits = logits.masked_fill(~keep, float("-inf"))
        if self.truncate:
            scaled = self._truncate(scaled)
        logp = torch.log_softmax(scaled, dim=-1)  # greedy rows: temperature 1, no truncation
        probs = logp.exp()
        tokens = logits.argmax(dim=-1)
        for r in torch.nonzero(~self.greedy).flatten().tolist():
            tokens[r] = torch.multinomial(probs[r], 1, generator=self.generators[r])[0]
        return tokens, logp.gather(1, tokens[:, None])[:, 0]

    def _truncate(self, scaled: torch.Tensor) -> torch.Tensor:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        rank = torch.arange(scaled.shape[-1], device=scaled.device)[None, :]
        k = torch.where(self.top_k > 0, self.top_k, scaled.shape[-1])[:, None]
        remove = rank >= k
        probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
        # drop a token when the tokens ranked above it already reach top_p (the top one is kept)
        remove |= (probs.cumsum(dim=-1) - probs) >= self.top_p[:, None]
        remove &= ~self.greedy[:, None]
        mask = torch.zeros_like(remove).scatter(1, order, remove)
        return scaled.masked_fill(mask, float("-inf"))


def _has_stop(text: str, stops: tuple[str, ...]) -> bool:
    return any(stop in text for stop in stops)


def _model_eos(model: torch.nn.Module) -> set[int]:
    for config in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        eos = getattr(config, "eos_token_id", None)
        if eos is not None:
            return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}
    return set()
