"""Running the configurations of a Plan: on the CPU each in a fresh process forked by a zygote
(`CpuProbeServer`), on a GPU all in this process with a full allocator reset between them (`GpuRunner`);
`run_sweeps` walks the plan on this rank, in step with the other ranks under torchrun.
"""
from __future__ import annotations

import base64
import json
import os
import pickle
import socket
import subprocess
import sys
import time
from pathlib import Path

from verify._internal.settings import child_environ, launcher_var
from verify.memory.plan import Config, Plan, byte_unit


def package_root() -> str:
    """The directory that contains the `verify` package (the repository, or site-packages when installed):
    the probe processes import verify (and what sits beside it) from there, as this process did."""
    import verify

    return str(Path(verify.__file__).resolve().parent.parent)


def _zygote_env(plan: Plan) -> dict:
    # nothing of torchrun's rendezvous: a probe process that needs a group gets its own (request env);
    # TORCHELASTIC_USE_AGENT_STORE in particular would make it wait for a store nobody serves
    env = child_environ(drop=("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"),
                        drop_prefixes=("LOCAL_", "GROUP_", "ROLE_", "TORCHELASTIC_"))
    env["PYTHONPATH"] = os.pathsep.join([package_root(), *filter(None, [launcher_var("PYTHONPATH")])])
    # glibc: a fixed mmap threshold stops it raising the threshold after large frees, so tensor-sized
    # blocks are always mmap'ed and unmapped on free: RSS follows live tensors (see RssProbe).
    env["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)
    env["OMP_NUM_THREADS"] = str(plan.threads)
    # idle OpenMP workers sleep instead of spinning: on a shared 2-core box spinning made a step 4x
    # slower (11.9 s vs 3.1 s for N=4, B=8 with other jobs running); peaks are unaffected
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env["OPENBLAS_NUM_THREADS"] = "1"  # numpy's BLAS pool: no idle threads in the zygote we fork from
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU probe never touches a GPU
    return env


def encode_options(options) -> str:
    """Spec.options for the probe process: a pickle, base64 (any picklable object, not only JSON)."""
    return base64.b64encode(pickle.dumps(options)).decode("ascii")


class CpuProbeServer:
    """A `python -m verify.memory._zygote --serve ADAPTER` zygote; `run` measures one configuration in a
    fresh forked process. A zygote that dies is restarted for the next configuration. It runs in this
    process's working directory, so an adapter importable from here is importable there."""

    def __init__(self, plan: Plan, timeout: float = 900):
        self.plan, self.timeout, self.proc = plan, timeout, None
        self.ref, self.options = plan.adapter.locate(), encode_options(plan.options)

    def _start(self):
        import tempfile

        from verify.memory._zygote import MARK

        self.err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "verify.memory._zygote", "--serve", self.ref],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True,
                                     env=_zygote_env(self.plan))
        line = self.proc.stdout.readline()
        if not line.startswith(MARK):
            self._dead()
            raise RuntimeError(f"the CPU probe process did not start: {self._err_tail()}")
        self.info = json.loads(line[len(MARK):])

    def _err_tail(self) -> str:
        self.err.seek(0)
        tail = [ln for ln in self.err.read().splitlines() if ln.strip()]
        return tail[-1] if tail else "no output"

    def _dead(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def request(self, c: Config, port: int | None = None) -> dict:
        p = self.plan
        req = dict(adapter=self.ref, options=self.options, N=c.N, B=c.B, steps=p.steps, warmup=p.warmup, seed=0,
                   data_seed=1 + p.rank, threads=p.threads, timeout=self.timeout)
        if p.world > 1:
            req["env"] = dict(RANK=str(p.rank), WORLD_SIZE=str(p.world), LOCAL_RANK=str(p.rank),
                              MASTER_ADDR=launcher_var("MASTER_ADDR", "127.0.0.1"), MASTER_PORT=str(port))
        return req

    def run(self, c: Config, port: int | None = None) -> dict:
        from verify.memory._zygote import MARK

        if self.proc is None:
            try:
                self._start()
            except (OSError, RuntimeError) as e:
                return dict(error=str(e))
        t0 = time.perf_counter()
        try:
            self.proc.stdin.write(json.dumps(self.request(c, port)) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except OSError:
            line = ""
        if not line.startswith(MARK):
            msg = f"the CPU probe process died: {self._err_tail()}"
            self._dead()
            return dict(error=msg)
        res = json.loads(line[len(MARK):])
        res["process_s"] = time.perf_counter() - t0
        res["isolation"] = "fork" if self.info.get("fork") else "exec"
        return res

    def close(self):
        if self.proc is not None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None


def nvml_status(plan: Plan) -> tuple[object, str | None]:
    """(an NvmlSampler for the plan's device, None) or (None, the one-line reason NVML cannot be used)."""
    from verify.memory.probes import NvmlSampler, ProbeUnavailable

    try:
        return NvmlSampler.open([plan.device], period=0.002), None
    except ProbeUnavailable as e:
        return None, str(e)


class GpuRunner:
    """All configurations in this process, with a full allocator reset before each."""

    def __init__(self, plan: Plan):
        import torch

        from verify._internal.header import fp32_only

        torch.cuda.set_device(plan.device)
        fp32_only()  # fp32 as the anchor measured it
        self.plan = plan
        self.nvml, self.nvml_reason = nvml_status(plan)
        if self.nvml is None and plan.rank == 0:
            print(f"verify.memory: {self.nvml_reason}; GPU peaks from torch's allocator only", file=sys.stderr,
                  flush=True)

    def run(self, c: Config) -> dict:
        import torch

        from verify._internal.protocol import Spec
        from verify.memory import measure
        from verify.memory.probes import CudaProbe, cuda_full_reset, one_line

        p = self.plan
        leftover = cuda_full_reset(p.device)
        spec = Spec(accum_steps=c.N, dtype=torch.float32, device=str(p.device), seed=0, options=p.options)
        try:
            res = measure(p.adapter, spec, micro_batch=c.B, steps=p.steps, warmup=p.warmup,
                          probe=CudaProbe(p.device, self.nvml, self.nvml_reason), data_seed=1 + p.rank)
        except torch.cuda.OutOfMemoryError:
            res = dict(error="CUDA out of memory")
        except Exception as e:  # noqa: BLE001  (a trainer that crashes is a finding, not a harness crash)
            import traceback

            res = dict(error=f"trainer or probe raised {one_line(e)}", traceback=traceback.format_exc())
        res.update(allocated_left_over_bytes=leftover)
        cuda_full_reset(p.device)
        return res


def dist_or_none():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _fresh_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def run_sweeps(plan: Plan, progress=None) -> list[dict]:
    """This rank's measurement of every configuration, in plan order. `progress`: an object whose
    update(done, info) is called after each configuration (the CLI's progress bar), or None."""
    dist = dist_or_none()
    bar = progress if plan.rank == 0 else None
    gpu = GpuRunner(plan) if plan.cuda else None
    cpu = CpuProbeServer(plan) if not plan.cuda else None
    unit, scale = byte_unit(plan.cuda)
    rows = []
    try:
        for i, c in enumerate(plan.configs):
            if dist is not None:
                dist.barrier()
            t_config = time.perf_counter()
            if gpu is not None:
                res = gpu.run(c)
            else:
                port = None
                if dist is not None:
                    box = [_fresh_port() if plan.rank == 0 else None]
                    dist.broadcast_object_list(box, src=0)
                    port = box[0]
                res = cpu.run(c, port)
            res.update(N=c.N, B=c.B, eff=c.N * c.B * plan.world, sweeps=list(c.sweeps), rank=plan.rank,
                       config_s=time.perf_counter() - t_config)
            rows.append(res)
            if bar is not None:
                info = res["error"] if "error" in res else \
                    f"N={c.N} B={c.B} peak {res['peak_bytes'] / scale:.3f} {unit} ({res['config_s']:.1f} s)"
                bar.update(i + 1, info)
    finally:
        if cpu is not None:
            cpu.close()
    if dist is not None:
        dist.barrier()
    return rows
