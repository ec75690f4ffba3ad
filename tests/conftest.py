"""Shared test settings.

One intra-op thread per test process: on a 2-core machine running pytest-xdist workers (and
spawned gloo ranks), torch's default thread pool oversubscribes the cores and made single tests
about 10x slower. Set before any test imports torch.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

# Simulated steps are cached on disk (simulator/cache.py): a test session uses a cache of its own, never
# the user's (a test must not pass because of what an earlier run left there).
if "OMNIBENCH_CACHE" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["OMNIBENCH_CACHE"] = tempfile.mkdtemp(prefix="omnibench-test-cache-")
    atexit.register(shutil.rmtree, os.environ["OMNIBENCH_CACHE"], True)

# Loss-parity references (tests/parity.py) that a session's xdist workers share: a fresh folder for every
# session (made by the controller, inherited by its workers), never one an earlier session left.
if "PYTEST_XDIST_WORKER" not in os.environ or "OMNIBENCH_TEST_REFERENCES" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["OMNIBENCH_TEST_REFERENCES"] = tempfile.mkdtemp(prefix="omnibench-test-references-")
    atexit.register(shutil.rmtree, os.environ["OMNIBENCH_TEST_REFERENCES"], True)


# Each loss-parity launch (one xdist group) takes one to two minutes on one worker. xdist hands groups
# out in collection order, so collected first they start at once, one per worker, and the rest of the
# suite fills in around them, instead of one starting when the other worker is nearly done.
HEAVY_FIRST = ("parity-layouts", "parity-omni", "parity-zero", "parity-chunks", "parity-hsdp", "sharded-adamw",
               "parity-freeze", "runtime_master")


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        mark = item.get_closest_marker("xdist_group")
        name = (mark.args[0] if mark.args else mark.kwargs.get("name")) if mark else None
        return HEAVY_FIRST.index(name) if name in HEAVY_FIRST else len(HEAVY_FIRST)

    items.sort(key=rank)  # stable: the rest keep their order
