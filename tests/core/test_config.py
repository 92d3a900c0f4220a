import pytest

from xtrain_core.config import PRESETS, ModelConfig, OptimConfig, TrainConfig


@pytest.mark.parametrize("field,value,msg", [
    ("accum_steps", 0, "train.accum_steps must be ≥ 1, got 0"),
    ("accum_steps", -1, "train.accum_steps must be ≥ 1, got -1"),
    ("accum_steps", 2.0, "train.accum_steps must be an integer, got 2.0"),
    ("micro_batch", 0, "train.micro_batch must be ≥ 1, got 0"),
    ("steps", 0, "train.steps must be ≥ 1, got 0"),
    ("seq_len", 0, "train.seq_len must be ≥ 1, got 0"),
    ("seed", -3, "train.seed must be an integer in [0, 2^63), got -3"),
])
def test_train_config_names_field_and_value(field, value, msg):
    with pytest.raises(ValueError) as e:
        TrainConfig(**{field: value})
    assert str(e.value) == msg


def test_model_config_checks_heads_divide_width():
    with pytest.raises(ValueError, match=r"model.d_model must be divisible by model.n_head, got 10 and 3"):
        ModelConfig(d_model=10, n_head=3)
    with pytest.raises(ValueError, match=r"model.n_layer must be ≥ 1, got 0"):
        ModelConfig(n_layer=0)


@pytest.mark.parametrize("kw,msg", [
    (dict(lr=0), "optim.lr must be a finite number > 0, got 0"),
    (dict(max_grad_norm=0.0), "optim.max_grad_norm must be > 0 or None, got 0.0"),
    (dict(warmup_steps=-1), "optim.warmup_steps must be an integer ≥ 0, got -1"),
    (dict(betas=(1.0, 0.9)), "optim.betas must lie in [0, 1), got (1.0, 0.9)"),
])
def test_optim_config(kw, msg):
    with pytest.raises(ValueError) as e:
        OptimConfig(**kw)
    assert str(e.value) == msg


def test_effective_batch_is_n_b_w_and_configs_are_frozen():
    from xtrain_core.config import effective_batch

    assert effective_batch(4, 3) == 12 and effective_batch(4, 3, world=2) == 24
    t = TrainConfig(accum_steps=4, micro_batch=3)
    with pytest.raises(Exception):
        t.accum_steps = 2


def test_gpt2ish_preset_is_the_anchor_model():
    m = PRESETS["gpt2-ish"]
    assert (m.n_layer, m.d_model, m.n_head, m.vocab_size, m.seq_len) == (12, 768, 12, 8192, 512)


@pytest.mark.parametrize("field,value,msg", [
    ("accum_steps", 2**20 + 1, "train.accum_steps must be ≤ 1048576, got 1048577"),
    ("micro_batch", 2**16 + 1, "train.micro_batch must be ≤ 65536, got 65537"),
    ("seed", 2**63, "train.seed must be an integer in [0, 2^63), got 9223372036854775808"),
])
def test_sizes_a_run_can_never_meet_are_refused(field, value, msg):
    with pytest.raises(ValueError) as e:
        TrainConfig(**{field: value})
    assert str(e.value) == msg


def test_lr_must_be_finite():
    for lr in (float("inf"), float("nan")):
        with pytest.raises(ValueError, match="optim.lr must be a finite number > 0"):
            OptimConfig(lr=lr)
