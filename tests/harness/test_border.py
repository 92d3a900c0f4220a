"""The three places and their borders, held by the import graph read from the source (docs/design/layout.md).

    xtrain_core    the trainer: imports nothing of verify, xtrain_proof or the planted bench
    verify         the generic harness: imports nothing of xtrain (xtrain_core, xtrain_proof), of the planted
                   bench or of this repository's tests, and names none of them in a "MODULE:NAME" string
    xtrain_proof   xtrain's wing: the one shipped package that imports both
    _xtrain_cli    the command lines' plumbing both use (one-line errors, exit 2): imports neither

Every `import` counts wherever it stands (a function-local import runs at call time; a cycle closed lazily is
still a cycle). Importing `a.b.c` also runs `a/__init__` and `a/b/__init__`; those implied edges are left out.
Beyond the borders: no cycle, no arrow up the LAYERS, no shipped module over 400 lines.
"""
from __future__ import annotations

import ast
import fnmatch
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
SHIPPED = ("verify", "xtrain_core", "xtrain_proof", "_xtrain_cli")
PACKAGES = (*SHIPPED, "planted")
MAX_LINES = 400
MAX_DOC = 10  # a module docstring says what the module is for and points at its design note
# what the generic harness must not reach: xtrain, the bench, and the repository's own folders
NOT_GENERIC = ("xtrain_core", "xtrain_proof", "planted", "tests", "examples", "benchmarks", "tools")

# Lowest first; a module may import modules of its own layer and of lower ones. Patterns are fnmatch'ed on
# the dotted name; the most specific (longest) pattern that matches a module decides its layer.
LAYERS = [
    # the command lines' one-line errors (exit 2), integer types, progress bar: xtrain's and the harness's alike
    ("CLI plumbing, shared", ["_xtrain_cli"]),
    ("xtrain core", ["xtrain_core", "xtrain_core.*"]),
    ("xtrain CLI", ["xtrain_core.train"]),
    ("CLI plumbing", ["verify._internal.cli"]),
    # the façade (`verify`: lazy, imports nothing at load) and what every part of the harness shares
    ("harness base", ["verify", "verify.data", "verify._internal", "verify._internal.metrics", "verify._internal.objective", "verify._internal.header", "verify._internal.settings", "verify._internal.trainers",
                      "verify._internal.verdict", "verify._internal.protocol", "verify._internal.declare", "verify._internal.precision", "verify._internal.expected",
                      "verify._internal.hints", "verify._internal.atstep", "verify._internal.ranks",
                      "verify._internal.ranks.comm", "verify._internal.ranks.mesh", "verify.mesh"]),
    # running a case: cases and strategies, the pull driver, rank pools, the GPU lock
    ("harness runtime", ["verify._internal.cases", "verify._internal.cases.*", "verify._internal.ranks.*",
                         "verify._internal.gpulock", "verify.hf"]),
    ("gates", ["verify._internal.gates", "verify._internal.gates.*"]),
    # the run report prints each gate's bound in words from the tolerance policy's constants
    ("report", ["verify._internal.report", "verify._internal.report_merge", "verify._internal.prove"]),
    ("studies", ["verify.selftest", "verify.selftest.*", "verify.memory", "verify.memory.*", "verify.study",
                 "verify._internal.scaleplan"]),
    ("front ends", ["verify._internal.plugin", "verify._internal.failure_view", "verify.run", "verify.gpu_gate",
                    "verify.selftest.__main__", "verify.memory.cli", "verify.memory.__main__", "verify.test_gates",
                    "verify.test_gates_*"]),
    ("xtrain's wing", ["xtrain_proof", "xtrain_proof.*"]),
    ("planted bench", ["planted", "planted.*"]),
]


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = p
    return out


def imported(name: str, path: pathlib.Path, known) -> set[str]:
    """Every module `name` imports anywhere in its source, as the nearest known module where there is one
    (`import a.b.c` where c is an attribute: a.b), else as written (another distribution, or a repository folder)."""
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            # `from pkg import sub` imports the module pkg.sub where there is one, else a name of pkg
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            near = t
            while near and near not in known:
                near = near.rpartition(".")[0]
            out.add(near or t)
    out.discard(name)
    return out


MODULES = modules()
IMPORTS = {m: imported(m, p, MODULES) for m, p in MODULES.items()}
GRAPH = {m: {t for t in ts if t in MODULES} for m, ts in IMPORTS.items()}
EDGES = {(a, b) for a, targets in GRAPH.items() for b in targets}


def top(module: str) -> str:
    return module.split(".")[0]


def layer(module: str) -> int:
    best = max(((len(pat), i) for i, (_, pats) in enumerate(LAYERS) for pat in pats
                if fnmatch.fnmatchcase(module, pat)), default=None)
    assert best is not None, f"{module} is in no layer: add it to LAYERS (and docs/design/layout.md)"
    return best[1]


def crossings(source: str, forbidden) -> list[str]:
    """Imports from package `source` of a top-level name in `forbidden`."""
    return sorted(f"{a} -> {b}" for a, ts in IMPORTS.items() if top(a) == source for b in ts if top(b) in forbidden)


