"""SIGTERM stops a command even when the interpreter drops the handler's exception (omnibench/stopping.py)."""

import os
import signal

import pytest

from omnibench.stopping import exit_on_sigterm, raise_if_stopped
from omnibench.sweep import Sweep

# the dropped exception is what these tests make happen; pytest reports each one it sees
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


class _SignalledInAFinalizer:
    """Receives SIGTERM while its finalizer runs, as a simpy process's generator closed by the garbage
    collector can: the handler's SystemExit is printed as "Exception ignored" and dropped."""

    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(10_000):  # the handler runs at one of these bytecodes, inside the finalizer
            pass


def test_a_sigterm_whose_exit_a_finalizer_dropped_is_raised_again_where_work_is_committed():
    previous = signal.getsignal(signal.SIGTERM)
    with exit_on_sigterm():
        _SignalledInAFinalizer()  # the exit is dropped here: execution goes on
        with pytest.raises(SystemExit) as e:
            raise_if_stopped()
        assert e.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == previous


def test_a_sweep_stops_after_the_item_during_which_a_dropped_sigterm_arrived():
    seen = []

    def step(x):
        seen.append(x)
        if x == 1:
            _SignalledInAFinalizer()
        return x

    with exit_on_sigterm(), Sweep(workers=1) as sweep, pytest.raises(SystemExit):
        sweep.map(step, [0, 1, 2, 3])
    assert seen == [0, 1]


def test_without_a_sigterm_nothing_is_raised_and_a_block_s_signal_does_not_outlive_it():
    with exit_on_sigterm():
        raise_if_stopped()
    with exit_on_sigterm():
        _SignalledInAFinalizer()
    raise_if_stopped()  # the stop was the block's; a sweep after it (another command in this process) runs
    with Sweep(workers=1) as sweep:
        assert sweep.map(abs, [-1, 2]) == [1, 2]
