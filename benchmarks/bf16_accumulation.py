"""bf16 gradient accumulation: how its error grows with N, and where the harness starts rejecting it.

    python -m benchmarks.bf16_accumulation [--out reports] [--max-n 256] [--model mini] [--seeds 5]

A benchmark of numerics, not of speed, and not a test. For N = 1, 2, 4, ..., --max-n micro-steps of B rows
(default B = 1; one fixed init seed and data seed), the step-0 boundary gradient is computed four ways on
the same N·B rows:

    (a) fp32 accumulation   xtrain's AccumTrainer, bf16 autocast forward, gradients summed in fp32 .grad
    (b) bf16 buffer         verify.adapters.broken_numerics.Bf16AccumulationBuffer: each micro-step's
                            gradient summed into a bf16 buffer (DeepSpeed #1800 / #2768; why Megatron keeps
                            fp32 main grads)
    (c) float64 big batch   AccumTrainer at N = 1 in float64 on all N·B rows: the reference
    (d) bf16 big batch      the same trainer at N = 1 in bf16 autocast: the rounding the gate allows for

and judged by the harness's own policy (verify/gates/tolerance.py): per parameter,
err(acc) ≤ C·max(err(big), err(big, all parameters)) + FLOOR·κ (tolerance.bound), with big = (d) OF THE SAME TRAINER (for (b): Bf16AccumulationBuffer at
N = 1, i.e. (d) rounded to bf16 once) and κ the sum's condition number from verify.case.block_grads. Each
row also runs the gate itself, check_equivalence, on both adapters (xtrain's verify.adapters.xtrain.single
and broken_numerics.bf16_accumulation_buffer), and the benchmark checks that its own worst error/bound
ratio agrees with the gate's verdict (exit 1 if not).

--seeds K repeats the measurement (without the gate calls) for K-1 more (init, data) seed pairs, so the
report shows how much the N at which the bound is crossed depends on the draw.

Writes OUT/bf16-accumulation.json (verify._meta header) and OUT/bf16-accumulation.png (log-log error
vs N; error/bound ratio vs N), all or none.
"""
from __future__ import annotations

import io
import json
import math
import os
import sys
import time

import torch

from xtrain_core.cli import Parser, UsageError, fail, int_at_least, positive_int
from xtrain_core.config import PRESETS, ModelConfig

from verify._meta import atomic_write_all, header
from verify.adapters import broken_numerics, xtrain
from verify.case import Case, block_grads, drive
from verify.gates.single import check_equivalence
from verify.gates.tolerance import (C, FLOOR, GateFailure, bound, condition, needs_kappa, overall_error, rel_err,
                                    step0_checks)

KIND = "bf16-accumulation"
MODELS = {"mini": ModelConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32), **PRESETS}
LOSS = "loss of step 0"  # the gate's name for the loss check (verify/gates/tolerance.py: Judge.step0)
XTRAIN, BUFFER = xtrain.single, broken_numerics.bf16_accumulation_buffer


def _ratios(acc, big, ref, kappa: dict, N: int) -> dict:
    """error / bound of every check the gate makes (tolerance.step0_checks: the step-0 loss, each gradient),
    as the gate reports it: κ only where the check needs it (tolerance.needs_kappa), bf16's term over N blocks."""
    return {LOSS if name is None else name: a / bound(b, k if needs_kappa(a, b, o) else 1.0, o, "bf16", N)
            for _, name, a, b, k, o in step0_checks(acc, big, ref, kappa, "bf16")}


def _worst(ratios: dict) -> tuple[str, float]:
    name = max(ratios, key=lambda k: ratios[k])
    return name, ratios[name]


