"""The pytest plugin (entry point `pytest11: xtrain-verify`, loaded through _xtrain_pytest/entry.py):
options, hypothesis profiles, the run report.

    pytest --pyargs verify --verify-trainer mypkg.train:factory -n auto

Options --verify-trainer, --verify-report, --verify-backend, --verify-device (a bad value: a one-line usage
error, exit 4); profiles dev / ci / gpu by HYPOTHESIS_PROFILE (unset: hypothesis' default stays). Settings
are built once here and installed (verify._internal.settings.install). Loading costs no torch import.
Design: docs/design/layout.md ("The plugin", "The report", "Settings"); profiles: docs/verify-your-trainer.md.
"""
from __future__ import annotations

import os

import pytest

from verify._internal.settings import PROFILES, Settings, SettingError, check_report_dir, env_of, install, launcher_var
from verify._internal.trainers import default_trainer, trainer_ref

OPT_TRAINER, OPT_REPORT, OPT_BACKEND, OPT_DEVICE = "--verify-trainer", "--verify-report", "--verify-backend", "--verify-device"
_KEY = pytest.StashKey[dict]()
_SETTINGS = pytest.StashKey[Settings]()
MARKERS = ("verify_gate: a gate test of verify (its failures go into the run report)",
           "gpu: needs a CUDA device (skipped without one)",
           "distributed: spawns a process group",
           "memory: peak-memory probe; never shares a GPU with other tests under xdist",
           "slow: long-running; deselect with -m 'not slow'")


def _profiles() -> None:
    from hypothesis import HealthCheck, Phase, settings

    # No explain phase: after shrinking it replays the failing case once per varied part of it (each replay
    # a whole run of the user's trainer and the float64 references) to annotate lines the verdict does not
    # need; on HF's Trainer that was most of a failing gate's time. The shrunk case stays in every verdict.
    phases = tuple(p for p in Phase if p is not Phase.explain)
    ci = settings.get_profile("ci")
    settings.register_profile("dev", max_examples=10, deadline=None, phases=phases)
    settings.register_profile("ci", parent=ci, max_examples=100, deadline=None, phases=phases,
                              suppress_health_check=[HealthCheck.too_slow])
    settings.register_profile("gpu", parent=settings.get_profile("ci"), max_examples=150)
    # production sizes on one GPU (verify.gpu_gate --scale): every gate's corners and one drawn case, stopping at the
    # first failure (a corner of a billion-parameter trainer costs minutes, and each failure kept its runs' memory)
    settings.register_profile("scale", parent=settings.get_profile("ci"), max_examples=1, report_multiple_bugs=False)


def load_profile(s: Settings) -> None:
    """HYPOTHESIS_PROFILE of `s`, where it names one of ours (before collection: budgets read it when tests
    are defined; hypothesis' --hypothesis-profile, loaded after this, still wins)."""
    if s.hypothesis_profile in PROFILES:
        from hypothesis import settings

        settings.load_profile(s.hypothesis_profile)


try:
    _profiles()
except ImportError:  # hypothesis absent: the gates cannot run, the plugin stays out of the way
    pass


def pytest_addoption(parser):
    g = parser.getgroup("verify", "xtrain verify: prove a trainer's gradient accumulation")
    g.addoption(OPT_TRAINER, metavar="MODULE:FACTORY", default=None,
                help="the adapter to prove (default: the configured default trainer, xtrain's)")
    g.addoption(OPT_REPORT, metavar="DIR", default=None,
                help="where verify-report.json/.md go (default: ./reports of the invoking directory)")
    # no `choices=`: a bad value is one line from Settings, not pytest's usage block
    g.addoption(OPT_BACKEND, metavar="gloo|nccl", default=None,
                help=f"process-group backend of the data-parallel gates (default ${env_of('backend')}, else nccl "
                     f"on cuda and gloo on the cpu)")
    g.addoption(OPT_DEVICE, metavar="cpu|cuda", default=None,
                help=f"device of the gates (default ${env_of('device')} or cpu)")


def cache_home(s: Settings) -> str:
    """Where a verify run keeps its tools' state: $XDG_CACHE_HOME/xtrain-verify (default ~/.cache/...)."""
    return os.path.join(s.cache_home, "xtrain-verify")


def example_dir(home: str, trainer: str | None) -> str:
    """hypothesis' storage per trainer (its database keys by test alone): one trainer's saved failures are never
    replayed against, or deleted by a passing run of, another."""
    key = trainer or default_trainer() or "default"
    return os.path.join(home, "hypothesis", "".join(c if c.isalnum() or c in "._-" else "_" for c in key))


def _verify_run(config) -> bool:
    """A run of verify's gates from a user's directory: --verify-trainer given, or `--pyargs verify[...]`.
    (This repository's own test runs keep pytest's and hypothesis' defaults.)"""
    o = config.option
    return getattr(o, "verify_trainer", None) is not None or (
        bool(getattr(o, "pyargs", False)) and any(a.split("::")[0].split(".")[0] == "verify" for a in config.args))


