"""The pytest plugin (entry point `pytest11: xtrain-verify`, loaded through _xtrain_pytest/entry.py):
options, hypothesis profiles, the run report.

    pytest verify -n auto                                           # this repo: xtrain's trainer
    pytest --pyargs verify --verify-trainer mypkg.train:factory -n auto    # anyone's

Options: --verify-trainer MODULE:FACTORY (default xtrain's), --verify-report DIR (default ./reports of
the invoking directory), --verify-backend gloo|nccl, --verify-device cpu|cuda. A bad value is a
one-line usage error naming the option (pytest's exit status 4), before anything is written.

Hypothesis profiles, chosen by HYPOTHESIS_PROFILE (or hypothesis' --hypothesis-profile):
    dev  random, 10 examples a test (verify.strategies.budget scales floors down): fast feedback
    ci   extends hypothesis' built-in ci profile: derandomized, no deadline, print_blob
    gpu  ci plus more examples, for GPU runners
Unset, hypothesis' own default profile stays in force (the plugin is loaded in every pytest run of an
environment that has xtrain installed, so it changes nothing until asked). Loading it costs no torch
import: the adapter is loaded when a gate test first asks for it, or at start-up when the option is given.
"""
from __future__ import annotations

import os

import pytest

OPT_TRAINER, OPT_REPORT, OPT_BACKEND, OPT_DEVICE = "--verify-trainer", "--verify-report", "--verify-backend", "--verify-device"
ENV_BACKEND, ENV_DEVICE = "XTRAIN_DIST_BACKEND", "XTRAIN_TEST_DEVICE"
_KEY = pytest.StashKey[dict]()
MARKERS = ("verify_gate: a gate test of verify (its failures go into the run report)",
           "gpu: needs a CUDA device (skipped without one)",
           "distributed: spawns a process group",
           "memory: peak-memory probe; never shares a GPU with other tests under xdist",
           "slow: long-running; deselect with -m 'not slow'")


def _profiles() -> None:
    from hypothesis import HealthCheck, settings

    ci = settings.get_profile("ci")
    settings.register_profile("dev", max_examples=10, deadline=None)
    settings.register_profile("ci", parent=ci, max_examples=100, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow])
    settings.register_profile("gpu", parent=settings.get_profile("ci"), max_examples=150)
    if os.environ.get("HYPOTHESIS_PROFILE") in ("dev", "ci", "gpu"):
        settings.load_profile(os.environ["HYPOTHESIS_PROFILE"])


try:
    _profiles()
except ImportError:  # hypothesis absent: the gates cannot run, the plugin stays out of the way
    pass


def pytest_addoption(parser):
    g = parser.getgroup("verify", "xtrain verify: prove a trainer's gradient accumulation")
    g.addoption(OPT_TRAINER, metavar="MODULE:FACTORY", default=None,
                help="the adapter to prove (default: verify.adapters.xtrain:adapter, xtrain's trainer)")
    g.addoption(OPT_REPORT, metavar="DIR", default=None,
                help="where verify-report.json/.md go (default: ./reports of the invoking directory)")
    g.addoption(OPT_BACKEND, choices=("gloo", "nccl"), default=None,
                help=f"process-group backend of the data-parallel gates (default ${ENV_BACKEND} or gloo)")
    g.addoption(OPT_DEVICE, choices=("cpu", "cuda"), default=None,
                help=f"device of the gates (default ${ENV_DEVICE} or cpu)")


def pytest_configure(config):
    for m in MARKERS:
        config.addinivalue_line("markers", m)
    o = config.option
    state = dict(trainer=getattr(o, "verify_trainer", None), report=getattr(o, "verify_report", None),
                 adapter=None, stats={}, failures=[])
    config.stash[_KEY] = state
    # The library reads these (pools, strategies), in this process and in xdist workers and ranks it starts.
    if getattr(o, "verify_backend", None):
        os.environ[ENV_BACKEND] = o.verify_backend
    if getattr(o, "verify_device", None):
        os.environ[ENV_DEVICE] = o.verify_device
    if os.environ.get(ENV_DEVICE, "cpu").startswith("cuda"):
        _cuda_setup()
    if state["report"] is not None:
        rep = os.path.abspath(state["report"])
        if os.path.exists(rep) and not os.path.isdir(rep):
            raise pytest.UsageError(f"{OPT_REPORT} {state['report']}: exists and is not a directory; pass a directory")
    if state["trainer"] is not None:  # named explicitly: fail now, not in the middle of the run
        state["adapter"] = _load(state["trainer"])
    xdist = config.pluginmanager.hasplugin("xdist")
    config.pluginmanager.register((_XdistReporter if xdist else _Reporter)(config), "verify-reporter")


