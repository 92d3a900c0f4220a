"""A zoo trainer's choices, drawn from its seed: `draw(seed) -> Recipe`, the same Recipe for the same seed on
every machine (random.Random(seed), choices drawn in a fixed order). Each choice is independent where the
combination is correct; where it is not, the draw avoids it (e.g. a per-micro-batch mean is exact only when
every micro-batch holds the same units, so a token mean always divides at the boundary). docs/design/zoo.md.
"""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field

from benchmarks.zoo.models import Arch, SEQ
from benchmarks.zoo.optim import OPTIMIZERS, SCHEDULES

LAYOUTS = {"single": 30, "ddp": 17, "manual": 17, "uneven": 9, "uneven_ddp": 5, "tp": 6, "pp": 4, "dp_pp": 4,
           "cp": 8}  # weights: meshes are the most expensive, a share
FAMILIES = {"mlp": 16, "cnn": 10, "lm": 28, "moe": 12, "policy": 18, "packed": 16}
DATA_PARALLEL = ("ddp", "manual", "uneven", "uneven_ddp")
MESHES = ("tp", "pp", "dp_pp", "cp")
ROW_LOSSES = ("mse", "row_ce", "row_mean")  # every micro-batch holds the same units: its rows


@dataclass(frozen=True)
class Recipe:
    seed: int
    layout: str  # single, ddp (torch DDP, no_sync), manual (one boundary all-reduce), uneven[_ddp], tp, pp, dp_pp, cp
    family: str  # mlp, cnn, lm, moe, policy, packed
    data: str  # the verify.data helper: regression, classification, tokens, causal_lm, rollouts, packed
    loss: str  # mse, row_ce, token_mean, row_mean; policy: seq_mean, token_mean, seq_sum; packed: doc_mean, token_mean
    arch: Arch | None = None
    kl: bool = False  # policy: a KL term to the reference policy (token_mean)
    ids: str = "raw"  # policy: token ids from the raw inputs, or from verify.data.unpack_rollouts
    aux: str = "none"  # moe: z (router z-loss, a row mean) or balance (Switch's, per micro-batch, declared)
    optimizer: str = "sgd"
    schedule: str = "none"
    clip: float | None = None  # max_norm of clip_grad_norm_, or None
    drawn_clip: bool = False  # the clip is an option the gates draw (on / off), and unclipped= is declared
    precisions: tuple = ("fp32",)
    divide: str = "mean"  # mean (÷ units and N per micro-step), boundary (Σ, ÷ the window's count), optimizer
    metrics: tuple = ()
    plain: bool = False
    partial: bool = False  # partial_grads()
    pipeline: str = ""  # pp, dp_pp: gpipe, 1f1b or interleaved
    overflow_rows: bool = False  # fp16 on floating inputs: Adapter(overflow=verify.data.overflow_rows)
    short_window: bool = False  # one process: a run may end with a short window (Adapter(short_last_window=True))
    notes: tuple = field(default=(), compare=False)

    @property
    def terms(self) -> tuple[str, ...]:
        if self.family == "moe":
            return ("lm", "aux")
        if self.family == "policy":
            return ("policy", "kl") if self.kl else ("policy",)
        return ("loss",)

    @property
    def token_weighted(self) -> bool:
        """Declares an ignore_index: the harness pads its targets."""
        return self.family in ("moe", "policy", "packed") or self.loss == "token_mean"

    @property
    def per_micro(self) -> tuple[str, ...]:
        return ("aux",) if self.aux == "balance" else ()

    def fixed_units(self, terms=None) -> bool:
        """Whether every micro-batch holds the same units of each term (rows): a per-micro-step mean is exact."""
        kinds = {"loss": self.loss, "lm": "token_mean", "aux": "row_mean", "kl": "token_mean",
                 "policy": self.loss}
        return all(kinds[t] in ROW_LOSSES + ("seq_mean", "seq_sum") for t in (terms or self.terms))

    def as_dict(self) -> dict:
        d = asdict(self)
        d.pop("notes")
        d["arch"] = asdict(self.arch) if self.arch else None
        d["precisions"] = list(self.precisions)
        d["metrics"] = list(self.metrics)
        return d

    def short(self) -> str:
        a = self.arch
        arch = (f"[{a.bias} bias, {a.positions}{', tied' if a.tied else ''}, {a.norm}norm]" if a else "")
        extra = (f"+kl" if self.kl else "") + (f" ids={self.ids}" if self.family == "policy" else "") + \
                (f" aux={self.aux}" if self.aux != "none" else "")
        return (f"{self.family}{arch} {self.data}/{self.loss}{extra} · {self.optimizer} {self.schedule} "
                f"clip={'drawn' if self.drawn_clip else self.clip} · {'/'.join(self.precisions)} · {self.layout} "
                f"{' ' + self.pipeline if self.pipeline else ''} ÷{self.divide}{' plain' if self.plain else ''}{' partial' if self.partial else ''}"
                f"{' metrics=' + ','.join(self.metrics) if self.metrics else ''}{' short-last-window' if self.short_window else ''}")


