"""``MODEL_FAMILIES``: HF ``model_type`` -> the family module that reads its config.

Adding a family = a folder ``megamarl/models/<family>/`` exposing ``MODEL_TYPES`` and
``arch_from_hf(hf_config) -> DecoderArch``, plus one line in ``_FAMILY_MODULES``.
"""

from __future__ import annotations

import importlib

from megamarl.models.spec import DecoderArch
from megamarl.registry import Registry

_FAMILY_MODULES = (
    "megamarl.models.llama",
    "megamarl.models.qwen2",
    "megamarl.models.qwen3",
    "megamarl.models.qwen2_moe",
    "megamarl.models.qwen3_moe",
)

MODEL_FAMILIES: Registry = Registry(
    "model architecture (HF model_type)",
    signature="module with MODEL_TYPES and arch_from_hf(hf_config) -> DecoderArch",
)
for _module_name in _FAMILY_MODULES:
    _module = importlib.import_module(_module_name)
    for _model_type in _module.MODEL_TYPES:
        MODEL_FAMILIES.add(_model_type, _module)


def arch_from_hf(hf_config) -> DecoderArch:
    """The ``DecoderArch`` of an HF config; ``ValueError`` listing supported types otherwise."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in MODEL_FAMILIES:
        archs = getattr(hf_config, "architectures", None)
        raise ValueError(
            f"unsupported architecture model_type='{model_type}' (architectures={archs}); "
            f"supported model_type: {MODEL_FAMILIES.names()}"
        )
    assert model_type is not None  # None is no registered family (checked above)
    return MODEL_FAMILIES.get(model_type).arch_from_hf(hf_config)
