"""Pull mode: a loop the framework owns (HF `Trainer.train()`, Lightning `Trainer.fit()`) driven as the
four-method trainer the gates drive.

    pull = verify.Pull(spec, batch=lambda x, y: {"input_ids": x, "labels": y})
    trainer = SomeFrameworkTrainer(model, ..., dataset=pull.dataset, collate_fn=pull.collate)
    return pull.start(trainer.train, model)

The loop runs in a thread that takes turns with the harness: lazy batches, the boundary read before clipping,
micro-steps marked at their first forward, the window's backpropagated loss, failures raised with their
traceback. How and why: docs/design/recipes.md, "The framework owns the loop".
"""
from __future__ import annotations

import collections
import gc
import threading
import traceback
import weakref
from collections.abc import Mapping

import torch

from verify._internal.settings import child_environ, set_library_env

__all__ = ["Pull", "PullError"]

_LOCAL = threading.local()  # .channel in a framework thread
_INSTALL = threading.Lock()
_installed = False
LENGTH = 1 << 16  # micro-batches the dataset claims: more than any case draws, small for a random sampler


class PullError(RuntimeError):
    """The framework's loop failed, ended early, or did not meet the harness in time; str(e) says where."""


class _Stopped(BaseException):
    """Raised inside the framework's thread to end it (BaseException: frameworks re-raise it)."""


def _timeout() -> float:
    from verify._internal.settings import current

    return current().timeout


class _Channel:
    """The state both sides share. fw: running | need_data | boundary | released | done."""

    def __init__(self, timeout: float):
        self.cv = threading.Condition()
        self.queue = collections.deque()  # (batch, label) handed by the harness, not yet taken
        self.labels = collections.deque()  # labels of taken batches whose forward has not begun
        self.fw, self.error, self.stopped, self.timeout = "running", None, False, timeout
        self.passed = False  # the boundary of the current window was met
        self.need_mark = True  # the next module forward begins a micro-step
        self.losses, self.window_losses = [], []
        self.windows = None

    def _wait(self, ready, what: str, framework: bool) -> None:
        if not self.cv.wait_for(lambda: ready() or self.stopped, self.timeout):
            if framework:
                raise _Stopped(f"no harness call for {self.timeout:.0f} s while {what}")
            self.stopped = True  # the Pull is unusable now: its thread ends at its next wait
            raise PullError(f"the framework's loop did not {what} within {self.timeout:.0f} s (state {self.fw}); "
                            f"set XTRAIN_DIST_TIMEOUT to wait longer")
        if self.stopped and framework:
            raise _Stopped()

    # -- the framework's side (its thread) ---------------------------------------------------------
    def take(self):
        with self.cv:
            if not self.queue:
                self.fw = "need_data"
                self.cv.notify_all()
                self._wait(lambda: bool(self.queue), "waiting for a micro-batch", True)
            batch, label = self.queue.popleft()
            self.fw, self.passed = "running", False
            self.labels.append(label)
            return batch

    def boundary(self) -> None:
        with self.cv:
            if self.passed:
                return  # the clip already met the harness; the step pre-hook passes
            self.passed, self.fw = True, "boundary"
            self.window_losses, self.losses = self.losses, []
            self.cv.notify_all()
            self._wait(lambda: self.fw == "released", "at the boundary", True)
            self.fw = "running"

    def forward(self) -> None:
        if self.need_mark:
            self.need_mark = False
            label = self.labels.popleft() if self.labels else None
            if label is not None and self.windows is not None:
                self.windows.mark(label)

    def backward(self, tensors) -> None:
        if isinstance(tensors, torch.Tensor) and tensors.numel() == 1:
            self.losses.append(tensors.detach().reshape(()))
        self.need_mark = True

    # -- the harness's side --------------------------------------------------------------------------
    def quiet(self, what: str) -> str:
        """Wait until the framework waits for the harness (or ended); return its state."""
        with self.cv:
            self._wait(lambda: self.fw == "boundary" or self.fw == "done" or (self.fw == "need_data" and not self.queue),
                       what, False)
            if self.error is not None:
                raise PullError(f"the framework's loop raised (in its thread):\n{self.error}")
            return self.fw

    def stop(self) -> None:
        with self.cv:
            self.stopped = True
            self.cv.notify_all()


