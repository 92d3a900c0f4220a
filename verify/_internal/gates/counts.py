"""The boundary rule: what a trainer's collectives may be, per micro-step and per step, as one declarative row.

A `CountRow` says, for one optimizer step in one sync mode, how many collectives of each family (c10d's names
merged; on gloo a reduce_scatter is read as the all_reduce gloo records, comm.recorded) are issued on each
micro-step before the boundary and at it, and how many floating elements the boundary reductions carry; anything
it does not name must not happen. A key may name a link ("all_reduce@inter-node"). Without a declared row,
`CountRow.default`: nothing before the boundary, every gradient element reduced once at it (P ≤ E ≤ parameter
elements + SCALARS). `expected` collectives are excused first (`excused`); a row's `side` is no gradient's.

The table of rows, families, links and HSDP: docs/design/distributed.md, "Count tables".
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from verify._internal.ranks.comm import LINKS, RECORDED_AS, family, link_of, recorded

__all__ = ["CountRow", "declared_row", "family", "families", "check_row", "check_step", "excused", "as_recorded", "SCALARS",
           "DEFAULT_MODE"]

SCALARS = 8  # side-channel floats allowed to ride with the gradients (xtrain: Σ raw·B_local and N·B_local)
DEFAULT_MODE = "the default rule"  # CountRow.default's mode
REDUCTIONS = ("all_reduce", "reduce_scatter")


def families(cs) -> Counter:
    return Counter(family(c.op) for c in cs)


@dataclass(frozen=True)
class CountRow:
    """Expected collectives of one optimizer step in one sync mode (see the module docstring). Counts are
    exact ints, or (lo, hi) with hi None for "at least lo"."""

    mode: str
    before: dict = field(default_factory=dict)  # family -> count on EACH micro-step 0..N-2
    boundary: dict | None = field(default_factory=dict)  # family -> count at the boundary; None: any (the
    # default row judges what the boundary's collectives carry, not their kind or number)
    elements: tuple | None = None  # (lo, hi) floating elements the `carriers` reduce at the boundary; None: not checked
    first_micro: dict = field(default_factory=dict)  # extra on micro-step 0 of step 0 (e.g. a graph-recording pass)
    skipped: dict = field(default_factory=dict)  # family -> count the boundary leaves out on a step the trainer
    # skips whole (a window without a valid token: no clip, no update), e.g. clipping's norm all-reduce
    carriers: tuple | None = REDUCTIONS  # families whose floating elements are the gradient's; None: every
    # gradient-like collective (comm.Collective.kind). A sharded trainer's all-gathers are parameters, not gradients
    side: tuple = ()  # Expected entries WITH numel: the boundary window's non-gradient traffic (a framework's
    # logged metrics, reduced per micro-step), at most count each per step; not carried, not in bytes per step

    def __post_init__(self):
        for e in self.side:
            if getattr(e, "numel", None) is None:
                raise ValueError(f"CountRow {self.mode!r}: side entry {e!r} has no numel; give each side entry the "
                                 f"elements of its collective (Expected(op, count, numel=...)), so it cannot excuse "
                                 f"a gradient")
        keys = [(name, k) for name in ("before", "boundary", "first_micro", "skipped")
                for k in (getattr(self, name) or {})]
        for name, k in keys:
            fam, _, link = k.partition("@")
            if "@" in k and link not in LINKS:
                raise ValueError(f"CountRow {self.mode!r}: {name} key {k!r} names link {link!r}; use "
                                 f"{' or '.join(f'{fam}@{x}' for x in LINKS)}")
        for name, k in keys:
            if "@" not in k and k in self.qualified:
                raise ValueError(f"CountRow {self.mode!r}: {name} key {k!r} has no link while another key names "
                                 f"one for {k}; name the link in every {k} key ({k}@{LINKS[0]}, {k}@{LINKS[1]})")
        for backend in {b for b, _ in RECORDED_AS}:  # two families one backend records alike: linked alike
            linked = {recorded(f, backend) for f in self.qualified}
            bare = sorted({k for _, k in keys if "@" not in k and recorded(k, backend) in linked})
            if bare:
                raise ValueError(f"CountRow {self.mode!r}: key {bare[0]!r} has no link while a family {backend} records "
                                 f"as the same one names a link; name the link in both")

    @property
    def qualified(self) -> frozenset:
        """The families the row counts per link (a key of any of its windows names a link)."""
        return frozenset(k.partition("@")[0] for d in (self.before, self.boundary or {}, self.first_micro,
                                                       self.skipped) for k in d if "@" in k)

    def key(self, c, links: dict | None, backend: str | None = None) -> str:
        """Collective `c`'s key in this row: its family, with its link where the row qualifies the family (as
        `backend` records it; a reduce_scatter gloo might record one day is read as its all_reduce too)."""
        fam = recorded(family(c.op), backend)
        if fam not in {recorded(f, backend) for f in self.qualified}:
            return fam
        if links is None:
            raise ValueError(f"CountRow {self.mode!r} counts {fam} per link, and no group -> link map was given")
        return f"{fam}@{link_of(c, links)}"

    @classmethod
    def default(cls, grad_elements: int, param_elements: int) -> "CountRow":
        """The row of a trainer that declares none: no collective before the boundary; at the boundary, the
        reference's `grad_elements` gradient elements reduced once, plus at most SCALARS side-channel
        scalars over the trainer's `param_elements` parameter elements."""
        return cls(DEFAULT_MODE, before={}, boundary=None, elements=(grad_elements, param_elements + SCALARS),
                   carriers=None)

    def describe(self) -> str:
        f = lambda d: ", ".join(f"{k}×{_fmt(v)}" for k, v in sorted(d.items())) or "none"  # noqa: E731
        return f"'{self.mode}': before the boundary {f(self.before)}; at the boundary {f(self.boundary or {})}"

    def recorded_note(self, backend: str | None) -> str:
        """'' or why the row's counts read otherwise on `backend` (gloo: a reduce_scatter is an all_reduce)."""
        named = sorted({k.partition("@")[0] for d in (self.before, self.boundary or {}, self.first_micro, self.skipped)
                        for k in d if recorded(k.partition("@")[0], backend) != k.partition("@")[0]})
        return "".join(f" ({backend} records each {f} as an {recorded(f, backend)}, so the row's {f} counts as "
                       f"{recorded(f, backend)} here: docs/design/distributed.md, \"Count tables\")" for f in named)

    def carried(self, cs) -> list:
        """The collectives whose floating elements count as the gradient's."""
        if self.carriers is None:
            return [c for c in cs if c.kind == "gradient"]
        return [c for c in cs if c.floating and family(c.op) in self.carriers]


