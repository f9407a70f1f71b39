"""HFEngine against transformers itself: greedy tokens, logprobs, batching, weights, lifecycle."""

from __future__ import annotations

import asyncio

import pytest
import torch

from megamarl.models.tiny import tiny_model
from megamarl.rollout.engines.base import ENGINES, SamplingParams
from megamarl.rollout.engines.hf import HFEngine

PROMPTS = [
    [1, 9690, 198, 2683, 359],
    [1, 4093, 28, 17, 12],
    [1, 300],
    [1, 77, 88, 99, 1000, 2000, 3000, 4000],
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def make_engine(**kwargs) -> HFEngine:
    return HFEngine(tiny_model("llama", seed=0), **kwargs)


@pytest.fixture(scope="module")
def reference():
    return tiny_model("llama", seed=0)


def generate_all(engine, prompts, sampling):
    async def main():
        return await asyncio.gather(*(engine.generate(p, sampling) for p in prompts))

    return asyncio.run(main())


def test_registered():
    assert ENGINES.get("hf") is HFEngine


def test_greedy_matches_transformers_generate(reference):
    engine = make_engine(max_wait_ms=20)
    outs = generate_all(engine, PROMPTS, GREEDY)
    assert engine.batcher.batch_rows == [len(PROMPTS)]  # one left-padded batch
    for prompt, (gen,) in zip(PROMPTS, outs):
        expected = reference.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=12, eos_token_id=2, pad_token_id=2
        )[0, len(prompt) :].tolist()
        if 2 in expected:  # transformers pads after EOS; we stop at it
            expected = expected[: expected.index(2) + 1]
        assert gen.token_ids == expected
        assert gen.finish_reason == ("stop" if expected[-1] == 2 else "length")
        assert gen.weight_version == 0


def teacher_forced_logprobs(model, prompt, response, temperature=1.0):
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(response)[:, None])[:, 0]


def test_greedy_logprobs_equal_teacher_forced(reference):
    engine = make_engine(max_wait_ms=20)
    for prompt, (gen,) in zip(PROMPTS, generate_all(engine, PROMPTS, GREEDY)):
        expected = teacher_forced_logprobs(reference, prompt, gen.token_ids)
        assert torch.allclose(torch.tensor(gen.logprobs), expected, atol=1e-5, rtol=0)


def test_sampled_logprobs_are_tempered_policy_and_seeded(reference):
    engine = make_engine(max_wait_ms=20)
    sampling = SamplingParams(temperature=0.7, max_tokens=10, seed=123, n=2)
    outs = generate_all(engine, PROMPTS[:2], sampling)
    for prompt, gens in zip(PROMPTS[:2], outs):
        assert len(gens) == 2
        for gen in gens:
            expected = teacher_forced_logprobs(reference, prompt, gen.token_ids, temperature=0.7)
            assert torch.allclose(torch.tensor(gen.logprobs), expected, atol=1e-5, rtol=0)
    again = generate_all(make_engine(), PROMPTS[:2], sampling)  # other batch composition, same seeds
    assert [[g.token_ids for g in gens] for gens in again] == [[g.token_ids for g in gens] for gens in outs]
    assert outs[0][0].token_ids != outs[0][1].token_ids  # n samples differ (seed + sample index)


def test_top_k_one_is_greedy_and_logprob_zero():
    engine = make_engine()
    greedy = generate_all(engine, PROMPTS[:1], GREEDY)[0][0]
    (gen,) = generate_all(engine, PROMPTS[:1], SamplingParams(temperature=1.3, top_k=1, max_tokens=12))[0]
    assert gen.token_ids == greedy.token_ids
    assert all(abs(lp) < 1e-6 for lp in gen.logprobs)  # renormalised over a support of one token


def test_stop_ids_and_max_tokens_per_request():
    engine = make_engine(max_wait_ms=20)
    (base,) = generate_all(engine, PROMPTS[:1], GREEDY)[0]
    stop = base.token_ids[3]
    outs = generate_all(
        engine,
        PROMPTS[:1] * 2,
        SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=(stop,)),
    )
    cut = base.token_ids.index(stop) + 1
    assert outs[0][0].token_ids == base.token_ids[:cut] and outs[0][0].finish_reason == "stop"

    async def mixed():
        short = engine.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=2))
        long = engine.generate(PROMPTS[0], GREEDY)
        return await asyncio.gather(short, long)

    (short,), (long,) = asyncio.run(mixed())
    assert short.token_ids == base.token_ids[:2] and short.finish_reason == "length"
    assert long.token_ids == base.token_ids


