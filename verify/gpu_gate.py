"""python -m verify.gpu_gate [--out DIR] [--profile gpu|ci|dev] [--max-world W] [--no-memory] [--backend nccl|gloo]
                            [--trainer MODULE:FACTORY] [--scale] [--effective-batch E]

The CI gate on a GPU box: the shipped gates on CUDA (profile gpu), the memory probe on the first GPU, and with
≥ 2 GPUs the data-parallel gates over NCCL; each step a subprocess with its own log, then DIR/gpu-gate.json and
DIR/summary.md; exit 1 if a step failed, 2 on bad input. `--trainer` proves your trainer (the memory step is
then left out). Under torchrun it adds the launched world (verify.run) above the box's GPUs. A repository adds
its own steps through main(extra=...) (this one's: tools/gpu_gate.py). `--scale --trainer T`: a production-size
trainer on one GPU, planned first (scale_plan). Details: docs/design/distributed.md, memory.md ("Scale plan").
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from verify._internal.cli import Parser, UsageError, fail, plugin_args, positive_int, writable_dir

from verify._internal.settings import Settings, SettingError, child_environ, env_of, install, usable_cores

STEP_TIMEOUT = {"plan": 300, "gates": 900, "memory": 600, "nccl": 1200, "launched": 1800}  # seconds
SCALE_GATES = "accumulation_equals_big_batch or accum1_bit_identical or reported_metrics"  # verify/test_gates.py
OTHER_STEP_TIMEOUT = 1200  # a caller's own step (plan's `extra`)
GO = "gpu-gate/go"  # torchrun's store key rank 0 sets when the launched world may start (pool_launched.connect's prefix)


def parse_args(argv=None):
    p = Parser(prog="verify.gpu_gate", description=__doc__.split("\n\n")[1])
    p.add_argument("--out", default="gpu-reports", help="directory for the logs and reports (default gpu-reports)")
    p.add_argument("--profile", choices=("gpu", "ci", "dev"), default="gpu", help="hypothesis profile (default gpu)")
    p.add_argument("--max-world", type=positive_int, default=4, help="largest NCCL world (default 4, capped by GPUs)")
    p.add_argument("--no-memory", action="store_true", help="skip the memory probe")
    p.add_argument("--trainer", metavar="MODULE:FACTORY",
                   help="the trainer the gates prove (default xtrain's; then xtrain's own steps are left out)")
    p.add_argument("--scale", action="store_true",
                   help="one GPU, a production-size --trainer: its memory plan, then equivalence, bit-exact, metrics "
                        "(profile scale) and the memory probe")
    p.add_argument("--effective-batch", type=positive_int, default=None, metavar="E",
                   help="the memory probe's effective batch (default 32; with --scale 512, at the ends of each sweep: "
                        "a checkpointed row's activations are small next to a large model's gradient buffers)")
    p.add_argument("--plan-only", action="store_true",
                   help="with --scale: the memory plan alone (DIR/plan.json, or its one-line refusal), nothing run")
    p.add_argument("--backend", choices=("nccl", "gloo"), default="nccl",
                   help="under torchrun: the launched world's backend (default nccl; gloo: CPU ranks, a dry run)")
    return p.parse_args(argv)


def plan(gpus: int, out: str, args, launch: dict | None = None, extra=None) -> list[tuple[str, list[str], dict]]:
    """The steps, in order: (name, command, environment). `extra(gpus, out, args, pytest, env)` adds steps of the
    caller's own (a repository's tests: tools/gpu_gate.py) after the shipped ones; `launch` (pool_launched.describe's
    dict, under torchrun) adds the launched step last: the command every rank runs, verify.run in the launched world."""
    py = sys.executable
    pytest = [py, "-m", "pytest", "-p", "no:cacheprovider", *plugin_args(), "-q", "-rs"]
    trainer = getattr(args, "trainer", None)
    pytest += ["--verify-trainer", trainer] if trainer else []
    env = {env_of("hypothesis_profile"): args.profile}
    if getattr(args, "scale", False):  # the float64 comparisons of a billion parameters run on the host: its cores
        threads = str(min(usable_cores(), 16))  # (one trainer at a time on the GPU: no rank competes for them)
        return scale_plan(out, args, pytest, {env_of("hypothesis_profile"): "scale", env_of("threads"): threads})
    steps = [("gates", [*pytest, "--pyargs", "verify", "-m", "not distributed", "--verify-device", "cuda", "-n", "4",
                        "--verify-report", os.path.join(out, "gates"), "--junitxml", os.path.join(out, "gates.xml")], env)]
    if not args.no_memory and not trainer:  # the probe's own default: the configured default trainer
        steps.append(("memory", [py, "-m", "verify.memory", "--effective-batch", str(getattr(args, "effective_batch", None) or 32),
                                 "--device", "cuda:0",
                                 "--out", os.path.join(out, "memory")], {}))
    if gpus >= 2:
        steps.append(("nccl", [*pytest, "--pyargs", "verify", "-m", "distributed", "--verify-backend", "nccl",
                               "--verify-device", "cuda", "-n", "2", "--verify-report", os.path.join(out, "nccl"),
                               "--junitxml", os.path.join(out, "nccl.xml")], {**env, **nccl_world(gpus, args)}))
    if extra is not None:
        steps += extra(gpus, out, args, pytest, env)
    if launch is not None:  # verify.run adds --pyargs verify and turns xdist off; its world is the launch's
        steps.append(("launched", [py, "-m", "verify.run", *pytest[3:],
                                   "-m", "distributed", "--verify-backend", launch["backend"],  # gloo ranks: the CPU
                                   "--verify-device", "cuda" if launch["backend"] == "nccl" else "cpu",
                                   "--verify-report", os.path.join(out, "launched"),
                                   "--junitxml", os.path.join(out, "launched.xml")], env))
    return steps


def scale_plan(out: str, args, pytest: list[str], env: dict) -> list[tuple[str, list[str], dict]]:
    """--scale: the memory plan (verify/_internal/scaleplan.py; one line and exit 2 when it cannot fit, nothing else
    run), then equivalence, bit-exact and metrics in one process on cuda:0 (no xdist: one trainer at a time; profile
    scale: every corner and one drawn case), then the memory probe on the same trainer: --effective-batch (512) at
    the ends of each sweep, one measured step (five builds of the trainer, not one per divisor of E). Each step's GPU
    peak is in the report (GpuPeak)."""
    py = sys.executable
    plan = [("plan", [py, "-m", "verify._internal.scaleplan", args.trainer, "cuda:0", os.path.join(out, "plan.json")], {})]
    if getattr(args, "plan_only", False):
        return plan
    return [*plan,
            ("gates", [*pytest, "--pyargs", "verify", "-k", SCALE_GATES, "--verify-device", "cuda", "-p", "no:xdist",
                       "--verify-report", os.path.join(out, "gates"), "--junitxml", os.path.join(out, "gates.xml")], env),
            ("memory", [py, "-m", "verify.memory", "--trainer", args.trainer, "--effective-batch",
                        str(getattr(args, "effective_batch", None) or 512), "--sweep", "ends", "--steps", "1", "--device", "cuda:0",
                        "--out", os.path.join(out, "memory")], {})]


def nccl_world(gpus: int, args) -> dict:
    """A step's environment for the largest NCCL world: the box's GPUs, at most --max-world."""
    return {env_of("max_world"): str(min(gpus, args.max_world))}


def _last_line(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            lines = [ln.strip() for ln in f if ln.strip()]
        return lines[-1][:300] if lines else ""
    except OSError:
        return ""


def _die_with_parent() -> None:
    """In a step's child: SIGTERM when this process dies (torchrun stops a failed launch's ranks with SIGTERM;
    verify.run prints its stacks on it)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def step_environ(name: str) -> dict:
    """The environment a step starts from: this one, less torchrun's variables unless it is the launched step
    (a node's own steps are no launched ranks: Accelerate, for one, would take them for a world of W)."""
    from verify._internal.ranks.launched import LAUNCH_VARS

    return child_environ(drop=() if name == "launched" else LAUNCH_VARS)


