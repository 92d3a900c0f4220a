"""The border between the generic harness and xtrain's wing, held by the import graph (issue 17 item 1).

The graph is read from the source (ast), every `import` counted wherever it stands: a function-local import
is still an arrow (it runs at call time, and a cycle closed lazily is still a cycle). Importing `a.b.c`
also runs `a/__init__` and `a/b/__init__`; those implied edges are left out, as the standard package
pattern (an `__init__` re-exporting a submodule that imports a sibling) would otherwise read as a cycle.

    generic   every verify module outside verify/adapters/ imports nothing from xtrain_core or
              verify.adapters: a user's trainer is verified by the same code as xtrain's
    cycles    no module reaches itself through imports
    layers    LAYERS below, lowest first: no module imports one of a higher layer (docs/design/layout.md)
    size      every verify module has ≤ 400 lines
"""
from __future__ import annotations

import ast
import fnmatch
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("verify", "xtrain_core")
MAX_LINES = 400

# Lowest first; a module may import modules of its own layer and of lower ones. Patterns are fnmatch'ed
# on the dotted name; the most specific (longest) pattern that matches a module decides its layer.
LAYERS = [
    # one-line usage errors, exit 2: the plumbing every command line shares (xtrain_core/cli.py re-exports it)
    ("CLI plumbing", ["verify._cli"]),
    ("xtrain core", ["xtrain_core", "xtrain_core.*"]),
    ("xtrain CLI", ["xtrain_core.train"]),
    # the façade (`verify`: lazy, imports nothing at load) and what every part of the harness shares
    ("harness base", ["verify", "verify._meta", "verify.settings", "verify.verdict", "verify.comm",
                      "verify.protocol", "verify.expected", "verify.data", "verify.hints", "verify.mesh",
                      "verify.atstep"]),
    # running a case: the driving loop, rank pools, the pull driver, strategies, the GPU lock
    ("harness runtime", ["verify.case", "verify.pool", "verify.pool_*", "verify.pull", "verify.strategies",
                         "verify._gpulock"]),
    ("gates", ["verify.gates", "verify.gates.*"]),
    # the run report prints each gate's bound in words from the tolerance policy's constants
    ("report", ["verify.report"]),
    ("studies", ["verify.selftest", "verify.selftest.*", "verify.memory", "verify.memory.*"]),
    ("front ends", ["verify.plugin", "verify._failure_view", "verify.run", "verify.selftest.__main__", "verify.gpu_gate", "verify.memory.cli",
                    "verify.test_gates", "verify.test_gates_*"]),
    # adapters: xtrain's trainers and the planted bugs, built on the harness and on xtrain_core
    ("adapters", ["verify.adapters", "verify.adapters.*"]),
    # xtrain's wing entry (WING_ENTRIES): the generic memory CLI run with xtrain's defaults
    ("wing entries", ["verify.memory.__main__"]),
]

# Front ends that are xtrain's wing (docs/design/memory.md): `python -m verify.memory` defaults to xtrain's trainer,
# its short trainer names, --model/--seq-len and the H200 anchor; the library under it is generic, and
# nothing imports the entry (memory's own modules are held like every other generic module).
WING_ENTRIES = {"verify.memory.__main__"}


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = p
    return out


def imports(name: str, path: pathlib.Path, known) -> set[str]:
    """The package modules `name` imports anywhere in its source (the module itself left out)."""
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
            while t and t not in known:  # `import a.b.c` where c is an attribute: the nearest module
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


MODULES = modules()
GRAPH = {m: imports(m, p, MODULES) for m, p in MODULES.items()}
EDGES = {(a, b) for a, targets in GRAPH.items() for b in targets}


def layer(module: str) -> int:
    best = max(((len(pat), i) for i, (_, pats) in enumerate(LAYERS) for pat in pats
                if fnmatch.fnmatchcase(module, pat)), default=None)
    assert best is not None, f"{module} is in no layer: add it to LAYERS (and docs/design/layout.md)"
    return best[1]


def generic(module: str) -> bool:
    return (module.split(".")[0] == "verify" and not (module + ".").startswith("verify.adapters.")
            and module not in WING_ENTRIES)


def wing(module: str) -> bool:
    return module.split(".")[0] == "xtrain_core" or (module + ".").startswith("verify.adapters.")


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
    assert "verify.protocol" in GRAPH["verify.case"]
    assert "xtrain_core.trainer" in GRAPH["verify.adapters.broken"]
    assert "verify.comm" in GRAPH["verify.case"]
    assert "verify.report" in GRAPH["verify.selftest.__main__"]  # `from .. import report`, function-local


def test_generic_harness_imports_nothing_of_xtrain():
    bad = sorted((a, b) for a, b in EDGES if generic(a) and wing(b))
    assert not bad, "generic harness modules importing xtrain's wing:\n" + "\n".join(f"  {a} -> {b}" for a, b in bad)


def test_no_import_cycles():
    found = cycles(GRAPH)
    assert not found, "import cycles:\n" + "\n".join("  " + " <-> ".join(c) for c in found)


def test_no_lower_layer_imports_a_higher_one():
    bad = sorted((a, b) for a, b in EDGES if layer(b) > layer(a))
    assert not bad, "upward arrows:\n" + "\n".join(
        f"  {a} ({LAYERS[layer(a)][0]}) -> {b} ({LAYERS[layer(b)][0]})" for a, b in bad)


def test_every_verify_module_is_at_most_400_lines():
    long = {m: n for m, p in MODULES.items() if m.split(".")[0] == "verify"
            and (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"verify modules over {MAX_LINES} lines: {long}"


def test_the_checks_can_fail():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    assert generic("verify.gates.single") and generic("verify") and not generic("verify.adapters.xtrain")
    assert generic("verify.memory.report") and generic("verify.memory.cli") and not generic("verify.memory.__main__")
    assert layer("verify.memory.__main__") > layer("verify.adapters.xtrain_memory") > layer("verify.memory.cli")
    assert wing("xtrain_core.config") and wing("verify.adapters") and not wing("verify.case")
    assert layer("verify.gates.single") > layer("verify.case") > layer("verify.protocol")
    assert layer("verify.selftest.__main__") > layer("verify.selftest") and layer("verify.pool_worker") == layer("verify.pool")


def test_the_design_doc_lists_the_layers():
    import re

    text = (ROOT / "docs" / "design" / "layout.md").read_text()
    section = text[text.index("**The border and the layers**"):]
    section = section[:section.index("\n\n**")]
    listed = re.findall(r"(?m)^\d+\. (.+?) — ", section)
    assert listed == [name for name, _ in LAYERS], listed
