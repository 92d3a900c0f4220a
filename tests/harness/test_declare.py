"""An adapter's declarations, one frozen dataclass per concern: each checks itself in one line naming Group.field, and
an adapter written with the flat keywords of earlier releases is the same adapter as its grouped form."""
import dataclasses
import importlib
import pickle

import pytest

import verify
from verify._internal.declare import FLAT, GROUPS

EXAMPLES = ("token_mean_lm", "context_parallel", "ddp_no_sync", "pipeline_schedule", "tensor_parallel", "moe_aux",
            "packed_documents", "fsdp2_sequence_parallel", "mlp_regressor")


def _data(rows, seed):
    return verify.data.regression(features=2)(rows, seed)


def _factory(spec):
    raise AssertionError("never built here")


@pytest.mark.parametrize("build, says", [
    (lambda: verify.Batches(ignore_index="-100"), "Batches.ignore_index must be an integer"),
    (lambda: verify.Batches(empty_windows="no"), "Batches.empty_windows must be True or False, got 'no'"),
    (lambda: verify.Distributed(uneven=1), "Distributed.uneven must be True or False, got 1"),
    (lambda: verify.Distributed(expected=("all_reduce",)), "Distributed.expected must hold verify.Expected"),
    (lambda: verify.Distributed(counts=3), "Distributed.counts must be callable (case -> verify.CountRow), got 3"),
    (lambda: verify.Distributed(mesh_axes=("dp",)), "mesh_axes must name distinct axes"),
    (lambda: verify.Distributed(mesh_axes=("tp",), mesh_sizes={"pp": (2,)}), "mesh_sizes must map axes among tp"),
    (lambda: verify.Numerics(precisions=("fp8",)), "Numerics.precisions must be a non-empty subset of fp32, bf16, fp16"),
    (lambda: verify.Numerics(precisions=()), "Numerics.precisions must be a non-empty subset"),
    (lambda: verify.Numerics(overflow="rows"), "Numerics.overflow must be callable"),
    (lambda: verify.MemoryModel(predicted_peak=3), "MemoryModel.predicted_peak must be callable"),
    (lambda: verify.Parity(name="ckpt", apply=len, exact="yes"), "Parity.exact must be True or False, got 'yes'"),
    (lambda: verify.adapter(data=_data, batches={"ignore_index": -100})(_factory), "batches= must be a verify.Batches(...)"),
    (lambda: verify.adapter(data=_data, metrics=("loss",))(_factory), "metrics= must be a verify.Metrics(...)"),
    (lambda: verify.adapter(data=_data, ignore_idx=-100)(_factory), "adapter() has no declaration 'ignore_idx'"),
    (lambda: verify.adapter(data=_data, precisions=("fp64",))(_factory), "Numerics.precisions must be a non-empty"),
])
def test_each_declaration_checks_itself_in_one_line(build, says):
    with pytest.raises(verify.AdapterError) as e:
        build()
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_flat_keyword_is_its_groups_field_built_replaced_and_read():
    flat = verify.adapter(data=_data, ignore_index=-100, data_parallel=True, uneven=True, precisions=("fp32", "bf16"))(
        _factory)
    grouped = verify.adapter(data=_data, batches=verify.Batches(ignore_index=-100),
                             distributed=verify.Distributed(data_parallel=True, uneven=True),
                             numerics=verify.Numerics(precisions=("fp32", "bf16")))(_factory)
    for g in GROUPS:
        assert getattr(flat, g) == getattr(grouped, g), g
    assert flat.declarations() == grouped.declarations()
    assert (flat.ignore_index, flat.uneven, flat.precisions) == (-100, True, ("fp32", "bf16"))
    # replacing one flat field keeps the rest of its group; a whole group replaces the group
    moved = grouped.replace(empty_windows=False)
    assert moved.batches == verify.Batches(ignore_index=-100, empty_windows=False)
    assert grouped.replace(distributed=verify.Distributed()).data_parallel is False
    assert dataclasses.replace(grouped, uneven=False).distributed == verify.Distributed(data_parallel=True)
    # process_group implies data parallelism, as the flat keyword always did
    assert verify.adapter(data=_data, process_group=True)(_factory).data_parallel
    with pytest.raises(AttributeError, match="no attribute 'ignore_idx'"):
        grouped.ignore_idx  # noqa: B018


def test_the_flat_names_are_the_groups_fields_and_none_collides():
    top = {f.name for f in dataclasses.fields(verify.Adapter)}
    per_group = [f.name for cls, _ in GROUPS.values() for f in dataclasses.fields(cls)]
    assert len(per_group) == len(set(per_group)) == len(FLAT) and not set(FLAT) & top


@pytest.mark.parametrize("name", EXAMPLES)
def test_each_recipe_in_its_flat_form_of_earlier_releases_is_the_same_adapter(name):
    """The recipes declare grouped; rewritten with the flat keywords they used before, each is the same adapter
    (same groups, same report line), and it still pickles by reference."""
    recipe = importlib.import_module(f"examples.{name}").factory
    flat = {f.name: getattr(getattr(recipe, g), f.name) for g, (cls, _) in GROUPS.items() for f in dataclasses.fields(cls)}
    old = verify.adapter(data=recipe.data, plain=recipe.plain, options=recipe.options, defaults=recipe.defaults,
                         metrics=recipe.metrics, objective=recipe.objective, parity=recipe.parity,
                         thresholds=recipe.thresholds, **flat)(recipe.factory)
    for g in GROUPS:
        assert getattr(old, g) == getattr(recipe, g), (name, g)
    assert old.declarations() == recipe.declarations()
    assert pickle.loads(pickle.dumps(recipe)).declarations() == recipe.declarations()


def test_every_gate_runs_its_first_corner_on_both_sides_of_each_declared_threshold():
    from examples import llama_scale
    from verify._internal.cases.corners import corners, gate_corners

    for gate in (verify.Gate.EQUIVALENCE, verify.Gate.REPORTED_METRICS, verify.Gate.LONG_WINDOW):
        plain, crossed = gate_corners(llama_scale.factory, gate), corners(llama_scale.factory, gate)
        assert crossed[:len(plain)] == plain and len(crossed) == len(plain) + 2, gate
        first = plain[0][0] if isinstance(plain[0], tuple) else plain[0]
        for got, chunk in zip(crossed[len(plain):], (1 << 20, 5)):
            for case in (got if isinstance(got, tuple) else (got,)):
                if isinstance(case, verify.Case):
                    assert case.options.loss_chunk == chunk and case.accum_steps in (first.accum_steps, 256), gate
    assert llama_scale.factory.declarations()["thresholds"] == ["loss chunk"]
    with pytest.raises(verify.AdapterError, match="thresholds= must hold verify.Threshold"):
        verify.adapter(data=_data, thresholds=(1024,))(_factory)
    with pytest.raises(verify.AdapterError, match="Threshold.apply must be callable"):
        verify.Threshold(name="bucket", apply=25)