class _Lazy(Mapping):
    """One micro-batch, taken from the harness at its first use (FIFO with the other lazy batches)."""

    def __init__(self, channel):
        if isinstance(channel, Mapping):  # rebuilt as type(batch)({k: ...}) (swift's to_device): a taken batch
            self._ch, self._batch = None, dict(channel)
        else:
            self._ch, self._batch = channel, None

    def _get(self):
        if self._batch is None:
            self._batch = self._ch.take()
        return self._batch

    def to(self, *args, **kwargs):  # accelerate's and Lightning's device transfer: the batch's first use
        b = self._get()
        move = lambda v: v.to(*args, **kwargs) if isinstance(v, torch.Tensor) else v  # noqa: E731
        if isinstance(b, Mapping):
            return {k: move(v) for k, v in b.items()}
        return type(b)(move(v) for v in b) if isinstance(b, (tuple, list)) else move(b)

    def __getitem__(self, key):
        return self._get()[key]

    def copy(self):  # dict's: a loop that edits its copy of the batch (swift's concatenated_forward)
        return dict(self._get())

    def __iter__(self):
        return iter(self._get())

    def __len__(self):
        return len(self._get())


class _Dataset(torch.utils.data.Dataset):
    """Sized (so Lightning does not prefetch), map-style (so accelerate shards no index across ranks: each
    rank's Pull feeds its own rank), every index a lazy batch."""

    def __init__(self, channel: _Channel):
        self._ch = channel

    def __len__(self):
        return LENGTH

    def __getitem__(self, i):
        return _Lazy(self._ch)


def _channel():
    return getattr(_LOCAL, "channel", None)


def _install() -> None:
    """Process-wide hooks, once; each acts only in a Pull's thread."""
    global _installed
    with _INSTALL:
        if _installed:
            return
        import torch.nn.utils as nn_utils
        import torch.nn.utils.clip_grad as clip_grad
        from torch.nn.modules.module import register_module_forward_pre_hook
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        def before(fn):
            def wrapped(*args, **kwargs):
                ch = _channel()
                if ch is not None:
                    ch.boundary()
                return fn(*args, **kwargs)

            wrapped.__wrapped__ = fn
            return wrapped

        for name in ("clip_grad_norm_", "clip_grad_value_"):
            w = before(getattr(clip_grad, name))
            setattr(clip_grad, name, w)
            setattr(nn_utils, name, w)
        # the two halves of clip_grad_norm_, public since torch 2.6: accelerate >= 1.16 clips with them
        for name in ("get_total_norm", "clip_grads_with_norm_"):
            if hasattr(nn_utils, name):
                setattr(nn_utils, name, before(getattr(nn_utils, name)))

        def step_pre(optimizer, args, kwargs):
            ch = _channel()
            if ch is None or ch.passed:
                return None  # not a Pull's thread, or the clip already met the harness
            closure = kwargs.get("closure", args[1] if len(args) > 1 else None)  # args[0] is the optimizer
            # The wait runs inside the step, in a closure, not in torch's loop over the pre-hooks: the harness
            # arms its own pre-hook for its optimizer_step() call while the thread waits, and this step runs
            # it after the wait (a hook registered during that loop is skipped, or breaks it).
            armed = set(_step_pre_hooks())

            def closure_then_boundary():  # the window's last backward runs inside a framework's closure
                out = None if closure is None else closure()
                ch.boundary()
                for key, hook in list(_step_pre_hooks().items()):
                    if key not in armed:
                        hook(optimizer, args, kwargs)  # its return value cannot apply: the step is running
                return out

            return args[:1], {**kwargs, "closure": closure_then_boundary}

        register_optimizer_step_pre_hook(step_pre)

        def forward_pre(module, args):
            ch = _channel()
            if ch is not None:
                ch.forward()

        register_module_forward_pre_hook(forward_pre)
        backward = torch.autograd.backward

        def backward_seen(tensors, *args, **kwargs):
            ch = _channel()
            out = backward(tensors, *args, **kwargs)
            if ch is not None:
                ch.backward(tensors)
            return out

        torch.autograd.backward = backward_seen
        # HF's train() begins with accelerate's free_memory(): a full gc.collect() of this process, 0.4 s with
        # torch, transformers and hypothesis loaded, once per trainer (the gates build hundreds). What is
        # alive now stays alive (modules, the harness), so it is frozen out of the collector, once: those
        # collections then scan only what came after (0.4 s -> ms). Freed by reference counting as before.
        gc.collect()
        gc.freeze()
        _installed = True


def _step_pre_hooks() -> dict:
    """torch's global optimizer step pre-hooks, {id: hook} (its registry: torch offers no public view)."""
    from torch.optim import optimizer

    return getattr(optimizer, "_global_optimizer_pre_hooks", {})


