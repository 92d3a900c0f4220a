"""Small framework-owned loops for tests/harness/test_pull.py: each runs its own loop over a loader and is driven
by verify.Pull, like the HF and Lightning recipes, without either framework."""
import torch
import torch.nn.functional as F

import verify

DATA = verify.data.regression(features=4)


def _model(spec):
    torch.manual_seed(spec.seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).to(spec.device, spec.dtype)


def loop(model, loader, n, *, scale=None, clip=1.0, fail_at=None):
    """An HF-4.46-like loop: it fetches (and reads) the whole window before the first backward, and its
    loader reads one batch ahead; it clips at `clip`, then steps."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    it, step = iter(loader), 0
    ahead = next(it)
    while True:
        window = []
        for _ in range(n):
            window.append(tuple(ahead.to("cpu")))  # reads the batch now, as HF counts its labels
            ahead = next(it)  # one batch ahead, unread (accelerate's loader)
        for x, y in window:
            if step == fail_at:
                raise ValueError("planted failure in the framework's loop")
            loss = F.mse_loss(model(x), y)
            (loss / (n if scale is None else scale)).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        step += 1


def _factory(spec, **kw):
    model, pull = _model(spec), verify.Pull(spec, timeout=kw.pop("timeout", None))
    loader = torch.utils.data.DataLoader(pull.dataset, batch_size=1, collate_fn=pull.collate)
    return pull.start(lambda: loop(model, loader, kw.pop("n", spec.accum_steps), **kw), model)


correct = verify.adapter(data=DATA)(_factory)
times_n = verify.adapter(data=DATA)(lambda spec: _factory(spec, scale=1))  # the 1/N missing, clipping ON
fails = verify.adapter(data=DATA)(lambda spec: _factory(spec, fail_at=1))
long_window = verify.adapter(data=DATA)(lambda spec: _factory(spec, n=spec.accum_steps + 1, timeout=5))


def _as_dict(x, y):
    return {"x": x, "y": y}


def rebuilt_loop(model, loader, n):
    """A loop that moves each batch as ms-swift's to_device does, type(batch)({k: ...}), then pops from a copy
    of it (swift's concatenated_forward): a copy is the taken batch, never a second take."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    it = iter(loader)
    while True:
        window = [next(it) for _ in range(n)]
        for b in window:
            b = type(b)({k: v.to("cpu") for k, v in b.items()}).copy()
            F.mse_loss(model(b.pop("x")), b.pop("y")).div(n).backward()
        opt.step()
        opt.zero_grad()


def _rebuilt(spec):
    model, pull = _model(spec), verify.Pull(spec, batch=_as_dict)
    loader = torch.utils.data.DataLoader(pull.dataset, batch_size=1, collate_fn=pull.collate)
    return pull.start(lambda: rebuilt_loop(model, loader, spec.accum_steps), model)


rebuilt = verify.adapter(data=DATA)(_rebuilt)
