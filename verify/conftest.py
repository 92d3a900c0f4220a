"""Hypothesis profiles, chosen by HYPOTHESIS_PROFILE (or --hypothesis-profile):

dev  -- default; random, few examples, fast feedback
ci   -- extends hypothesis' built-in ci profile: derandomized, no deadline, print_blob
gpu  -- ci plus more examples, for GPU runners
"""
import json
import os

import torch
from hypothesis import HealthCheck, settings

_ci = settings.get_profile("ci")
settings.register_profile("dev", max_examples=15, deadline=None)
settings.register_profile("ci", parent=_ci, max_examples=100, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("gpu", parent=settings.get_profile("ci"), max_examples=150)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

if os.environ.get("XTRAIN_TEST_DEVICE", "cpu").startswith("cuda"):
    if not torch.cuda.is_available():
        raise SystemExit("XTRAIN_TEST_DEVICE=cuda but torch sees no CUDA GPU; unset it to test on the CPU")
    # Bit-exact gates need run-to-run determinism on the GPU; TF32 off so fp32 means fp32.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    from ._meta import fp32_only

    fp32_only()

# CPU results depend on the intra-op thread count (GUIDE §3): reference and candidate run in the same
# process, and one thread per xdist worker keeps 2-core CI boxes from oversubscribing.
torch.set_num_threads(int(os.environ.get("XTRAIN_TEST_THREADS", "1")))


# -- the run report: workers send their tallies, the controller writes once -------------------------
def _is_worker(config) -> bool:
    return hasattr(config, "workerinput")


def pytest_sessionfinish(session, exitstatus):
    from . import stats

    import sys

    pool = sys.modules.get("verify.pool")
    if pool is not None:  # close this process's rank pools: each rank barriers, destroys its group, exits
        pool.close_all()
    config = session.config
    if _is_worker(config):
        config.workeroutput["xtrain_stats"] = stats.dump()
        return
    merged = getattr(config, "_xtrain_stats", {})
    stats.merge(merged, stats.dump())
    if not merged:
        return
    from ._meta import atomic_write, header
    from .strategies import gate_device

    profile = settings._current_profile or "dev"
    doc = dict(**header("verify", gate_device()), hypothesis_profile=profile, exitstatus=int(exitstatus),
               gates=merged)
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "reports",
                        f"verify-{profile}.json")
    atomic_write(path, json.dumps(doc, indent=1))


try:
    import xdist  # noqa: F401

    def pytest_testnodedown(node, error):
        from . import stats

        blob = getattr(node, "workeroutput", {}).get("xtrain_stats")
        if blob:
            stats.merge(node.config.__dict__.setdefault("_xtrain_stats", {}), blob)
except ImportError:
    pass


# GPU tests hold a shared lock, GPU memory tests an exclusive one (verify/_gpulock.py).
from ._gpulock import _gpu_sharing  # noqa: E402,F401