def run_steps(steps, out: str, cwd: str, before=None) -> list[dict]:
    """Each step as a subprocess logging to DIR/<step>.log; `before(name)` is called as each one starts."""
    results = []
    for i, (name, cmd, env) in enumerate(steps):
        if before is not None:
            before(name)
        log = os.path.join(out, f"{name}.log")
        print(f"[{i + 1}/{len(steps)}] {name}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
        limit = STEP_TIMEOUT.get(name, OTHER_STEP_TIMEOUT)
        t0 = time.monotonic()
        with open(log, "w") as f, GpuPeak() as peak:
            try:
                rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=cwd,
                                    env={**step_environ(name), **env}, timeout=limit,
                                    preexec_fn=_die_with_parent if name == "launched" and sys.platform == "linux"
                                    else None).returncode
            except subprocess.TimeoutExpired:
                rc = 124
                f.write(f"\nverify.gpu_gate: step {name} timed out after {limit} s\n")
        dt = time.monotonic() - t0
        results.append(dict(step=name, command=" ".join(cmd), returncode=rc, seconds=round(dt, 1), log=log,
                            last_line=_last_line(log), gpu_peak_gib=peak.gib))
        print(f"    {'ok' if rc == 0 else 'FAILED (exit %d)' % rc} in {dt:.0f} s"
              f"{'' if peak.gib is None else f', GPU peak {peak.gib:.1f} GiB'}: {results[-1]['last_line']}",
              file=sys.stderr, flush=True)
        if name == "plan" and rc != 0:
            break  # a plan that does not fit runs nothing
    return results


