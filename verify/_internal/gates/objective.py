"""The normaliser gate: each term of the loss divides by what its declaration says (verify.Objective; undeclared,
a token mean where the adapter has an ignore_index), checked against the counts the harness knows.

Fresh float64 trainers at the same parameters run whole windows, each term alone (Spec.terms) where the objective
has several: additivity over disjoint windows by the term's weight, padding, one sequence's halves, the big batch
(several terms) and per_micro terms. A failure names the term, the check and, for additivity, which normaliser's
weights the numbers do fit. Bounds: tolerance.bound64. Design: docs/design/numerics.md ("Normalisers").
"""
from __future__ import annotations

import torch

from verify._internal.cases.case import Case, Trace, split
from verify._internal.gates.clipped import CLIP_EPS, UNJUDGED, preclip, unclipped_options, unclipped_run
from verify._internal.gates.metrics import factor_text
from verify._internal.gates.single import run_alone
from verify._internal.gates.tokens import _floors, _flip, _Runs, _zeros_like_any, windows_case
from verify._internal.gates.tolerance import bound64, param_err, param_scale, scale_note, whole_norm
from verify._internal.objective import NORMALISERS, Weights, objective_of
from verify._internal.verdict import Gate, GateFailure, GateResult, GateSkipped

__all__ = ["check_normaliser", "not_declared"]

GATE = Gate.NORMALISER
_COUNTED = {"valid targets": " (targets that are not ignore_index)"}
_CHECKS = ("additivity", "padding", "one sequence", "per micro-batch")  # the checks that add gradients up
PROBES = 3  # rows of window A run alone to show the other runs unclipped (grads_from="optimizer": _Term.finish)


def not_declared(adapter) -> str | None:
    """Why the gate does not apply to `adapter`, or None."""
    if objective_of(adapter) is None:
        return (f"{adapter.name} declares no objective and no ignore_index: its normaliser is not checked (declare "
                f"@verify.adapter(objective=verify.Objective(terms={{'loss': 'row_mean'}})), or ignore_index= for a "
                f"token mean)")
    return None


def check_normaliser(adapter, case: Case, *, pool=None) -> GateResult:
    """Every declared term's normaliser (module docstring); GateFailure naming the term and the check,
    GateSkipped for an adapter that declares nothing to check."""
    reason = not_declared(adapter)
    if reason:
        raise GateSkipped(reason)
    case = case.replace(options=unclipped_options(adapter, case.options))  # the pre-clip gradient, where declared
    return run_alone(normaliser_job, adapter, windows_case(adapter, case), pool)


