"""A model cache entry built by a rank other than 0 is complete. transformers 5's ``save_pretrained``
writes weights and config only on global rank 0 once torch.distributed is up, so an entry built by
rank 1 (whichever rank takes the lock first builds it) had only tokenizer files: the README's
quickstart then failed on both ranks with "Unrecognized model ... model_type"."""

import os

import pytest

from megamarl.parallel.launch import run_ranks

pytestmark = pytest.mark.distributed


def _rank1_builds(rank, cache):
    import torch.distributed as dist
    from transformers import AutoConfig

    from megamarl.models.packaged import resolve_model_path

    os.environ["MEGAMARL_CACHE"] = cache
    if rank == 1:
        resolve_model_path("tiny-random-llama")  # builds it: rank 1 holds the lock
    dist.barrier()
    path = resolve_model_path("tiny-random-llama")  # rank 0 reads rank 1's entry
    return AutoConfig.from_pretrained(path).model_type, sorted(p.name for p in path.iterdir())


def test_an_entry_built_on_rank_1_has_weights_and_config(tmp_path, smollm2_path):
    # the new cache holds the session's SmolLM2 entry (tiny-random-llama takes its tokenizer), so rank 1
    # builds only the entry under test instead of converting SmolLM2's GGUF again (~45 CPU-s)
    (tmp_path / "cache" / "models").mkdir(parents=True)
    (tmp_path / "cache" / "models" / smollm2_path.name).symlink_to(smollm2_path, target_is_directory=True)
    results = run_ranks(_rank1_builds, 2, str(tmp_path / "cache"), timeout_s=300)
    for model_type, files in results:
        assert model_type == "llama"
        assert {"config.json", "model.safetensors", "tokenizer.json", ".megamarl-complete"} <= set(files)
