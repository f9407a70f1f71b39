"""TRL's side of ``scripts/bench_trl.py``: the quickstart's solver alone trained with ``trl.GRPOTrainer``.

    /work/venv-trl/bin/python scripts/trl_grpo_worker.py --dataset prompts.jsonl --settings settings.json \
        --model <packaged HF dir> --out <dir>

Runs in TRL's own environment (trl, transformers, torch; no megamarl: this file imports nothing of it).
``bench_trl.py`` renders the prompts with megamarl's own env and agent code and hands them over as a
JSONL dataset in megamarl's task order (``{"prompt", "answer", "task_id", "step"}``); ``settings.json``
holds the budget and the GRPO settings. The reward is ``solver_reward``: megamarl's math reward for the
solver alone (the last number of the reply; team + team_alpha * local, both "the answer is right"),
checked against megamarl's env in ``tests/unit/test_bench_trl.py``. Writes ``<out>/model`` (the trained
HF directory, for ``scripts/evaluate.py --hf``) and ``<out>/trl_result.json`` (times, rewards per step,
versions, the resolved GRPOConfig).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import sys
import time
from pathlib import Path

# megamarl.orchestration.agents.last_number, verbatim (this environment has no megamarl to import)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number(text: str) -> float | None:
    """The last number in ``text`` ("3 + 2 = 5" -> 5.0); thousands separators are removed."""
    found = _NUMBER.findall(re.sub(r"(?<=\d),(?=\d{3}\b)", "", text))
    return float(found[-1]) if found else None


def solver_reward(completion: str, answer: float, *, team_alpha: float) -> float:
    """megamarl's reward of a lone solver's reply: team (1 if the answer is right) + team_alpha * local
    (the solver's own correctness, the same check); an unparseable reply scores 0."""
    value = last_number(completion)
    correct = float(value is not None and abs(value - answer) < 1e-6)
    return correct + team_alpha * correct


def grpo_config(settings: dict, output_dir: Path):
    """TRL's GRPOConfig for megamarl's settings (``bench_trl.run_trl`` writes them): the same budget,
    sampling, optimizer, clip range and loss aggregation, where TRL has a knob for it."""
    from trl import GRPOConfig

    batch = settings["num_tasks"] * settings["group_size"]
    return GRPOConfig(
        output_dir=str(output_dir),
        max_steps=settings["steps"],
        num_generations=settings["group_size"],
        # one optimizer step per num_tasks x group_size samples, in micro-batches of micro_batch_size
        per_device_train_batch_size=settings["micro_batch_size"],
        gradient_accumulation_steps=batch // settings["micro_batch_size"],
        shuffle_dataset=False,  # megamarl's task order: step i trains on the tasks megamarl's step i drew
        temperature=settings["temperature"],
        top_p=1.0,
        top_k=0,
        max_completion_length=settings["max_tokens"],
        use_vllm=False,
        learning_rate=settings["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=settings["weight_decay"],
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=settings["grad_clip"],
        beta=settings["kl_coef"],
        epsilon=settings["clip_low"],
        epsilon_high=settings["clip_high"],
        loss_type="dapo",  # token-mean over the whole step's tokens: megamarl's algorithm.loss_agg
        scale_rewards="group",
        num_iterations=settings["ppo_epochs"],
        bf16=settings["bf16"],
        gradient_checkpointing=False,  # megamarl's policies.<p>.recompute: none
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=settings["seed"],
        use_cpu=True,
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dataset", type=Path, required=True)
    parser.add_argument("--settings", type=Path, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    settings = json.loads(args.settings.read_text())

    import datasets
    import torch
    import transformers
    import trl
    from trl import GRPOTrainer

    rows = [json.loads(line) for line in args.dataset.read_text().splitlines() if line.strip()]
    dataset = datasets.Dataset.from_list(rows)
    team_alpha = settings["team_alpha"]

    def reward(prompts, completions, answer, **_) -> list[float]:
        return [solver_reward(c, a, team_alpha=team_alpha) for c, a in zip(completions, answer)]

    reward.__name__ = "megamarl_math_reward"
    config = grpo_config(settings, args.out / "trainer")
    trainer = GRPOTrainer(
        model=args.model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=transformers.AutoTokenizer.from_pretrained(args.model),
    )
    start, cpu_start = time.perf_counter(), time.process_time()
    trainer.train()
    train_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    trainer.save_model(str(args.out / "model"))
    steps = [entry for entry in trainer.state.log_history if "reward" in entry]
    result = {
        "train_s": round(train_s, 1),
        "train_cpu_s": round(cpu_s, 1),
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "steps": len(steps),
        "samples": len(steps) * settings["num_tasks"] * settings["group_size"],
        "success_per_step": [round(entry["reward"] / (1 + team_alpha), 4) for entry in steps],
        "log_history": trainer.state.log_history,
        "param_dtype": str(next(trainer.model.parameters()).dtype),  # the optimizer's (master) weights
        "mixed_precision": str(trainer.accelerator.mixed_precision),  # bf16: every forward in autocast
        "torch_threads": torch.get_num_threads(),
        "versions": {
            "trl": trl.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "datasets": datasets.__version__,
            "python": sys.version.split()[0],
        },
        "grpo_config": {k: v for k, v in config.to_dict().items() if isinstance(v, (int, float, str, bool))},
    }
    (args.out / "trl_result.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"TRL: {result['samples']} samples in {train_s:.1f} s; success/step {result['success_per_step']}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