def measure(opts, N: int, B: int, seed: int, data_seed: int, *, gate: bool) -> dict:
    """One N: the four gradients, their errors vs the float64 big batch, the policy's ratios, and (gate=True)
    the gate's verdict on both adapters."""
    t0 = time.perf_counter()
    case = Case(accum_steps=N, micro_batch=B, steps=1, options=opts, precision="bf16", seed=seed,
                data_seed=data_seed)
    batches = case.batches(XTRAIN)

    def run(adapter, n, dtype):
        return drive(adapter(case.spec(accum_steps=n, dtype=dtype)), batches, n, dtype=dtype, gate=KIND)

    ref = run(XTRAIN, 1, torch.float64)  # (c)
    big = run(XTRAIN, 1, torch.float32)  # (d): bf16 autocast (case.precision), fp32 params
    big_buf = run(BUFFER, 1, torch.float32)  # (d) for the buffer trainer: its N = 1 rounds (d) to bf16 once
    acc = run(XTRAIN, N, torch.float32)  # (a)
    buf = run(BUFFER, N, torch.float32)  # (b)
    # κ as the gate computes it. The blocks are float64 runs (no autocast), where the buffer trainer IS
    # xtrain's, so one set serves both adapters.
    kappa = condition(block_grads(XTRAIN, case, "cpu") if N > 1 else [], ref.grads0)
    ra, rb = _ratios(acc, big, ref, kappa, N), _ratios(buf, big_buf, ref, kappa, N)
    rbx = _ratios(buf, big, ref, kappa, N)  # (b) held to xtrain's big batch (d) instead of its own
    wa, wb, wbx = _worst(ra), _worst(rb), _worst(rbx)
    row = dict(N=N, rows=N * B, seed=seed, data_seed=data_seed,
               err_fp32_accum=overall_error(acc.grads0, ref.grads0), err_bf16_buffer=overall_error(buf.grads0, ref.grads0),
               err_big_bf16=overall_error(big.grads0, ref.grads0), err_big_bf16_buffer=overall_error(big_buf.grads0, ref.grads0),
               overall_big_bf16_buffer=overall_error(big_buf.grads0, ref.grads0),
               worst_fp32_accum=dict(check=wa[0], ratio=wa[1]), worst_bf16_buffer=dict(check=wb[0], ratio=wb[1]),
               worst_bf16_buffer_vs_d=dict(check=wbx[0], ratio=wbx[1]))
    if gate:
        per = {}
        for name, g in ref.grads0.items():
            per[name] = dict(kappa=max(1.0, kappa.get(name, 1.0)), err_big_bf16=rel_err(big.grads0[name], g),
                             err_big_bf16_buffer=rel_err(big_buf.grads0[name], g),
                             err_fp32_accum=rel_err(acc.grads0[name], g), err_bf16_buffer=rel_err(buf.grads0[name], g),
                             ratio_fp32_accum=ra[name], ratio_bf16_buffer=rb[name],
                             ratio_bf16_buffer_vs_d=rbx[name])
        row["per_parameter"] = per
        row["ratio_loss"] = dict(fp32_accum=ra[LOSS], bf16_buffer=rb[LOSS])
        row["gate_xtrain"], row["gate_bf16_buffer"] = _gate(XTRAIN, case, wa[1]), _gate(BUFFER, case, wb[1])
    row["seconds"] = time.perf_counter() - t0
    return row


def _gate(adapter, case, ratio: float) -> dict:
    """check_equivalence's verdict, and whether the ratio computed here agrees with it: a pass must report
    the same worst ratio (≤ 1), a rejection must come with a ratio > 1."""
    try:
        r = check_equivalence(adapter, case)
    except GateFailure as e:
        return dict(verdict="rejected", message=str(e), agrees=ratio > 1.0)
    return dict(verdict="passed", worst=r.worst, ratio=r.ratio,
                agrees=ratio <= 1.0 and math.isclose(r.ratio, ratio, rel_tol=1e-9, abs_tol=1e-12))


# -- output ----------------------------------------------------------------------------------------------

def _fmt_row(r) -> str:
    ga, gb = r["gate_xtrain"]["verdict"], r["gate_bf16_buffer"]["verdict"]
    wa, wb = r["worst_fp32_accum"], r["worst_bf16_buffer"]
    return (f"{r['N']:>4} {r['err_big_bf16']:>10.3e} {r['err_fp32_accum']:>10.3e} {r['err_bf16_buffer']:>10.3e} "
            f"{wa['ratio']:>7.3f} {wb['ratio']:>7.3f}  {wb['check']:<20} {r['worst_bf16_buffer_vs_d']['ratio']:>9.3f} "
            f"{ga:>7} {gb:>9} {r['seconds']:>6.1f}")


