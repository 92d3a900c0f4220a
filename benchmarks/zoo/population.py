"""The zoo as importable adapters: `benchmarks.zoo.population:t<seed>` is the honest trainer of that seed,
built from recipe.draw(seed) with exactly the declarations it needs, so the plugin, the self-test and every
pool rank import the same trainer by name:

    pytest --pyargs verify --verify-trainer benchmarks.zoo.population:t1234
    python -m verify.selftest --verify-trainer benchmarks.zoo.population:t1234

A variant changes choices of the seed's recipe, for narrowing a failure down: t1234__clip=None__divide=boundary
(values: None, True, False, numbers without a dot such as 5e-1, or words).
"""
from __future__ import annotations

import dataclasses
import re
import sys
from dataclasses import dataclass

import verify
from benchmarks.zoo import losses, mesh, trainer
from benchmarks.zoo.models import CLASSES, FEATURES, OUTPUTS, SEQ, VOCAB
from benchmarks.zoo.recipe import Recipe, draw

MODULE = __name__
NAME = re.compile(r"t(\d+)((?:__\w+=[\w+-]+)*)$")


@dataclass(frozen=True)
class Options:
    """The knobs the gates draw for a recipe with a drawn clip: clipping on (at the recipe's max_norm) or off."""

    clip: float | None = None


def no_clip(options):
    return dataclasses.replace(options or Options(), clip=None)


def clip_of(options):
    return (options or Options()).clip


def data_of(r: Recipe):
    return {"regression": lambda: verify.data.regression(features=FEATURES, outputs=OUTPUTS),
            "classification": lambda: verify.data.classification(features=FEATURES, classes=CLASSES),
            "tokens": lambda: verify.data.tokens(vocab=VOCAB, seq_len=SEQ),
            "causal_lm": lambda: verify.data.causal_lm(vocab=VOCAB, seq_len=SEQ),
            "rollouts": lambda: verify.data.rollouts(vocab=VOCAB, prompt_len=losses.PROMPT,
                                                     completion_len=losses.COMPLETION),
            "packed": lambda: verify.data.packed(vocab=VOCAB, seq_len=SEQ, max_docs=3, ignore_index=losses.IGNORE),
            }[r.data]()


def objective_of(r: Recipe):
    """The declared objective; None where the default says it (a token mean with an ignore_index)."""
    if r.family in ("mlp", "cnn") or r.loss == "row_mean":
        return verify.Objective(terms={"loss": "row_mean"})
    if r.family == "moe":
        aux = "row_mean" if r.aux == "z" else "batch"
        return verify.Objective(terms={"lm": "token_mean", "aux": aux}, per_micro=r.per_micro)
    if r.family == "policy":
        return verify.Objective(terms={"policy": r.loss, **({"kl": "token_mean"} if r.kl else {})})
    if r.family == "packed" and r.loss == "doc_mean":
        return verify.Objective(terms={"loss": "seq_mean"}, sequences=verify.data.count_documents)
    return None


def trainer_class(r: Recipe, plain: bool = False):
    if r.layout in ("tp", "pp", "dp_pp", "cp"):
        base = {"tp": mesh.TPTrainer, "pp": mesh.PPTrainer, "dp_pp": mesh.PPTrainer, "cp": mesh.CPTrainer}[r.layout]
        return type(f"Zoo{r.seed}", (base,), {"recipe": r, "__module__": MODULE})
    bases = ((trainer.PartialSums,) if r.partial else ()) + ((trainer.LossScale,) if "fp16" in r.precisions else ())
    base = trainer.Plain if plain else trainer.Trainer
    return type(f"Zoo{r.seed}{'Plain' if plain else ''}", (*bases, base), {"recipe": r, "__module__": MODULE})


def declarations(r: Recipe) -> dict:
    """verify.adapter(...)'s keywords for the recipe: exactly what it needs."""
    d = dict(data=data_of(r), precisions=r.precisions, name=f"zoo t{r.seed}")
    if r.plain:
        d["plain"] = trainer_class(r, plain=True)
    if r.token_weighted:
        d["ignore_index"] = losses.IGNORE
    if objective_of(r) is not None:
        d["objective"] = objective_of(r)
    if r.layout in ("manual", "uneven"):
        d.update(data_parallel=True, subgroups=True)
    if r.layout in ("ddp", "uneven_ddp"):
        d.update(process_group=True, expected=verify.DDP_EXPECTED, subgroups=True)
    if r.layout.startswith("uneven"):
        d["uneven"] = True
    if r.divide == "optimizer":
        d["grads_from"] = "optimizer"
    if r.drawn_clip:
        from hypothesis import strategies as st

        d.update(options=st.builds(Options, clip=st.sampled_from([None, r.clip])), defaults=Options(r.clip),
                 unclipped=no_clip)
    if r.metrics:
        d["metrics"] = verify.Metrics(names=r.metrics, max_norm=clip_of if r.drawn_clip else r.clip)
    if r.overflow_rows:
        d["overflow"] = verify.data.overflow_rows
    if r.short_window:
        d["short_last_window"] = True
    if r.layout == "tp":
        d.update(mesh_axes=("dp", "tp"), counts=mesh.tp_counts, mesh_sizes={"tp": (2, 3, 6)})
    elif r.layout in ("pp", "dp_pp"):
        pp = (2, 3, 4) if r.pipeline == "interleaved" else (2, 3, 4, 5, 6, 7, 8)
        d.update(mesh_axes=("pp",) if r.layout == "pp" else ("dp", "pp"), mesh_sizes={"pp": pp})
    elif r.layout == "cp":
        d.update(mesh_axes=("dp", "cp"), counts=mesh.cp_counts, mesh_sizes={"cp": (2, 4, 8)})
    return d


def _value(text: str):
    if text in ("None", "True", "False"):
        return {"None": None, "True": True, "False": False}[text]
    try:
        return float(text) if any(c in text for c in "e.") and text[0].isdigit() else int(text)
    except ValueError:
        return text


def adapter_of(seed: int, changes: str = "") -> verify.Adapter:
    """The adapter of t<seed>, or of a variant: `changes` '__field=value...' replaced in its recipe."""
    fields = dict(part.split("=", 1) for part in changes.split("__") if part)
    r = dataclasses.replace(draw(seed), **{k: _value(v) for k, v in fields.items()})
    ad = verify.adapter(**declarations(r))(trainer_class(r))
    name = f"t{seed}{changes}"
    return ad.replace(ref=f"{MODULE}:{name}", name=f"zoo {name}")


def __getattr__(name: str):
    m = NAME.match(name)
    if m is None:
        raise AttributeError(f"module {MODULE!r} has no attribute {name!r} (zoo trainers are t<seed>, e.g. t1234)")
    ad = adapter_of(int(m.group(1)), m.group(2))
    globals()[name] = ad  # the adapter is a module-level name from now on (Adapter.locate finds it)
    return ad


def one_process(seed: int):
    """(t<seed>, {precision: a case of its defaults, N=3 B=2 K=1}), or None for a data-parallel trainer (its runs need
    a process group): what the reference's false-alarm benchmarks judge (benchmarks/start_zoo.py, reference_zoo.py)."""
    adapter = getattr(sys.modules[__name__], f"t{seed}")
    if adapter.process_group:
        return None
    return adapter, {p: verify.Case(accum_steps=3, micro_batch=2, steps=1, seed=seed, options=adapter.defaults,
                                    precision=p) for p in adapter.precisions}
