"""One settings object (verify/_internal/settings.py): every knob defined once, the guide's table drawn from it, and
every option checked up front — a bad one is one line naming it and the fix, nothing run, nothing written."""
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from verify._internal.settings import KNOBS, Settings, SettingError, check_report_dir, knobs_table, usable_cores

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**{k: v for k, v in os.environ.items() if not k.startswith("XTRAIN_")}, "PYTHONPATH": ROOT,
       "HYPOTHESIS_PROFILE": "dev", "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")


# -- the object ------------------------------------------------------------------------------------------

def test_defaults_and_the_environment():
    s = Settings.from_env({})
    assert (s.device, s.backend, s.threads, s.min_world, s.max_world, s.timeout) == ("cpu", "gloo", 1, 1, 4, 120.0)
    n = usable_cores()  # the most threads allowed: one per core this process may use
    s = Settings.from_env({"XTRAIN_TEST_THREADS": str(n), "XTRAIN_DIST_MAX_WORLD": "8", "XTRAIN_DIST_TIMEOUT": "2.5",
                           "XTRAIN_DIST_BACKEND": "", "XTRAIN_GIT_COMMIT": "abc", "HYPOTHESIS_PROFILE": "ci"})
    assert (s.threads, s.max_world, s.timeout, s.backend, s.git_commit, s.hypothesis_profile) == (
        n, 8, 2.5, "gloo", "abc", "ci")
    s = Settings.from_env({"XTRAIN_RANKS_PER_NODE": "2"})  # emulated nodes of 2 ranks; a smaller pool is one node
    assert (Settings().per_node(4), s.per_node(4), s.per_node(1)) == (4, 2, 1)


def test_the_backend_follows_the_device_and_an_option_wins_over_its_variable():
    assert Settings.from_env({"XTRAIN_TEST_DEVICE": "cuda"}).backend == "nccl"
    assert Settings.from_env({}, device="cuda").backend == "nccl"
    assert Settings.from_env({"XTRAIN_DIST_BACKEND": "gloo"}, device="cuda").backend == "gloo"
    assert Settings.from_env({"XTRAIN_DIST_BACKEND": "nccl"}, backend="gloo", device=None).backend == "gloo"


def test_export_writes_only_what_options_set():
    env = {}
    Settings.from_env({}, device="cpu").export(env)
    assert env == {"XTRAIN_TEST_DEVICE": "cpu"}  # the backend a child derives itself (it may get another device)
    env = {}
    Settings.from_env({"XTRAIN_DIST_MAX_WORLD": "2"}, backend="gloo").export(env)
    assert env == {"XTRAIN_DIST_BACKEND": "gloo"}


@pytest.mark.parametrize("env,overrides,line", [
    ({"XTRAIN_TEST_THREADS": "two"}, {}, "XTRAIN_TEST_THREADS=two: must be an integer ≥ 1"),
    ({"XTRAIN_TEST_THREADS": "0"}, {}, "XTRAIN_TEST_THREADS=0: must be an integer ≥ 1"),
    ({"XTRAIN_RANKS_PER_NODE": "0"}, {}, "XTRAIN_RANKS_PER_NODE=0: must be an integer ≥ 1"),
    ({"XTRAIN_RANKS_PER_NODE": "two"}, {}, "XTRAIN_RANKS_PER_NODE=two: must be an integer ≥ 1"),
    ({"XTRAIN_DIST_BACKEND": "mpi"}, {}, "XTRAIN_DIST_BACKEND=mpi: must be gloo or nccl"),
    ({}, {"backend": "mpi"}, "--verify-backend mpi: must be gloo or nccl"),
    ({}, {"device": "tpu"}, "--verify-device tpu: must be cpu or cuda"),
    ({"XTRAIN_DIST_TIMEOUT": "nan"}, {}, "XTRAIN_DIST_TIMEOUT=nan: must be a number of seconds ≥ 1"),
    ({"XTRAIN_DIST_TIMEOUT": "0.001"}, {}, "XTRAIN_DIST_TIMEOUT=0.001: must be a number of seconds ≥ 1"),
    ({"XTRAIN_TEST_THREADS": "1000"}, {}, f"XTRAIN_TEST_THREADS=1000: exceeds the {usable_cores()} CPU core(s) this "
                                          f"process may use; set XTRAIN_TEST_THREADS ≤ {usable_cores()}"),
    ({"HYPOTHESIS_PROFILE": "bogus"}, {}, "HYPOTHESIS_PROFILE=bogus: unknown profile; use dev, ci, gpu, scale (or one "
                                          "registered with hypothesis' register_profile)"),
    ({"XTRAIN_POOL_START": "fork"}, {}, "XTRAIN_POOL_START=fork: must be forkserver or spawn"),
    ({"XTRAIN_DIST_MIN_WORLD": "8"}, {}, "XTRAIN_DIST_MIN_WORLD=8: exceeds max_world=4; set XTRAIN_DIST_MAX_WORLD ≥ 8 too"),
])
def test_a_bad_knob_is_one_line_naming_it(env, overrides, line):
    with pytest.raises(SettingError) as e:
        Settings.from_env(env, **overrides)
    assert str(e.value) == line