@pytest.hookimpl(tryfirst=True, specname="pytest_configure")
def pytest_configure_verify_caches(config):  # a second pytest_configure (specname), run first
    """A verify run leaves nothing in the invoking directory but the report: hypothesis' example database
    (failing examples, replayed first next time; one per trainer, example_dir) and pytest's cache (--lf) go to
    cache_home(), where they
    still persist across runs, and so does pytest-benchmark's storage where that plugin is installed. Runs
    before pytest's cacheprovider reads cache_dir (tryfirst, registered later); a cache_dir,
    --benchmark-storage or HYPOTHESIS_STORAGE_DIRECTORY the user set wins. First of all, every option and
    knob is checked (Settings): a bad one is pytest's one-line usage error before anything is written. The
    Settings built here are this process's (install), read once: nothing of them goes through the environment."""
    o = config.option
    try:
        s = Settings.from_env(device=getattr(o, "verify_device", None), backend=getattr(o, "verify_backend", None))
        s.check_machine()
        if getattr(o, "verify_report", None) is not None:
            check_report_dir(o.verify_report, OPT_REPORT)
    except SettingError as e:
        raise pytest.UsageError(str(e)) from None
    config.stash[_SETTINGS] = install(s)
    try:
        load_profile(s)
    except ImportError:
        pass
    if not _verify_run(config):
        return
    home = cache_home(s)
    # hypothesis reads its own variable when set (the user's wins); xdist workers run this hook alike
    if launcher_var("HYPOTHESIS_STORAGE_DIRECTORY") is None:
        try:
            from hypothesis.configuration import set_hypothesis_home_dir

            set_hypothesis_home_dir(example_dir(home, getattr(o, "verify_trainer", None)))
        except ImportError:
            pass
    inicache = getattr(config, "_inicache", None)  # pytest has no public setter for an ini value
    if (config.pluginmanager.hasplugin("cacheprovider") and isinstance(inicache, dict)
            and config.getini("cache_dir") == ".pytest_cache"):
        inicache["cache_dir"] = os.path.join(home, "pytest")
    # pytest-benchmark, where installed (no dependency of ours), makes its storage folder at start-up
    if getattr(config.option, "benchmark_storage", None) == "file://./.benchmarks":
        config.option.benchmark_storage = "file://" + os.path.join(home, "benchmarks")


def pytest_report_header(config):
    """What a fresh machine resolved, first thing in every run's log (CI's too): a new release of a dependency
    is then named beside whatever it changed."""
    from verify._internal.header import version, versions_text

    return f"verify: xtrain-verify {version()}; {versions_text()}"


def pytest_configure(config):
    for m in MARKERS:
        config.addinivalue_line("markers", m)
    o = config.option
    state = dict(trainer=getattr(o, "verify_trainer", None), report=getattr(o, "verify_report", None),
                 adapter=None, stats={}, failures=[])
    config.stash[_KEY] = state
    s = config.stash[_SETTINGS]  # checked and installed first thing (pytest_configure_verify_caches)
    s.setup_device()
    if state["trainer"] is not None:  # named explicitly: fail now, not in the middle of the run
        state["adapter"] = _load(state["trainer"], s)
    xdist = config.pluginmanager.hasplugin("xdist")
    config.pluginmanager.register((_XdistReporter if xdist else _Reporter)(config), "verify-reporter")


_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the verify package (this module: verify/_internal/)


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


def _load(ref: str, settings: Settings):
    from verify._internal.protocol import AdapterError, load_adapter

    try:
        adapter = load_adapter(ref, option=OPT_TRAINER)
        adapter.check_factory(settings.device, option=OPT_TRAINER, raises=True)
        return adapter
    except AdapterError as e:
        raise pytest.UsageError(str(e)) from None


def settings_of(config) -> dict:
    from verify._internal.gates.worlds import max_world, min_world

    s = config.stash[_SETTINGS]
    profile = s.hypothesis_profile or config.getoption("hypothesis_profile", None) or "default"
    out = dict(hypothesis_profile=profile, device=s.device, backend=s.backend,
               worlds=[min_world(config.stash[_KEY]["adapter"], s), max_world(s)], threads=s.threads)
    from verify._internal.ranks.pool import launched

    if launched() is not None:  # under `python -m verify.run`: the launch itself, and the worlds run on its ranks
        out["launch"] = {**launched().launch, "launched_worlds": sorted(launched().worlds)}
    return out


@pytest.fixture(scope="session")
def verify_settings(request) -> Settings:
    """The run's Settings: built once from the options and the environment (pytest_configure_verify_caches)."""
    return request.config.stash[_SETTINGS]


@pytest.fixture(scope="session")
def verify_adapter(request, verify_settings):
    """The adapter under proof (--verify-trainer, default xtrain's)."""
    import torch

    state = request.config.stash[_KEY]
    if state["adapter"] is None:
        state["adapter"] = _load(trainer_ref(state["trainer"]), verify_settings)
    # CPU results depend on the intra-op thread count: candidate and reference run with the same one,
    # and one thread per xdist worker keeps 2-core boxes from oversubscribing.
    torch.set_num_threads(verify_settings.threads)
    return state["adapter"]