_PKG = os.path.dirname(os.path.abspath(__file__))


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """Collecting the gate modules from an installed package: no bytecode caches next to them (pytest
    would otherwise write its rewritten-assert caches into site-packages)."""
    path = str(getattr(collector, "path", "") or "")
    if not path.startswith(_PKG + os.sep):
        return (yield)
    import sys

    before, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        return (yield)
    finally:
        sys.dont_write_bytecode = before


def _load(ref: str):
    from .protocol import AdapterError, load_adapter

    try:
        return load_adapter(ref, option=OPT_TRAINER)
    except AdapterError as e:
        raise pytest.UsageError(str(e)) from None


def _cuda_setup() -> None:
    import torch

    if not torch.cuda.is_available():
        raise pytest.UsageError(f"{OPT_DEVICE} cuda: no CUDA GPU is visible to torch; use {OPT_DEVICE} cpu")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # bit-exact gates need determinism
    torch.use_deterministic_algorithms(True)
    from ._meta import fp32_only

    fp32_only()


def settings_of(config) -> dict:
    from .gates.distributed import max_world, min_world
    from .pool import default_backend
    from .strategies import gate_device

    profile = os.environ.get("HYPOTHESIS_PROFILE") or config.getoption("hypothesis_profile", None) or "default"
    return dict(hypothesis_profile=profile, device=gate_device(), backend=default_backend(),
                worlds=[min_world(), max_world()], threads=int(os.environ.get("XTRAIN_TEST_THREADS", "1")))


@pytest.fixture(scope="session")
def verify_adapter(request):
    """The adapter under proof (--verify-trainer, default xtrain's)."""
    import torch

    state = request.config.stash[_KEY]
    if state["adapter"] is None:
        from .protocol import DEFAULT_REF

        state["adapter"] = _load(state["trainer"] or DEFAULT_REF)
    # CPU results depend on the intra-op thread count: candidate and reference run with the same one,
    # and one thread per xdist worker keeps 2-core boxes from oversubscribing.
    torch.set_num_threads(int(os.environ.get("XTRAIN_TEST_THREADS", "1")))
    return state["adapter"]


# -- the report: workers send their tallies, the controller writes once ----------------------------

def _is_worker(config) -> bool:
    return hasattr(config, "workerinput")


class _Reporter:
    """Registered per run: collects gate failures (controller) and writes the report at the end."""

    def __init__(self, config):
        self.config = config

    def pytest_runtest_logreport(self, report):
        if report.failed and report.when == "call" and "verify_gate" in report.keywords:
            crash = getattr(report.longrepr, "reprcrash", None)
            text = crash.message if crash is not None else str(report.longrepr)[-2000:]
            self.config.stash[_KEY]["failures"].append(dict(test=report.nodeid, message=text))

    def pytest_sessionfinish(self, session, exitstatus):
        import sys

        config, state = self.config, self.config.stash[_KEY]
        pool = sys.modules.get("verify.pool")
        if pool is not None:  # close this process's rank pools: each rank barriers, destroys its group, exits
            pool.close_all()
        report = sys.modules.get("verify.report")
        if _is_worker(config):
            if report is not None:
                config.workeroutput["verify_stats"] = report.dump()
            return
        if report is not None:
            report.merge(state["stats"], report.dump())
        if not state["stats"] and not state["failures"]:
            return  # no gate ran: nothing to report
        from . import report as rep

        folder = state["report"] or os.path.join(str(config.invocation_params.dir), "reports")
        adapter = state["adapter"]
        trainer = state["trainer"] or (adapter.ref if adapter is not None else None) or "verify.adapters.xtrain:adapter"
        tr = config.pluginmanager.get_plugin("terminalreporter")
        try:
            written = rep.write(folder, trainer=trainer, settings=settings_of(config), gates=state["stats"],
                                failures=state["failures"], exitstatus=int(exitstatus),
                                device=os.environ.get(ENV_DEVICE, "cpu"),
                                declarations=adapter.declarations() if adapter is not None else None)
        except OSError as e:
            if tr is not None:
                tr.write_line(f"verify: could not write the report to {folder}: {e}", red=True)
            return
        if tr is not None:
            tr.write_line(f"verify: report written to {written[0]} and {written[1]}")


class _XdistReporter(_Reporter):
    def pytest_testnodedown(self, node, error):
        blob = getattr(node, "workeroutput", {}).get("verify_stats")
        if blob:
            from . import report

            report.merge(self.config.stash[_KEY]["stats"], blob)