def test_a_gloo_world_is_checked_against_the_cores_and_the_default_always_fits(monkeypatch):
    """Issue 42: XTRAIN_DIST_MAX_WORLD=100 was accepted on 2 cores (a load of 65, nothing ran in 150 s) while the
    threads were checked. A gloo world × its ranks' threads may ask RANKS_PER_CORE = 4 per core the process may use;
    the default world 4 fits every machine at every allowed thread count (threads ≤ cores), so only a value set
    above it can fail; under nccl the GPUs cap the world instead (world_cap)."""
    from verify._internal import settings as mod

    for cores in (1, 2, 3, 16):
        monkeypatch.setattr(mod, "usable_cores", lambda: cores)
        for threads in range(1, cores + 1):
            Settings(threads=threads).check_machine()  # the default stays valid
        Settings(max_world=4 * cores).check_machine()
        with pytest.raises(SettingError) as e:
            Settings.from_env({"XTRAIN_DIST_MAX_WORLD": str(4 * cores + 1)}).check_machine()
        assert str(e.value) == (f"XTRAIN_DIST_MAX_WORLD={4 * cores + 1}: more gloo ranks than this machine runs: at "
                                f"most {4 * cores} (4 per CPU core × the {cores} core(s) this process may use); set "
                                f"XTRAIN_DIST_MAX_WORLD ≤ {4 * cores}")
    monkeypatch.setattr(mod, "usable_cores", lambda: 2)
    with pytest.raises(SettingError) as e:  # each rank's threads count: 2 threads on 2 cores leave 4 ranks
        Settings.from_env({"XTRAIN_TEST_THREADS": "2", "XTRAIN_DIST_MIN_WORLD": "5", "XTRAIN_DIST_MAX_WORLD": "5"}
                          ).check_machine()
    assert str(e.value) == ("XTRAIN_DIST_MIN_WORLD=5: more gloo ranks than this machine runs: at most 4 (4 per CPU "
                            "core × the 2 core(s) this process may use ÷ 2 threads per rank (XTRAIN_TEST_THREADS)); "
                            "set XTRAIN_DIST_MIN_WORLD ≤ 4")


def test_the_selftest_refuses_a_world_the_machine_cannot_run(tmp_path, capsys, monkeypatch):
    from verify.selftest.__main__ import main

    monkeypatch.setenv("XTRAIN_DIST_MAX_WORLD", "100")
    with pytest.raises(SystemExit) as e:
        main(["--verify-report", str(tmp_path / "r")])
    err, n = capsys.readouterr().err, 4 * usable_cores()
    assert e.value.code == 2 and err == (f"verify.selftest: error: XTRAIN_DIST_MAX_WORLD=100: more gloo ranks than "
                                         f"this machine runs: at most {n} (4 per CPU core × the {usable_cores()} core(s) "
                                         f"this process may use); set XTRAIN_DIST_MAX_WORLD ≤ {n}\n"), err
    assert list(tmp_path.iterdir()) == []


def test_the_settings_are_frozen_and_fields_are_checked_when_built_directly():
    with pytest.raises(Exception):
        Settings().device = "cuda"
    with pytest.raises(ValueError, match=r"^threads=0: must be an integer ≥ 1$"):
        Settings(threads=0)


