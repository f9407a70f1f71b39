"""Disaggregated weight sync over gloo: a Megatron WG on ranks 1-2 (TP=2, then PP=2 with one sender per
stage) trains and pushes its weights to an HF engine on rank 0, several times with increasing
versions, while rank 0 keeps generating.

Checked: after every sync the engine's weights equal the WG's export bit for bit; every generation
carries the version of the weights it was sampled with (its greedy tokens are the argmax of exactly
that version's weights, so a wrong stamp or a half-updated model would show); buckets are used.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from megamarl.parallel.launch import run_ranks

pytestmark = pytest.mark.distributed

ENGINE_RANK = 0
VERSIONS = {"tp2": (1, 2), "pp2": (3, 4)}  # two syncs per layout, increasing across layouts
PROMPTS = [[1, 9690, 198, 2683, 359], [1, 300, 301, 302]]
BUCKET_MB = 0.25  # the tiny model (~13 MB: a 12.6 MB embedding, 0.6 MB of layers) takes several buckets


def train_batch(step: int):
    from megamarl.rl.batch import collate
    from megamarl.rl.sample import Sample

    g = torch.Generator().manual_seed(step)
    samples = []
    for i, (p_len, r_len) in enumerate([(5, 4), (3, 6), (7, 2), (4, 5)]):
        samples.append(
            Sample(
                task_id=f"t{i % 2}",
                episode_id=f"e{i}",
                agent="solver",
                policy="p",
                turn=0,
                prompt_ids=torch.randint(0, 49152, (p_len,), generator=g).tolist(),
                response_ids=torch.randint(0, 49152, (r_len,), generator=g).tolist(),
                rollout_logprobs=(-torch.rand(r_len, generator=g) * 3).tolist(),
            )
        )
    return collate(samples, pad_id=0).replace(advantages=torch.tensor([1.0, -0.5, 0.75, -1.25]))


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha1(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


class BackgroundGenerations:
    """Rank 0's rollout during the syncs: greedy requests in a loop on another thread."""

    def __init__(self, engine) -> None:
        import threading

        self.engine, self.records, self.stop = engine, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import asyncio

        from megamarl.rollout.engines.base import SamplingParams

        async def loop():
            sampling = SamplingParams(temperature=0.0, max_tokens=4)
            while not self.stop.is_set():
                outs = await asyncio.gather(*(self.engine.generate(p, sampling) for p in PROMPTS))
                self.records += [(g[0].weight_version, i, g[0].token_ids) for i, g in enumerate(outs)]
                await asyncio.sleep(0.05)

        asyncio.run(loop())

    def wait_for_first(self, timeout_s: float = 60) -> None:
        import time

        deadline = time.monotonic() + timeout_s
        while not self.records and time.monotonic() < deadline:
            time.sleep(0.01)

    def finish(self) -> list[tuple[int, int, list[int]]]:
        self.stop.set()
        self.thread.join(timeout=60)
        return self.records


def _disaggregated(rank, model_dir):
    import torch.distributed as dist

    from megamarl.config import PolicyConfig
    from megamarl.parallel.placement import PlacementConfig, WorkerGroupLayout, build_worker_groups
    from megamarl.rl.losses import LossConfig
    from megamarl.rl.policy_setup import load_policy_model
    from megamarl.rl.worker import PolicyWorker
    from megamarl.rollout.engines.hf import HFEngine
    from megamarl.rollout.weights.weight_sync import sync_weights

    wgs = build_worker_groups(
        PlacementConfig(
            {
                "tp2": WorkerGroupLayout(ranks=[1, 2], tp=2),
                "pp2": WorkerGroupLayout(ranks=[1, 2], pp=2),
            },
            mode="colocated",
        )
    )
    engine = HFEngine(model_dir, max_wait_ms=1) if rank == ENGINE_RANK else None
    out = {"synced": {}, "exported": {}, "stats": {}}
    if engine is not None:
        out["synced"][0] = {k: v.clone() for k, v in engine.base_model.state_dict().items()}
        background = BackgroundGenerations(engine)
        background.wait_for_first()  # some generations with the initial weights (version 0)
    for layout, wg in wgs.items():
        worker = None
        if wg.is_member:
            policy = PolicyConfig(model=str(model_dir), micro_batch_size=2, lr=5e-3, grad_clip=0.0)
            worker = PolicyWorker(layout, policy, wg, load_policy_model(policy, wg, seed=0), LossConfig())
        for version in VERSIONS[layout]:
            if worker is not None:
                worker.train_step(train_batch(version))
            stats = sync_weights(
                wg,
                worker.export if worker else None,
                [engine] if engine else None,
                version=version,
                engine_rank=ENGINE_RANK,
                bucket_mb=BUCKET_MB,
            )
            out["stats"][version] = (stats.num_tensors, stats.num_bytes, stats.num_buckets)
            if engine is not None:  # the weights every generation stamped `version` must have used
                out["synced"][version] = {k: v.clone() for k, v in engine.base_model.state_dict().items()}
            if worker is not None:
                exported = {name: digest(t) for name, t in worker.export()}  # collective in the stage
                if wg.tp_rank == 0:
                    out["exported"][version] = exported
        dist.barrier()
    if engine is not None:
        out["generations"] = background.finish()
        out["versions_served"] = sorted({v for v, _, _ in out["generations"]})
        out["generations_ok"] = _generations_match_their_versions(
            model_dir, out["generations"], out["synced"]
        )
        out["synced"] = {v: {k: digest(t) for k, t in state.items()} for v, state in out["synced"].items()}
    return out


