"""Hypothesis profiles, chosen by HYPOTHESIS_PROFILE (or --hypothesis-profile):

dev  -- default; random, few examples, fast feedback
ci   -- extends hypothesis' built-in ci profile: derandomized, no deadline, print_blob
gpu  -- ci plus more examples, for GPU runners
"""
import os

import torch
from hypothesis import HealthCheck, settings

_ci = settings.get_profile("ci")
settings.register_profile("dev", max_examples=15, deadline=None)
settings.register_profile("ci", parent=_ci, max_examples=100, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("gpu", parent=settings.get_profile("ci"), max_examples=150)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

# CPU results depend on the intra-op thread count (GUIDE §3): reference and candidate run in the same
# process, and one thread per xdist worker keeps 2-core CI boxes from oversubscribing.
torch.set_num_threads(int(os.environ.get("XTRAIN_TEST_THREADS", "1")))


def pytest_sessionfinish(session, exitstatus):
    """Close this process's rank pools (verify/pool.py), if a distributed test started any: each rank
    barriers, destroys its process group and exits. (atexit and PR_SET_PDEATHSIG are the backstops.)"""
    import sys

    pool = sys.modules.get("verify.pool")
    if pool is not None:
        pool.close_all()