class _Term:
    """The runs and verdicts of one term."""

    def __init__(self, adapter, case: Case, device: str, name: str, kind: str, several: bool):
        self.adapter, self.name, self.kind, self.norm = adapter, name, kind, NORMALISERS[kind]
        self.case = case.replace(terms=(name,)) if several else case
        self.r = _Runs(adapter, self.case, device)
        self.w = Weights(adapter, objective_of(adapter))
        self.label = f"term {name!r} ({kind}: {self.norm.means})"
        self.worst, self.ratio, self.extra = "", 0.0, {}
        # grads_from="optimizer": a run's gradient is post-clip, additive only where provably unclipped (clipped.py)
        self.preclip, self.unjudged, self.later, self.norms = preclip(adapter, self.case.options), [], [], []
        if self.preclip is not None:  # every run's stepped norm: the largest bounds the clip threshold from below
            run = self.r.run
            self.r.run = lambda *a: self._seen(run(*a))

    def _seen(self, trace: Trace) -> Trace:
        self.norms.append(whole_norm(trace.grads0))
        return trace

    def finish(self) -> None:
        """The gradient checks put off until every run of the term was made (grads_from="optimizer"): each judged
        where every run it adds up is provably unclipped (clipped.unclipped_run), else its loss alone was."""
        eps = getattr(self.adapter.metrics, "clip_eps", CLIP_EPS)
        shown = lambda t: self.preclip(t) or unclipped_run(whole_norm(t.grads0), max(self.norms), eps, bound64())  # noqa
        self._probe(lambda: all(shown(t) for _, traces, _ in self.later for t in traces), eps)
        for head, traces, judge in self.later:
            if all(map(shown, traces)):
                judge()
            else:
                self.unjudged.append(next(c for c in _CHECKS if head.startswith(c)))

    def _probe(self, done, eps: float) -> None:
        """Up to PROBES rows of window A, each a window alone: a mean's gradient is a convex combination of its
        rows', so a row's norm tops a window's where nothing clipped, and then shows the window unclipped. A row
        stepped as large as the largest run (within clip_eps) is the clip's plateau: more rows cannot tell."""
        r = self.r
        rows = [i for i in range(r.xa.shape[0]) if r.ign is None or r.count(r.ya[i:i + 1])][:PROBES]
        for i in rows if self.later and self.norm.weight != "1" else ():  # a sum's window outgrows its rows
            if done():
                return
            top = max(self.norms)
            r.run([(r.xa[i:i + 1], r.ya[i:i + 1])], 1, GATE)
            if abs(self.norms[-1] - top) <= eps + bound64() * top:
                return

    def weight(self, x, y, kind: str | None = None) -> float:
        return self.w.of(kind or self.kind, x, y)

    def check(self, what: str, err: float, floor: float, kappa: float, why: str, hint: str | None = None) -> None:
        b = bound64(floor, kappa)
        if not err <= b:  # also NaN
            k = f", κ {kappa:.3g}" if kappa > 1.0 else ""
            raise GateFailure(f"[{GATE}] {self.label}: {what}: relative error {err:.3e} > {b:.1e} (float64 floor "
                              f"{floor:.1e}{k}) — {why}; case {self.case}", gate=GATE, case=self.case, error=err,
                              bound=b, hint=hint or f"the term {self.name!r} is not {self.norm.means}: divide by the "
                                                    f"window's count of {self.norm.weight}"
                                                    f"{_COUNTED.get(self.norm.weight, '')}, over every micro-step and rank")
        if err / b >= self.ratio:
            self.worst, self.ratio = f"{self.name}: {what}", err / b

    def adds_up(self, head: str, parts: list, whole, whole_w: float, floors: tuple, why: str, fit=None,
                hint: str | None = None) -> None:
        """Σ w_p·(loss, gradient)_p = w·(loss, gradient) of the whole, parts [(w_p, Trace)] at the same parameters."""
        overall, per = floors
        parts = [(w, t) for w, t in parts if w]  # a part of weight 0 (no valid target) adds nothing: its loss is NaN
        if not whole_w:
            return
        s = sum(w * t.losses[0] for w, t in parts)
        want = whole_w * whole.losses[0]
        # κ of the sum as the parts give it (not of the measured whole, which a bug may shrink)
        kappa = sum(abs(w * t.losses[0]) for w, t in parts) / (abs(s) or 1.0) if len(parts) > 1 else 1.0
        err = abs(s - want) / (abs(want) or 1.0)
        if not err <= bound64(overall, kappa) and fit is not None:
            why += fit()
        self.check(f"{head} (step-0 loss)", err, overall, kappa, why, hint)
        traces = [whole, *(t for _, t in parts)]
        judge = lambda: self._grads(head, parts, whole, whole_w, floors, why, hint)  # noqa: E731
        if self.preclip is None:
            return judge()
        self.later.append((head, traces, judge))  # after clipping: judged once every run is in (finish)

    def _grads(self, head: str, parts: list, whole, whole_w: float, floors: tuple, why: str, hint) -> None:
        overall, per = floors
        traces = [whole, *(t for _, t in parts)]
        names = sorted(set(whole.grads0).union(*(t.grads0 for _, t in parts)))
        sums, wants = {}, {}
        for name in names:
            zero = _zeros_like_any(traces, name)
            sums[name] = [w * t.grads0.get(name, zero).double() for w, t in parts]
            wants[name] = whole_w * whole.grads0.get(name, zero).double()
        # one parameter is judged relative to itself, or to the whole gradient where it is zero at the run's resolution
        big, got = whole_norm(wants), whole_norm({k: sum(v) for k, v in sums.items() if v})
        for name in names:
            terms, g = sums[name], wants[name]
            sn = param_scale(sum(terms), got, overall) if terms else 0.0
            self.check(f"{head}, gradient of {name!r}{scale_note(g, big, overall)}", param_err(sum(terms), g, big, overall),
                       per.get(name, overall), sum(x.norm().item() for x in terms) / sn if sn > 0 and len(terms) > 1
                       else 1.0, why, hint)