@no_gpu
@pytest.mark.parametrize("env,overrides,line", [
    ({}, {"backend": "nccl"}, "--verify-backend nccl: no CUDA GPU is visible to torch (NCCL puts rank r on cuda:r); "
                              "use --verify-backend gloo"),
    ({"XTRAIN_TEST_DEVICE": "cuda"}, {}, "XTRAIN_TEST_DEVICE=cuda: no CUDA GPU is visible to torch; use "
                                         "XTRAIN_TEST_DEVICE=cpu"),
])
def test_cuda_and_nccl_need_a_gpu(env, overrides, line):
    with pytest.raises(SettingError) as e:
        Settings.from_env(env, **overrides).check_machine()
    assert str(e.value) == line


def test_a_report_folder_is_checked_and_nothing_is_left_behind(tmp_path):
    check_report_dir(str(tmp_path / "a" / "b"), "--verify-report")
    assert list(tmp_path.iterdir()) == []  # the probe's folders are gone again
    (tmp_path / "f").write_text("")
    with pytest.raises(SettingError, match=r"^--out .*f: exists and is not a directory; pass a directory$"):
        check_report_dir(str(tmp_path / "f"), "--out")
    with pytest.raises(SettingError, match=r"^--verify-report /proc/x: cannot write there \(.*\); pass a writable"):
        check_report_dir("/proc/x", "--verify-report")


# -- one home: the guide's table, and no knob read around it ------------------------------------------------

def test_the_guide_lists_exactly_the_knobs():
    with open(os.path.join(ROOT, "docs", "verify-your-trainer.md"), encoding="utf-8") as f:
        doc = f.read()
    block = re.search(r"<!-- knobs:[^\n]*\n(.*?)<!-- /knobs -->", doc, re.S)
    assert block is not None and block[1] == knobs_table(), "regenerate the table with verify._internal.settings.knobs_table()"
    from hypothesis import settings

    from verify._internal import plugin  # noqa: F401  (registers the profiles)

    doc = next(k.doc for k in KNOBS if k.env == "HYPOTHESIS_PROFILE")
    assert [int(n) for n in re.findall(r"\d+", doc)] == [settings.get_profile(p).max_examples for p in ("dev", "ci", "gpu")]


def test_the_docs_state_the_codes_defaults():
    """The table's default column, and the guide's and design's prose where they give a knob's default."""
    d = Settings()
    for k in KNOBS:
        if k.default.isdigit():
            assert int(k.default) == getattr(d, k.field), k
    design = sorted(os.path.join("docs", "design", f) for f in os.listdir(os.path.join(ROOT, "docs", "design"))
                    if f.endswith(".md"))
    text = "".join(open(os.path.join(ROOT, p), encoding="utf-8").read() for p in
                   ("README.md", "docs/verify-your-trainer.md", *design))
    text = " ".join(text.split())
    said = re.findall(r"`XTRAIN_DIST_TIMEOUT`,? (?:default )?(\d+) s", text)
    assert said and all(int(n) == d.timeout for n in said), said
    said = re.findall(r"`XTRAIN_DIST_MIN_WORLD`\.\.`XTRAIN_DIST_MAX_WORLD`, (\d+)\.\.(\d+) by default", text)
    assert said and all((int(a), int(b)) == (d.min_world, d.max_world) for a, b in said), said
    from verify.selftest import DIST

    assert re.findall(r"the self-test's cases go to world (\d+)", text) == [str(max(DIST))]


