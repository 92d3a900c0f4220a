"""The dev loop's tier (docs/performance.md, "Test tiers"): a family of parametrised cases that repeats one check on
other bugs or shapes runs its first member under -m "not slow" (the dev loop) and every member in CI."""
import pytest

_PARAM = type(pytest.param(None))


def dev_first(values, *, dev: int = 1):
    """`values` of a parametrize (plain values, tuples of them, or pytest.param) with every member after the first
    `dev` marked slow; each keeps its own marks and id."""
    out = []
    for i, v in enumerate(values):
        p = v if isinstance(v, _PARAM) else pytest.param(*(v if isinstance(v, tuple) else (v,)))
        marks = [*p.marks, *([pytest.mark.slow] if i >= dev else [])]
        out.append(pytest.param(*p.values, marks=marks, id=p.id))
    return out


# A test that imports a training framework (transformers, TRL, Accelerate, Lightning, DeepSpeed) runs in CI, not in
# the dev loop: each import costs seconds in every xdist worker that meets one (accelerate pulls in deepspeed).
imports_framework = pytest.mark.slow
