"""A CUDA IPC weight bucket, encoded by megamarl, decoded in another process as vLLM's IPC engine does.

The sender side is ``megamarl.rollout.weights.vllm_native_sync``'s own code: tensors bucketed by
``engines.base.buckets`` in the engine's dtype (fp32 weights travel as bf16), made contiguous on the GPU
(``VLLMNativeSender._wire``), shared with ``_ipc_handles`` (``reduce_tensor`` args keyed by the GPU's
UUID) and pickled with ``_pickled`` (the ``ipc_handles_pickled`` field of ``/update_weights``). A spawned
child (a stand-in for the vLLM server's worker: it has no vLLM here) decodes the payload as
``IPCWeightTransferUpdateInfo`` and ``IPCWeightTransferEngine.receive_weights`` do (base64 + pickle,
look up its own GPU's UUID, put its device index at argument 6, ``rebuild_cuda_tensor``) and returns
what it read. The bytes must be exactly the sent ones, in the announced dtypes and shapes; and the
child's tensors must alias the sender's memory (a write by the sender after the child rebuilt its
views is seen through them), which is what makes IPC a zero-copy transfer."""

import pytest
import torch

pytestmark = [pytest.mark.gpu]

ENGINE_DTYPE = torch.bfloat16


def _named_tensors(device) -> list[tuple[str, torch.Tensor]]:
    """HF-named weights as a trainer exports them: fp32 matrices (one transposed: not contiguous), a
    bf16 norm and an int buffer (integers keep their dtype on the wire)."""
    g = torch.Generator().manual_seed(0)
    return [
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(64, 32, generator=g).to(device)),
        ("model.layers.0.mlp.down_proj.weight", torch.randn(48, 64, generator=g).to(device).t()),
        ("model.layers.0.input_layernorm.weight", torch.rand(32, generator=g).to(device, torch.bfloat16)),
        ("model.rotary.inv_freq_ids", torch.arange(16, device=device)),
    ]


def _decode_like_vllm(update_info: dict, inbox, outbox) -> None:
    """Child process: vLLM's worker-side decoding of an unpacked IPC update (vLLM 0.32's
    ``ipc_engine.py``), then report what was read; hold the views until told to re-read them."""
    import base64
    import pickle

    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    try:
        device_index = torch.cuda.current_device()
        handles = pickle.loads(base64.b64decode(update_info["ipc_handles_pickled"]))
        uuid = str(torch.cuda.get_device_properties(device_index).uuid)
        tensors = []
        for name, handle in zip(update_info["names"], handles):
            if uuid not in handle:
                raise ValueError(f"IPC handle of {name} not found for GPU UUID {uuid}: {list(handle)}")
            args = list(handle[uuid])
            args[6] = device_index  # the receiver's device index, as vLLM does
            tensors.append(rebuild_cuda_tensor(*args))
        outbox.put(
            (
                "read",
                [
                    (str(t.dtype).removeprefix("torch."), list(t.shape), str(t.device), t.cpu().clone())
                    for t in tensors
                ],
            )
        )
        inbox.get(timeout=120)  # the sender wrote into its tensors: read again through the same views
        torch.cuda.synchronize()
        outbox.put(("reread", [t.cpu().clone() for t in tensors]))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        import traceback

        outbox.put(("error", f"{exc!r}\n{traceback.format_exc()}"))


def test_ipc_bucket_round_trip_decoded_like_vllm_in_a_child_process(record_property):
    import torch.multiprocessing as mp

    from megamarl.rollout.engines.base import buckets
    from megamarl.rollout.weights.server_sync import dtype_name
    from megamarl.rollout.weights.vllm_native_sync import VLLMNativeSender, _ipc_handles, _pickled

    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    named = _named_tensors(device)
    sender = VLLMNativeSender.__new__(VLLMNativeSender)  # only its wire conversion: no server, no HTTP
    sender.dtype = ENGINE_DTYPE
    (bucket,) = list(buckets(named, 64 * 2**20, dtype=ENGINE_DTYPE))
    bucket = [(name, sender._wire(t)) for name, t in bucket]  # what travels: kept referenced, as in send()
    update_info = {
        "names": [n for n, _ in bucket],
        "dtype_names": [dtype_name(t.dtype) for _, t in bucket],
        "shapes": [list(t.shape) for _, t in bucket],
        "ipc_handles_pickled": _pickled([_ipc_handles(t) for _, t in bucket]),
    }
    # no synchronize, as in send(): the child's reads are ordered after the casts by the CUDA event
    # ``reduce_tensor`` records on the current stream, which ``rebuild_cuda_tensor`` waits on

    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_decode_like_vllm, args=(update_info, inbox, outbox))
    child.start()
    try:
        kind, read = outbox.get(timeout=180)
        assert kind == "read", read
        for (name, sent), (dtype, shape, where, got) in zip(bucket, read):
            assert (
                dtype
                == update_info["dtype_names"][update_info["names"].index(name)]
                == dtype_name(sent.dtype)
            )
            assert shape == list(sent.shape) and where.startswith("cuda"), (name, shape, where)
            assert torch.equal(got, sent.cpu()), name  # bit-exact
        assert [dtype for dtype, *_ in read] == ["bfloat16", "bfloat16", "bfloat16", "int64"]
        for _, sent in bucket:
            sent.add_(1)  # zero-copy: the child's views see the sender's memory
        torch.cuda.synchronize()
        inbox.put("reread")
        kind, reread = outbox.get(timeout=120)
        assert kind == "reread", reread
        for (name, sent), got in zip(bucket, reread):
            assert torch.equal(got, sent.cpu()), name
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0
    del bucket
    torch.cuda.ipc_collect()
    record_property("num_tensors", len(update_info["names"]))
    record_property("payload_chars", len(update_info["ipc_handles_pickled"]))
