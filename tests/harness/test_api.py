"""verify's public API is exactly `__all__`, every name in it resolves, and importing it is cheap."""
import pathlib
import re
import subprocess
import sys

import pytest

import verify

PUBLIC = {
    "Trainer", "Spec", "Adapter", "adapter", "AdapterError", "data", "hf", "Metrics", "Objective", "Parity",
    "Batches", "Distributed", "Numerics", "MemoryModel", "Threshold",
    "Expected", "DDP_EXPECTED", "DDP_WORLD1_EXPECTED", "CountRow", "Windows", "Mesh", "device_mesh",
    "Pull", "PullError", "check", "Case", "Gate", "GateFailure", "GateSkipped", "Settings",
    "run_selftest", "measure_memory", "report_header", "atomic_write",
}
ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_all_is_the_public_api_and_resolves():
    # no cap on the count: what matters is that no user code needs verify._internal (the test below)
    assert set(verify.__all__) == PUBLIC and len(verify.__all__) == len(PUBLIC)
    for name in verify.__all__:
        assert getattr(verify, name) is not None, name
    assert set(dir(verify)) >= PUBLIC
    import pytest

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        verify.nope  # noqa: B018


def test_import_verify_loads_neither_hypothesis_nor_the_harness():
    code = "import sys, verify; print(sorted(m for m in ('hypothesis', 'verify._internal.gates', 'verify._internal.cases.strategies') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_the_plugin_is_registered_on_the_pytest11_entry_point():
    from importlib.metadata import entry_points

    eps = [ep for ep in entry_points(group="pytest11") if ep.value == "_xtrain_pytest.entry"]
    assert eps and eps[0].name == "xtrain-verify", eps


INTERNAL_IMPORT = re.compile(r"^\s*(?:from|import)\s+verify\._internal\b", re.M)


def test_no_recipe_or_guide_reaches_into_verify_internal():
    """Recipes are what users copy, the guide what they read: both use public names only (a mesh trainer's
    DeviceMesh is verify.device_mesh), so nothing a user writes depends on verify._internal."""
    texts = {p.name: p.read_text() for p in sorted((ROOT / "examples").glob("*.py"))}
    # xtrain's wing, the planted bench, every benchmark (those of the harness itself through verify.study), the
    # recipes' tests; only the harness's own unit tests (tests/harness, tests/helpers) read its internals
    for p in [*(ROOT / "xtrain_proof").glob("*.py"), *(ROOT / "planted").glob("*.py"), *(ROOT / "benchmarks").rglob("*.py"),
              *(ROOT / "tests" / "examples").glob("*.py")]:  # the recipes' tests, as a user's own would be
        texts[str(p.relative_to(ROOT))] = p.read_text()
    leaks = [name for name, text in texts.items() if INTERNAL_IMPORT.search(text)]
    # what users read or run as written: the guide, the recipes' notes, the benchmarks' shell scripts
    for p in [ROOT / "docs" / "verify-your-trainer.md", ROOT / "docs" / "design" / "recipes.md",
              *(ROOT / "benchmarks").glob("*.sh")]:
        leaks += [str(p.relative_to(ROOT))] if "verify._internal" in p.read_text() else []
    assert not leaks, f"reach into verify._internal: {leaks}"


def test_each_public_name_is_used_in_an_example_or_the_guide():
    """A name users never meet in a recipe or the guide is not API: it goes, or the guide says how to use it."""
    text = (ROOT / "docs" / "verify-your-trainer.md").read_text()
    text += "".join(p.read_text() for p in sorted((ROOT / "examples").glob("*.py")))
    unused = [n for n in sorted(PUBLIC) if not re.search(rf"\b{re.escape(n)}\b", text)]
    assert not unused, f"public names in no example and not in the guide: {unused}"


def test_the_old_mesh_path_still_works_and_names_the_new_one(monkeypatch):
    """An adapter written from the guide before 12-05 (`from verify.mesh import device_mesh`, `verify.mesh.device_mesh(
    spec)`) runs: the old path gives the same objects, warning once that they are `verify.device_mesh` and `verify.Mesh`."""
    import importlib
    import sys

    monkeypatch.delitem(sys.modules, "verify.mesh", raising=False)
    monkeypatch.delitem(vars(verify), "mesh", raising=False)
    with pytest.warns(FutureWarning, match=r"verify\.mesh is deprecated: use verify\.device_mesh\(spec\) and verify\.Mesh"):
        old = verify.mesh  # attribute access, as the old recipes wrote it
    assert old.device_mesh is verify.device_mesh and old.Mesh is verify.Mesh
    assert importlib.import_module("verify.mesh") is old  # `from verify.mesh import device_mesh`: the same module


def test_atomic_write_writes_one_file_or_several_all_or_none(tmp_path):
    """verify.atomic_write(path, text), and a dict {path: text}: every file written (folders made), or none of them
    (a failure on the second leaves the first as it was, no temp file behind)."""
    one, two = tmp_path / "a.json", tmp_path / "b.md"
    assert verify.atomic_write(str(one), "1") == [str(one)] and one.read_text() == "1"
    assert verify.atomic_write({str(one): "2", str(two): "3"}) == [str(one), str(two)]
    assert (one.read_text(), two.read_text(), oct(one.stat().st_mode & 0o777)) == ("2", "3", "0o644")
    with pytest.raises(OSError):  # the second file's folder would be a file
        verify.atomic_write({str(one): "4", str(one / "c.md"): "5"})
    assert one.read_text() == "2" and sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.md"]
    with pytest.raises(TypeError, match="takes no data argument"):
        verify.atomic_write({str(one): "6"}, "7")
