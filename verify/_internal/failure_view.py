"""A failed gate test as a user reads it (the plugin's longrepr): the verdict first and whole, its hint,
hypothesis' notes, and only the user's own frames — the harness's, hypothesis', pytest's and pluggy's hidden."""
from __future__ import annotations

import os

_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the verify package (this module: verify/_internal/)
_HIDDEN: tuple[str, ...] = ()


def _internal(path: str) -> bool:
    """Frames of the harness and its machinery (verify, this shim, hypothesis, pytest, pluggy): a user
    reading a gate's failure needs their own frames only."""
    return any(path.startswith(d + os.sep) for d in _HIDDEN)


def _hidden_dirs() -> tuple[str, ...]:
    import _pytest
    import pluggy

    out = [_PKG, os.path.join(os.path.dirname(_PKG), "_xtrain_pytest"), os.path.dirname(_pytest.__file__),
           os.path.dirname(pluggy.__file__)]
    try:
        import hypothesis

        out.append(os.path.dirname(hypothesis.__file__))
    except ImportError:
        pass
    return tuple(out)


def _gate_failures(exc) -> list:
    """The GateFailures in `exc` (hypothesis raises an exception group when it finds several distinct ones)."""
    from verify._internal.verdict import GateFailure

    if isinstance(exc, GateFailure):
        return [exc]
    return [f for e in getattr(exc, "exceptions", ()) for f in _gate_failures(e)]


def _user_notes(notes: list) -> list[str]:
    """hypothesis' notes (one string per line or per paragraph) as lines, without the "Explanation" block
    when it lists only lines inside the harness (which says nothing to the user)."""
    lines = "\n".join(str(n).rstrip("\n") for n in notes).split("\n")
    out, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "Explanation:":
            j = i + 1
            while j < len(lines) and lines[j][:1].isspace():
                j += 1
            paths = [ln.strip().rsplit(":", 1)[0] for ln in lines[i + 1:j] if ln.strip().startswith(os.sep)]
            if paths and all(_internal(p) for p in paths):
                i = j
                continue
        out.append(lines[i])
        i += 1
    return out


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def verdict_repr(item, excinfo):
    """pytest's longrepr for a failed gate test: the verdict whole, its hint, hypothesis' notes (the
    falsifying example, how to reproduce it), and only the user's own frames. Its crash message — what the
    short summary prints after the test id — is the verdict. Built from pytest's own repr classes, so it
    crosses from xdist workers intact."""
    from _pytest._code.code import ExceptionChainRepr, ReprEntryNative, ReprFileLocation, ReprTraceback, Traceback

    from verify._internal.hints import hint

    global _HIDDEN
    _HIDDEN = _HIDDEN or _hidden_dirs()
    fails = _gate_failures(excinfo.value)
    user = lambda ei: Traceback([e for e in ei.traceback if not _internal(str(e.path))])  # noqa: E731
    if not fails:  # the trainer raised: its own frames, the harness's hidden; its error's first line whole
        style = "short" if item.config.option.tbstyle == "short" else "long"
        longrepr, line = excinfo.getrepr(style=style, tbfilter=user), excinfo.exconly(tryshort=True).split("\n")[0]
        if getattr(longrepr, "reprcrash", None) is not None:  # the summary: that line, not hypothesis' notes too
            longrepr.reprcrash.message = line
        return longrepr, line, None, None
    first = fails[0]
    from verify._internal.gates.rerun import diagnosed  # a failure re-run with one knob changed at a time names its class (once)

    first = diagnosed(getattr(item, "funcargs", {}).get("verify_adapter"), first)
    verdict, why = _one_line(first), hint(first)
    lines = [verdict + "\n"] + ([f"hint: {why}\n"] if why else [])
    lines += [f"also: {_one_line(f)}\n" for f in fails[1:]]
    notes = _user_notes(getattr(excinfo.value, "__notes__", None) or getattr(first, "__notes__", None) or [])
    if any(n.strip() for n in notes):
        lines += ["\n"] + [n + "\n" for n in notes]
    lines.append("(the harness's frames are hidden; --full-trace shows them)\n")
    path, lineno = item.location[0], (item.location[1] or 0) + 1
    crash = ReprFileLocation(path=path, lineno=lineno, message=verdict)
    return (ExceptionChainRepr([(ReprTraceback([ReprEntryNative(lines)], None, style="native"), crash, None)]), verdict,
            why, first.gate)
