"""python -m verify.memory --effective-batch E [--device auto|cpu|cuda|cuda:K] [--model tiny|small|gpt2-ish]
                        [--seq-len S] [--steps K] [--out DIR] [--trainer NAME|module:factory] [--threads T]

Measures the peak memory of gradient accumulation and checks that it follows ONE micro-batch, not N.

  sweep A  fixed effective batch E: every N dividing E, with B = E/N
  sweep B  fixed micro-batch B = 1: N = 1, 2, 4, 8, ... up to E

Each configuration is isolated: on the CPU a fresh process per configuration (peak RSS above the RSS
right before the measured steps); on a GPU one process with a full allocator reset between
configurations (torch's max allocated/reserved, plus NVML device memory used sampled by a thread).
Writes OUT/memory-E{E}.json, .md and .png (atomically, all or none) and exits 1 if an invariant fails:

  (a) fixed E: peak does not grow as N grows; peak(N=E, B=1) is well below peak(N=1, B=E)
  (b) fixed B: peak is flat within 2% for N >= 2; peak(N=2) - peak(N=1) <= the gradient buffers

Under torchrun each rank measures its own process/device; rank 0 writes the report with per-rank
peaks. Thresholds and what each figure includes: docs/design.md, "Peak memory".
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from xtrain_core.cli import Parser, Progress, UsageError, fail, positive_int, resolve_device
from xtrain_core.config import PRESETS, ModelConfig

SCHEMA_VERSION = 1
MiB, GiB = 2**20, 2**30
REL_TOL = 0.02
"""Flatness / no-growth tolerance relative to the peak (the issue's 2%)."""
CPU_NOISE_BYTES = 4 * MiB
"""CPU absolute noise floor. Six configurations (small, S=256, (1,1) to (1,32)) repeated 5× each in fresh
processes had a spread (max − min) of at most 0.33 MiB (docs/design.md); 4 MiB is 12× that, for other
machines and libcs. (GUIDE §4's ±5 MiB was measured without the mmap-threshold and HWM-reset controls.)"""
GPU_NOISE_BYTES = 2 * MiB
"""GPU absolute floor: torch's allocated bytes are deterministic per configuration; 2 MiB (one large
allocator block) absorbs library workspaces that differ between shapes."""
ANCHOR_TARGET_RATIO = 0.126
"""peak(N=32, B=1) / peak(N=1, B=32) plain torch gave on one H200 (2.0413 / 16.2643 GiB = 0.1255)."""
REPO = Path(__file__).resolve().parents[1]
DEFAULT_ANCHOR = REPO / "reports" / "anchors" / "h200_torch_single_E32.json"


# -- plan -----------------------------------------------------------------------------------------

@dataclass
class Config:
    N: int
    B: int
    sweeps: tuple[str, ...]


@dataclass
class Plan:
    E: int
    world: int
    rank: int
    device: object  # torch.device
    model_name: str
    model: ModelConfig
    seq_len: int
    steps: int
    trainer: str
    threads: int
    out: Path
    anchor: Path | None
    configs: list[Config] = field(default_factory=list)

    @property
    def E_local(self) -> int:
        return self.E // self.world

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def plan_configs(e_local: int) -> list[Config]:
    """Sweep A (N | E, B = E/N, ascending N), then sweep B (B = 1, N = 1, 2, 4, ... ≤ E); shared ones once."""
    a = [(n, e_local // n) for n in range(1, e_local + 1) if e_local % n == 0]
    b, n = [], 1
    while n <= e_local:
        b.append((n, 1))
        n *= 2
    out = [Config(n, bb, ("A", "B") if (n, bb) in b else ("A",)) for n, bb in a]
    out += [Config(n, bb, ("B",)) for n, bb in b if (n, bb) not in a]
    return out


def parse_args(argv=None):
    p = Parser(prog="verify.memory", description=__doc__.split("\n\n")[1],
               epilog="Exit status: 0 all invariants hold, 1 one fails or cannot be established, 2 bad input.")
    p.add_argument("--effective-batch", type=positive_int, default=32, metavar="E",
                   help="E: sequences per optimizer step, over all ranks (default 32)")
    p.add_argument("--device", default="auto", help="auto (cuda if visible, else cpu), cpu, cuda or cuda:K")
    p.add_argument("--model", choices=sorted(PRESETS), default=None,
                   help="model preset (default: small on cpu, gpt2-ish on cuda, the anchor's model)")
    p.add_argument("--seq-len", type=positive_int, default=None, help="S (default: the model's limit)")
    p.add_argument("--steps", type=positive_int, default=None,
                   help="measured optimizer steps per configuration, after one warm-up step (default: cpu 1, cuda 3 as the anchor)")
    p.add_argument("--out", default="reports", help="directory for memory-E{E}.json/.md/.png (default reports/)")
    p.add_argument("--trainer", default="xtrain",
                   help="trainer to measure: xtrain (default), a planted bug from verify/broken.py "
                        "(leaky_graph), or module:factory (a Spec -> trainer callable)")
    p.add_argument("--threads", type=positive_int, default=None, help="CPU intra-op threads (default: torch's)")
    p.add_argument("--anchor", default=None, help=f"plain-torch anchor JSON (default {DEFAULT_ANCHOR.relative_to(REPO)})")
    return p.parse_args(argv)


def build_plan(args) -> Plan:
    """Flags -> Plan, or UsageError naming the flag. Runs nothing."""
    import torch

    from .memprobe import resolve_trainer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if args.device == "auto":
        if torch.cuda.is_available():
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) if world > 1 else 0)
        else:
            device = torch.device("cpu")  # main() says so once the flags are known to be valid
    else:
        device = resolve_device(args.device)
        if device.type == "cuda" and world > 1:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        elif device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    model_name = args.model or ("gpt2-ish" if device.type == "cuda" else "small")
    model = PRESETS[model_name]
    seq = args.seq_len or model.seq_len
    if seq > model.seq_len:
        raise UsageError(f"--seq-len {seq} exceeds --model {model_name}'s limit of {model.seq_len}; "
                         f"pass --seq-len ≤ {model.seq_len}")
    E = args.effective_batch
    if E % world:
        raise UsageError(f"--effective-batch {E} is not divisible by the world size {world}; "
                         f"E = N × B × world")
    try:
        resolve_trainer(args.trainer)
    except ValueError as e:
        raise UsageError(f"--trainer: {e}") from None
    anchor = Path(args.anchor) if args.anchor else (DEFAULT_ANCHOR if DEFAULT_ANCHOR.is_file() else None)
    if args.anchor and not anchor.is_file():
        raise UsageError(f"--anchor {args.anchor}: no such file")
    out = Path(args.out)
    if rank == 0:  # fail now, not after minutes of measuring
        import tempfile

        try:
            out.mkdir(parents=True, exist_ok=True)
            tempfile.TemporaryFile(dir=out).close()
        except OSError as e:
            raise UsageError(f"--out {args.out}: cannot write there ({e.strerror or e})") from None
    plan = Plan(E=E, world=world, rank=rank, device=device, model_name=model_name, model=model, seq_len=seq,
                steps=args.steps or (3 if device.type == "cuda" else 1), trainer=args.trainer,
                threads=args.threads or torch.get_num_threads(), out=out, anchor=anchor)
    plan.configs = plan_configs(plan.E_local)
    return plan


# -- running --------------------------------------------------------------------------------------

def _zygote_env(plan: Plan) -> dict:
    # nothing of torchrun's rendezvous: a probe process that needs a group gets its own (request env);
    # TORCHELASTIC_USE_AGENT_STORE in particular would make it wait for a store nobody serves
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
           and not k.startswith(("LOCAL_", "GROUP_", "ROLE_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
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


class CpuProbeServer:
    """A `python -m verify._memprobe --serve` zygote; `run` measures one configuration in a fresh forked
    process. A zygote that dies is restarted for the next configuration."""

    def __init__(self, plan: Plan, timeout: float = 900):
        self.plan, self.timeout, self.proc = plan, timeout, None

    def _start(self):
        import tempfile

        from ._memprobe import MARK

        self.err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "verify._memprobe", "--serve"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.err, text=True, cwd=str(REPO),
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

    def run(self, c: Config, port: int | None = None) -> dict:
        from ._memprobe import MARK

        if self.proc is None:
            try:
                self._start()
            except (OSError, RuntimeError) as e:
                return dict(error=str(e))
        p, m = self.plan, self.plan.model
        req = dict(model=dict(vocab_size=m.vocab_size, seq_len=m.seq_len, n_layer=m.n_layer, n_head=m.n_head,
                              d_model=m.d_model),
                   N=c.N, B=c.B, S=p.seq_len, steps=p.steps, seed=0, data_seed=1 + p.rank,
                   trainer=p.trainer, threads=p.threads, timeout=self.timeout)
        if p.world > 1:
            req["env"] = dict(RANK=str(p.rank), WORLD_SIZE=str(p.world), LOCAL_RANK=str(p.rank),
                              MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"), MASTER_PORT=str(port))
        t0 = time.perf_counter()
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
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


class GpuRunner:
    """All configurations in this process, with a full allocator reset before each."""

    def __init__(self, plan: Plan):
        import torch

        from ._meta import fp32_only
        from .memprobe import NvmlSampler, ProbeUnavailable, resolve_trainer

        torch.cuda.set_device(plan.device)
        fp32_only()  # fp32 as the anchor measured it
        self.plan, self.factory = plan, resolve_trainer(plan.trainer)
        try:
            self.nvml, self.nvml_reason = NvmlSampler.open([plan.device], period=0.002), None
        except ProbeUnavailable as e:
            self.nvml, self.nvml_reason = None, str(e)
            if plan.rank == 0:
                print(f"verify.memory: {e}; GPU peaks from torch's allocator only", file=sys.stderr, flush=True)

    def run(self, c: Config) -> dict:
        import torch

        from .interface import Spec
        from .memprobe import CudaProbe, cuda_full_reset, measure

        p = self.plan
        leftover = cuda_full_reset(p.device)
        spec = Spec(model=p.model, accum_steps=c.N, seed=0, device=str(p.device))
        seen = []

        def counting_factory(s):
            t = self.factory(s)
            seen.append(type(t).__name__)
            return t

        try:
            res = measure(counting_factory, spec, micro_batch=c.B, seq_len=p.seq_len, steps=p.steps,
                          probe=CudaProbe(p.device, self.nvml, self.nvml_reason), data_seed=1 + p.rank)
        except torch.cuda.OutOfMemoryError:
            res = dict(error="CUDA out of memory")
        except Exception as e:  # noqa: BLE001  (a trainer that crashes is a finding, not a harness crash)
            import traceback

            from .memprobe import _one_line
            res = dict(error=f"trainer or probe raised {_one_line(e)}", traceback=traceback.format_exc())
        res.update(trainer_class=seen[0] if seen else None, allocated_left_over_bytes=leftover)
        cuda_full_reset(p.device)
        return res


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _fresh_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def run_sweeps(plan: Plan) -> list[dict]:
    """This rank's measurement of every configuration, in plan order."""
    dist = _dist()
    bar = Progress(len(plan.configs), label="memory ") if plan.rank == 0 else None
    gpu = GpuRunner(plan) if plan.cuda else None
    cpu = CpuProbeServer(plan) if not plan.cuda else None
    unit, scale = ("GiB", GiB) if plan.cuda else ("MiB", MiB)
    rows = []
    for i, c in enumerate(plan.configs):
        if dist is not None:
            dist.barrier()
        if gpu is not None:
            res = gpu.run(c)
        else:
            port = None
            if dist is not None:
                box = [_fresh_port() if plan.rank == 0 else None]
                dist.broadcast_object_list(box, src=0)
                port = box[0]
            res = cpu.run(c, port)
        res.update(N=c.N, B=c.B, eff=c.N * c.B * plan.world, sweeps=list(c.sweeps), rank=plan.rank)
        rows.append(res)
        if bar is not None:
            info = res["error"] if "error" in res else f"N={c.N} B={c.B} peak {res['peak_bytes'] / scale:.3f} {unit}"
            bar.update(i + 1, info)
    if cpu is not None:
        cpu.close()
    if dist is not None:
        dist.barrier()
    return rows


# -- invariants -----------------------------------------------------------------------------------

def tolerance(plan_cuda: bool):
    floor = GPU_NOISE_BYTES if plan_cuda else CPU_NOISE_BYTES
    return floor, (lambda peak: max(floor, REL_TOL * peak))


def _fmt(b, unit_scale):
    unit, scale = unit_scale
    return f"{b / scale:.3f} {unit}" if unit == "GiB" else f"{b / scale:.1f} {unit}"


def check_invariants(per_rank: list[list[dict]], *, E_local: int, cuda: bool) -> list[dict]:
    """Verdicts for (a1) no growth at fixed E, (a2) well below, (b1) flat at fixed B, (b2) rise ≤ grads.

    Each verdict: id, claim, status (PASS / FAIL / INCONCLUSIVE / N/A), detail, rows (offending ones).
    Works on any rows with N, B, sweeps, peak_bytes, grad_bytes (or error): unit-testable without torch.
    """
    floor, slack = tolerance(cuda)
    us = ("GiB", GiB) if cuda else ("MiB", MiB)
    f = lambda b: _fmt(b, us)  # noqa: E731
    world = len(per_rank)
    checks = {
        "a1": dict(claim="fixed E: peak does not grow as N grows", fails=[], notes=[], na=[], inc=[]),
        "a2": dict(claim=f"fixed E: peak(N={E_local}, B=1) is well below peak(N=1, B={E_local})",
                   fails=[], notes=[], na=[], inc=[]),
        "b1": dict(claim="fixed B=1: peak flat within 2% for N ≥ 2", fails=[], notes=[], na=[], inc=[]),
        "b2": dict(claim="fixed B=1: peak(N=2) − peak(N=1) ≤ gradient buffers", fails=[], notes=[], na=[], inc=[]),
    }
    for rows in per_rank:
        r = rows[0]["rank"] if rows else 0
        who = f"rank {r}: " if world > 1 else ""
        ok = {(x["N"], x["B"]): x for x in rows if "error" not in x}
        for x in rows:
            if "error" in x:
                for k in checks:
                    if any(s in x["sweeps"] for s in ("A" if k[0] == "a" else "B")):
                        checks[k]["inc"].append(f"{who}N={x['N']},B={x['B']} failed to run: {x['error']}")
        p = {k: v["peak_bytes"] for k, v in ok.items()}
        A = sorted((x["N"], x["B"]) for x in rows if "A" in x["sweeps"] and (x["N"], x["B"]) in ok)
        Bs = sorted((x["N"], x["B"]) for x in rows if "B" in x["sweeps"] and (x["N"], x["B"]) in ok)
        # (a1) consecutive N at fixed E
        c = checks["a1"]
        if len(A) < 2:
            c["na"].append(f"{who}fewer than two configurations")
        for prev, nxt in zip(A, A[1:]):
            # Leaving N=1 adds the gradient buffers, held across micro-steps (the same allowance as b2):
            # where activations are small next to them, a correct trainer's peak rises by exactly that.
            grads = ok[nxt]["grad_bytes"] if prev[0] == 1 else 0
            if p[nxt] > p[prev] + grads + slack(p[prev]):
                held = f" + gradient buffers {f(grads)}" if grads else ""
                c["fails"].append(f"{who}N={nxt[0]},B={nxt[1]} peak {f(p[nxt])} > N={prev[0]},B={prev[1]} "
                                  f"peak {f(p[prev])}{held} + tolerance {f(slack(p[prev]))}")
        if len(A) >= 2:
            c["notes"].append(f"{who}" + " → ".join(f"N={k[0]}: {f(p[k])}" for k in A))
        # (a2) well below: N=E, B=1 must realise at least half the saving ideal accumulation would. Ideal:
        # one sequence's peak plus the gradient buffers held across micro-steps, peak(1,1) + G.
        c = checks["a2"]
        big, acc, one = (1, E_local), (E_local, 1), (1, 1)
        if E_local < 2:
            c["na"].append(f"{who}E = 1 per rank: nothing to accumulate")
        elif all(k in p for k in (big, acc, one)):
            g = ok[acc]["grad_bytes"]
            ideal = p[one] + g
            saving = p[big] - ideal
            mid = ideal + saving / 2
            ratio = p[acc] / p[big] if p[big] > 0 else float("nan")
            line = (f"{who}peak(N={E_local},B=1) {f(p[acc])} vs peak(N=1,B={E_local}) {f(p[big])} (ratio {ratio:.3f}); "
                    f"must be ≤ {f(mid)}, halfway from the ideal peak(1,1) + gradient buffers = {f(ideal)} to it")
            if saving < 4 * floor:
                c["inc"].append(f"{who}ideal accumulation would save only {f(saving)} here (peak(1,{E_local}) {f(p[big])} − "
                                f"peak(1,1) {f(p[one])} − gradient buffers {f(g)}), under 4× the noise floor "
                                f"({f(floor)}): not measurable; use a larger --effective-batch, --model or --seq-len")
            elif p[acc] > mid:
                c["fails"].append(line)
            else:
                c["notes"].append(line)
        # (b1) flat for N ≥ 2 at B = 1
        c = checks["b1"]
        flat = [k for k in Bs if k[0] >= 2]
        if not flat:
            c["na"].append(f"{who}no configuration with N ≥ 2")
        else:
            lo, hi = min(flat, key=p.get), max(flat, key=p.get)
            spread = p[hi] - p[lo]
            line = (f"{who}N={hi[0]} peak {f(p[hi])} − N={lo[0]} peak {f(p[lo])} = {f(spread)}; "
                    f"tolerance max(2%, {f(floor)}) = {f(slack(p[lo]))}")
            (c["fails"] if spread > slack(p[lo]) else c["notes"]).append(line)
        # (b2) rise from N=1 to N=2 at most the gradient buffers (held while micro-step 2 runs)
        c = checks["b2"]
        if (1, 1) in p and (2, 1) in p:
            g = ok[(2, 1)]["grad_bytes"]
            rise = p[(2, 1)] - p[(1, 1)]
            line = (f"{who}peak(N=2) {f(p[(2, 1)])} − peak(N=1) {f(p[(1, 1)])} = {f(rise)}; gradient buffers "
                    f"{f(g)} + tolerance {f(slack(p[(1, 1)]))}")
            (c["fails"] if rise > g + slack(p[(1, 1)]) else c["notes"]).append(line)
        elif E_local < 2:
            c["na"].append(f"{who}E = 1 per rank")
    out = []
    for k, c in checks.items():
        status = "FAIL" if c["fails"] else "INCONCLUSIVE" if c["inc"] else "N/A" if c["na"] and not c["notes"] else "PASS"
        rows = c["fails"] or c["inc"]
        out.append(dict(id=k, claim=c["claim"], status=status, rows=rows, detail=c["notes"] + c["na"]))
    return out


# -- anchor comparison ----------------------------------------------------------------------------

def anchor_applies(plan: Plan) -> bool:
    a = PRESETS["gpt2-ish"]
    return (plan.anchor is not None and plan.cuda and plan.world == 1 and plan.E == 32 and plan.model == a
            and plan.seq_len == 512)


def compare_anchor(plan: Plan, rows: list[dict]) -> dict | None:
    """Our rows beside plain torch's (same model, protocol and GPU kind), and the issue's targets."""
    if not anchor_applies(plan):
        return None
    anchor = json.loads(plan.anchor.read_text())
    by = {(x["N"], x["B"]): x for x in rows if "error" not in x}
    pairs = []
    for a in anchor:
        o = by.get((a["N"], a["B"]))
        pairs.append(dict(N=a["N"], B=a["B"], anchor=a, ours=None if o is None else dict(
            peak_alloc_gib=o["peak_bytes"] / GiB, peak_reserved_gib=o["peak_reserved_bytes"] / GiB,
            nvml_peak_gib=None if o.get("nvml_peak_used_bytes") is None else o["nvml_peak_used_bytes"] / GiB,
            step_ms=o["step_ms"], tok_s=o["tok_s"], static_gib=o["static_bytes"] / GiB)))
    a_by = {(a["N"], a["B"]): a for a in anchor}
    ratio = lambda d, key: d[(32, 1)][key] / d[(1, 32)][key]  # noqa: E731
    targets = []
    ours_ratio = by[(32, 1)]["peak_bytes"] / by[(1, 32)]["peak_bytes"] if (32, 1) in by and (1, 32) in by else None
    targets.append(dict(name="peak allocated ratio (N=32,B=1)/(N=1,B=32)", target=f"≤ {ANCHOR_TARGET_RATIO}",
                        ours=ours_ratio, anchor=ratio(a_by, "peak_alloc_gib"),
                        status="PASS" if ours_ratio is not None and ours_ratio <= ANCHOR_TARGET_RATIO else "FAIL"))
    flat = [by[k]["peak_bytes"] for k in by if k[1] == 1 and k[0] >= 2]
    a_flat = [a["peak_alloc_gib"] for a in anchor if a["B"] == 1 and a["N"] >= 2]
    ours_spread = (max(flat) - min(flat)) / min(flat) if flat else None
    targets.append(dict(name="flatness at B=1, N ≥ 2: (max − min) / min", target=f"≤ {REL_TOL:.0%}",
                        ours=ours_spread, anchor=(max(a_flat) - min(a_flat)) / min(a_flat),
                        status="PASS" if ours_spread is not None and ours_spread <= REL_TOL else "FAIL"))
    try:
        src = str(plan.anchor.resolve().relative_to(REPO))
    except ValueError:
        src = str(plan.anchor)
    return dict(source=src, pairs=pairs, targets=targets)


# -- provenance -----------------------------------------------------------------------------------

def git_info() -> dict:
    def git(*a):
        try:
            r = subprocess.run(["git", *a], cwd=str(REPO), capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    import hashlib

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    # without git (a copied tree on a GPU box), XTRAIN_GIT_COMMIT may name the commit; the hash of the
    # measured sources identifies the code either way
    h = hashlib.sha256()
    for f in sorted([*REPO.glob("xtrain_core/*.py"), *REPO.glob("verify/*.py")]):
        h.update(f.relative_to(REPO).as_posix().encode() + b"\0" + f.read_bytes())
    return dict(commit=commit or os.environ.get("XTRAIN_GIT_COMMIT"), commit_source="git" if commit else
                ("XTRAIN_GIT_COMMIT" if os.environ.get("XTRAIN_GIT_COMMIT") else None),
                branch=git("rev-parse", "--abbrev-ref", "HEAD") if commit else None,
                dirty=None if status is None else bool(status), sources_sha256=h.hexdigest())


def machine_info(plan: Plan, nvml=None, nvml_reason: str | None = None) -> dict:
    import torch

    cpu_model = None
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = dict(python=platform.python_version(), platform=platform.platform(), node=platform.node(),
                torch=torch.__version__, cuda=torch.version.cuda, cpu_count=os.cpu_count(), cpu_model=cpu_model,
                gpu=None, gpu_total_bytes=None, driver=None, nvml=None)
    if plan.cuda:
        props = torch.cuda.get_device_properties(plan.device)
        info.update(gpu=props.name, gpu_total_bytes=props.total_memory,
                    cudnn=torch.backends.cudnn.version(), gpu_count=torch.cuda.device_count())
        info["driver"] = nvml.driver_version() if nvml is not None else None
        info["nvml"] = "ok" if nvml is not None else nvml_reason
    return info


# -- main -----------------------------------------------------------------------------------------

def _usage_fail(msg: str, rank: int):
    if rank == 0:
        fail(msg)
    raise SystemExit(2)


def _init_dist(plan: Plan):
    import torch
    import torch.distributed as dist

    if plan.world > 1 and not dist.is_initialized():
        if plan.cuda:
            torch.cuda.set_device(plan.device)
        dist.init_process_group("nccl" if plan.cuda else "gloo")


def assemble(plan: Plan, per_rank: list[list[dict]], verdicts: list[dict], mi: dict) -> dict:
    configs = []
    for i, c in enumerate(plan.configs):
        ranks = [rows[i] for rows in per_rank]
        peaks = [x["peak_bytes"] for x in ranks if "error" not in x]
        configs.append(dict(N=c.N, B=c.B, eff=c.N * c.B * plan.world, sweeps=list(c.sweeps),
                            peak_bytes=max(peaks) if len(peaks) == len(ranks) else None, ranks=ranks))
    ok0 = [x for x in per_rank[0] if "error" not in x]
    static = None if not ok0 else {k: ok0[0][k] for k in ("param_bytes", "grad_bytes", "optim_state_bytes", "static_bytes")}
    floor, _ = tolerance(plan.cuda)
    if plan.cuda:
        probe = dict(
            kind="cuda", primary="peak_bytes = torch.cuda.max_memory_allocated over the measured steps",
            includes="everything torch's caching allocator handed out on this device: parameters, gradients, "
                     "optimizer state, token batches, activations, temporaries; not the CUDA context, not "
                     "cached-but-free blocks (those are in peak_reserved_bytes), not other processes.",
            nvml="nvml_peak_used_bytes = device memory used (nvmlDeviceGetMemoryInfo.used, what nvidia-smi "
                 "shows: CUDA context, cache, every process on the GPU), max over samples taken by a thread "
                 "every nvml_period_s during the measured steps",
            isolation="one process; before each configuration gc.collect, synchronize, empty_cache, "
                      "reset_peak_memory_stats (allocated_left_over_bytes records what was still allocated)")
    else:
        probe = dict(
            kind="cpu", primary="peak_bytes = peak RSS during the measured steps − RSS right before them",
            includes="Included: what a training step adds on top of the steady state — gradient buffers, "
                     "activations saved for backward, temporaries, optimizer-step scratch, and pages first touched "
                     "during the step. Not included (they are in the baseline): the interpreter and torch, the "
                     "parameters, the optimizer state (allocated by the warm-up step), the pre-drawn token batches. "
                     "High-water mark: " + ("VmHWM reset via /proc/self/clear_refs right before the measured steps"
                     if all(x.get("hwm_source", "").startswith("VmHWM") for x in per_rank[0] if "error" not in x)
                     else "ru_maxrss where the reset was refused (hwm_exact per row says whether the measured "
                          "steps set the peak)") + ".",
            isolation="a fresh process per configuration, forked from a `python -m verify._memprobe --serve` "
                      "zygote that imported torch and allocated no tensors (own address space, own peak-RSS "
                      "counter; `isolation` per row says fork or exec); glibc MALLOC_MMAP_THRESHOLD_=65536; "
                      "torch/OMP threads fixed")
    return dict(
        schema_version=SCHEMA_VERSION, tool="verify.memory",
        created_utc=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        git=git_info(), machine_info=mi,
        settings=dict(effective_batch=plan.E, world_size=plan.world, effective_batch_per_rank=plan.E_local,
                      device=str(plan.device), model_name=plan.model_name, model=plan.model.__dict__.copy(),
                      n_params=plan.model.n_params, seq_len=plan.seq_len, warmup_steps=1,
                      measured_steps=plan.steps, trainer=plan.trainer, dtype="float32",
                      threads=plan.threads if not plan.cuda else None, tf32=False if plan.cuda else None,
                      sweep_A=f"N | {plan.E_local}, B = {plan.E_local}/N (per rank)",
                      sweep_B="B = 1, N = 1, 2, 4, ... ≤ " + str(plan.E_local)),
        probe=probe,
        thresholds=dict(rel=REL_TOL, abs_noise_bytes=floor, well_below="peak(E,1) ≤ ideal + ½·(peak(1,E) − ideal), ideal = peak(1,1) + grad_bytes "
                        "(at least half the saving of ideal accumulation); INCONCLUSIVE when peak(1,E) − ideal < "
                        "4 × abs_noise_bytes",
                        rise="peak(2,1) − peak(1,1) ≤ grad_bytes + max(rel·peak(1,1), abs_noise_bytes)"),
        static=static, configs=configs, invariants=verdicts,
        anchor=compare_anchor(plan, per_rank[0]),
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    try:
        plan = build_plan(args)
    except UsageError as e:
        _usage_fail(str(e), rank)
    if args.device == "auto" and not plan.cuda and rank == 0:
        print("verify.memory: no CUDA GPU visible to torch; measuring the CPU path "
              "(a fresh process per configuration)", file=sys.stderr, flush=True)
    from . import memreport

    try:
        _init_dist(plan)
        t0 = time.perf_counter()
        rows = run_sweeps(plan)
        dist = _dist()
        if dist is not None:
            per_rank = [None] * plan.world
            dist.all_gather_object(per_rank, rows)
        else:
            per_rank = [rows]
        code = 0
        if plan.rank == 0:
            verdicts = check_invariants(per_rank, E_local=plan.E_local, cuda=plan.cuda)
            report = assemble(plan, per_rank, verdicts, machine_info(plan, *_nvml_for_info(plan)))
            report["wall_s"] = time.perf_counter() - t0
            report["command"] = "python -m verify.memory " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
            if report["anchor"] is not None:
                report["anchor"]["verdict"] = "PASS" if all(t["status"] == "PASS" for t in report["anchor"]["targets"]) else "FAIL"
            report["verdict"] = memreport.overall(report)
            paths = memreport.write_all(report, plan.out)
            print(memreport.text_table(report), flush=True)
            print("wrote " + ", ".join(str(p) for p in paths), flush=True)
            code = 1 if report["verdict"] == "FAIL" else 0
        if dist is not None:
            box = [code]
            dist.broadcast_object_list(box, src=0)
            code = box[0]
            dist.barrier()
            dist.destroy_process_group()
        return code
    except KeyboardInterrupt:
        fail("interrupted", code=130)
    except UsageError as e:
        _usage_fail(str(e), rank)


def _nvml_for_info(plan: Plan):
    if not plan.cuda:
        return None, None
    from .memprobe import NvmlSampler, ProbeUnavailable

    try:
        return NvmlSampler.open([plan.device]), None
    except ProbeUnavailable as e:
        return None, str(e)


if __name__ == "__main__":
    code = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # gloo teardown at interpreter exit sometimes aborts (GUIDE §3); the group is already destroyed
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