def test_micro_batcher_merges_concurrent_calls():
    engine = make_engine(max_batch_rows=6, max_wait_ms=50)
    outs = generate_all(
        engine, [PROMPTS[i % 4] for i in range(10)], SamplingParams(temperature=0.0, max_tokens=3)
    )
    assert len(outs) == 10
    assert engine.batcher.batch_rows == [6, 4]


def test_update_weights_changes_outputs_and_stamps_version(reference):
    engine = make_engine()
    before = generate_all(engine, PROMPTS, GREEDY)
    original = {k: v.clone() for k, v in reference.state_dict().items()}
    perturbed = {k: v + 0.2 * torch.randn_like(v) for k, v in original.items() if "layers.0." in k}
    engine.pause()
    engine.update_weights(perturbed.items(), version=1)  # partial update
    engine.resume()
    changed = generate_all(engine, PROMPTS, GREEDY)
    assert all(g[0].weight_version == 1 for g in changed)
    assert [g[0].token_ids for g in changed] != [g[0].token_ids for g in before]
    engine.update_weights(original.items(), version=2)
    restored = generate_all(engine, PROMPTS, GREEDY)
    assert [g[0].token_ids for g in restored] == [g[0].token_ids for g in before]
    assert {g[0].weight_version for g in restored} == {2}
    with pytest.raises(KeyError, match="not a weight"):
        engine.update_weights([("nope.weight", torch.zeros(1))], version=3)


def test_sleep_wake_and_pause_resume_round_trips(reference):
    engine = make_engine()
    before = [g[0].token_ids for g in generate_all(engine, PROMPTS, GREEDY)]

    engine.sleep(level=1)
    engine.wake()
    assert [g[0].token_ids for g in generate_all(engine, PROMPTS, GREEDY)] == before

    engine.sleep(level=2)
    assert all(p.numel() == 0 for p in engine.model.parameters())  # storage released
    assert engine.weight_version == -1  # no version held: a delta push (engine.delta_sync) goes full
    engine.wake()
    with pytest.raises(RuntimeError, match="discarded"):
        generate_all(engine, PROMPTS[:1], GREEDY)
    engine.update_weights(reference.state_dict().items(), version=5)
    after = generate_all(engine, PROMPTS, GREEDY)
    assert [g[0].token_ids for g in after] == before and after[0][0].weight_version == 5

    async def paused_round_trip():
        engine.pause()
        task = asyncio.ensure_future(engine.generate(PROMPTS[0], GREEDY))
        await asyncio.sleep(0.1)
        assert not task.done()  # held, not rejected
        engine.resume()
        return await asyncio.wait_for(task, 30)

    assert asyncio.run(paused_round_trip())[0].token_ids == before[0]


