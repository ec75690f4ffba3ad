"""Shared test settings.

One intra-op thread per test process: on a 2-core machine running pytest-xdist workers (and
spawned gloo ranks), torch's default thread pool oversubscribes the cores and made single tests
about 10x slower. Set before any test imports torch.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