class GpuPeak:
    """The most memory any GPU of the box had in use while the block ran (NVML, sampled every 0.2 s: every process,
    the CUDA contexts included); gib is None without NVML."""

    def __enter__(self):
        import threading

        self.gib, self._stop = None, threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception:  # noqa: BLE001  (no NVML: no GPU peak, the step runs the same)
            return self
        self.gib = 0.0

        def sample():
            while not self._stop.wait(0.2):
                used = max(pynvml.nvmlDeviceGetMemoryInfo(h).used for h in handles)
                self.gib = max(self.gib, used / 2**30)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if getattr(self, "_thread", None) is not None:
            self._thread.join()
        return False


def summary_md(doc: dict) -> str:
    from verify._internal.header import commit_text

    mi = doc["machine_info"]
    ok = all(s["returncode"] == 0 for s in doc["steps"])
    lines = [f"## verify GPU gate: {'passed' if ok else 'FAILED'}", "",
             f"{mi.get('gpu_count')} × {mi.get('gpu')} · torch {mi.get('torch')} · CUDA {mi.get('cuda')} · NCCL "
             f"{mi.get('nccl')} · driver {mi.get('driver')} · {commit_text(doc)} · {doc.get('utc')}", "",
             *([f"launched: {_launch_text(doc['launch'])}", ""] if doc.get("launch") else []),
             "| step | result | seconds | GPU peak (GiB) | last line |", "|---|---|---|---|---|"]
    for s in doc["steps"]:
        peak = "—" if s.get("gpu_peak_gib") is None else f"{s['gpu_peak_gib']:.1f}"
        lines.append(f"| {s['step']} | {'passed' if s['returncode'] == 0 else 'FAILED (%d)' % s['returncode']} | "
                     f"{s['seconds']:.0f} | {peak} | {s['last_line'].replace('|', '/')} |")
    from verify._internal import report

    for sub in ("gates", "nccl", "launched"):
        md = report.paths(os.path.join(doc["out"], sub))[1]
        if os.path.isfile(md):  # its body: the title line (the trainer) gives way to the step's heading
            lines += ["", f"### {sub}", "", open(md).read().split("\n", 2)[-1].strip()]
    return "\n".join(lines) + "\n"


