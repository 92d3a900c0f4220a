"""python -m verify.gpu_gate [--out DIR] [--profile gpu|ci|dev] [--max-world W] [--no-memory] [--backend nccl|gloo]
                            [--trainer MODULE:FACTORY]

The CI gate on a GPU box, one command a workflow or a person runs: it looks at the GPUs torch sees and runs

  gates     the gates on CUDA (hypothesis profile gpu; deterministic algorithms, TF32 off)
  gpu-tests the harness's own GPU tests (tests/ -m gpu), from a checkout
  memory    python -m verify.memory --effective-batch 32 on the first GPU (peak follows one micro-batch)
  nccl      with ≥ 2 GPUs: the data-parallel gates over NCCL, worlds 1..min(GPUs, W), rank r on cuda:r
            (from a checkout: also xtrain's DDP, DDP-option, FSDP2 and planted-bug tests)

each as a subprocess with its own log, then writes DIR/gpu-gate.json (the one report header, every step's
exit status, time and last line) and DIR/summary.md (for $GITHUB_STEP_SUMMARY), and exits 1 if any step
failed, 2 on bad input (no GPU, an unwritable DIR). `--trainer MODULE:FACTORY` proves your trainer instead of
xtrain's: the gates, nccl and launched steps get it (--verify-trainer), run from the current directory; the
steps of xtrain's own (its GPU tests, the memory probe, the checkout's NCCL tests) are left out.

Under torchrun (`torchrun --nnodes M --nproc-per-node G ... -m verify.gpu_gate --out DIR`) it adds the worlds
above the box's GPUs: rank 0 runs the steps above on its node while the other ranks wait on torchrun's store,
touching no GPU; then every rank starts `python -m verify.run` (verify/run.py) in the launched world:

  launched  the data-parallel gates at the launched world (M·G ranks, rank r on cuda:LOCAL_RANK; the worlds below
            it on its subgroups for adapters that declare subgroups, xtrain's included), --backend
            nccl (default), or gloo for a dry run of the launch itself on CPU ranks

and gpu-gate.json records the launch (nodes, ranks per node, backend, rendezvous). Rank 0's exit status is
the gate's; torchrun stops every rank when one fails.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from ._cli import Parser, UsageError, fail, plugin_args, positive_int, writable_dir

from .settings import Settings, SettingError, child_environ, env_of, install

STEP_TIMEOUT = {"gates": 900, "gpu-tests": 600, "memory": 600, "nccl": 1200, "launched": 1800}
GO = "gpu-gate/go"  # torchrun's store key rank 0 sets when the launched world may start (pool_launched.connect's prefix)


def parse_args(argv=None):
    p = Parser(prog="verify.gpu_gate", description=__doc__.split("\n\n")[1])
    p.add_argument("--out", default="gpu-reports", help="directory for the logs and reports (default gpu-reports)")
    p.add_argument("--profile", choices=("gpu", "ci", "dev"), default="gpu", help="hypothesis profile (default gpu)")
    p.add_argument("--max-world", type=positive_int, default=4, help="largest NCCL world (default 4, capped by GPUs)")
    p.add_argument("--no-memory", action="store_true", help="skip the memory probe")
    p.add_argument("--trainer", metavar="MODULE:FACTORY",
                   help="the trainer the gates prove (default xtrain's; then xtrain's own steps are left out)")
    p.add_argument("--backend", choices=("nccl", "gloo"), default="nccl",
                   help="under torchrun: the launched world's backend (default nccl; gloo: CPU ranks, a dry run)")
    return p.parse_args(argv)


def _checkout() -> str | None:
    """The repository root when verify runs from a checkout (tests/ beside it), else None (installed)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return root if os.path.isdir(os.path.join(root, "tests")) and os.path.isfile(os.path.join(root, "pyproject.toml")) else None


