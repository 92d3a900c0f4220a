import pytest
import torch

torch.set_num_threads(1)

from verify._internal.gpulock import gpu_lock  # noqa: E402
from verify._internal.settings import current, using  # noqa: E402


@pytest.fixture
def settings_with():
    """`settings_with(timeout=2, ...)`: the rest of the test runs under this process's Settings with those fields
    changed (what the knobs set for a run would give; verify._internal.settings.using), the run's own again after it. Pools
    started under them are pools of their own (verify._internal.ranks.pool keys pools by their Settings)."""
    import contextlib

    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(using(current().replace(**changes)))


@pytest.fixture(autouse=True)
def _gpu_sharing(request):
    """A test marked `gpu` holds the GPU lock (verify/_internal/gpulock.py) while it runs: shared, or exclusive when
    it is also marked `memory` (NVML's figures are device-wide)."""
    if request.node.get_closest_marker("gpu") is None:
        yield
        return
    with gpu_lock(exclusive=request.node.get_closest_marker("memory") is not None):
        yield


MATRIX = ("matrix: an end-to-end plugin run of a framework recipe whose claims the release matrix proves on the "
          "framework's releases (python -m benchmarks.frameworks); left out of a run unless -m names it")


def pytest_configure(config):
    config.addinivalue_line("markers", MATRIX)


# In this repository the plugin's gate tests run on xtrain. Its long-window test (N = 64..256, and every declared low
# precision at N = 256: ~14 s, the dev loop's longest) is CI's: the dev loop runs its checks apart (the planted
# bench's long-window and partial-sum bugs, tests/harness/test_lowprec.py). A user's own -m "not slow" keeps it.
CI_ONLY = ("verify/test_gates.py::test_long_accumulation_and_partial_sums",)


@pytest.hookimpl(tryfirst=True)  # before -m deselects: CI_ONLY's mark must be there when "not slow" is read
def pytest_collection_modifyitems(session, config, items):
    """The release matrix's end-to-end runs leave the default run (CI's, the dev loop's): `pytest -m matrix` runs
    them; each recipe keeps a fast smoke that runs by default. Then longest first: the tests marked `slow` (end to
    end: subprocesses, torchrun agents, self-tests; 10-60 s each) start before the rest, so under xdist the short
    ones fill the workers' last minutes instead of one worker finishing a minute-long test alone
    (longest-processing-time-first). Stable: otherwise collection order."""
    if "matrix" not in (config.getoption("markexpr") or ""):
        left = [item for item in items if item.get_closest_marker("matrix") is not None]
        if left:
            config.hook.pytest_deselected(items=left)
            items[:] = [item for item in items if item.get_closest_marker("matrix") is None]
    for item in items:
        if item.nodeid in CI_ONLY:
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
