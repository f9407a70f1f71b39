"""Delta weight pushes (``engine.delta_sync: tensors``): which tensors a push streams, exactly."""

from __future__ import annotations

import pytest
import torch

from megamarl.config import EngineConfig, PolicyConfig
from megamarl.config_sections import LoraConfig
from megamarl.rollout.weights.delta import DeltaSelector, common_version, sync_unit

LAYER = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "input_layernorm")


def weights(**changes: float) -> dict[str, torch.Tensor]:
    """A two-layer model in HF names; ``changes``: tensor (dots as __) -> value added to its element 0."""
    names = ["model.embed_tokens.weight"]
    names += [f"model.layers.{i}.{m}.weight" for i in (0, 1) for m in LAYER]
    names += ["model.norm.weight", "lm_head.weight"]
    out = {n: torch.full((2, 3), 0.5 + i) for i, n in enumerate(names)}
    for key, delta in changes.items():
        out[key.replace("__", ".")][0, 0] += delta
    return out


def push(selector, state, *, base, version, dtype=torch.float32) -> list[str]:
    return [
        n
        for n, _ in selector.select(((n, t.to(dtype)) for n, t in state.items()), base=base, version=version)
    ]


def test_units_are_decoder_layers_or_modules():
    assert sync_unit("model.layers.12.self_attn.q_proj.weight") == "model.layers.12"
    assert sync_unit("model.layers.3.mlp.experts.7.up_proj.weight") == "model.layers.3"
    assert sync_unit("model.embed_tokens.weight") == "model.embed_tokens"
    assert sync_unit("lm_head.weight") == "lm_head"


def test_first_push_is_full_then_only_changed_units():
    selector = DeltaSelector()
    state = weights()
    assert push(selector, state, base=0, version=1) == list(state)  # nothing recorded: full
    assert (selector.num_selected, selector.num_skipped, selector.version) == (13, 0, 1)

    # one tensor of layer 1 changed: all of layer 1 (q/k/v are one fused module in the engine)
    changed = weights(model__layers__1__self_attn__k_proj__weight=0.25)
    assert push(selector, changed, base=1, version=2) == [f"model.layers.1.{m}.weight" for m in LAYER]
    assert (selector.num_selected, selector.num_skipped) == (5, 8)

    # the final norm and the embedding changed, nothing else
    changed = weights(
        model__layers__1__self_attn__k_proj__weight=0.25,
        model__norm__weight=1.0,
        model__embed_tokens__weight=-1.0,
    )
    assert push(selector, changed, base=2, version=3) == ["model.embed_tokens.weight", "model.norm.weight"]
    assert push(selector, changed, base=3, version=4) == []  # nothing changed: nothing moves
    assert (selector.num_selected, selector.num_skipped) == (0, 13)


def test_bytes_are_compared_in_the_engines_dtype():
    selector = DeltaSelector()
    push(selector, weights(), base=None, version=1, dtype=torch.bfloat16)
    # the norm's element is 11.5, where bf16's spacing is 2^-4: 1e-3 rounds to the same bf16
    tiny = weights(model__norm__weight=1e-3)
    assert torch.equal(tiny["model.norm.weight"].bfloat16(), weights()["model.norm.weight"].bfloat16())
    assert push(selector, tiny, base=1, version=2, dtype=torch.bfloat16) == []
    assert push(DeltaSelector(), tiny, base=None, version=1) != []  # fp32 engine: the same change moves
    small = weights(model__norm__weight=0.1)  # 11.6 rounds to 11.625: it moves
    assert push(selector, small, base=2, version=3, dtype=torch.bfloat16) == ["model.norm.weight"]


def test_a_replica_at_another_version_gets_everything():
    selector = DeltaSelector()
    push(selector, weights(), base=None, version=1)
    push(selector, weights(model__norm__weight=1.0), base=1, version=2)
    everything = list(weights())
    # it missed version 2 (lagging), was restarted (UNSYNCED = -1), or replicas disagree (None)
    for base in (1, -1, None):
        assert push(selector, weights(model__norm__weight=1.0), base=base, version=3) == everything
        assert selector.version == 3
    assert common_version([3, 3]) == 3 and common_version([3, 2]) is None and common_version([]) is None


def test_an_abandoned_push_forgets_what_was_recorded():
    selector = DeltaSelector()
    push(selector, weights(), base=None, version=1)
    stream = selector.select(iter(weights(model__embed_tokens__weight=1.0).items()), base=1, version=2)
    next(iter(stream), None)  # a push that failed after its first unit
    assert selector.version is None
    assert push(selector, weights(), base=1, version=2) == list(weights())


def test_a_unit_split_across_the_stream_is_refused():
    state = weights()
    names = list(state)
    names.append(names.pop(1))  # layer 0's q_proj after everything else
    with pytest.raises(ValueError, match="model.layers.0"):
        list(DeltaSelector().select(((n, state[n]) for n in names), base=None, version=1))


def test_delta_sync_key_is_checked_at_load():
    assert EngineConfig().delta_sync == "off"
    with pytest.raises(
        ValueError, match=r"engine.delta_sync='layers' unknown; allowed: \['off', 'tensors'\]"
    ):
        EngineConfig(delta_sync="layers")
    with pytest.raises(ValueError, match="engine.delta_sync.*sglang"):
        EngineConfig(backend="sglang", delta_sync="tensors")
    with pytest.raises(ValueError, match="policies.<p>.engine.delta_sync.*lora"):
        PolicyConfig(model="m", lora=LoraConfig(), engine=EngineConfig(delta_sync="tensors"))