# -- multi-LoRA (L2) -------------------------------------------------------------------------------

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peft_adapter(path, seed):
    """A PEFT adapter directory with random (non-zero) A and B for the tiny model; returns its tensors."""
    from peft import LoraConfig, get_peft_model
    from peft.utils import get_peft_model_state_dict

    config = LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS)
    model = get_peft_model(tiny_model("llama", seed=0), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:  # non-zero B, larger than PEFT's init: the adapter must change greedy tokens
                param.normal_(0.0, 0.3, generator=gen)
    model.save_pretrained(path)
    return {k: v.clone() for k, v in get_peft_model_state_dict(model).items()}


def is_peft_greedy(path, prompts, responses) -> bool:
    """True when every response token is transformers+PEFT's argmax after its prefix (teacher-forced:
    one forward per prompt proves the greedy decode equal, since greedy is argmax at each prefix)."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(tiny_model("llama", seed=0), str(path)).eval()
    for prompt, response in zip(prompts, responses):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
        if logits.argmax(-1).tolist() != response:
            return False
    return True


def test_lora_adapters_match_peft_and_mix_in_one_micro_batch(tmp_path):
    peft_adapter(tmp_path / "solver", seed=1)
    peft_adapter(tmp_path / "verifier", seed=2)
    engine = make_engine(max_wait_ms=50)
    base = [g[0].token_ids for g in generate_all(engine, PROMPTS, GREEDY)]
    engine.add_lora("solver", tmp_path / "solver")
    engine.add_lora("verifier", tmp_path / "verifier")

    async def mixed():
        calls = [
            engine.generate(p, GREEDY, lora=lora) for lora in (None, "solver", "verifier") for p in PROMPTS
        ]
        return await asyncio.gather(*calls)

    outs = [g[0].token_ids for g in asyncio.run(mixed())]
    assert engine.batcher.batch_rows[-1] == 3 * len(PROMPTS)  # one micro-batch, decoded per adapter group
    solver, verifier = outs[len(PROMPTS) : 2 * len(PROMPTS)], outs[2 * len(PROMPTS) :]
    assert outs[: len(PROMPTS)] == base  # base requests are untouched by the adapters
    assert solver != base and verifier != solver
    assert is_peft_greedy(tmp_path / "solver", PROMPTS, solver)
    assert is_peft_greedy(tmp_path / "verifier", PROMPTS, verifier)
    with pytest.raises(ValueError, match="unknown LoRA adapter 'nobody'"):
        generate_all_lora(engine, PROMPTS[:1], "nobody")


def generate_all_lora(engine, prompts, lora):
    async def main():
        return await asyncio.gather(*(engine.generate(p, GREEDY, lora=lora) for p in prompts))

    return asyncio.run(main())


def test_lora_update_in_place_stamps_adapter_version_only(tmp_path, reference):
    peft_adapter(tmp_path / "solver", seed=1)
    other = peft_adapter(tmp_path / "other", seed=3)
    engine = make_engine()
    engine.add_lora("solver", tmp_path / "solver")
    engine.update_weights(reference.state_dict().items(), version=7)  # base update with PEFT-wrapped linears
    engine.update_weights(other.items(), version=3, lora="solver")  # in place, PEFT file names
    gens = generate_all_lora(engine, PROMPTS, "solver")
    assert is_peft_greedy(tmp_path / "other", PROMPTS, [g[0].token_ids for g in gens])
    assert {g[0].weight_version for g in gens} == {3}
    assert {g[0].weight_version for g in generate_all(engine, PROMPTS, GREEDY)} == {7}
    assert engine.lora_versions == {"solver": 3} and engine.weight_version == 7
    assert all(n.startswith("base_model.model.model.layers.") for n in other)  # PEFT file names
    with pytest.raises(KeyError, match="not a weight of LoRA adapter 'solver'"):
        engine.update_weights(
            [("base_model.model.lm_head.lora_A.weight", torch.zeros(1))], version=4, lora="solver"
        )
    with pytest.raises(ValueError, match="unknown LoRA adapter"):
        engine.update_weights(other.items(), version=4, lora="nobody")


class _IdsAsText:
    """A tokenizer stand-in: token ``i`` decodes to ``<i>``."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(f"<{i}>" for i in ids)


def test_stop_strings_end_a_row_on_the_decoded_text():
    """``SamplingParams.stop``: the row ends after the token that completes the string (kept in the
    ids), finish_reason "stop"; rows without stop strings in the same batch run on."""
    engine = make_engine(tokenizer=_IdsAsText(), max_wait_ms=20)
    (base,) = generate_all(engine, PROMPTS[:1], GREEDY)[0]
    cut = 4
    stop = f"{base.token_ids[cut - 2]}><{base.token_ids[cut - 1]}>"  # spans two tokens
    cut = min(
        i + 1
        for i in range(1, len(base.token_ids))
        if stop in "".join(f"<{t}>" for t in base.token_ids[: i + 1])
    )

    async def mixed():
        stopped = engine.generate(
            PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=12, stop=(stop, "never"))
        )
        plain = engine.generate(PROMPTS[0], GREEDY)
        return await asyncio.gather(stopped, plain)

    (stopped,), (plain,) = asyncio.run(mixed())
    assert stopped.token_ids == base.token_ids[:cut] and stopped.finish_reason == "stop"
    assert plain.token_ids == base.token_ids and plain.finish_reason == "length"
    with pytest.raises(ValueError, match="needs the engine's tokenizer"):
        generate_all(make_engine(), PROMPTS[:1], SamplingParams(max_tokens=2, stop=("x",)))
    with pytest.raises(ValueError, match="stop strings must be non-empty"):
        SamplingParams(stop=("",))