# -- failures a user can read (verify/_internal/failure_view.py) ----------------------------------------------

@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if (report.failed and call.excinfo is not None and item.get_closest_marker("verify_gate") is not None
            and not item.config.option.fulltrace):
        from verify._internal.failure_view import verdict_repr

        report.longrepr, verdict, why, gate = verdict_repr(item, call.excinfo)
        if verdict:  # plain attributes cross from xdist workers with the report (the gate as its name)
            report.verify_verdict, report.verify_hint = verdict, why
            report.verify_gate = None if gate is None else gate.value
    return report


# -- the report: workers send their tallies, the controller writes once ----------------------------

def _is_worker(config) -> bool:
    return hasattr(config, "workerinput")


def _reported_adapter(config):
    """The adapter the report describes: under xdist the controller ran no gate and has not loaded the default
    trainer; it loads it now, for its declarations (None if it cannot: the workers' failures say why)."""
    state = config.stash[_KEY]
    if state.get("adapter") is None:
        try:
            state["adapter"] = _load(trainer_ref(state.get("trainer")), config.stash[_SETTINGS])
        except Exception:  # noqa: BLE001  (a broken trainer reference is reported by the gates themselves)
            return None
    return state["adapter"]


class _Reporter:
    """Registered per run: collects gate failures (controller) and writes the report at the end."""

    def __init__(self, config):
        self.config = config

    def pytest_runtest_logreport(self, report):
        if "verify_gate" not in report.keywords:
            return
        state = self.config.stash[_KEY]
        if report.failed and report.when == "call":
            crash = getattr(report.longrepr, "reprcrash", None)
            text = crash.message if crash is not None else str(report.longrepr)[-2000:]
            state["failures"].append(dict(test=report.nodeid, gate=getattr(report, "verify_gate", None), message=text,
                                          hint=getattr(report, "verify_hint", None)))

    def pytest_terminal_summary(self, terminalreporter):
        """Skipped gates say why on the terminal: the report's skipped rows (each gate once, by its key, where it
        ran no example; a test that skips since another runs its gate skips no gate). And the short summary pytest
        prints next (after this hook) shows a failed gate's verdict whole: pytest trims it to the terminal's
        width below verbosity 2, and a verdict cut at `verify._internal.gates.toler...` says nothing."""
        if _is_worker(self.config):
            return
        state, tr = self.config.stash[_KEY], terminalreporter
        from verify._internal.report import coverage

        if state["stats"]:
            adapter = _reported_adapter(self.config)
            missing, last = coverage(state["stats"], adapter.declarations() if adapter is not None else None)
            tr.write_sep("=", "verify: not checked")
            for line in missing:
                tr.write_line(line)
            tr.write_line(f"verify: {last}", bold=True)
        failed = tr.stats.get("failed", [])
        if any(getattr(r, "verify_verdict", None) for r in failed) and not self.config.option.force_short_summary:
            self.config.option.verbose = max(self.config.option.verbose, 2)

    def pytest_sessionfinish(self, session, exitstatus):
        import sys

        config, state = self.config, self.config.stash[_KEY]
        pool = sys.modules.get("verify._internal.ranks.pool")
        if pool is not None:  # close this process's rank pools: each rank barriers, destroys its group, exits
            pool.close_all()
        report = sys.modules.get("verify._internal.report")
        if _is_worker(config):
            if report is not None:
                config.workeroutput["verify_stats"] = report.dump()
            return
        if report is not None:
            from verify._internal.report_merge import merge

            merge(state["stats"], report.dump())
        if not state["stats"] and not state["failures"]:
            return  # no gate ran: nothing to report
        from verify._internal import report as rep

        folder = state["report"] or os.path.join(str(config.invocation_params.dir), "reports")
        adapter = _reported_adapter(config)
        trainer = state["trainer"] or (adapter.ref if adapter is not None else None) or default_trainer() or "default"
        tr = config.pluginmanager.get_plugin("terminalreporter")
        try:
            replaced = rep.replaces(folder, trainer)
            written = rep.write(folder, trainer=trainer, settings=settings_of(config), gates=state["stats"],
                                failures=state["failures"], exitstatus=int(exitstatus),
                                device=config.stash[_SETTINGS].device,
                                declarations=adapter.declarations() if adapter is not None else None)
        except OSError as e:
            if tr is not None:
                tr.write_line(f"verify: could not write the report to {folder}: {e}", red=True)
            return
        if tr is not None:
            tr.write_line(f"verify: report written to {written[0]} and {written[1]}"
                          + (f"; it replaced {replaced} (--verify-report DIR keeps one per trainer)" if replaced else ""),
                          yellow=bool(replaced))


class _XdistReporter(_Reporter):
    def pytest_testnodedown(self, node, error):
        blob = getattr(node, "workeroutput", {}).get("verify_stats")
        if blob:
            from verify._internal.report_merge import merge

            merge(self.config.stash[_KEY]["stats"], blob)