def plan(gpus: int, out: str, args, root: str | None, launch: dict | None = None) -> list[tuple[str, list[str], dict]]:
    """The steps, in order: (name, command, environment). `launch` (pool_launched.describe's dict, under torchrun)
    adds the launched step last: the command every rank runs, verify.run in the launched world."""
    py = sys.executable
    pytest = [py, "-m", "pytest", "-p", "no:cacheprovider", *plugin_args(), "-q", "-rs"]
    trainer = getattr(args, "trainer", None)
    root = None if trainer else root  # a user's trainer: the installed plan, from the user's directory
    pytest += ["--verify-trainer", trainer] if trainer else []
    here = ["verify"] if root else ["--pyargs", "verify"]
    env = {env_of("hypothesis_profile"): args.profile}
    steps = [("gates", [*pytest, *here, "-m", "not distributed", "--verify-device", "cuda", "-n", "4",
                        "--verify-report", os.path.join(out, "gates"), "--junitxml", os.path.join(out, "gates.xml")], env)]
    if root:
        steps.append(("gpu-tests", [*pytest, "tests", "-m", "gpu", "--junitxml", os.path.join(out, "gpu-tests.xml")], env))
    if not args.no_memory and not trainer:  # the probe measures xtrain's trainer
        steps.append(("memory", [py, "-m", "verify.memory", "--effective-batch", "32", "--device", "cuda:0",
                                 "--out", os.path.join(out, "memory")], {}))
    if gpus >= 2:
        targets = here + (["tests/harness/test_gates_dist.py", "tests/core/test_fsdp.py", "tests/harness/test_ddp_modes.py"] if root else [])
        targets = [t for t in targets if root is None or t.startswith("-") or os.path.exists(os.path.join(root, t))]
        steps.append(("nccl", [*pytest, *targets, "-m", "distributed", "--verify-backend", "nccl", "--verify-device",
                               "cuda", "-n", "2", "--verify-report", os.path.join(out, "nccl"),
                               "--junitxml", os.path.join(out, "nccl.xml")],
                      {**env, env_of("max_world"): str(min(gpus, args.max_world))}))
    if launch is not None:  # verify.run adds --pyargs verify and turns xdist off; its world is the launch's
        steps.append(("launched", [py, "-m", "verify.run", *pytest[3:],
                                   "-m", "distributed", "--verify-backend", launch["backend"],  # gloo ranks: the CPU
                                   "--verify-device", "cuda" if launch["backend"] == "nccl" else "cpu",
                                   "--verify-report", os.path.join(out, "launched"),
                                   "--junitxml", os.path.join(out, "launched.xml")], env))
    return steps


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
    from .pool_launched import LAUNCH_VARS

    return child_environ(drop=() if name == "launched" else LAUNCH_VARS)


def run_steps(steps, out: str, root: str | None, before=None) -> list[dict]:
    """Each step as a subprocess logging to DIR/<step>.log; `before(name)` is called as each one starts."""
    results = []
    for i, (name, cmd, env) in enumerate(steps):
        if before is not None:
            before(name)
        log = os.path.join(out, f"{name}.log")
        print(f"[{i + 1}/{len(steps)}] {name}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        with open(log, "w") as f:
            try:
                rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=root or os.getcwd(),
                                    env={**step_environ(name), **env}, timeout=STEP_TIMEOUT[name],
                                    preexec_fn=_die_with_parent if name == "launched" and sys.platform == "linux"
                                    else None).returncode
            except subprocess.TimeoutExpired:
                rc = 124
                f.write(f"\nverify.gpu_gate: step {name} timed out after {STEP_TIMEOUT[name]} s\n")
        dt = time.monotonic() - t0
        results.append(dict(step=name, command=" ".join(cmd), returncode=rc, seconds=round(dt, 1), log=log,
                            last_line=_last_line(log)))
        print(f"    {'ok' if rc == 0 else 'FAILED (exit %d)' % rc} in {dt:.0f} s: {results[-1]['last_line']}",
              file=sys.stderr, flush=True)
    return results


