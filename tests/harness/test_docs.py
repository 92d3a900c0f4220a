"""The numbers and names the docs quote from the code: each is read here from the code, so a change on
either side that the other does not follow fails."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DESIGN = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs" / "design").glob("*.md"))
DOCS = {p: (ROOT / p).read_text() for p in ("README.md", "docs/verify-your-trainer.md", "docs/performance.md", *DESIGN)}


def _flat(text: str) -> str:
    """Markdown wraps lines: compare with runs of whitespace (and a list item's indent) collapsed."""
    return re.sub(r"\s+", " ", text)


@pytest.mark.parametrize("doc", ["docs/design/tolerance.md", "docs/verify-your-trainer.md"])
def test_bound_formulas_quoted_as_the_code_computes_them(doc):
    from verify._internal.gates.tolerance import FLOAT64_TEXT, STEP0_TEXT

    text = _flat(DOCS[doc])
    for name, formula in (("STEP0_TEXT", STEP0_TEXT), ("FLOAT64_TEXT", FLOAT64_TEXT)):
        assert formula in text, f"{doc} does not quote tolerance.{name} = {formula!r}"


def test_report_prints_the_bound_the_gates_apply():
    from verify._internal.gates.tolerance import FLOAT64_TEXT, STEP0_TEXT
    from verify._internal.report import BOUNDS

    eq = next(v for k, v in BOUNDS.items() if "equivalence" in str(k).lower() and "data" not in str(k).lower())
    assert STEP0_TEXT in eq and FLOAT64_TEXT in eq, eq
    assert "κ" in eq and "all parameters" in eq, "the report's bound omits κ or the all-parameter term"


def test_profile_budgets_in_the_guide_are_the_plugins():
    import hypothesis

    import verify._internal.plugin  # noqa: F401  (registers the profiles)

    n = {p: hypothesis.settings.get_profile(p).max_examples for p in ("dev", "ci", "gpu")}
    want = f"a budget of {n['dev']} random examples / {n['ci']} derandomized / {n['gpu']}"
    assert want in _flat(DOCS["docs/verify-your-trainer.md"]), f"the guide should say {want!r}"
    m = re.search(r"dev profile draws (\d+)\s+examples", _flat(DOCS["docs/performance.md"]))
    assert m and int(m.group(1)) == n["dev"], "docs/performance.md: the dev profile's example count"


def test_long_window_n_in_the_docs():
    from verify._internal.gates.windows import LONG_N

    assert f"N = {LONG_N}" in _flat(DOCS["docs/performance.md"])


@pytest.mark.slow  # launches an interpreter (a torch import: 3-7 s on 2 cores): CI, not the dev loop
def test_memory_exit_codes_in_help_and_docstring():
    from verify.memory.report import EXIT_CODES

    out = subprocess.run([sys.executable, "-m", "verify.memory", "--help"], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    text = _flat(out.stdout)
    for verdict in ("PASS", "FAIL", "INCONCLUSIVE"):
        assert f"{EXIT_CODES[verdict]} {verdict}" in text, f"--help gives {verdict}'s exit code wrong: {text[-300:]}"
    readme = _flat(DOCS["README.md"])
    assert f"exits {EXIT_CODES['INCONCLUSIVE']}, INCONCLUSIVE" in readme
    assert f"exits {EXIT_CODES['FAIL']}, naming the rows" in readme


def test_gate_budget_table_is_the_codes():
    """The guide's table of cases per gate and profile is what gate_budget computes."""
    import hypothesis

    import verify._internal.plugin  # noqa: F401
    from verify._internal.gates.table import TABLE, gate_budget

    rows = dict(re.findall(r"^\| `([\w -]+)`[^|]*\| (\d+ \| \d+ \| \d+) \|$", DOCS["docs/verify-your-trainer.md"], re.M))
    names = {g.value: g for g, r in TABLE.items() if r.budget}  # one name per gate: the table's is the Gate's
    assert set(rows) == set(names), f"table gates {sorted(rows)} vs the gate table's budgets {sorted(names)}"
    for name, cells in rows.items():
        want = " | ".join(str(gate_budget(names[name], hypothesis.settings.get_profile(p).max_examples))
                          for p in ("dev", "ci", "gpu"))
        assert cells == want, f"{name}: the guide says {cells}, gate_budget gives {want}"


def _mentions(pattern: str):
    for doc, text in DOCS.items():
        for m in re.finditer(pattern, text):
            yield doc, m.group(1)


def test_every_command_and_path_the_docs_name_exists():
    """`python -m X` runs a module that exists; a repo path in backticks (verify/…, xtrain_core/…,
    benchmarks/…, examples/…, tests/…) is a file or folder of the tree. Moving a module without its docs
    fails here."""
    import importlib.util

    bad = []
    for doc, mod in _mentions(r"python3? -m ([\w.]+)"):
        if mod.split(".")[0] in ("verify", "xtrain_core", "benchmarks", "examples") and importlib.util.find_spec(mod) is None:
            bad.append(f"{doc}: python -m {mod}")
    for doc, path in _mentions(r"`((?:verify|xtrain_core|benchmarks|examples|tests|reports|docs)/[\w./-]*)`"):
        p = path.split("::")[0].rstrip("/.")
        if "*" not in p and "{" not in p and not (ROOT / p).exists():
            bad.append(f"{doc}: {path}")
    assert not bad, "the docs name what the tree does not have:\n" + "\n".join(bad)


def test_the_readme_and_the_guide_read_in_one_sitting():
    """README ≤ 120 lines, the user guide ≤ 500: the long stories live in docs/design/, told once."""
    lengths = {p: len(DOCS[p].splitlines()) for p in ("README.md", "docs/verify-your-trainer.md")}
    assert lengths["README.md"] <= 120 and lengths["docs/verify-your-trainer.md"] <= 500, lengths