def _run(channel: _Channel, run, cuda_device) -> None:
    _LOCAL.channel = channel
    env = child_environ()  # a copy: what the loop may remove
    try:
        if cuda_device is not None:  # CUDA's current device is per thread: the loop's is the harness's (rank r's)
            torch.cuda.set_device(cuda_device)
        run()
    except _Stopped:
        pass
    except BaseException:  # noqa: BLE001  (reported in the harness, with the traceback)
        channel.error = traceback.format_exc()
    finally:
        # a framework's teardown may edit the process's environment (Lightning deletes WORLD_SIZE): a rank
        # process of the harness runs other trainers after this one, so what the loop removed is put back
        set_library_env(env, keep_set=True)
        with channel.cv:
            channel.fw = "done"
            channel.cv.notify_all()


class Pull:
    """A framework-owned loop as a verify trainer. `batch(x, y)` turns the harness's micro-batch (this
    rank's rows) into what the framework's loader yields (default: the pair); hand the framework
    `dataset` with batch size 1 and `collate` (each item is already a whole micro-batch), then call
    `start(run, model)` with the loop (e.g. `trainer.train`) and the model whose parameters it trains.
    `start(..., metrics=logged)`: for an adapter that declares verify.Metrics, `logged()` returns what the
    framework logged for the step that just ran ({name: number}); metrics() calls it once the loop waits for
    its next micro-batch, past the step's logging."""

    def __init__(self, spec=None, *, batch=None, timeout: float | None = None):
        self.spec = spec
        self._ch = _Channel(_timeout() if timeout is None else timeout)
        self._batch = batch or (lambda x, y: (x, y))
        self.dataset = _Dataset(self._ch)
        self.model = None
        self._thread = None
        self._metrics = None

    @staticmethod
    def collate(items):
        return items[0]

    def start(self, run, model, metrics=None) -> "Pull":
        _install()
        self.model = model
        self._metrics = metrics
        cuda = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        self._thread = threading.Thread(target=_run, args=(self._ch, run, cuda), name="verify-pull", daemon=True)
        self._thread.start()
        weakref.finalize(self, _finish, self._ch, self._thread)
        state = self._ch.quiet("ask for its first micro-batch")  # set-up traffic stays in the harness's init window
        if state != "need_data":
            raise PullError(f"the framework's loop {'ended' if state == 'done' else 'reached an optimizer step'} "
                            f"before asking for a micro-batch: hand it Pull.dataset as its training data")
        return self

    # -- the protocol ----------------------------------------------------------------------------------
    def micro_step(self, inputs, targets, micro):
        from verify._internal.ranks.comm import active_windows

        ch = self._ch
        windows = active_windows()
        label = windows.marks[-1][1] if windows is not None and windows.marks else None
        batch = self._batch(inputs, targets)
        with ch.cv:
            ch.windows = windows
            ch.queue.append((batch, label))
            ch.cv.notify_all()
        if ch.quiet(f"take micro-batch {micro}") == "done":
            raise PullError(f"the framework's loop ended at micro-batch {micro}")

    def _at_boundary(self, what: str) -> None:
        state = self._ch.quiet(f"reach its optimizer step ({what})")
        if state != "boundary":
            self._ch.stop()  # unusable now: end the framework's thread instead of leaving it waiting
            raise PullError(f"{what}: the framework's loop {'ended' if state == 'done' else 'asked for another micro-batch'}"
                            f" instead of reaching its optimizer step: its accumulation window is not the "
                            f"{getattr(self.spec, 'accum_steps', '?')} micro-steps of Spec.accum_steps")

    def grads(self):
        self._at_boundary("grads()")
        return {k: p.grad for k, p in self.model.named_parameters() if p.grad is not None}

    def optimizer_step(self):
        self._at_boundary("optimizer_step()")
        ch = self._ch
        with ch.cv:
            losses = ch.window_losses
            ch.fw = "released"
            ch.cv.notify_all()
        ch.quiet("finish its optimizer step")
        loss = torch.stack(losses).sum() if losses else torch.tensor(float("nan"))
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(loss)  # each rank's share of the objective: the mean over ranks is the step's
            loss = loss / dist.get_world_size()
        return loss

    def metrics(self):
        self._ch.quiet("log its step")
        return {} if self._metrics is None else self._metrics()

    def params(self):
        self._ch.quiet("stop")
        return dict(self.model.named_parameters())


def _finish(channel: _Channel, thread: threading.Thread) -> None:
    channel.stop()
    if thread is not threading.current_thread():
        thread.join(timeout=10)
