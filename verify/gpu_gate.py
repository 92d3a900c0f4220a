"""python -m verify.gpu_gate [--out DIR] [--profile gpu|ci|dev] [--max-world W] [--no-memory]

The CI gate on a GPU box, one command a workflow or a person runs: it looks at the GPUs torch sees and runs

  gates     the gates on CUDA (hypothesis profile gpu; deterministic algorithms, TF32 off)
  gpu-tests the harness's own GPU tests (tests/ -m gpu), from a checkout
  memory    python -m verify.memory --effective-batch 32 on the first GPU (peak follows one micro-batch)
  nccl      with ≥ 2 GPUs: the data-parallel gates over NCCL, worlds 1..min(GPUs, W), rank r on cuda:r
            (from a checkout: also xtrain's DDP, DDP-option, FSDP2 and planted-bug tests)

each as a subprocess with its own log, then writes DIR/gpu-gate.json (the one report header, every step's
exit status, time and last line) and DIR/summary.md (for $GITHUB_STEP_SUMMARY), and exits 1 if any step
failed, 2 on bad input (no GPU, an unwritable DIR).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from ._cli import Parser, UsageError, fail, positive_int, writable_dir

from .settings import Settings, SettingError, env_of

STEP_TIMEOUT = {"gates": 900, "gpu-tests": 600, "memory": 600, "nccl": 1200}


def parse_args(argv=None):
    p = Parser(prog="verify.gpu_gate", description=__doc__.split("\n\n")[1])
    p.add_argument("--out", default="gpu-reports", help="directory for the logs and reports (default gpu-reports)")
    p.add_argument("--profile", choices=("gpu", "ci", "dev"), default="gpu", help="hypothesis profile (default gpu)")
    p.add_argument("--max-world", type=positive_int, default=4, help="largest NCCL world (default 4, capped by GPUs)")
    p.add_argument("--no-memory", action="store_true", help="skip the memory probe")
    return p.parse_args(argv)


def _checkout() -> str | None:
    """The repository root when verify runs from a checkout (tests/ beside it), else None (installed)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return root if os.path.isdir(os.path.join(root, "tests")) and os.path.isfile(os.path.join(root, "pyproject.toml")) else None


def _plugin_args() -> list[str]:
    """`-p _xtrain_pytest.entry` when the pytest11 entry point is not registered (a bare tree on PYTHONPATH,
    e.g. a checkout copied to a GPU box without `pip install`); an installed xtrain loads it by itself, and
    loading it twice would be an error."""
    from importlib.metadata import entry_points

    registered = any(ep.value == "_xtrain_pytest.entry" for ep in entry_points(group="pytest11"))
    return [] if registered else ["-p", "_xtrain_pytest.entry"]


def plan(gpus: int, out: str, args, root: str | None) -> list[tuple[str, list[str], dict]]:
    py = sys.executable
    pytest = [py, "-m", "pytest", "-p", "no:cacheprovider", *_plugin_args(), "-q", "-rs"]
    here = ["verify"] if root else ["--pyargs", "verify"]
    env = {env_of("hypothesis_profile"): args.profile}
    steps = [("gates", [*pytest, *here, "-m", "not distributed", "--verify-device", "cuda", "-n", "4",
                        "--verify-report", os.path.join(out, "gates"), "--junitxml", os.path.join(out, "gates.xml")], env)]
    if root:
        steps.append(("gpu-tests", [*pytest, "tests", "-m", "gpu", "--junitxml", os.path.join(out, "gpu-tests.xml")], env))
    if not args.no_memory:
        steps.append(("memory", [py, "-m", "verify.memory", "--effective-batch", "32", "--device", "cuda:0",
                                 "--out", os.path.join(out, "memory")], {}))
    if gpus >= 2:
        targets = here + (["tests/harness/test_gates_dist.py", "tests/core/test_fsdp.py", "tests/harness/test_ddp_modes.py"] if root else [])
        targets = [t for t in targets if root is None or t.startswith("-") or os.path.exists(os.path.join(root, t))]
        steps.append(("nccl", [*pytest, *targets, "-m", "distributed", "--verify-backend", "nccl", "--verify-device",
                               "cuda", "-n", "2", "--verify-report", os.path.join(out, "nccl"),
                               "--junitxml", os.path.join(out, "nccl.xml")],
                      {**env, env_of("max_world"): str(min(gpus, args.max_world))}))
    return steps


def _last_line(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            lines = [ln.strip() for ln in f if ln.strip()]
        return lines[-1][:300] if lines else ""
    except OSError:
        return ""


def run_steps(steps, out: str, root: str | None) -> list[dict]:
    results = []
    for i, (name, cmd, env) in enumerate(steps):
        log = os.path.join(out, f"{name}.log")
        print(f"[{i + 1}/{len(steps)}] {name}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        with open(log, "w") as f:
            try:
                rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=root or os.getcwd(),
                                    env={**os.environ, **env}, timeout=STEP_TIMEOUT[name]).returncode
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
             "| step | result | seconds | last line |", "|---|---|---|---|"]
    for s in doc["steps"]:
        lines.append(f"| {s['step']} | {'passed' if s['returncode'] == 0 else 'FAILED (%d)' % s['returncode']} | "
                     f"{s['seconds']:.0f} | {s['last_line'].replace('|', '/')} |")
    from . import report

    for sub in ("gates", "nccl"):
        md = report.paths(os.path.join(doc["out"], sub))[1]
        if os.path.isfile(md):  # its body: the title line (the trainer) gives way to the step's heading
            lines += ["", f"### {sub}", "", open(md).read().split("\n", 2)[-1].strip()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    out = os.path.abspath(args.out)
    try:
        Settings.from_env()  # a bad knob fails here, in one line, not in every step's subprocess
        import torch

        if not torch.cuda.is_available():
            raise UsageError("no CUDA GPU is visible to torch: this gate is for GPU runners (on a CPU box run "
                             "`HYPOTHESIS_PROFILE=ci python -m pytest -n auto`)")
        writable_dir("--out", args.out)
    except (UsageError, SettingError) as e:
        fail(str(e))
    from ._meta import atomic_write, header

    gpus, root = torch.cuda.device_count(), _checkout()
    print(f"verify.gpu_gate: {gpus} GPU(s) ({torch.cuda.get_device_name(0)}), reports in {out}", file=sys.stderr)
    steps = run_steps(plan(gpus, out, args, root), out, root)
    doc = dict(header("gpu-gate", "cuda"), out=out, gpus=gpus, profile=args.profile, steps=steps,
               passed=all(s["returncode"] == 0 for s in steps))
    atomic_write(os.path.join(out, "gpu-gate.json"), json.dumps(doc, indent=1))
    atomic_write(os.path.join(out, "summary.md"), summary_md(doc))
    print(f"verify.gpu_gate: {'passed' if doc['passed'] else 'FAILED'}; wrote {out}/gpu-gate.json, summary.md",
          file=sys.stderr)
    return 0 if doc["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