# "MODULE:NAME" naming xtrain, the bench or a repository folder (a reference the harness would import by string)
REF = re.compile(r"\b(?:%s)(?:\.\w+)*:\w+" % "|".join(NOT_GENERIC))


def named_refs(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    return [f"{path.relative_to(ROOT)}:{n.lineno}: {m.group(0)}" for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) for m in REF.finditer(n.value)]


def cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]; counter[0] += 1; stack.append(root); on.add(root)  # noqa: E702
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]; counter[0] += 1; stack.append(w); on.add(w)  # noqa: E702
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop(); on.discard(w); comp.append(w)  # noqa: E702
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_the_graph_is_read():
    # the reader must see the arrows that are known to exist, or every check below passes vacuously
    assert "verify._internal.protocol" in GRAPH["verify._internal.cases.case"]
    assert "xtrain_core.trainer" in GRAPH["planted.broken"]
    assert "verify._internal.report" in GRAPH["verify.selftest.__main__"]  # function-local
    assert {"verify", "xtrain_core.trainer"} <= {t for t in IMPORTS["xtrain_proof.adapters"]}  # public names
    assert "torch" in IMPORTS["xtrain_core.trainer"]  # an import of another distribution is kept, as written


def test_the_shared_cli_plumbing_imports_neither_side():
    bad = crossings("_xtrain_cli", ("verify", "xtrain_core", "xtrain_proof", "planted", "_xtrain_pytest"))
    assert not bad, "_xtrain_cli importing a side:\n  " + "\n  ".join(bad)


def test_xtrain_core_imports_nothing_of_the_harness():
    bad = crossings("xtrain_core", ("verify", "xtrain_proof", "planted", "_xtrain_pytest"))
    assert not bad, "xtrain_core importing the harness:\n  " + "\n  ".join(bad)


def test_the_generic_harness_imports_nothing_of_xtrain_or_the_bench():
    bad = crossings("verify", NOT_GENERIC)
    assert not bad, "generic harness modules importing xtrain or the repository:\n  " + "\n  ".join(bad)


def test_no_module_reference_to_xtrain_or_the_repository_inside_the_harness():
    bad = [hit for m, p in MODULES.items() if top(m) == "verify" for hit in named_refs(p)]
    assert not bad, "'MODULE:NAME' strings naming xtrain or the repository in the harness:\n  " + "\n  ".join(bad)


def test_the_wing_is_the_one_shipped_package_importing_both():
    both = sorted(pkg for pkg in SHIPPED if crossings(pkg, ("verify",)) and crossings(pkg, ("xtrain_core",)))
    assert both == ["xtrain_proof"], both


def test_no_import_cycles():
    found = cycles(GRAPH)
    assert not found, "import cycles:\n" + "\n".join("  " + " <-> ".join(c) for c in found)


def test_no_lower_layer_imports_a_higher_one():
    bad = sorted((a, b) for a, b in EDGES if layer(b) > layer(a))
    assert not bad, "upward arrows:\n" + "\n".join(
        f"  {a} ({LAYERS[layer(a)][0]}) -> {b} ({LAYERS[layer(b)][0]})" for a, b in bad)


def test_every_shipped_module_is_at_most_400_lines():
    long = {m: len(p.read_text().splitlines()) for m, p in MODULES.items() if top(m) in SHIPPED}
    long = {m: n for m, n in long.items() if n > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def doc_lines(path: pathlib.Path) -> int | None:
    """Lines of the module docstring (None: there is none), counted as tests/examples counts a recipe's."""
    doc = ast.get_docstring(ast.parse(path.read_text(), str(path)), clean=False)
    return None if doc is None else len(doc.strip().splitlines())


def test_every_shipped_module_has_a_docstring_of_at_most_10_lines():
    # the long story lives in docs/design/ (README.md indexes the notes), told once
    lines = {m: doc_lines(p) for m, p in MODULES.items() if top(m) in SHIPPED}
    bad = sorted(f"{MODULES[m].relative_to(ROOT)}: {'no docstring' if n is None else f'{n} lines'}"
                 for m, n in lines.items() if n is None or n > MAX_DOC)
    assert not bad, f"module docstrings over {MAX_DOC} lines (move the story into docs/design/):\n  " + "\n  ".join(bad)


def test_the_checks_can_fail():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    assert REF.search("--verify-trainer xtrain_proof.adapters:adapter") and REF.search("tests.helpers.x:y")
    assert not REF.search("mypkg.train:factory") and not REF.search("xtrain's trainer: the default")
    assert layer("verify._internal.gates.single") > layer("verify._internal.cases.case") > layer("verify._internal.protocol")
    assert layer("planted.broken") > layer("xtrain_proof.adapters") > layer("verify.memory.__main__")
    assert layer("verify._internal.ranks.worker") == layer("verify._internal.ranks.pool")


def test_the_design_doc_lists_the_layers():
    text = (ROOT / "docs" / "design" / "layout.md").read_text()
    section = text[text.index("**The border and the layers**"):]
    section = section[:section.index("\n\n**")]
    listed = re.findall(r"(?m)^\d+\. (.+?) — ", section)
    assert listed == [name for name, _ in LAYERS], listed
