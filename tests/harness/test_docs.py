"""The numbers and names the docs quote from the code: each is read here from the code, so a change on
either side that the other does not follow fails."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = {p: (ROOT / p).read_text() for p in ("README.md", "docs/design.md", "docs/verify-your-trainer.md",
                                           "docs/performance.md")}


def _flat(text: str) -> str:
    """Markdown wraps lines: compare with runs of whitespace (and a list item's indent) collapsed."""
    return re.sub(r"\s+", " ", text)


@pytest.mark.parametrize("doc", ["docs/design.md", "docs/verify-your-trainer.md"])
def test_bound_formulas_quoted_as_the_code_computes_them(doc):
    from verify.gates.tolerance import FLOAT64_TEXT, STEP0_TEXT

    text = _flat(DOCS[doc])
    for name, formula in (("STEP0_TEXT", STEP0_TEXT), ("FLOAT64_TEXT", FLOAT64_TEXT)):
        assert formula in text, f"{doc} does not quote tolerance.{name} = {formula!r}"


def test_report_prints_the_bound_the_gates_apply():
    from verify.gates.tolerance import FLOAT64_TEXT, STEP0_TEXT
    from verify.report import BOUNDS

    eq = next(v for k, v in BOUNDS.items() if "equivalence" in str(k).lower() and "data" not in str(k).lower())
    assert STEP0_TEXT in eq and FLOAT64_TEXT in eq, eq
    assert "κ" in eq and "all parameters" in eq, "the report's bound omits κ or the all-parameter term"


def test_profile_budgets_in_the_guide_are_the_plugins():
    import hypothesis

    import verify.plugin  # noqa: F401  (registers the profiles)

    n = {p: hypothesis.settings.get_profile(p).max_examples for p in ("dev", "ci", "gpu")}
    want = f"a budget of {n['dev']} random examples / {n['ci']} derandomized / {n['gpu']}"
    assert want in _flat(DOCS["docs/verify-your-trainer.md"]), f"the guide should say {want!r}"
    m = re.search(r"dev profile draws (\d+)\s+examples", _flat(DOCS["docs/performance.md"]))
    assert m and int(m.group(1)) == n["dev"], "docs/performance.md: the dev profile's example count"


def test_long_window_n_in_the_docs():
    from verify.gates.windows import LONG_N

    assert f"N = {LONG_N}" in _flat(DOCS["docs/performance.md"])


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
