import torch
import torch.nn.functional as F

from xtrain_core.config import ModelConfig, OptimConfig
from xtrain_core.model import build_model
from xtrain_core.trainer import AccumTrainer, make_optimizer, plain_step


def test_shapes_and_param_count():
    cfg = ModelConfig(vocab_size=50, seq_len=16, n_layer=2, n_head=2, d_model=32)
    m = build_model(cfg, seed=0)
    idx = torch.randint(0, 50, (3, 10))
    assert m(idx).shape == (3, 10, 50)
    assert sum(p.numel() for p in m.parameters()) == cfg.n_params
    assert len(list(m.buffers())) == 0  # nothing for DDP to broadcast at forward


def test_loss_batched_is_mean_over_all_rows():
    cfg = ModelConfig(vocab_size=20, seq_len=8, n_layer=1, n_head=1, d_model=8)
    m = build_model(cfg, seed=1)
    idx, tgt = torch.randint(0, 20, (4, 8)), torch.randint(0, 20, (4, 8))
    rows = F.cross_entropy(m(idx).reshape(-1, 20), tgt.reshape(-1), reduction="none")
    torch.testing.assert_close(m.loss_batched(idx, tgt), rows.mean())


def test_build_model_is_seeded_and_leaves_global_rng_alone():
    cfg = ModelConfig(vocab_size=20, seq_len=8, n_layer=1, n_head=1, d_model=8)
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a, b = build_model(cfg, 5), build_model(cfg, 5)
    assert torch.equal(torch.rand(1), before)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_accum_trainer_n1_matches_core_plain_step():
    cfg = ModelConfig(vocab_size=30, seq_len=8, n_layer=1, n_head=2, d_model=16)
    o = OptimConfig(lr=1e-2, warmup_steps=2)
    a = AccumTrainer(build_model(cfg, 0), o, 1)
    m = build_model(cfg, 0)
    opt, sched = make_optimizer(m, o)
    for s in range(3):
        x, y = torch.randint(0, 30, (3, 7)), torch.randint(0, 30, (3, 7))
        la = a.train_step([(x, y)])
        lp = plain_step(m, opt, sched, o, x, y)
        assert torch.equal(la, lp)
    for (n, p), q in zip(a.model.named_parameters(), m.parameters()):
        assert torch.equal(p, q), n


def test_step_loss_is_mean_of_raw_micro_losses():
    cfg = ModelConfig(vocab_size=30, seq_len=8, n_layer=1, n_head=2, d_model=16)
    a = AccumTrainer(build_model(cfg, 0), OptimConfig(), 3)
    m = build_model(cfg, 0)
    batches = [(torch.randint(0, 30, (2, 5)), torch.randint(0, 30, (2, 5))) for _ in range(3)]
    want = sum(m.loss_batched(x, y).item() for x, y in batches) / 3
    assert abs(a.train_step(batches).item() - want) < 1e-6


def test_boundary_misuse_is_an_error():
    import pytest

    a = AccumTrainer(build_model(ModelConfig(), 0), OptimConfig(), 2)
    x = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(RuntimeError, match="before the boundary: ran 0 of 2"):
        a.optimizer_step()
    with pytest.raises(RuntimeError, match="micro=1, expected 0 of 2"):
        a.micro_step(x, x, 1)
    with pytest.raises(ValueError, match="accum_steps must be an integer ≥ 1, got 0"):
        AccumTrainer(a.model, OptimConfig(), 0)
