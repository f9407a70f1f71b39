"""The preemption signal reaches one rank; every rank agrees at the next step end."""

import os
import signal

import pytest

from megamarl.parallel.launch import run_ranks

pytestmark = pytest.mark.distributed


def _body(rank):
    import torch.distributed as dist

    from megamarl.runtime.preemption import PreemptionFlag

    flag = PreemptionFlag()
    before = flag.agreed(dist.group.WORLD)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGUSR1)  # only rank 1 is signalled
    after = flag.agreed(dist.group.WORLD)
    flag.uninstall()
    return before, after, flag.received


def test_signal_on_one_rank_is_agreed_by_all():
    assert run_ranks(_body, 2) == [(False, True, None), (False, True, signal.SIGUSR1)]
