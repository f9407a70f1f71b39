"""Ranks waiting for the driver's long work do not die on the collective timeout, and a real hang is
reported with what was awaited (``megamarl.parallel.distributed.wait_for_driver``).

The process group's own timeout is 2 s here; the driver works 4 s before the next collective. A
waiting rank prints nothing meanwhile (the store's timed waits logged c10d's "waitForInput ... timed
out" warning at every slice: every 30 s of a quickstart's evaluation, on rank 1's stderr)."""

import os
import tempfile
import time

import pytest

from megamarl.parallel.launch import run_ranks

pytestmark = pytest.mark.distributed


def _long_driver_work(rank):
    from datetime import timedelta

    import torch.distributed as dist

    from megamarl.parallel.distributed import wait_for_driver

    dist.barrier()  # both ranks create the group together: creating it is bound by its 2 s too
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=2))  # what a short timeout kills
    start = time.monotonic()
    payload = [None]
    if rank == 0:
        time.sleep(4.0)  # the driver's rollout / eval
        payload = ["batch"]
    with tempfile.TemporaryFile() as captured:  # what this rank writes on fd 2 (c10d logs in C++)
        saved = os.dup(2)
        os.dup2(captured.fileno(), 2)
        try:
            wait_for_driver("the rollout of step 1", timeout_s=60)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        captured.seek(0)
        stderr = captured.read().decode(errors="replace")
    dist.broadcast_object_list(payload, src=0, group=group)
    return payload[0], time.monotonic() - start, stderr


def _driver_hangs(rank):
    from megamarl.parallel.distributed import wait_for_driver

    if rank == 0:
        time.sleep(6.0)  # never reaches the rendezvous in time; keeps the store alive meanwhile
        return "driver"
    try:
        wait_for_driver("the evaluation at step 3", timeout_s=2.0)
    except TimeoutError as exc:
        return str(exc)
    return "no error"


def test_waiting_ranks_outlive_the_collective_timeout():
    results = run_ranks(_long_driver_work, 2, timeout_s=120)
    assert [r[0] for r in results] == ["batch", "batch"]
    assert results[1][1] >= 3.9  # rank 1 really waited through the driver's work
    assert results[1][2] == ""  # and said nothing while it waited


def test_a_real_hang_names_what_was_awaited():
    _, message = run_ranks(_driver_hangs, 2, timeout_s=120)
    assert message.startswith("rank 1 waited ")
    assert "the evaluation at step 3" in message and "trainer.collective_timeout_s" in message
