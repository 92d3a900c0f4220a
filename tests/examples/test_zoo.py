"""The zoo (benchmarks/zoo, docs/design/zoo.md): generated honest trainers. Its generator is reproducible from a
seed and declares what each trainer needs; a fixed-seed slice of ten one-process trainers passes the self-test's
fixed cases unwrapped while the operator drawn from its seed is killed; the runner writes its report from a clean
subprocess; the report counts a rejected honest trainer as a false alarm and an operator that survived as one."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # benchmarks/ is a folder of the repository, not part of the installed package
    sys.path.insert(0, ROOT)

from benchmarks.zoo import population, report  # noqa: E402
from benchmarks.zoo.recipe import LAYOUTS, Recipe, draw  # noqa: E402

# one process each (cheap), no known harness issue among their choices; every family and optimizer of the zoo
SLICE = (4, 28, 39, 57, 87, 165, 232, 259, 357, 412)


def test_a_seed_draws_the_same_trainer_every_time_and_the_draws_cover_every_choice():
    assert draw(1234) == draw(1234) and draw(1234).as_dict() == draw(1234).as_dict()
    drawn = [draw(s) for s in range(400)]
    for field, values in (("layout", set(LAYOUTS)), ("family", {"mlp", "cnn", "lm", "moe", "policy", "packed"}),
                          ("optimizer", {"sgd", "momentum", "adamw", "adafactor", "muon"}),
                          ("divide", {"mean", "boundary", "optimizer"}),
                          ("data", {"regression", "classification", "tokens", "causal_lm", "rollouts", "packed"})):
        assert {getattr(r, field) for r in drawn} == values, field
    assert {p for r in drawn for p in r.precisions} == {"fp32", "bf16", "fp16"}


def test_each_trainer_declares_what_its_choices_need():
    for r in (draw(s) for s in range(300)):
        d = population.declarations(r)
        assert ("ignore_index" in d) == r.token_weighted, r
        assert (d.get("grads_from") == "optimizer") == (r.divide == "optimizer"), r
        assert d.get("uneven", False) == r.layout.startswith("uneven"), r
        assert d.get("process_group", False) == (r.layout in ("ddp", "uneven_ddp")), r
        assert ("unclipped" in d) == r.drawn_clip and ("plain" in d) == r.plain, r
        if r.divide == "mean":  # a mean per micro-step is exact only where every micro-batch holds the same units
            assert r.fixed_units() and not r.layout.startswith("uneven"), r
        if r.family == "moe" and r.aux == "balance":
            assert d["objective"].per_micro == ("aux",), r


def test_the_population_resolves_t_seed_to_its_adapter_by_name():
    ad = population.t4
    assert ad.ref == "benchmarks.zoo.population:t4" and ad.name == "zoo t4" and population.t4 is ad
    with pytest.raises(AttributeError, match="t<seed>"):
        population.tx4  # noqa: B018
    variant = getattr(population, "t4__clip=5e-1__optimizer=sgd")  # a variant narrows a failure down
    assert variant.ref == "benchmarks.zoo.population:t4__clip=5e-1__optimizer=sgd"
    assert (variant.factory.recipe.clip, variant.factory.recipe.optimizer) == (0.5, "sgd")


def _row(seed, gates_verdict, failures=(), kill="killed", op="grads_times_N"):
    return {seed: {"gates": dict(verdict=gates_verdict, seconds=3.0, gates={"equivalence": "pass"},
                                 failures=list(failures)),
                   "kill": dict(seed=seed, operator=op, verdict=kill, wall_seconds=2.0)}}


def test_the_report_counts_false_alarms_survivors_and_errors_apart():
    fail = dict(test="test_normaliser", gate="normaliser", verdict="[normaliser] ...; case N=3 B=2", case="N=3 B=2",
                hint="h")
    results = {**_row(1, "passes"), **_row(2, "rejected", [fail]), **_row(3, "passes", kill="SURVIVED"),
               **_row(4, "error", kill="n/a", op=None)}
    doc = report.document(results, command="python -m benchmarks.zoo run --seeds 1,2,3,4", profile="dev", jobs=1,
                          wall=1.0, max_world=None)
    s = doc["summary"]
    assert s["false_alarms"] == [2] and s["judged"] == 3 and s["false_alarm_rate"] == round(1 / 3, 4)
    assert s["gate_errors"] == [4] and s["survived"] == [(3, "grads_times_N")] and s["kill_na"] == [4]
    assert s["killed"] == 2 and s["kill_rate"] == round(2 / 3, 4)
    assert {"schema_version", "machine_info", "git_commit", "utc", "command"} <= set(doc)
    md = report.render_md(doc)
    assert "### t2:" in md and "[normaliser]" in md and doc["command"] in md


@pytest.mark.slow
@pytest.mark.parametrize("seed", SLICE)
def test_a_zoo_trainer_passes_unwrapped_and_its_drawn_operator_is_killed(seed):
    from benchmarks.zoo import kill

    r: Recipe = draw(seed)
    assert r.layout == "single" and (r.arch is None or r.arch.bias != "qkv")  # the slice's premise (see SLICE)
    doc = kill.run(seed)
    assert doc["baseline_ok"] and not doc["errors"], doc
    assert doc["verdict"] == "killed", doc


@pytest.mark.slow
def test_the_runner_writes_the_report_from_a_subprocess(tmp_path):
    out = tmp_path / "zoo"
    p = subprocess.run([sys.executable, "-m", "benchmarks.zoo", "run", "--seeds", "28", "--profile", "dev",
                        "--jobs", "1", "--out", str(out), "--work", str(tmp_path / "work")],
                       cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads((out / "zoo.json").read_text())
    (row,) = doc["trainers"]
    assert row["seed"] == 28 and row["gates"]["verdict"] == "passes" and row["kill"]["verdict"] == "killed"
    assert row["gates"]["gates"]["equivalence"] == "pass" and doc["summary"]["false_alarm_rate"] == 0.0
    assert "--seeds 28 --profile dev" in doc["command"] and (out / "zoo.md").exists()


def test_a_stopped_run_resumes_only_jobs_of_the_same_commit_profile_and_world_cap(tmp_path):
    from benchmarks.zoo import runner

    key = dict(commit="a" * 40, profile="ci", max_world=None)
    runner._keep(str(tmp_path), 7, "gates", key, {"verdict": "passes", "seconds": 1.0})
    assert runner._kept(str(tmp_path), 7, "gates", key) == {"verdict": "passes", "seconds": 1.0}
    for other in (dict(key, commit="b" * 40), dict(key, profile="dev"), dict(key, max_world=2)):
        assert runner._kept(str(tmp_path), 7, "gates", other) is None
    assert runner._kept(str(tmp_path), 7, "kill", key) is None and runner._kept(str(tmp_path), 8, "gates", key) is None


def test_an_operator_that_is_the_honest_trainer_on_its_recipe_is_not_drawn():
    """lr_previous_step on a constant LR logs the same numbers as the honest trainer (the run of record drew it on
    t101, t149, t173, which "survived"): drawn again there, and still drawn where a schedule moves the LR."""
    from benchmarks.zoo.kill import candidates, draw_operator

    for seed in (101, 149, 173):
        ad = getattr(population, f"t{seed}")
        assert ad.factory.recipe.schedule == "none" and "lr_previous_step" in candidates(ad)
        assert draw_operator(seed, ad) not in (None, "lr_previous_step"), seed
    moving = [s for s in range(300) if draw(s).schedule != "none" and "lr" in draw(s).metrics]
    assert any(draw_operator(s, getattr(population, f"t{s}")) == "lr_previous_step" for s in moving)