def declared_row(adapter, case, reference: bool = False):
    """adapter.counts(case), checked: a data-parallel case (case.mesh None) gets a CountRow, a mesh case a dict
    axis -> CountRow (or coords -> CountRow, checked per rank by mesh_counts); None without a declaration.
    Anything else is an AdapterError naming what came back (a duck-typed row fails here, not as an
    AttributeError deep in the counter). `reference`: the float64 run's row (adapter.counts64 where declared)."""
    counts = adapter.counts64 if reference and adapter.counts64 is not None else adapter.counts
    if counts is None:
        return None
    row = counts(case)
    if case.mesh is None:
        return as_row(row, f"{adapter.name}: counts(case) for a data-parallel case (case.mesh is None)")
    if not isinstance(row, dict):
        from verify._internal.protocol import AdapterError

        raise AdapterError(f"{adapter.name}: counts(case) for a mesh case ({case.mesh}) must return a dict axis -> "
                           f"verify.CountRow, got {_short(row)}")
    return {a: r if r is None or callable(r) else as_row(r, f"{adapter.name}: counts(case)[{a!r}] ({case.mesh})")
            for a, r in row.items()}


def as_recorded(counts: dict, backend: str | None) -> dict:
    """A row's counts (family[@link] -> n) as `backend`'s recorder writes them: on gloo reduce_scatter[@link] is
    added to all_reduce[@link] (comm.RECORDED_AS); elsewhere unchanged."""
    out: dict = {}
    for k, v in counts.items():
        fam, at, link = k.partition("@")
        key = recorded(fam, backend) + at + link
        out[key] = _add(out[key], v) if key in out else v
    return out


