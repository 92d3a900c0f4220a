"""The CPU probe's process management: each configuration is measured in a FRESH process.

  python -m verify.memory._zygote REQUEST_JSON       one configuration in this new interpreter (slow start)
  python -m verify.memory._zygote --serve [ADAPTER]  a zygote: imports torch, the harness and the adapter
                                                     once, then FORKS a child per request line on stdin

A request names the adapter (MODULE:FACTORY), Spec.options as a base64 pickle, N, B, steps, warmup, seeds,
threads and optionally `env` (WORLD_SIZE > 1: the child joins a gloo group); the result is one line
`MEMPROBE_RESULT {json}` on stdout.
Why a fresh process, and why fork: docs/design/memory.md, "CPU isolation".
"""
from __future__ import annotations

import json
import os
import select
import signal
import sys
import time
import traceback

from verify._internal.settings import launcher_var, set_library_env

MARK = "MEMPROBE_RESULT "


def measure_request(req: dict) -> dict:
    """Measure one configuration in the current (fresh) process."""
    set_library_env(req.get("env") or {})  # a fresh probe process: torch.distributed's env:// reads them
    import torch

    torch.set_num_threads(req["threads"])
    import torch.distributed as dist

    world = int(launcher_var("WORLD_SIZE", "1"))
    if world > 1:
        import datetime

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    try:
        import base64
        import pickle

        from verify._internal.protocol import Spec, load_adapter
        from verify.memory import RssProbe, measure

        adapter = load_adapter(req["adapter"])
        options = pickle.loads(base64.b64decode(req["options"])) if req.get("options") else adapter.defaults
        spec = Spec(accum_steps=req["N"], dtype=torch.float32, device="cpu", seed=req["seed"], options=options)
        res = measure(adapter, spec, micro_batch=req["B"], steps=req["steps"], probe=RssProbe(),
                      data_seed=req["data_seed"], warmup=req.get("warmup", 1))
        res.update(threads=torch.get_num_threads(), pid=os.getpid(),
                   process_group=dict(backend=dist.get_backend(), world=dist.get_world_size()) if world > 1 else None)
        return res
    finally:
        if world > 1 and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def _safe(req: dict) -> dict:
    try:
        return measure_request(req)
    except Exception as e:  # noqa: BLE001  (reported as this configuration's error, with the traceback)
        from verify.memory.probes import one_line

        return dict(error=f"trainer or probe raised {one_line(e)}", traceback=traceback.format_exc())


def _run_forked(req: dict, timeout: float) -> dict:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the fresh process
        code = 1
        try:
            os.close(r)
            os.dup2(2, 1)  # stray prints must not reach the zygote's result channel
            res = _safe(req)
            data = json.dumps(res).encode()
            while data:
                data = data[os.write(w, data):]
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    chunks, deadline = [], time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([r], [], [], left)[0]:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(r)
            return dict(error=f"probe process timed out after {timeout:.0f} s")
        chunk = os.read(r, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    if chunks:
        return json.loads(b"".join(chunks))
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        hint = " (out of memory? the kernel's OOM killer sends SIGKILL)" if sig == signal.SIGKILL else ""
        return dict(error=f"probe process killed by signal {signal.Signals(sig).name}{hint}")
    return dict(error=f"probe process exited {os.WEXITSTATUS(status)} without a result")


def _run_exec(req: dict, timeout: float) -> dict:
    import subprocess

    try:
        p = subprocess.run([sys.executable, "-m", "verify.memory._zygote", json.dumps(req)], capture_output=True,
                           text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(error=f"probe process timed out after {timeout:.0f} s")
    for line in p.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    tail = [ln for ln in p.stderr.splitlines() if ln.strip()]
    return dict(error=f"probe process exited {p.returncode}: {tail[-1] if tail else 'no output'}")


def serve(ref: str | None = None) -> int:
    import torch

    import torch.distributed  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401  (FSDP2 adapters import it lazily: ~0.5 s per child otherwise)

    from verify._internal.cases import case  # noqa: F401  (measure draws through it)
    from verify._internal.protocol import load_adapter
    from verify.memory import probes  # noqa: F401

    if ref is not None:  # import the adapter's module once, here, not in every child
        load_adapter(ref)
    # The first optimizer constructor imports torch._dynamo (~1 s): pay it here, once. No tensor this makes
    # survives: every child starts from import-time state.
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    fork = hasattr(os, "fork")
    out = sys.stdout
    out.write(MARK + json.dumps(dict(ready=True, fork=fork, pid=os.getpid())) + "\n")
    out.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        timeout = float(req.get("timeout", 900))
        res = _run_forked(req, timeout) if fork else _run_exec(req, timeout)
        out.write(MARK + json.dumps(res) + "\n")
        out.flush()
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"] and len(argv) <= 2:
        return serve(argv[1] if len(argv) == 2 else None)
    res = _safe(json.loads(argv[0]))
    print(MARK + json.dumps(res), flush=True)
    return 0 if "error" not in res else 1


if __name__ == "__main__":
    sys.exit(main())
