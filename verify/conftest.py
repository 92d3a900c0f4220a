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

if os.environ.get("XTRAIN_TEST_DEVICE", "cpu").startswith("cuda"):
    if not torch.cuda.is_available():
        raise SystemExit("XTRAIN_TEST_DEVICE=cuda but torch sees no CUDA GPU; unset it to test on the CPU")
    # Bit-exact gates need run-to-run determinism on the GPU; TF32 off so fp32 means fp32.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

# CPU results depend on the intra-op thread count (GUIDE §3): reference and candidate run in the same
# process, and one thread per xdist worker keeps 2-core CI boxes from oversubscribing.
torch.set_num_threads(int(os.environ.get("XTRAIN_TEST_THREADS", "1")))