def test_no_module_reads_a_knob_around_the_settings():
    names = [k.env for k in KNOBS]
    for folder in ("verify", "benchmarks"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            for name in files:
                path = os.path.join(dirpath, name)
                if not name.endswith(".py") or path.endswith(os.path.join("verify", "settings.py")):
                    continue
                text = open(path, encoding="utf-8").read()
                for env in names:
                    assert not re.search(rf"environ(\.get)?[\[(]\s*['\"]{env}['\"]", text), f"{path} reads {env}"


# -- every entry point checks its options before anything runs ------------------------------------------------

def _pytest_verify(cwd, *args, env=None):
    cmd = [sys.executable, "-m", "pytest", "--pyargs", "verify", "-p", "no:cacheprovider", "-q", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env={**ENV, **(env or {})}, timeout=600)


def _one_usage_line(r, line: str, code: int = 4):
    """pytest's usage error (exit 4, as pytest's own bad options): exactly one line, no traceback."""
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert r.returncode == code and lines == [line], (r.returncode, r.stdout[-2000:], r.stderr[-2000:])


@pytest.mark.slow
@pytest.mark.parametrize("args,line", [
    (["--verify-report", "/proc/x"], "ERROR: --verify-report /proc/x: cannot write there (No such file or directory); "
                                     "pass a writable directory"),
    (["--verify-backend", "mpi"], "ERROR: --verify-backend mpi: must be gloo or nccl"),
    (["--verify-device", "tpu"], "ERROR: --verify-device tpu: must be cpu or cuda"),
    pytest.param(["--verify-backend", "nccl", "--verify-trainer", "examples.mlp_regressor:factory"],
                 "ERROR: --verify-backend nccl: no CUDA GPU is visible to torch (NCCL puts rank r on cuda:r); use "
                 "--verify-backend gloo", marks=no_gpu),
])
def test_the_plugin_refuses_a_bad_option_in_one_line(tmp_path, args, line):
    r = _pytest_verify(tmp_path, *args)
    _one_usage_line(r, line)
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.slow
@pytest.mark.parametrize("env,line", [
    ({"XTRAIN_DIST_TIMEOUT": "soon"}, "ERROR: XTRAIN_DIST_TIMEOUT=soon: must be a number of seconds ≥ 1"),
    ({"HYPOTHESIS_PROFILE": "bogus"}, "ERROR: HYPOTHESIS_PROFILE=bogus: unknown profile; use dev, ci, gpu, scale (or one "
                                      "registered with hypothesis' register_profile)"),
    ({"XTRAIN_DIST_MAX_WORLD": "100"}, f"ERROR: XTRAIN_DIST_MAX_WORLD=100: more gloo ranks than this machine runs: at "
                                       f"most {4 * usable_cores()} (4 per CPU core × the {usable_cores()} core(s) this "
                                       f"process may use); set XTRAIN_DIST_MAX_WORLD ≤ {4 * usable_cores()}"),
])
def test_a_bad_knob_stops_any_pytest_run_in_one_line(tmp_path, env, line):
    """The plugin is loaded by every pytest run of the environment: a bad variable is its usage error (it
    was a traceback at import before the plugin checked the settings first; a bogus profile ran the
    default budget, saying nothing)."""
    r = _pytest_verify(tmp_path, env=env)
    _one_usage_line(r, line)
    assert list(tmp_path.iterdir()) == []


def test_a_profile_registered_with_hypothesis_is_accepted():
    """A user's own profile (their conftest's register_profile) is theirs to load: not refused as unknown."""
    from hypothesis import settings

    settings.register_profile("xtrain-test-own", max_examples=2)
    assert Settings.from_env({"HYPOTHESIS_PROFILE": "xtrain-test-own"}).hypothesis_profile == "xtrain-test-own"
    assert Settings.from_env({"HYPOTHESIS_PROFILE": "default"}).hypothesis_profile == "default"


NOT_A_TRAINER = '''
import verify


class Half:  # micro_step and params, no grads() nor optimizer_step()
    def __init__(self, spec):
        pass

    def micro_step(self, inputs, targets, micro):
        pass

    def params(self):
        return {}


@verify.adapter(data=verify.data.regression(features=4))
def factory(spec):
    return Half(spec)


dp = verify.adapter(data=verify.data.regression(features=4), data_parallel=True)(Half)
'''


@pytest.mark.slow
def test_a_factory_without_the_protocols_methods_is_a_usage_error(tmp_path):
    (tmp_path / "mine.py").write_text(NOT_A_TRAINER)
    need = "a trainer needs micro_step(), grads(), optimizer_step(), params() (verify.Trainer)"
    r = _pytest_verify(tmp_path, "--verify-trainer", "mine:factory")
    _one_usage_line(r, f"ERROR: --verify-trainer mine:factory: mine.factory makes a Half without grads(), "
                       f"optimizer_step(); {need}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.py"]


def test_the_factory_check_in_process(tmp_path, monkeypatch):
    """Single-process adapters build one trainer; a data-parallel one is checked by its class (never built
    in the invoking process); and every build checks the object (__call__)."""
    from verify._internal.protocol import AdapterError, Spec, load_adapter

    (tmp_path / "mine2.py").write_text(NOT_A_TRAINER)
    monkeypatch.syspath_prepend(str(tmp_path))
    for ref in ("mine2:factory", "mine2:dp"):
        a = load_adapter(ref)
        with pytest.raises(AdapterError, match=r"without grads\(\), optimizer_step\(\)"):
            a.check_factory()
        with pytest.raises(AdapterError, match=r"makes a Half without grads\(\), optimizer_step\(\)"):
            a(Spec(accum_steps=1))
    load_adapter("examples.mlp_regressor:factory").check_factory()  # a real trainer passes


RAISES = '''
import verify


@verify.adapter(data=verify.data.regression(features=4))
def factory(spec):
    open("no-such-checkpoint.pt")  # line 7: a factory whose file is missing
'''


def test_a_factory_that_raises_is_named_with_its_line_in_process(tmp_path, monkeypatch):
    from verify._internal.protocol import AdapterError, load_adapter

    (tmp_path / "mine3.py").write_text(RAISES)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    a = load_adapter("mine3:factory")
    a.check_factory()  # not asked: the gates report it, with their case
    with pytest.raises(AdapterError) as e:
        a.check_factory(raises=True)
    assert str(e.value) == ("--verify-trainer mine3:factory: mine3.factory raised building a trainer (accum_steps=1, "
                            "float32, its defaults): FileNotFoundError: [Errno 2] No such file or directory: "
                            "'no-such-checkpoint.pt' (mine3.py:7); fix the factory or what it reads")


@pytest.mark.slow
def test_a_factory_that_raises_is_a_usage_error_not_a_gate_failure(tmp_path):
    (tmp_path / "mine.py").write_text(RAISES)
    r = _pytest_verify(tmp_path, "--verify-trainer", "mine:factory")
    _one_usage_line(r, "ERROR: --verify-trainer mine:factory: mine.factory raised building a trainer (accum_steps=1, "
                       "float32, its defaults): FileNotFoundError: [Errno 2] No such file or directory: "
                       "'no-such-checkpoint.pt' (mine.py:7); fix the factory or what it reads")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.py"]


def test_the_selftest_refuses_a_bad_option_in_one_line(tmp_path, capsys):
    from verify.selftest.__main__ import main

    out = ["--verify-report", str(tmp_path / "r")]
    cases = [(["--verify-report", "/proc/x"], "--verify-report /proc/x: cannot write there (No such file or directory); "
                                              "pass a writable directory"),
             ([*out, "--verify-backend", "mpi"], "--verify-backend mpi: must be gloo or nccl"),
             ([*out, "--max-world", "99"], "--max-world 99: the self-test has data-parallel cases for worlds 1..4; "
                                           "pass --max-world ≤ 4")]
    if not torch.cuda.is_available():
        cases.append(([*out, "--verify-backend", "nccl"], "--verify-backend nccl: no CUDA GPU is visible to torch (NCCL "
                                                          "puts rank r on cuda:r); use --verify-backend gloo"))
    for argv, line in cases:
        before = dict(os.environ)
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err == f"verify.selftest: error: {line}\n", err
        assert dict(os.environ) == before and list(tmp_path.iterdir()) == []  # nothing exported, nothing written


def test_selftest_max_world_is_bounded_by_what_the_gates_draw(monkeypatch):
    from verify.selftest.__main__ import max_world_bound

    assert max_world_bound(Settings.from_env({})) == (4, "the self-test has data-parallel cases for worlds 1..4")
    assert max_world_bound(Settings.from_env({"XTRAIN_DIST_MAX_WORLD": "2"})) == \
        (2, "XTRAIN_DIST_MAX_WORLD=2 (worlds the gates draw)")


def test_memory_refuses_an_absurd_effective_batch_in_under_a_second(capsys):
    from verify.memory.cli import parse_args

    t0 = time.perf_counter()
    with pytest.raises(SystemExit) as e:
        parse_args(["--effective-batch", "99999999999999999999"])
    assert e.value.code == 2 and time.perf_counter() - t0 < 1.0
    err = capsys.readouterr().err
    assert err.startswith("verify.memory: error: argument --effective-batch: must be ≤ 65536, got 9999") and \
        len(err.splitlines()) == 1


def test_the_memory_bound_is_the_largest_micro_batch():
    from verify.memory.cli import MAX_E
    from xtrain_core.config import MAX_MICRO_BATCH

    assert MAX_E == MAX_MICRO_BATCH  # sweep A's N = 1 runs all E rows as one micro-batch