def _add(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return a + b
    (la, ha), (lb, hb) = (a if isinstance(a, tuple) else (a, a)), (b if isinstance(b, tuple) else (b, b))
    return la + lb, None if ha is None or hb is None else ha + hb


def as_row(row, what: str) -> "CountRow":
    """`row` if it is a CountRow; else the one-line AdapterError "counts= must return verify.CountRow, got …"."""
    if isinstance(row, CountRow):
        return row
    from verify._internal.protocol import AdapterError

    raise AdapterError(f"{what}: counts= must return verify.CountRow, got {_short(row)}; build the row with "
                       f"verify.CountRow(mode, before=..., boundary=...)")


def _short(v) -> str:
    text = " ".join(repr(v).split())
    return f"{type(v).__name__} {text[:80] + '…' if len(text) > 80 else text}"


def _fmt(v) -> str:
    if isinstance(v, tuple):
        lo, hi = v
        return f"≥{lo}" if hi is None else f"{lo}..{hi}"
    return str(v)


def _ok(v, n: int) -> bool:
    if isinstance(v, tuple):
        lo, hi = v
        return n >= lo and (hi is None or n <= hi)
    return n == v


def excused(cs: list, expected, k: int, m: int, world: int) -> tuple[list, list]:
    """Split the collectives of micro-step m of step k in a run of `world` ranks into (declared-expected
    (Expected, Collective) pairs, the rest). An Expected matches a collective of its op's family and dtype
    class (and `numel`, where it gives one), at most `count` per window; one with a `world` excuses traffic only in
    runs of that world size."""
    budget = {i: e.count for i, e in enumerate(expected) if (e.world is None or e.world == world)
              and (e.step is None or e.step == k) and (e.micro is None or e.micro == m)}
    ok, rest = [], []
    for c in cs:
        for i, e in enumerate(expected):
            if (budget.get(i, 0) > 0 and recorded(family(e.op), c.backend) == family(c.op) and e.numel in (None, c.numel)
                    and e.dtype in ("any", "floating" if c.floating else "integer")):
                budget[i] -= 1
                ok.append((e, c))
                break
        else:
            rest.append(c)
    return ok, rest


def check_row(row: CountRow, observed: list, want: dict, where: str, describe, extra: dict | None = None,
              less: dict | None = None, links: dict | None = None, backend: str | None = None) -> str | None:
    """None if `observed` (collectives of one window) has exactly the families of `want` (plus `extra`, minus
    `less`), else the failure text naming the row and every collective seen. `links`: process group (c10d
    name) -> comm.INTRA / INTER, where the row counts a family per link (the text then names the link).
    `backend`: the run's, whose recorder may write a family as another (as_recorded)."""
    keyed = [(row.key(c, links, backend), c) for c in observed]
    seen = Counter(k for k, _ in keyed)
    need = dict(want)
    for k, v in (extra or {}).items():
        need[k] = need.get(k, 0) + v if isinstance(need.get(k, 0), int) and isinstance(v, int) else v
    for k, v in (less or {}).items():
        need[k] = need.get(k, 0) - v if isinstance(need.get(k, 0), int) else need.get(k, 0)
    need = as_recorded(need, backend)
    bad = [k for k in set(seen) | set(need) if not _ok(need.get(k, 0), seen.get(k, 0))]
    if not bad:
        return None
    got = ", ".join(f"{k}×{n}" for k, n in sorted(seen.items())) or "none"
    exp = ", ".join(f"{k}×{_fmt(v)}" for k, v in sorted(need.items())) or "none"
    off = [(k, c) for k, c in keyed if k in bad] + [(k, c) for k, c in keyed if k not in bad]
    show = lambda k, c: describe(c) + (f" ({k.partition('@')[2]})" if "@" in k else "")  # noqa: E731
    listed = "; ".join(show(k, c) for k, c in off[:4]) + (f" (+{len(off) - 4} more)" if len(off) > 4 else "")
    return (f"{where}: count table row {row.mode!r} expects {exp}, observed {got}" + (f": {listed}" if listed else "")
            + row.recorded_note(backend))


def check_step(row: CountRow, micro: list, boundary: list, k: int, W: int, expected, describe,
               skipped: bool = False, links: dict | None = None) -> tuple[list, str | None]:
    """One optimizer step of one rank's run against `row`: `micro` the collectives of each micro-step
    0..N-2, `boundary` those of micro-step N-1 and optimizer_step(). Returns (the (micro-step, Expected,
    Collective) the declaration excused, the first failure's text or None). `skipped`: a step without a valid
    token, which the trainer skips whole (the row's `skipped` collectives left out). `links`: the rank's process
    groups -> link (comm.group_links), for a row that counts per link. The row's `side` is taken out of the
    boundary first (never carried; StepComm.side reports it)."""
    N, default, used = len(micro) + 1, row.mode == DEFAULT_MODE, []
    backend = next((c.backend for cs in [*micro, boundary] for c in cs), None)  # the run's: its recorder's spelling
    boundary = excused(boundary, row.side, k, N - 1, W)[1]
    for m, cs in enumerate(micro):
        ok, rest = excused(cs, expected, k, m, W)
        used += [(m, e, c) for e, c in ok]
        if default and rest:
            listed = "; ".join(describe(c) for c in rest[:3]) + (f" (+{len(rest) - 3} more)" if len(rest) > 3 else "")
            return used, (f"step {k}, micro-step {m} of {N}: {len(rest)} collective(s) before the boundary: {listed} — "
                          f"{'micro-step 0' if N == 2 else f'micro-steps 0..{N - 2}'} must not communicate (a "
                          f"collective the trainer needs there must be declared: distributed=verify.Distributed(expected=...))")
        where = f"step {k}, micro-step {m} of {N} (before the boundary)"
        msg = None if default else check_row(row, rest, row.before, where, describe,
                                             row.first_micro if (k, m) == (0, 0) else None, links=links,
                                             backend=backend)
        if msg:
            return used, msg
    if row.boundary is not None:
        ok, rest = excused(boundary, expected, k, N - 1, W)
        used += [(N - 1, e, c) for e, c in ok]
        at = f"step {k}, boundary (micro-step {N - 1} of {N}, optimizer_step()" + (
            ", a window without a valid token: no update)" if skipped else ")")
        msg = check_row(row, rest, row.boundary, at, describe, row.first_micro if (k, N) == (0, 1) else None,
                        row.skipped if skipped else None, links, backend)
        if msg:
            return used, msg
    return used, None if row.elements is None else _elements(row, row.carried(boundary), k, N, W, describe)


def _elements(row: CountRow, carried: list, k: int, N: int, W: int, describe) -> str | None:
    """The floating elements the boundary's carriers reduce, against the row's (lo, hi)."""
    (lo, hi), E = row.elements, sum(c.numel for c in carried)
    if row.mode != DEFAULT_MODE:
        if lo <= E and (hi is None or E <= hi):
            return None
        return (f"step {k}, boundary: the reductions carry {E} floating elements, count table row {row.mode!r} "
                f"expects {lo}..{'' if hi is None else hi} (the gradient once, plus side channels)")
    at = f"step {k}, boundary (micro-step {N - 1} of {N}, grads(), optimizer_step())"
    listed = "; ".join(describe(c) for c in carried[:4]) or "none"
    if E == 0:  # alone, a rank has nobody to reduce with: the single-process path
        return None if W == 1 else (f"{at}: no gradient all-reduce — expected the {lo} gradient elements reduced "
                                    f"once across {W} ranks, saw no floating-point reduction")
    if E < lo:
        return f"{at}: gradient collectives cover {E} of {lo} gradient elements (some parameters not reduced): {listed}"
    if E > hi:
        return (f"{at}: {E} elements reduced for {lo} gradient elements (+ ≤ {SCALARS} scalars): gradients reduced "
                f"more than once: {listed}")
    return None
