"""Each rank receives only its own data (megamarl.rl.dispatch, Trainer.rollout_and_prepare).

Four spawned gloo ranks train the disaggregated L3 preset for two steps: rank 0 drives the rollout
and hosts both engines, the sender's worker group (WG) is rank 1, the receiver's WG is ranks 2-3
(DP 2). A ``Trainer`` subclass records what reached each rank: the driver gets no rows, rank 1 only
sender rows, ranks 2 and 3 disjoint halves of the receiver rows, and everyone the same summary; the
run logs ``perf/batch_bytes_per_rank``. The two policies are two tokenizer families (tiny Llama with
SmolLM2's tokenizer, tiny Qwen2 with its own): each rank's rows hold only ids of its policy's
vocabulary, padded with its own tokenizer's pad id (the receiver may stop after its digit, so its rows
differ in length), and the receiver trains with a KL term against its own reference model.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from megamarl.parallel.launch import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
PRESET = ROOT / "configs" / "presets" / "l3_disaggregated.yaml"
NUM_STEPS = 2


def _train_and_record(rank: int, output_dir: str) -> list[dict]:
    from megamarl.cli.configure import load_config
    from megamarl.trainer import Trainer

    records: list[dict] = []

    class RecordingTrainer(Trainer):
        """Notes, per step, which policies' rows and how many bytes this rank received."""

        def rollout_and_prepare(self):
            received, metrics = super().rollout_and_prepare()
            records.append(
                {
                    "trained_policies": received.summary.trained_policies,
                    "num_samples": received.summary.num_samples,
                    "num_bytes": len(pickle.dumps(received)),
                    "shares": {
                        name: {
                            "row_policies": sorted({p for m in share.minis for p in m.rows.names("policy")}),
                            "rows": [
                                (e, a)
                                for m in share.minis
                                for e, a in zip(m.rows.names("episode"), m.rows.names("agent"))
                            ],
                            "counts": [m.counts for m in share.minis],
                            "pads": sorted(
                                {
                                    t
                                    for m in share.minis
                                    for t in m.rows.tokens[~m.rows.attention_mask].tolist()
                                }
                            ),
                            "max_id": max(int(m.rows.tokens.max()) for m in share.minis),
                        }
                        for name, share in received.shares.items()
                    },
                }
            )
            return received, metrics

    cfg = load_config(
        PRESET,
        [
            "policies.receiver_policy.ranks=[2,3]",
            f"trainer.total_steps={NUM_STEPS}",
            "eval.num_tasks=0",
            "rollout.num_tasks=2",
            "rollout.group_size=4",
            "agents.receiver.sampling.max_tokens=2",  # a digit, then <|im_end|> or a second digit
            "agents.receiver.sampling.allowed_tokens=['0','1','2','3','4','5','6','7','8','9','<|im_end|>']",
            "policies.receiver_policy.kl_coef=0.01",
            f"output_dir={output_dir}",
            "name=run",
        ],
    )
    RecordingTrainer(cfg).fit()
    return records


# each policy's tokenizer: (vocabulary size, pad id)
TOKENIZERS = {"sender_policy": (49152, 2), "receiver_policy": (515, 512)}


def test_a_rank_receives_only_its_policys_dp_share(tmp_path):
    per_rank = run_ranks(_train_and_record, 4, str(tmp_path), timeout_s=900)
    receiver_pads = set()
    for rank, records in enumerate(per_rank):
        for step, record in enumerate(records, start=1):
            for name, share in record["shares"].items():
                vocab, pad = TOKENIZERS[name]
                assert share["max_id"] < vocab, (
                    f"rank {rank}, step {step}: {name} got an id beyond its vocabulary"
                )
                assert set(share["pads"]) <= {pad}, (
                    f"rank {rank}, step {step}: {name} padded with {share['pads']}"
                )
                receiver_pads |= set(share["pads"]) if name == "receiver_policy" else set()
    assert receiver_pads == {512}, "no receiver row was padded: the check above saw no padding"
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, NUM_STEPS + 1))
    for step, row in enumerate(metrics):
        driver, sender, receiver_a, receiver_b = (records[step] for records in per_rank)
        assert {r["trained_policies"] for r in (driver, sender, receiver_a, receiver_b)} == {
            ("sender_policy", "receiver_policy")
        }
        assert driver["shares"] == {}  # the driver holds no WG shard: counts only
        assert list(sender["shares"]) == ["sender_policy"]
        assert sender["shares"]["sender_policy"]["row_policies"] == ["sender_policy"]
        assert len(sender["shares"]["sender_policy"]["rows"]) == row["agent/sender/num_samples"]
        halves = []
        for receiver in (receiver_a, receiver_b):
            assert list(receiver["shares"]) == ["receiver_policy"]  # none of the sender's rows
            share = receiver["shares"]["receiver_policy"]
            assert share["row_policies"] == ["receiver_policy"]
            halves.append(set(share["rows"]))
        assert not halves[0] & halves[1]  # DP ranks: disjoint parts ...
        assert len(halves[0] | halves[1]) == row["agent/receiver/num_samples"]  # ... that make the whole
        assert (
            receiver_a["shares"]["receiver_policy"]["counts"]
            == receiver_b["shares"]["receiver_policy"]["counts"]
        )
        assert driver["num_samples"] == row["agent/sender/num_samples"] + row["agent/receiver/num_samples"]
        # the metric is the largest payload; the driver's own (a summary) is a few hundred bytes
        assert (
            row["perf/batch_bytes_per_rank"]
            >= max(r["num_bytes"] for r in (sender, receiver_a, receiver_b)) * 0.9
        )
        assert row["perf/batch_bytes_total"] > row["perf/batch_bytes_per_rank"]
        assert driver["num_bytes"] < 1000 < sender["num_bytes"]