def _fits(term: _Term, windows: list, whole_xy, whole: Trace, floor: float):
    """' — the losses fit <kind>'s weights instead' for the first other additive normaliser whose weights make
    the step-0 losses add up (a token mean first asks whether it is a mean of micro-batch means), else ''."""
    def fit() -> str:
        micro = _micro_means(term, floor, term.case.accum_steps)
        if micro:
            return micro
        for kind, norm in NORMALISERS.items():
            if kind == term.kind or not norm.additive:
                continue
            s = sum(w * t.losses[0] for w, t in ((term.weight(x, y, kind), t) for (x, y), t in windows) if w)
            want = term.weight(*whole_xy, kind) * whole.losses[0]
            if abs(s - want) <= bound64(floor) * max(abs(want), 1e-300):
                return f"; the losses add up with {kind}'s weights ({norm.weight}): {norm.means}"
        # a trainer that reorders the window (TRL shuffles it) hides which rows shared a micro-batch; at one row per
        # micro-batch the order cannot matter (a sequence mean would have fitted its weights above)
        return _micro_means(term, floor, term.r.xa.shape[0])
    return fit


def _micro_means(t: _Term, floor: float, n: int) -> str:
    """'; at N=n ... the mean of its micro-batches' own losses' where a failing token mean is exactly that, else ''."""
    r = t.r
    if t.kind != "token_mean" or n < 2 or r.xa.shape[0] % n:
        return ""
    at_n = r.run([(r.xa, r.ya)], n, GATE).losses[0]
    # a micro-batch without a valid target adds 0 to the sum and 1 to the micro-steps (its mean alone may read NaN)
    alone = [r.run([xy], 1, GATE).losses[0] if r.count(xy[1]) else 0.0 for xy in split(r.xa, r.ya, n)]
    mean = sum(alone) / n
    kappa = sum(abs(v) for v in alone) / (abs(sum(alone)) or 1.0)
    if not abs(at_n - mean) <= bound64(floor, kappa) * max(abs(mean), 1e-300):  # also NaN
        return ""
    b = r.xa.shape[0] // n
    where = "" if n == t.case.accum_steps else (f" (at one row per micro-batch, where the order the trainer gives the "
                                                f"window's rows cannot matter)")
    return (f"; at N={n} B={b}{where} window A's loss {at_n:.6g} is the mean of its micro-batches' own losses "
            f"({mean:.6g}): the count of valid targets is taken per micro-batch and the means averaged over the "
            f"micro-steps — a normaliser counted over one micro-batch, off by a factor that depends on how the "
            f"window's tokens fall into its micro-batches")