def _generations_match_their_versions(model_dir, records, synced) -> dict[int, bool]:
    """Per version: every generation stamped with it is the greedy decode of that version's weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ok: dict[int, bool] = {}
    for version in sorted({v for v, _, _ in records}):
        model.load_state_dict(synced[version])
        for prompt_index, tokens in {(i, tuple(t)) for v, i, t in records if v == version}:
            ids = torch.tensor([PROMPTS[prompt_index] + list(tokens)])
            with torch.no_grad():
                argmax = model(ids).logits[0, len(PROMPTS[prompt_index]) - 1 : -1].argmax(-1).tolist()
            ok[version] = ok.get(version, True) and argmax == list(tokens)
    return ok


def test_disaggregated_sync_tp2_and_pp2_stamps_versions(tmp_path):
    from megamarl.models.packaged import resolve_model_path

    model_dir = resolve_model_path("tiny-random-llama")
    engine, stage0, stage1 = run_ranks(_disaggregated, 3, str(model_dir), timeout_s=420)

    for layout, versions in VERSIONS.items():
        for version in versions:
            if layout == "tp2":  # one stage: rank 1 sends it all
                exported = stage0["exported"][version]
                assert stage1["exported"] == {} or version not in stage1["exported"]
            else:  # one sender per stage; together the stages cover every HF tensor
                exported = {**stage0["exported"][version], **stage1["exported"][version]}
                assert not set(stage0["exported"][version]) & set(stage1["exported"][version])
            synced = engine["synced"][version]
            assert {n: synced[n] for n in exported} == exported, (layout, version)  # bit-exact
            assert set(synced) - set(exported) <= {"lm_head.weight"}  # tied: exported once as embed_tokens
            num_tensors, _num_bytes, num_buckets = engine["stats"][version]
            assert num_tensors == len(exported) and num_buckets >= 3, (layout, engine["stats"][version])
    changed = [engine["synced"][v] != engine["synced"][w] for v, w in [(0, 1), (1, 2), (2, 3), (3, 4)]]
    assert all(changed), changed  # every train step changed the weights the engine serves

    assert engine["versions_served"][0] == 0 and len(engine["versions_served"]) >= 3, engine[
        "versions_served"
    ]
    assert all(engine["generations_ok"].values()), engine["generations_ok"]


def _private_world(rank, init_file):
    """Rank 0 builds and destroys a one-rank world inside PrivateWorld (what an in-process vLLM does);
    the ranks' own world and groups keep working, before and after."""
    import torch.distributed as dist

    from megamarl.rollout.engines.private_world import PrivateWorld

    ours = dist.new_group([0, 1])
    out = {}
    if rank == 0:
        private = PrivateWorld()
        with private.active():
            assert not dist.is_initialized()
            dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
            inner = dist.new_group([0])  # collective over the private world only: no peer needed
            out["inner_size"] = dist.get_world_size()
        out["outer_size"] = dist.get_world_size()
        x = torch.ones(1)
        dist.all_reduce(x, group=inner)  # the private group still works outside the context
        out["inner_sum"] = x.item()
        with private.active():
            dist.destroy_process_group()  # vLLM's shutdown: tears down the (private) default world
    x = torch.ones(1) * (rank + 1)
    dist.all_reduce(x, group=ours)
    dist.all_reduce(x, group=dist.new_group([0, 1]))  # group names still agree across ranks
    dist.barrier()
    out["outer_sum"] = x.item()
    return out


def test_private_world_keeps_the_trainers_world_intact(tmp_path):
    first, second = run_ranks(_private_world, 2, str(tmp_path / "init"))
    assert first == {"inner_size": 1, "outer_size": 2, "inner_sum": 1.0, "outer_sum": 6.0}
    assert second == {"outer_sum": 6.0}
