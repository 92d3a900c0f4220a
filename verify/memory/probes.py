"""Peak-memory probes, and what a trainer holds between steps.

  CPU  `RssProbe`: peak RSS of THIS process during the measured steps, above the RSS right before them; one
       fresh process per configuration (verify/memory/_zygote.py).
  GPU  `CudaProbe`: torch's allocator peaks (max allocated / reserved) and, when NVML works, `NvmlSampler`:
       device memory used, sampled by a thread. NVML failing never raises out of here (ProbeUnavailable).

A probe has `start()` and `stop() -> dict` (its figures; `peak_bytes` is the one the invariants check).
What each probe measures: docs/design/memory.md, "What each probe measures".
"""
from __future__ import annotations

import gc
import resource
import sys
import threading
import time

import torch

from verify._internal.settings import launcher_var

__all__ = ["ProbeUnavailable", "RssProbe", "CudaProbe", "NvmlSampler", "cuda_full_reset", "probe_definition",
           "tensor_bytes", "optimizer_info", "optimizer_state_bytes", "one_line", "saved_activation_bytes"]


class ProbeUnavailable(RuntimeError):
    """A probe cannot run here; str(e) is a one-line reason."""


def one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return f"{type(e).__name__}: {text}" if type(e).__name__ not in text else text


# -- CPU: resident set size of this process -------------------------------------------------------

def _status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _ru_maxrss_bytes() -> int:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024  # Linux reports KiB, macOS bytes