def _halves(y: torch.Tensor, ignore: int, within: torch.Tensor):
    """One row's targets (1, S) -> the row with only the first / only the second half of the valid targets in
    `within` (1, S) bool; valid targets outside it stay in both."""
    valid = ((y[0] != ignore) & within[0]).nonzero().flatten()
    first, second = y.clone(), y.clone()
    first[0, valid[len(valid) // 2:]] = ignore
    second[0, valid[:len(valid) // 2]] = ignore
    return first, second


def _sequence_to_halve(t: _Term, x, y):
    """(within (1, S) bool, what) for row (x, y): the targets to halve and how the headline names them, or None.
    A row of one sequence: all of it. A packed row (several sequences) only where the objective gives its segments:
    a sequence mean halves its first sequence of ≥ 2 valid targets (the others' means cancel out of
    n_1·L_1 + n_2·L_2 = n·L), every other normaliser the row's valid targets (sequences do not weigh inside it)."""
    valid = y != t.r.ign
    seqs = t.weight(x, y, "seq_mean")
    if seqs == 1.0 or (t.kind != "seq_mean" and t.w.segments is not None):
        return (valid, "" if seqs == 1.0 else f", all {seqs:g} sequences") if int(valid.sum()) >= 2 else None
    if t.w.segments is None:
        return None  # a packed row without its segments: which targets form one sequence is not known
    seg = torch.as_tensor(t.w.segments(x, y)).reshape(y.shape)
    for d in torch.unique(seg).tolist():
        if int((valid & (seg == d)).sum()) >= 2:
            return valid & (seg == d), f", sequence {d} of its {seqs:g}, the others as they are"
    return None


def _packed_rows(t: _Term, x, y) -> int:
    """Rows of the window holding more than one sequence (packed rows; 0 without Objective.sequences)."""
    if t.w.sequences is None:
        return 0
    return int((torch.as_tensor(t.w.sequences(x, y)) > 1).sum())


def _term_job(t: _Term, N: int) -> None:
    r, case = t.r, t.case
    if t.name in (t.adapter.objective.per_micro if t.adapter.objective is not None else ()):
        return _per_micro(t, N)
    a_b = r.run([(r.xa, r.ya), (r.xb, r.yb)], N, GATE)  # step 0 is window A alone
    a = Trace(a_b.losses[:1], a_b.grads0, a_b.params[:1])
    union = (torch.cat([r.xa, r.xb]), torch.cat([r.ya, r.yb]))
    ab = r.run([union], 2 * N, GATE)
    twins = [(ab, r.run([_flip(union)], 1, GATE))]
    several = t.case.terms is not None
    if several:  # the term at N micro-steps vs at accum_steps=1, on window A
        big = r.run([(r.xa, r.ya)], 1, GATE)
        twins.append((big, r.run([_flip((r.xa, r.ya))], 1, GATE)))
    if not t.norm.additive:
        floors = _floors(twins)
        return _big_batch(t, a, big, floors) if several else None
    b = r.run([(r.xb, r.yb)], N, GATE)
    # a row without a valid target adds 0 to a term over tokens; a row mean's row (a z-loss) may add anything
    padded = r.ign is not None and t.norm.in_row is not None and int((r.ya != r.ign).sum())
    if padded:
        pad, n_pad = r.padded()
        rows = r.run([pad], n_pad, GATE)
        twins.append((rows, r.run([_flip(pad)], 1, GATE)))
    floors = _floors(twins)
    if several:  # first: a term off by a count of the case is named by its factor
        _big_batch(t, a, big, floors)
    # a term over tokens on a window without a valid target: w·L is 0 (its L is NaN); a row mean's rows still count
    wa, wb, wab = (t.weight(x, y) if r.ign is None or t.norm.in_row is None or r.count(y) else 0.0
                   for x, y in ((r.xa, r.ya), (r.xb, r.yb), union))
    packed = _packed_rows(t, r.xa, r.ya) + _packed_rows(t, r.xb, r.yb)
    t.extra = dict(weights=(wa, wb), floor64=floors[0], packed_rows=packed,
                   **({} if r.ign is None else dict(valid=(r.count(r.ya), r.count(r.yb)))))
    windows = [((r.xa, r.ya), a), ((r.xb, r.yb), b)]
    counts = f"A ({wa:g} {t.norm.weight}) and B ({wb:g})" if t.norm.weight != "1" else "A and B (a sum: weight 1)"
    head = f"additivity over windows {counts}, at the same parameters: w_A·L_A + w_B·L_B vs w_AB·L_AB"
    t.adds_up(head, [(wa, a), (wb, b)], ab, wab, floors,
              f"the windows' losses {'weighted by ' + t.norm.weight if t.norm.weight != '1' else 'summed'} do not add "
              f"up to the union's",
              fit=_fits(t, windows, union, ab, floors[0]))
    if padded:
        wp = t.weight(*pad)
        head = (f"padding: window A ({wa:g} {t.norm.weight}) plus {case.effective_batch} rows without a valid target, "
                f"inside every micro-batch (w → {wp:g}): w_A·L_A vs w_A+P·L_A+P")
        why = ("rows without a valid target changed the result by other than the declared weight"
               + (": padding is counted" if not t.norm.padding_counts else ": empty sequences must count"))
        t.adds_up(head, [(wa, a)], rows, wp, floors, why)
    if padded:
        _one_sequence(t, floors)


def _one_sequence(t: _Term, floors: tuple) -> None:
    """The first row of A with a sequence of ≥ 2 valid targets (_sequence_to_halve), as three one-row windows: its
    first half, its second half, and whole (the in-row weight of the normaliser)."""
    r, ign = t.r, t.r.ign
    for i in range(r.ya.shape[0]):
        x, y = r.xa[i:i + 1], r.ya[i:i + 1]
        picked = _sequence_to_halve(t, x, y)
        if picked is not None:
            break
    else:
        return
    within, where = picked
    t.extra.update(halved=f"row {i} of window A{where}", halved_packed=bool(where))  # where "": a row of one sequence
    first, second = _halves(y, ign, within)
    runs = [r.run([(x, h)], 1, GATE) for h in (first, second, y)]
    n = [float(((h != ign) & within).sum()) for h in (first, second, y)]
    w = n if t.norm.in_row == "valid" else [1.0, 1.0, 1.0]
    head = (f"one sequence (row {i} of window A{where}, {int(n[2])} valid targets) as its two halves ({int(n[0])} + "
            f"{int(n[1])}): " + ("n_1·L_1 + n_2·L_2 vs n·L" if t.norm.in_row == "valid" else "L_1 + L_2 vs L"))
    why, hint = _halves_why(t, [r.losses[0] for r in runs], n, floors[0])
    t.adds_up(head, [(w[0], runs[0]), (w[1], runs[1])], runs[2], w[2], floors, why, hint=hint)


def _halves_why(t: _Term, losses: list, n: list, floor: float) -> tuple[str, str | None]:
    """(why, hint) of a failed halves check: a normaliser where the halves' losses fit the other in-row weights
    (valid counts or plainly); where they fit neither, also the input: the check masks a sequence's head, and only a
    model whose input is the same whichever targets are masked can be judged so (docs/design/numerics.md)."""
    valid = "by their valid counts: the term does not divide each sequence by its own length"
    plain = "plainly: the term divides a sequence by its own length where a constant is declared"
    declared, own, other = (valid, n, [1.0] * 3) if t.norm.in_row == "valid" else (plain, [1.0] * 3, n)

    def fits(w) -> bool:
        parts, whole = [w[0] * losses[0], w[1] * losses[1]], w[2] * losses[2]
        kappa = sum(map(abs, parts)) / (abs(sum(parts)) or 1.0)
        return abs(sum(parts) - whole) <= bound64(floor, kappa) * abs(whole)  # also False on NaN

    if fits(own) or fits(other):  # the losses fit a normaliser: the declared one (a gradient fails) or the other
        return "a sequence's halves do not add up " + declared, None
    count = "its own length" if t.norm.in_row == "valid" else "the declared constant"
    return (f"a sequence's halves add up neither by their valid counts nor plainly: the term does not divide each "
            f"sequence by {count}, or the model's input changes with which targets are masked (this check masks the "
            f"first half: ids, positions or an attention mask taken from the targets change what the second half "
            f"sees)", f"make the term {t.norm.means}, and feed the model the same input whatever targets are "
                      f"ignore_index: a masked target leaves the loss, nothing else (verify.data.unpack_rollouts "
                      f"keeps every id)")


def _big_batch(t: _Term, a: Trace, big: Trace, floors: tuple) -> None:
    overall, per = floors
    got, want = a.losses[0], big.losses[0]
    why = f"the term at {t.case.accum_steps} micro-steps is not the big batch's" + factor_text(got, want, t.case)
    if not (got != got and want != want):  # both NaN: neither run holds a valid target of the term
        t.check(f"window A at N={t.case.accum_steps} vs the big batch (step-0 loss {got:.6g} vs {want:.6g})",
                abs(got - want) / (abs(want) or 1.0), overall, 1.0, why)
    whole = whole_norm(big.grads0)
    for name in sorted(set(a.grads0) | set(big.grads0)):
        zero = _zeros_like_any([a, big], name)
        want = big.grads0.get(name, zero)
        t.check(f"window A at N={t.case.accum_steps} vs the big batch, gradient of {name!r}"
                f"{scale_note(want, whole, overall)}", param_err(a.grads0.get(name, zero), want, whole, overall),
                per.get(name, overall), 1.0, why)


def _per_micro(t: _Term, N: int) -> None:
    """A per-micro-batch term: window A at N = the mean over its micro-batches of each one alone (accum_steps=1)."""
    r = t.r
    a = r.run([(r.xa, r.ya)], N, GATE)
    blocks = [r.run([xy], 1, GATE) for xy in split(r.xa, r.ya, N)]
    floors = _floors([(blocks[0], r.run([_flip(split(r.xa, r.ya, N)[0])], 1, GATE))])  # a twin of one micro-batch
    head = f"per micro-batch: window A at N={N} vs the mean of its {N} micro-batches, each alone"
    t.adds_up(head, [(1.0 / N, b) for b in blocks], a, 1.0, floors,
              "the term is not each micro-batch's own value averaged over the micro-steps (declared per_micro)")


def normaliser_job(adapter, case: Case, device: str) -> GateResult:
    obj = objective_of(adapter)
    several = obj.split
    worst, ratio, extra, unjudged = "", 0.0, {}, []
    for name, kind in obj.terms.items():
        t = _Term(adapter, case, device, name, kind, several)
        _term_job(t, case.accum_steps)
        t.finish()
        extra = extra or t.extra  # the first term's counts (the one term of most objectives)
        unjudged += [u for u in t.unjudged if u not in unjudged]
        if t.ratio >= ratio:
            worst, ratio = t.worst, t.ratio
    if unjudged:  # the report's "Not checked" lines say it (report.coverage)
        what = " and ".join([", ".join(unjudged[:-1]), unjudged[-1]] if unjudged[1:] else unjudged)
        extra["unjudged"] = UNJUDGED.format(what=what + (" checks" if unjudged[1:] else " check"))
    return GateResult(GATE, case, worst, ratio, terms=dict(obj.terms), **extra)
