"""Models: HF <-> Megatron bridge per family, TP-aware LoRA, checkpoints, packaged/tiny models.

- ``bridge``: ``build_model``, ``load_hf_weights``, ``export_hf_weights`` (streaming); models receive
  their worker group's process groups and never call ``torch.distributed``
  (``megamarl.parallel.collectives``).
- ``families.MODEL_FAMILIES``: HF ``model_type`` -> family folder (``llama``, ``qwen2``, ``qwen3``).
- ``lora``: per-agent adapters on one frozen base, PEFT export.
- ``dist_checkpoint``: ``dist_checkpointing`` (torch_dist) save/load of model + AdamW state, any layout.
- ``convert``: HF <-> Megatron conversion of one model (the ``megamarl-convert`` CLI is
  ``megamarl.cli.export``).
"""