HEAD = (f"{'N':>4} {'err (d)':>10} {'err (a)':>10} {'err (b)':>10} {'ratio a':>7} {'ratio b':>7}  "
        f"{'worst check of (b)':<20} {'b vs (d)':>9} {'gate a':>7} {'gate b':>9} {'s':>6}")


def render_png(doc) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["rows"]
    ns = [r["N"] for r in rows]
    # The parameter the gate would name for the buffer at the largest N: its own error and its bound.
    top = rows[-1]["worst_bf16_buffer"]["check"]
    if top == LOSS:
        top = max(rows[-1]["per_parameter"], key=lambda k: rows[-1]["per_parameter"][k]["ratio_bf16_buffer"])
    per = [r["per_parameter"][top] for r in rows]
    bound_ = [bound(p["err_big_bf16_buffer"], p["kappa"], r["overall_big_bf16_buffer"], "bf16", r["N"])
              for p, r in zip(per, rows)]

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8), constrained_layout=True)
    blue, red, grey = "tab:blue", "tab:red", "0.45"
    ax1.plot(ns, [r["err_big_bf16"] for r in rows], ":", color=grey, lw=1.8, zorder=3,
             label="(d) bf16-autocast big batch, N = 1")
    ax1.plot(ns, [r["err_fp32_accum"] for r in rows], "-o", color=blue, ms=5,
             label="(a) xtrain: fp32 accumulation")
    ax1.plot(ns, [r["err_bf16_buffer"] for r in rows], "-s", color=red, ms=5,
             label="(b) bf16 accumulation buffer")
    ax1.plot(ns, [p["err_bf16_buffer"] for p in per], "--^", color=red, ms=4, lw=1, alpha=0.7,
             label=f"(b), {top} only")
    ax1.plot(ns, bound_, "-", color="k", lw=1.2,
             label=f"gate bound for (b), {top}:\nC·max(err(big), err(big, all)) + FLOOR·κ")
    ax1.set_ylabel("relative error of the step-0 gradient vs float64 (c)")
    ax1.set_title("whole gradient (all parameters flattened), and the gate's worst parameter", fontsize=9.5)

    spread = doc.get("seed_spread") or []
    for key, color, marker, label in (("worst_fp32_accum", blue, "o", "(a) xtrain: fp32 accumulation"),
                                      ("worst_bf16_buffer", red, "s", "(b) bf16 accumulation buffer")):
        ax2.plot(ns, [r[key]["ratio"] for r in rows], "-" + marker, color=color, ms=5, label=label)
        if len(spread) > 1:
            lo = [min(s[key][i] for s in spread) for i in range(len(ns))]
            hi = [max(s[key][i] for s in spread) for i in range(len(ns))]
            ax2.fill_between(ns, lo, hi, color=color, alpha=0.15, lw=0,
                             label=f"shaded: min–max over {len(spread)} (init, data) seed pairs"
                             if key == "worst_bf16_buffer" else None)
    ax2.plot(ns, [r["worst_bf16_buffer_vs_d"]["ratio"] for r in rows], "--", color=red, lw=1, alpha=0.8,
             label="(b) held to (d), xtrain's big batch, not to its own")
    rej = [r for r in rows if r["gate_bf16_buffer"]["verdict"] == "rejected"]
    if rej:
        ax2.plot([r["N"] for r in rej], [r["worst_bf16_buffer"]["ratio"] for r in rej], "x", color="k", ms=11,
                 mew=2, ls="none", label="check_equivalence rejects (b)")
    ax2.axhline(1.0, color="k", lw=1.2, ls="--", label="bound (error / bound = 1)")
    ax2.set_ylabel("worst error / bound over the gate's checks")
    ax2.set_title("the gate's margin: error / bound, worst check", fontsize=9.5)

    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_xlabel(f"N (micro-steps of B = {doc['settings']['micro_batch']} row summed into one gradient)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7.5, loc="upper left", framealpha=0.9)
    # room above the data for the legends (upper left, where every curve starts low)
    lo, hi = ax1.get_ylim()
    ax1.set_ylim(lo, hi * (hi / lo) ** 0.6)
    lo, hi = ax2.get_ylim()
    ax2.set_ylim(min(lo, 0.08), max(hi, 1.5) * 4)
    for ax in (ax1, ax2):  # 1-2-5 ticks: a log axis spanning ~2 decades gets too few labels otherwise
        lo, hi = ax.get_ylim()
        ticks = [m * 10.0 ** e for e in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
                 for m in (1, 2, 5) if lo <= m * 10.0 ** e <= hi]
        ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
        ax.minorticks_off()
    s = doc["settings"]
    m = s["model"]
    fig.suptitle(f"bf16 gradient accumulation, step 0: GPT L{m['n_layer']} d{m['d_model']} h{m['n_head']} "
                 f"V{m['vocab_size']}, S={s['seq_len']}, B={s['micro_batch']}, seed {s['seed']}, data seed "
                 f"{s['data_seed']}; CPU bf16 autocast; C={C:g}, FLOOR=8·eps32", fontsize=10.5)
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=110)
    plt.close(fig)
    return out.getvalue()