def _pick(rng: random.Random, weights: dict):
    keys = list(weights)
    return rng.choices(keys, weights=[weights[k] for k in keys])[0]


def draw(seed: int) -> Recipe:
    rng = random.Random(int(seed))
    layout = _pick(rng, LAYOUTS)
    if layout in ("tp", "pp", "dp_pp"):
        family = "mlp"
    elif layout == "cp":
        family = "lm"
    else:
        family = _pick(rng, FAMILIES)
    if layout in ("ddp", "uneven_ddp") and family == "moe":
        family = "lm"  # torch DDP reduces one .grad: a second term with another count has nowhere to go
    data, loss, arch, kl, ids, aux = _task(rng, family, layout)
    r = dict(seed=int(seed), layout=layout, family=family, data=data, loss=loss, arch=arch, kl=kl, ids=ids, aux=aux)
    mesh = layout in MESHES
    r["optimizer"] = rng.choice(("sgd", "momentum", "adamw") if layout == "tp" else OPTIMIZERS)
    r["schedule"] = rng.choice(SCHEDULES)
    r["clip"] = rng.choice((None, None, 0.5, 1.0, 5.0))
    r["drawn_clip"] = not mesh and r["clip"] is not None and rng.random() < 0.3
    low = [] if mesh else rng.choice(([], [], ["bf16"], ["fp16"], ["bf16", "fp16"]))
    r["precisions"] = tuple(["fp32", *low])
    probe = Recipe(**r)
    styles = ["boundary"]
    if probe.fixed_units() and not layout.startswith("uneven"):
        styles.append("mean")
    if len(probe.terms) == 1 and not mesh:
        styles.append("optimizer")
    if layout in ("ddp", "uneven_ddp") and len(probe.terms) > 1:
        styles = [s for s in styles if s == "mean"]
    r["divide"] = "mean" if mesh and probe.fixed_units() else "boundary" if mesh else rng.choice(styles)
    if r["divide"] == "optimizer" and r["clip"] is not None:  # the guide: a trainer that clips where the gradient
        r["drawn_clip"] = True  # is read (grads_from="optimizer") declares unclipped=, or a ×N before the clip hides
    if rng.random() < 0.5:
        names = ["loss", "grad_norm", "lr", "tokens" if probe.token_weighted else "rows"]
        if r["clip"] is not None and not r["drawn_clip"]:
            names.append("clip_coef")
        r["metrics"] = tuple(n for n in names if rng.random() < 0.75) or ("loss",)
    r["plain"] = r["divide"] == "mean" and layout in ("single", "ddp", "manual") and rng.random() < 0.5
    r["partial"] = (layout == "single" and r["divide"] != "optimizer" and len(probe.terms) == 1
                    and rng.random() < 0.3)
    r["pipeline"] = rng.choice(("gpipe", "1f1b", "interleaved")) if layout in ("pp", "dp_pp") else ""
    r["overflow_rows"] = "fp16" in r["precisions"] and family in ("mlp", "cnn") and rng.random() < 0.5
    r["short_window"] = layout == "single" and rng.random() < 0.4  # drawn last: the earlier choices keep their seeds' values
    return Recipe(**r)


def _task(rng, family: str, layout: str):
    """(data, loss, arch, kl, ids, aux) of one family."""
    kl, ids, aux, arch = False, "raw", "none", None
    if family in ("mlp", "cnn"):
        data = {"pp": "regression", "dp_pp": "regression", "tp": "classification"}.get(layout) or \
            rng.choice(("regression", "classification"))
        return data, "mse" if data == "regression" else "row_ce", None, kl, ids, aux
    arch = Arch(bias=rng.choice(("none", "all", "qkv")), positions=rng.choice(("learned", "rotary")),
                tied=rng.random() < 0.3, norm=rng.choice(("layer", "rms")), moe=family == "moe", seq=SEQ)
    if family == "lm":
        data = "tokens" if layout == "cp" else rng.choice(("tokens", "tokens", "causal_lm"))
        loss = "token_mean" if data == "causal_lm" or layout == "cp" else rng.choice(("token_mean", "row_mean"))
        if data == "causal_lm":
            arch = Arch(**{**asdict(arch), "seq": SEQ + 1})
        return data, loss, arch, kl, ids, aux
    if family == "moe":
        return "tokens", "token_mean", arch, kl, ids, rng.choice(("z", "balance"))
    if family == "policy":
        loss = rng.choice(("seq_mean", "token_mean", "seq_sum"))
        kl = layout not in ("ddp", "uneven_ddp") and rng.random() < 0.4
        return "rollouts", loss, arch, kl, rng.choice(("raw", "helper")), aux
    return "packed", rng.choice(("doc_mean", "token_mean")), arch, kl, ids, aux
