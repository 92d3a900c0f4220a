"""The contracts the harness leans on in the libraries it builds on, one test each, so that a new release that
breaks one fails HERE, naming the library, its version and what verify needs of it, instead of somewhere deep
in a gate or a plugin run. A fresh machine resolves the newest releases pyproject.toml allows (.ci/run builds one
every run): pyproject says per dependency why it is capped or followed.

Nothing here reads another library's wording: each test asserts on a behaviour (an attribute, a call's effect,
a value that must come back), never on a message text.
"""
from __future__ import annotations

import io
from importlib.metadata import version

import pytest


def _broken(dist: str, what: str, where: str) -> str:
    return f"{dist} {version(dist)} no longer provides {what}, which {where} relies on"


def test_hypothesis_profiles_and_phases():
    """verify/_internal/plugin.py: the dev/ci/gpu profiles extend hypothesis' own "ci" profile and leave out the explain
    phase; prove.py leaves out the shrink phase where a row says so (the long window)."""
    from hypothesis import Phase, settings

    ci = settings.get_profile("ci")
    assert ci.derandomize, _broken("hypothesis", "a derandomized built-in 'ci' profile", "verify/_internal/plugin.py's ci profile")
    names = {p.name for p in Phase}
    need = {"explicit", "reuse", "generate", "target", "shrink", "explain"}
    assert need <= names, _broken("hypothesis", f"the phases {sorted(need - names)}", "verify/_internal/plugin.py and verify/_internal/prove.py")


def test_hypothesis_storage_can_be_moved(tmp_path):
    """verify/_internal/plugin.py moves the example database out of the invoking directory (a verify run leaves nothing
    there but the report) with hypothesis.configuration.set_hypothesis_home_dir."""
    from hypothesis import configuration

    setter = getattr(configuration, "set_hypothesis_home_dir", None)
    assert callable(setter), _broken("hypothesis", "configuration.set_hypothesis_home_dir", "verify/_internal/plugin.py")
    before = configuration.storage_directory()
    before = getattr(before, "path", before)  # 6.170 returns an object holding the path (6.155: the path)
    try:
        setter(str(tmp_path))
        found = configuration.storage_directory("examples")  # where the default database lives from then on
        where = str(getattr(found, "path", found))
        assert where.startswith(str(tmp_path)), _broken(
            "hypothesis", "a default example database under set_hypothesis_home_dir's folder", "verify/_internal/plugin.py")
    finally:
        setter(str(before))


def test_a_failing_example_reaches_the_exception_notes():
    """The plugin prints a failing gate test's __notes__ under the verdict: hypothesis must attach the drawn value
    there (whatever words it puts around it), so the user sees the case that failed and how to replay it."""
    from hypothesis import Phase, given, settings
    from hypothesis import strategies as st

    drawn = "case-marker-4711"

    @settings(max_examples=1, database=None, phases=(Phase.generate,))
    @given(st.just(drawn))
    def fails(x):
        raise AssertionError("planted")

    with pytest.raises(AssertionError) as info:
        fails()
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert repr(drawn) in notes, _broken("hypothesis", "the failing example in the exception's __notes__",
                                          "verify/_internal/plugin.py (_verdict_repr)")


def test_pytest_repr_classes_render_the_verdict():
    """verify/_internal/plugin.py builds a failed gate's longrepr from pytest's own repr classes (so it crosses from xdist
    workers whole), with the verdict as the summary's crash message."""
    from _pytest._code.code import ExceptionChainRepr, ReprEntryNative, ReprFileLocation, ReprTraceback
    from _pytest._io import TerminalWriter

    crash = ReprFileLocation(path="test_gates.py", lineno=1, message="[equivalence] planted verdict")
    rep = ExceptionChainRepr([(ReprTraceback([ReprEntryNative(["[equivalence] planted verdict\n", "hint: x\n"])],
                                             None, style="native"), crash, None)])
    out = io.StringIO()
    rep.toterminal(TerminalWriter(out))
    assert "[equivalence] planted verdict" in out.getvalue() and "hint: x" in out.getvalue(), _broken(
        "pytest", "ExceptionChainRepr/ReprEntryNative rendering their lines", "verify/_internal/plugin.py (_verdict_repr)")
    assert rep.reprcrash.message == "[equivalence] planted verdict"


def test_pytest_ini_cache_can_be_redirected():
    """verify/_internal/plugin.py points pytest's cache_dir at the cache home through config._inicache (pytest has no
    public setter), before the cacheprovider reads it."""
    from _pytest.config import get_config

    config = get_config()
    assert isinstance(getattr(config, "_inicache", None), dict), _broken(
        "pytest", "Config._inicache (a dict of resolved ini values)", "verify/_internal/plugin.py (cache_dir)")


def test_xdist_hooks_the_report_merge_uses():
    """verify/_internal/plugin.py's controller merges the workers' tallies in pytest_testnodedown (node.workeroutput)."""
    import xdist.newhooks

    assert hasattr(xdist.newhooks, "pytest_testnodedown"), _broken(
        "pytest-xdist", "the pytest_testnodedown hook", "verify/_internal/plugin.py (_XdistReporter)")


def test_torch_hooks_the_counter_and_pull_use():
    """verify/_internal/ranks/comm.py reads c10d's flight recorder; verify/_internal/cases/pull.py reads a framework's gradient in a global
    optimizer step pre-hook."""
    import torch
    from torch.optim import optimizer

    c10d = torch._C._distributed_c10d
    assert callable(getattr(c10d, "_dump_fr_trace", None)), _broken("torch", "_dump_fr_trace", "verify/_internal/ranks/comm.py")
    assert callable(getattr(optimizer, "register_optimizer_step_pre_hook", None)), _broken(
        "torch", "torch.optim.optimizer.register_optimizer_step_pre_hook", "verify/_internal/cases/pull.py")