def _launch_text(launch: dict) -> str:
    return (f"{launch['launcher']}, {launch['nodes']} node(s) × {launch['ranks_per_node']} = world {launch['world']}, "
            f"{launch['backend']}, rendezvous {launch['rendezvous']}")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def serve_launch(args, out: str, env: dict, s: Settings) -> int:
    """A launched rank other than 0: wait on torchrun's store (no deadline, no GPU touched) until rank 0 has run
    its node's steps, then be a rank of the launched world (verify.run), its output torchrun's."""
    from verify._internal.ranks import launched as pool_launched

    store = pool_launched.connect(s.timeout)
    pool_launched._wait(store, GO, None)  # a store that is gone (rank 0's node failed) raises: this rank ends
    _, cmd, step_env = plan(0, out, args, pool_launched.describe(env, args.backend))[-1]
    return subprocess.run(cmd, cwd=os.getcwd(), env={**child_environ(), **step_env},
                          preexec_fn=_die_with_parent if sys.platform == "linux" else None).returncode


def main(argv=None, extra=None) -> int:
    """The gate; `extra` adds a caller's own steps (plan()), run from the current directory."""
    args = parse_args(argv)
    out = os.path.abspath(args.out)
    from verify._internal.ranks import launched as pool_launched

    env = pool_launched.launched_env()
    try:  # this process's Settings, once: a bad knob fails here, in one line, not in every step's subprocess
        s = install(Settings.from_env())
    except SettingError as e:
        fail(str(e))
    if env is not None and int(env["RANK"]) != 0:
        try:
            if not _cuda_available():
                raise UsageError("no CUDA GPU is visible to torch on this launched rank")
        except UsageError as e:
            fail(str(e))
        return serve_launch(args, out, env, s)
    try:
        if not _cuda_available():
            raise UsageError("no CUDA GPU is visible to torch: this gate is for GPU runners (on a CPU box run "
                             "`HYPOTHESIS_PROFILE=ci python -m pytest -n auto`)")
        writable_dir("--out", args.out)
        if args.plan_only and not args.scale:
            raise UsageError("--plan-only is --scale's: add --scale (and --trainer MODULE:FACTORY)")
        if args.scale and not args.trainer:
            raise UsageError("--scale needs --trainer MODULE:FACTORY: the production-size trainer to prove "
                             "(a module-level adapter of it)")
        if args.trainer:  # one line now, rather than a usage error in every step's log
            from verify._internal.protocol import load_adapter

            load_adapter(args.trainer, option="--trainer")
    except (UsageError, SettingError, ValueError) as e:
        fail(str(e))
    import torch

    from verify._internal.header import atomic_write, header

    gpus = torch.cuda.device_count()
    launch = pool_launched.describe(env, args.backend) if env is not None else None
    print(f"verify.gpu_gate: {gpus} GPU(s) ({torch.cuda.get_device_name(0)}), reports in {out}"
          + (f"; launched: {_launch_text(launch)}" if launch else ""), file=sys.stderr)

    def go(name: str) -> None:  # the other ranks join now (the store is reached then: no connection idles for an hour)
        if name == "launched":
            pool_launched.connect(s.timeout).set(GO, "1")

    steps = run_steps(plan(gpus, out, args, launch, extra), out, os.getcwd(), go)
    if steps[0]["step"] == "plan" and steps[0]["returncode"] != 0:  # --scale: refused before anything ran
        fail(steps[0]["last_line"].removeprefix("verify.scaleplan: ").removeprefix("error: "))
    doc = dict(header("gpu-gate", "cuda"), out=out, gpus=gpus, profile=args.profile, steps=steps,
               passed=all(s["returncode"] == 0 for s in steps), **({"launch": launch} if launch else {}))
    atomic_write(os.path.join(out, "gpu-gate.json"), json.dumps(doc, indent=1))
    atomic_write(os.path.join(out, "summary.md"), summary_md(doc))
    print(f"verify.gpu_gate: {'passed' if doc['passed'] else 'FAILED'}; wrote {out}/gpu-gate.json, summary.md",
          file=sys.stderr)
    return 0 if doc["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