def summary_md(doc: dict) -> str:
    from ._meta import commit_text

    mi = doc["machine_info"]
    ok = all(s["returncode"] == 0 for s in doc["steps"])
    lines = [f"## verify GPU gate: {'passed' if ok else 'FAILED'}", "",
             f"{mi.get('gpu_count')} × {mi.get('gpu')} · torch {mi.get('torch')} · CUDA {mi.get('cuda')} · NCCL "
             f"{mi.get('nccl')} · driver {mi.get('driver')} · {commit_text(doc)} · {doc.get('utc')}", "",
             *([f"launched: {_launch_text(doc['launch'])}", ""] if doc.get("launch") else []),
             "| step | result | seconds | last line |", "|---|---|---|---|"]
    for s in doc["steps"]:
        lines.append(f"| {s['step']} | {'passed' if s['returncode'] == 0 else 'FAILED (%d)' % s['returncode']} | "
                     f"{s['seconds']:.0f} | {s['last_line'].replace('|', '/')} |")
    from . import report

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


def serve_launch(args, out: str, root: str | None, env: dict, s: Settings) -> int:
    """A launched rank other than 0: wait on torchrun's store (no deadline, no GPU touched) until rank 0 has run
    its node's steps, then be a rank of the launched world (verify.run), its output torchrun's."""
    from . import pool_launched

    store = pool_launched.connect(s.timeout)
    pool_launched._wait(store, GO, None)  # a store that is gone (rank 0's node failed) raises: this rank ends
    _, cmd, step_env = plan(0, out, args, root, pool_launched.describe(env, args.backend))[-1]
    return subprocess.run(cmd, cwd=root or os.getcwd(), env={**child_environ(), **step_env},
                          preexec_fn=_die_with_parent if sys.platform == "linux" else None).returncode


def main(argv=None) -> int:
    args = parse_args(argv)
    out = os.path.abspath(args.out)
    from . import pool_launched

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
        return serve_launch(args, out, None if args.trainer else _checkout(), env, s)
    try:
        if not _cuda_available():
            raise UsageError("no CUDA GPU is visible to torch: this gate is for GPU runners (on a CPU box run "
                             "`HYPOTHESIS_PROFILE=ci python -m pytest -n auto`)")
        writable_dir("--out", args.out)
        if args.trainer:  # one line now, rather than a usage error in every step's log
            from .protocol import load_adapter

            load_adapter(args.trainer, option="--trainer")
    except (UsageError, SettingError, ValueError) as e:
        fail(str(e))
    import torch

    from ._meta import atomic_write, header

    gpus, root = torch.cuda.device_count(), None if args.trainer else _checkout()
    launch = pool_launched.describe(env, args.backend) if env is not None else None
    print(f"verify.gpu_gate: {gpus} GPU(s) ({torch.cuda.get_device_name(0)}), reports in {out}"
          + (f"; launched: {_launch_text(launch)}" if launch else ""), file=sys.stderr)

    def go(name: str) -> None:  # the other ranks join now (the store is reached then: no connection idles for an hour)
        if name == "launched":
            pool_launched.connect(s.timeout).set(GO, "1")

    steps = run_steps(plan(gpus, out, args, root, launch), out, root, go)
    doc = dict(header("gpu-gate", "cuda"), out=out, gpus=gpus, profile=args.profile, steps=steps,
               passed=all(s["returncode"] == 0 for s in steps), **({"launch": launch} if launch else {}))
    atomic_write(os.path.join(out, "gpu-gate.json"), json.dumps(doc, indent=1))
    atomic_write(os.path.join(out, "summary.md"), summary_md(doc))
    print(f"verify.gpu_gate: {'passed' if doc['passed'] else 'FAILED'}; wrote {out}/gpu-gate.json, summary.md",
          file=sys.stderr)
    return 0 if doc["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