def main(argv=None):
    p = Parser(prog="benchmarks.bf16_accumulation",
               description="error of bf16 gradient accumulation vs N, and the harness gate's verdict")
    p.add_argument("--out", default="reports")
    p.add_argument("--max-n", type=positive_int, default=256, help="largest N (powers of two from 1)")
    p.add_argument("--model", choices=sorted(MODELS), default="mini",
                   help="mini: GPT L2 d32 h2 V64 (default); or a CLI preset")
    p.add_argument("--seq-len", type=positive_int, default=16)
    p.add_argument("--micro-batch", type=positive_int, default=1)
    p.add_argument("--seed", type=int_at_least(0), default=0, help="model init seed")
    p.add_argument("--data-seed", type=int_at_least(0), default=0)
    p.add_argument("--seeds", type=positive_int, default=5,
                   help="(init, data) seed pairs for the spread: the given one and K-1 more (gate on the first only)")
    p.add_argument("--threads", type=positive_int, default=1, help="torch intra-op threads")
    a = p.parse_args(argv)
    try:
        cfg = MODELS[a.model]
        if a.seq_len > cfg.seq_len:
            raise UsageError(f"--seq-len {a.seq_len} exceeds --model {a.model}'s limit of {cfg.seq_len}")
    except UsageError as e:
        fail(str(e))
    torch.set_num_threads(a.threads)
    opts = xtrain.XtrainOptions(model=cfg, seq_len=a.seq_len)
    ns = [1 << k for k in range(a.max_n.bit_length()) if 1 << k <= a.max_n]
    t0 = time.perf_counter()

    print(f"{KIND}: {opts.describe()}, B={a.micro_batch}, seed {a.seed}, data seed {a.data_seed}, "
          f"{torch.get_num_threads()} thread(s)")
    print("errors: relative, whole gradient, vs the float64 big batch (c); ratio: worst error/bound of the gate's "
          "checks; gate: check_equivalence")
    print(HEAD, flush=True)
    rows = []
    for N in ns:
        rows.append(measure(opts, N, a.micro_batch, a.seed, a.data_seed, gate=True))
        print(_fmt_row(rows[-1]), flush=True)

    spread = [dict(seed=a.seed, data_seed=a.data_seed,
                   worst_fp32_accum=[r["worst_fp32_accum"]["ratio"] for r in rows],
                   worst_bf16_buffer=[r["worst_bf16_buffer"]["ratio"] for r in rows],
                   err_fp32_accum=[r["err_fp32_accum"] for r in rows],
                   err_bf16_buffer=[r["err_bf16_buffer"] for r in rows])]
    for k in range(1, a.seeds):
        s, d = a.seed + k, a.data_seed + k
        more = [measure(opts, N, a.micro_batch, s, d, gate=False) for N in ns]
        spread.append(dict(seed=s, data_seed=d, worst_fp32_accum=[r["worst_fp32_accum"]["ratio"] for r in more],
                           worst_bf16_buffer=[r["worst_bf16_buffer"]["ratio"] for r in more],
                           err_fp32_accum=[r["err_fp32_accum"] for r in more],
                           err_bf16_buffer=[r["err_bf16_buffer"] for r in more]))
    for s in spread:
        over = [n for n, x in zip(ns, s["worst_bf16_buffer"]) if x > 1.0]
        s["bf16_buffer_first_over_bound"] = over[0] if over else None
        over = [n for n, x in zip(ns, s["worst_fp32_accum"]) if x > 1.0]
        s["fp32_accum_first_over_bound"] = over[0] if over else None

    disagree = [(r["N"], who) for r in rows for who in ("gate_xtrain", "gate_bf16_buffer") if not r[who]["agrees"]]
    rejected = [r["N"] for r in rows if r["gate_bf16_buffer"]["verdict"] == "rejected"]
    summary = dict(
        bf16_buffer_first_rejected_n=rejected[0] if rejected else None,
        bf16_buffer_rejected_ns=rejected,
        xtrain_passes_every_n=all(r["gate_xtrain"]["verdict"] == "passed" for r in rows),
        xtrain_worst_ratio=max(r["worst_fp32_accum"]["ratio"] for r in rows),
        first_over_bound_by_seed={f"{s['seed']}/{s['data_seed']}": s["bf16_buffer_first_over_bound"] for s in spread},
        ratio_agrees_with_gate=not disagree,
        elapsed_s=time.perf_counter() - t0)
    doc = dict(**header(KIND),
               settings=dict(model_name=a.model, model=dict(vocab_size=cfg.vocab_size, seq_len=cfg.seq_len,
                                                            n_layer=cfg.n_layer, n_head=cfg.n_head,
                                                            d_model=cfg.d_model, n_params=cfg.n_params),
                             seq_len=a.seq_len, micro_batch=a.micro_batch, seed=a.seed, data_seed=a.data_seed,
                             Ns=ns, precision="bf16", device="cpu", C=C, FLOOR=FLOOR, seeds=a.seeds,
                             threads=torch.get_num_threads(), optim=repr(opts.optim), loss_norm=opts.loss_norm),
               legend={"a": "fp32_accum: xtrain AccumTrainer, bf16 autocast, fp32 .grad accumulation",
                       "b": "bf16_buffer: broken_numerics.Bf16AccumulationBuffer",
                       "c": "float64 big batch (AccumTrainer N=1, float64): the reference of every err",
                       "d": "big_bf16: AccumTrainer N=1, bf16 autocast (big_bf16_buffer: the buffer trainer at "
                            "N=1, the gate's big batch for (b))",
                       "ratio": "error / (C·err(big) + FLOOR·max(1, κ)) per check (κ where the gate uses it: "
                                "tolerance.needs_kappa), worst over the step-0 loss "
                                "and every parameter's gradient, big = the same trainer at N=1 (the gate's policy; "
                                "*_vs_d: the buffer held to xtrain's big batch (d) instead)",
                       "kappa": "max(1, κ) as the bound uses it (κ from block_grads; none at N=1)"},
               summary=summary, rows=rows, seed_spread=spread)
    files = {os.path.join(a.out, f"{KIND}.json"): json.dumps(doc, indent=1) + "\n"}
    try:
        files[os.path.join(a.out, f"{KIND}.png")] = render_png(doc)
    except ImportError:
        print(f"{KIND}: matplotlib is not installed; writing the report without the plot", file=sys.stderr)
    written = atomic_write_all(files)

    first = summary["bf16_buffer_first_rejected_n"]
    print(f"\nbf16 buffer: the gate rejects it from N = {first} (rejected at {rejected})" if first else
          f"\nbf16 buffer: the gate passes it at every N ≤ {ns[-1]}")
    print(f"xtrain fp32 accumulation: {'passes' if summary['xtrain_passes_every_n'] else 'FAILS'} at every N, "
          f"worst ratio {summary['xtrain_worst_ratio']:.3f}")
    if a.seeds > 1:
        print("first N over the bound for the buffer, by (init seed/data seed): " +
              ", ".join(f"{k}: {v or f'none ≤ {ns[-1]}'}" for k, v in summary["first_over_bound_by_seed"].items()))
    print(f"wrote {', '.join(written)} in {summary['elapsed_s']:.1f} s")
    if disagree:
        print(f"{KIND}: error: the ratio computed here disagrees with check_equivalence at {disagree}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