def rss_bytes() -> int | None:
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def reset_hwm() -> bool:
    """Reset this process's peak RSS (VmHWM) to its current RSS (Linux ≥ 4.0, /proc/self/clear_refs '5')."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class RssProbe:
    """Peak RSS during the measured steps minus RSS right before them, in a fresh process.

    The baseline holds: the interpreter and torch, the model's parameters, the optimizer state (made by
    the warm-up step), gradient buffers that live between steps (xtrain's flat buffer, DDP's buckets),
    the pre-drawn batches, and heap the warm-up step freed but the C allocator kept (verify.memory runs
    the child with MALLOC_MMAP_THRESHOLD_ fixed so tensor-sized blocks are unmapped on free and this
    stays small). The figure therefore holds what a training step adds: gradients it allocates,
    activations saved for backward, temporaries, optimizer-step scratch.

    High-water mark: VmHWM after resetting it through /proc/self/clear_refs; where that reset is not
    allowed, ru_maxrss, which still covers the warm-up step: the figure is then exact only if the
    measured steps peak higher than the warm-up (they should: the optimizer state now exists), and
    `hwm_exact` says whether that could be confirmed.
    """

    kind = "cpu-rss"

    def start(self) -> None:
        gc.collect()
        self.base = rss_bytes()
        if self.base is None:
            raise ProbeUnavailable("no /proc/self/status: the CPU probe needs Linux")
        self.reset = reset_hwm()
        self.ru_before = _ru_maxrss_bytes()

    def stop(self) -> dict:
        ru_after = _ru_maxrss_bytes()
        hwm_kib = _status_kib("VmHWM") if self.reset else None
        peak = hwm_kib * 1024 if hwm_kib is not None else ru_after
        return dict(
            peak_bytes=peak - self.base,
            rss_base_bytes=self.base,
            rss_peak_bytes=peak,
            hwm_source="VmHWM reset via /proc/self/clear_refs" if self.reset else "ru_maxrss (no reset)",
            # with no reset, ru_maxrss also covers the warm-up; it grew during the measured steps only if
            # they set the peak
            hwm_exact=bool(self.reset or ru_after > self.ru_before),
        )


# -- GPU: torch's allocator and NVML --------------------------------------------------------------

def nvml_index_for(device: torch.device):
    """The NVML handle of a torch CUDA device (by UUID, then PCI bus id, then index)."""
    import pynvml

    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        try:
            u = str(uuid)
            return pynvml.nvmlDeviceGetHandleByUUID(u if u.startswith(("GPU-", "MIG-")) else "GPU-" + u)
        except Exception:  # noqa: BLE001  (MIG, old drivers: fall through)
            pass
    if hasattr(props, "pci_bus_id"):
        try:
            bus = f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
            return pynvml.nvmlDeviceGetHandleByPciBusId(bus)
        except Exception:  # noqa: BLE001
            pass
    if launcher_var("CUDA_VISIBLE_DEVICES") is not None:
        raise ProbeUnavailable(f"cannot map torch device {device} to an NVML device (CUDA_VISIBLE_DEVICES is set)")
    return pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)


class NvmlSampler:
    """Device memory used (nvmlDeviceGetMemoryInfo(h).used, as nvidia-smi and the anchor read it) for each
    device, sampled every `period` seconds by a daemon thread; keeps the max per device."""

    def __init__(self, handles, names, period: float):
        import pynvml

        self.nv, self.handles, self.names, self.period = pynvml, handles, names, period
        self._stop = threading.Event()
        self.error: str | None = None

    @classmethod
    def open(cls, devices, period: float = 0.002) -> "NvmlSampler":
        """Raises ProbeUnavailable (one line) when the package, the library or the device is missing."""
        try:
            import pynvml
        except ImportError:
            raise ProbeUnavailable("NVML unavailable: nvidia-ml-py (pynvml) is not installed") from None
        try:
            pynvml.nvmlInit()
            handles = [nvml_index_for(d) for d in devices]
            names = [pynvml.nvmlDeviceGetName(h) for h in handles]
            names = [n.decode() if isinstance(n, bytes) else n for n in names]
            for h in handles:
                pynvml.nvmlDeviceGetMemoryInfo(h)
        except ProbeUnavailable:
            raise
        except Exception as e:  # noqa: BLE001  (NVMLError_LibraryNotFound, _DriverNotLoaded, _NoPermission, ...)
            raise ProbeUnavailable(f"NVML unavailable: {one_line(e)}") from None
        return cls(handles, names, period)

    def _used(self) -> list[int]:
        return [self.nv.nvmlDeviceGetMemoryInfo(h).used for h in self.handles]

    def start(self) -> None:
        self._stop.clear()
        self.error, self.samples = None, 0
        try:
            self.base = self._used()
        except Exception as e:  # noqa: BLE001
            self.error, self.base = one_line(e), [0] * len(self.handles)
        self.peak = list(self.base)
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="nvml-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set() and self.error is None:
            try:
                self.peak = [max(p, u) for p, u in zip(self.peak, self._used())]
                self.samples += 1
            except Exception as e:  # noqa: BLE001  (a failing NVML read ends sampling, never the run)
                self.error = one_line(e)
            time.sleep(self.period)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        elapsed = time.perf_counter() - self._t0
        if self.error is None:
            try:
                self.peak = [max(p, u) for p, u in zip(self.peak, self._used())]
            except Exception as e:  # noqa: BLE001
                self.error = one_line(e)
        ok = self.error is None
        return dict(
            nvml_peak_used_bytes=self.peak[0] if ok else None,
            nvml_base_used_bytes=self.base[0] if ok else None,
            nvml_per_device=[dict(name=n, peak_used_bytes=p if ok else None) for n, p in zip(self.names, self.peak)],
            nvml_period_s=self.period,
            nvml_samples=self.samples,
            nvml_mean_interval_s=elapsed / self.samples if self.samples else None,
            nvml_error=self.error,
        )


class CudaProbe:
    """Allocator peaks of one device (reset right before the measured steps) plus an optional NVML sampler."""

    kind = "cuda-allocator"

    def __init__(self, device: torch.device, nvml: NvmlSampler | None, nvml_reason: str | None = None):
        self.device, self.nvml, self.nvml_reason = device, nvml, nvml_reason

    def start(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.alloc_base = torch.cuda.memory_allocated(self.device)
        if self.nvml is not None:
            self.nvml.start()

    def stop(self) -> dict:
        torch.cuda.synchronize(self.device)
        out = dict(
            peak_bytes=torch.cuda.max_memory_allocated(self.device),
            peak_reserved_bytes=torch.cuda.max_memory_reserved(self.device),
            allocated_before_bytes=self.alloc_base,
        )
        if self.nvml is not None:
            out.update(self.nvml.stop())
        else:
            out.update(nvml_peak_used_bytes=None, nvml_error=self.nvml_reason)
        return out


def cuda_full_reset(device: torch.device) -> int:
    """Between configurations: free everything the last one left, empty the cache, reset the peaks.
    Returns the bytes still allocated afterwards (0 unless something outlives its configuration)."""
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def probe_definition(cuda: bool, hwm_reset: bool = True) -> dict:
    """What the report says each figure is (its `probe` section). `hwm_reset`: every CPU row's peak came
    from VmHWM after a reset (else some from ru_maxrss)."""
    if cuda:
        return dict(
            kind="cuda", primary="peak_bytes = torch.cuda.max_memory_allocated over the measured steps",
            includes="everything torch's caching allocator handed out on this device: parameters, gradients, "
                     "optimizer state, batches, activations, temporaries; not the CUDA context, not "
                     "cached-but-free blocks (those are in peak_reserved_bytes), not other processes.",
            nvml="nvml_peak_used_bytes = device memory used (nvmlDeviceGetMemoryInfo.used, what nvidia-smi "
                 "shows: CUDA context, cache, every process on the GPU), max over samples taken by a thread "
                 "every nvml_period_s during the measured steps",
            isolation="one process; before each configuration gc.collect, synchronize, empty_cache, "
                      "reset_peak_memory_stats (allocated_left_over_bytes records what was still allocated)")
    hwm = ("VmHWM reset via /proc/self/clear_refs right before the measured steps" if hwm_reset else
           "ru_maxrss where the reset was refused (hwm_exact per row says whether the measured steps set the peak)")
    return dict(
        kind="cpu", primary="peak_bytes = peak RSS during the measured steps − RSS right before them",
        includes="Included: what a training step adds on top of the steady state — activations saved for "
                 "backward, temporaries, gradients the step allocates (a trainer that frees them between steps, "
                 "zero_grad(set_to_none=True); FSDP2's unsharded gradients and gathered parameters), optimizer-step "
                 "scratch, and pages first touched during the step. Not included (they are in the baseline): the "
                 "interpreter and torch, the parameters, the optimizer state (allocated by the warm-up step), "
                 "gradient buffers that live between steps (xtrain's flat buffer, DDP's buckets), the pre-drawn "
                 "batches. "
                 f"High-water mark: {hwm}.",
        isolation="a fresh process per configuration, forked from a `python -m verify.memory._zygote --serve` "
                  "zygote that imported torch and the adapter and allocated no tensors (own address space, own "
                  "peak-RSS counter; `isolation` per row says fork or exec); glibc MALLOC_MMAP_THRESHOLD_=65536; "
                  "torch/OMP threads fixed")


# -- what the trainer holds ---------------------------------------------------------------------------

def tensor_bytes(obj) -> int:
    """Bytes this process holds: a DTensor (FSDP2's sharded parameters and optimizer state) counts its local
    shard, not the global tensor."""
    if isinstance(obj, torch.Tensor):
        if hasattr(obj, "to_local"):
            obj = obj.to_local()
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def optimizer_info(trainer) -> dict | None:
    """Class and implementation flags of the trainer's torch optimizer (.opt / .optimizer), if exposed."""
    for attr in ("opt", "optimizer"):
        opt = getattr(trainer, attr, None)
        if isinstance(opt, torch.optim.Optimizer):
            d = opt.defaults
            return dict(cls=type(opt).__name__, fused=d.get("fused"), foreach=d.get("foreach"))
    return None


def optimizer_state_bytes(trainer) -> int | None:
    """Bytes of the optimizer state, if the trainer exposes its torch optimizer as .opt or .optimizer."""
    for attr in ("opt", "optimizer"):
        opt = getattr(trainer, attr, None)
        if isinstance(opt, torch.optim.Optimizer):
            return sum(tensor_bytes(s) for s in opt.state.values())
    return None


# -- activations of one micro-batch, measured directly (not from a peak) ------------------------------

def saved_activation_bytes(model, forward, *args) -> dict:
    """Run `forward(*args)` once (grad enabled) and count what autograd SAVES for backward: every distinct
    storage packed by torch.autograd.graph.saved_tensors_hooks, whole storage bytes once each, the
    model's parameters excluded (they are counted as parameters). Saved tensors only: not temporaries
    that live and die inside an op or inside the backward. Also the bytes of the model's output (the
    logits), from a forward hook. Returns {'saved_bytes', 'saved_tensors', 'output_bytes'}; the graph is
    freed before returning."""
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    seen: dict[int, int] = {}
    out = []

    def pack(t):
        st = t.untyped_storage()
        if st._cdata not in params and st._cdata not in seen:
            seen[st._cdata] = st.nbytes()
        return t

    hook = model.register_forward_hook(lambda m, i, o: out.append(tensor_bytes(o)))
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = forward(*args)
        del loss
    finally:
        hook.remove()
    return dict(saved_bytes=sum(seen.values()), saved_tensors=len(seen), output_bytes=out[0] if out else 0)
