import torch

from xtrain_core.data import TokenStream, split_micro


def test_micro_batches_are_the_big_batch_in_order():
    """N draws of B == one draw of N·B: the accumulation run sees the big batch's sequences in order."""
    N, B, S = 4, 3, 16
    a = TokenStream(100, S, seed=7)
    micro = [a.next(B) for _ in range(N)]
    big_idx, big_tgt = TokenStream(100, S, seed=7).next(N * B)
    assert torch.equal(torch.cat([m[0] for m in micro]), big_idx)
    assert torch.equal(torch.cat([m[1] for m in micro]), big_tgt)
    for (x, y), (bx, by) in zip(micro, split_micro(big_idx, big_tgt, N)):
        assert torch.equal(x, bx) and torch.equal(y, by)


def test_targets_are_inputs_shifted_and_in_vocab():
    x, y = TokenStream(37, 9, seed=1).next(5)
    assert x.shape == y.shape == (5, 9) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert int(x.max()) < 37 and int(x.min()) >= 0


def test_seed_changes_stream_and_is_reproducible():
    assert torch.equal(TokenStream(50, 8, seed=3).next(4)[0], TokenStream(50, 8, seed=3).next(4)[0])
    assert not torch.equal(TokenStream(50, 8, seed=3).next(4)[0], TokenStream(50, 8, seed=4).next(4)[0])


def test_byte_file(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("héllo world, " * 20, encoding="utf-8")
    x, y = TokenStream(256, 12, seed=0, data=f).next(3)
    raw = f.read_bytes()
    for row, trow in zip(x, y):
        s = bytes(row.tolist())
        assert s in raw and bytes(trow.tolist()) in raw


def test_file_too_short(tmp_path):
    import pytest

    f = tmp_path / "t.txt"
    f.write_text("abc")
    with pytest.raises(ValueError, match="has 3 bytes; seq_len 8 needs at least 10"):
        TokenStream(256, 8, data=f)


def test_split_rejects_uneven():
    import pytest

    with pytest.raises(ValueError, match="does not split into 4"):
        split_micro(torch.zeros(6, 2), torch.zeros(6, 2), 4)
