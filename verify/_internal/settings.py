"""One settings object: every knob of a verify run, defined once (KNOBS), checked up front, built ONCE per process
by its entry point and passed down; this module is the only one that touches os.environ.

    s = Settings.from_env(backend="nccl", device=None)    # the entry point: an option wins over its variable
    s.check_machine()                                     # cuda / nccl need a GPU: a SettingError now
    install(s)                                            # this process's one Settings
    current()                                             # what the library reads, where no argument brings them

The flow, the backend pairing and the knob table's docs: docs/design/layout.md ("Settings").
"""
from __future__ import annotations

import contextlib
import math
import os
import tempfile
from dataclasses import dataclass, field, fields, replace

__all__ = ["Settings", "SettingError", "Knob", "KNOBS", "RANKS_PER_CORE", "check_report_dir", "env_of", "knobs_table", "usable_cores",
           "cuda_setup", "fp32_only", "DEVICES", "BACKENDS", "POOL_STARTS", "install", "current", "using",
           "launcher_var", "child_environ", "set_library_env"]

DEVICES, BACKENDS, POOL_STARTS = ("cpu", "cuda"), ("gloo", "nccl"), ("forkserver", "spawn")
# gloo ranks (CPU processes) per core a world may ask, counting each rank's threads: the default world 4 at one
# thread fits one core; 100 ranks on 2 cores reached a load of 65 and ran nothing in 150 s
RANKS_PER_CORE = 4


class SettingError(ValueError):
    """A knob or option that cannot be used; str(e) is one line: the option or variable, the value, the fix."""


@dataclass(frozen=True)
class Knob:
    field: str  # the Settings field
    env: str  # the variable that sets it
    default: str  # as the docs show it
    doc: str  # one line for the docs
    option: str | None = None  # the command-line option that sets it too, where there is one


KNOBS = (
    Knob("device", "XTRAIN_TEST_DEVICE", "cpu", "where the gates run: cpu or cuda (deterministic algorithms, TF32 off)",
         "--verify-device"),
    Knob("backend", "XTRAIN_DIST_BACKEND", "nccl on cuda, else gloo",
         "process groups of the rank pools: gloo or nccl (rank r on cuda:r; needs a GPU)", "--verify-backend"),
    Knob("threads", "XTRAIN_TEST_THREADS", "1", "CPU intra-op threads of every gate run and pool rank (at most the cores the process may use)"),
    Knob("min_world", "XTRAIN_DIST_MIN_WORLD", "1", "smallest world the data-parallel gates draw (gloo: the largest's "
         "limit applies)"),
    Knob("max_world", "XTRAIN_DIST_MAX_WORLD", "4", f"largest world the data-parallel gates draw (gloo: world × "
         f"threads ≤ {RANKS_PER_CORE} × the cores the process may use; capped by the GPUs under nccl)"),
    Knob("timeout", "XTRAIN_DIST_TIMEOUT", "120", "seconds (≥ 1) a distributed job or a Pull wait may take; then the "
         "hung ranks' stacks are dumped"),
    Knob("pool_start", "XTRAIN_POOL_START", "forkserver for gloo, spawn for nccl",
         "how pool ranks start: forkserver (torch preloaded once) or spawn"),
    Knob("hypothesis_profile", "HYPOTHESIS_PROFILE", "unset: your hypothesis default",
         "dev, ci or gpu: a budget of 10 random examples / 100 derandomized / 150 per test (another name: "
         "one registered with hypothesis)"),
    Knob("cache_home", "XDG_CACHE_HOME", "`~/.cache`", "a verify run keeps hypothesis' database and pytest's cache "
         "in `$XDG_CACHE_HOME/xtrain-verify`"),
    Knob("gpu_lock", "XTRAIN_GPU_LOCK", "`<tmp>/xtrain-gpu-<uid>.lock`",
         "the lock file that keeps a memory test off a GPU other tests use"),
    Knob("ranks_per_node", "XTRAIN_RANKS_PER_NODE", "unset: a pool is one node",
         "emulate nodes of R ranks in spawned pools (rank r on node r // R, LOCAL_WORLD_SIZE=R): the per-link "
         "count rows on one host; a launched world has its launcher's nodes"),
    Knob("git_commit", "XTRAIN_GIT_COMMIT", "git rev-parse HEAD", "the commit a report names (a copied tree has no .git)"),
)
_BY_FIELD = {k.field: k for k in KNOBS}
_BY_ENV = {k.env: k for k in KNOBS}


def env_of(name: str) -> str:
    """The variable of knob `name` (the one place it is spelled)."""
    return _BY_FIELD[name].env
PROFILES = ("dev", "ci", "gpu", "scale")  # the hypothesis profiles the plugin registers (verify/_internal/plugin.py)


def knobs_table() -> str:
    """KNOBS as the markdown table docs/verify-your-trainer.md shows (tests/harness/test_settings.py holds them equal)."""
    rows = ["| variable | option | default | what it sets |", "|---|---|---|---|"]
    for k in KNOBS:
        rows.append(f"| `{k.env}` | {f'`{k.option}`' if k.option else ''} | {k.default} | {k.doc} |")
    return "\n".join(rows) + "\n"


def _default_lock() -> str:
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return os.path.join(tempfile.gettempdir(), f"xtrain-gpu-{uid}.lock")


@dataclass(frozen=True)
class Settings:
    device: str = "cpu"
    backend: str = ""  # "" = follow the device (nccl on cuda, else gloo); resolved in __post_init__
    threads: int = 1
    min_world: int = 1
    max_world: int = 4
    timeout: float = 120.0
    pool_start: str = ""  # "" = by backend (pool.start_method)
    hypothesis_profile: str = ""
    cache_home: str = ""  # "" = ~/.cache
    gpu_lock: str = ""  # "" = <tmp>/xtrain-gpu-<uid>.lock
    git_commit: str = ""  # "" = ask git
    ranks_per_node: int = 0  # 0 = unset: a spawned pool is one node
    sources: dict = field(default_factory=dict, compare=False, repr=False)
    """field -> where its value came from ("--verify-backend", "XTRAIN_DIST_BACKEND"): what an error names."""

    def __post_init__(self):
        def need(ok: bool, name: str, fix: str):
            if not ok:
                raise SettingError(f"{self.where(name)}: {fix}")

        need(self.device in DEVICES, "device", "must be cpu or cuda")
        if not self.backend:
            object.__setattr__(self, "backend", "nccl" if self.device == "cuda" else "gloo")
        need(self.backend in BACKENDS, "backend", "must be gloo or nccl")
        for name in ("threads", "min_world", "max_world"):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v >= 1, name, "must be an integer ≥ 1")
        need(self.ranks_per_node == 0 and "ranks_per_node" not in self.sources or
             isinstance(self.ranks_per_node, int) and self.ranks_per_node >= 1, "ranks_per_node", "must be an integer ≥ 1")
        need(self.min_world <= self.max_world, "min_world",
             f"exceeds {self.where('max_world')}; set {_BY_FIELD['max_world'].env} ≥ {self.min_world} too")
        # below a second a healthy gloo job cannot even start its ranks: every job "hangs" and dumps stacks
        need(isinstance(self.timeout, (int, float)) and math.isfinite(self.timeout) and self.timeout >= 1, "timeout",
             "must be a number of seconds ≥ 1")
        cores = usable_cores()  # more threads than cores only thrashes (1000 on 2 cores: a load of 300, no end)
        need(self.threads <= cores, "threads", f"exceeds the {cores} CPU core(s) this process may use; "
             f"set {_BY_FIELD['threads'].env} ≤ {cores}")
        need(self.hypothesis_profile in ("", *PROFILES) or _registered(self.hypothesis_profile), "hypothesis_profile",
             f"unknown profile; use {', '.join(PROFILES)} (or one registered with hypothesis' register_profile)")
        need(self.pool_start in ("", *POOL_STARTS), "pool_start", "must be forkserver or spawn")
        if not self.cache_home:
            object.__setattr__(self, "cache_home", os.path.join(os.path.expanduser("~"), ".cache"))
        if not self.gpu_lock:
            object.__setattr__(self, "gpu_lock", _default_lock())

    def fix(self, name: str, value) -> str:
        """How to set `name` to `value` the way it was set: '--verify-device cpu' or 'XTRAIN_TEST_DEVICE=cpu'."""
        src = self.sources.get(name) or _BY_FIELD[name].option or _BY_FIELD[name].env
        return f"{src} {value}" if src.startswith("--") else f"{src}={value}"

    def where(self, name: str) -> str:
        """'--verify-backend mpi', 'XTRAIN_DIST_BACKEND=mpi' or 'backend='mpi'': what an error about `name` names."""
        src, v = self.sources.get(name), getattr(self, name)
        if src is None:
            return f"{name}={v!r}"
        return f"{src} {v}" if src.startswith("--") else f"{src}={v}"

    @staticmethod
    def current() -> "Settings":
        """This process's Settings (what a run was started with): for an adapter that branches on a knob."""
        return current()

    @classmethod
    def from_env(cls, environ=None, **overrides) -> "Settings":
        """The knobs from `environ` (default os.environ), then `overrides` by field name (None: not given, the
        variable stands). An empty variable counts as unset."""
        environ = os.environ if environ is None else environ
        values, sources = {}, {}
        types = {f.name: f.type for f in fields(cls)}
        for k in KNOBS:
            text = environ.get(k.env)
            if not text:
                continue
            sources[k.field] = k.env
            if types[k.field] == "int":
                values[k.field] = _number(int, text, k.env, "an integer ≥ 1")
            elif types[k.field] == "float":
                values[k.field] = _number(float, text, k.env, "a number of seconds ≥ 1")
            else:
                values[k.field] = text
        for name, v in overrides.items():
            if name not in _BY_FIELD:
                raise TypeError(f"Settings has no knob {name!r}")
            if v is not None:
                values[name], sources[name] = v, _BY_FIELD[name].option or name
        return cls(**values, sources=sources)

    def check_machine(self) -> None:
        """What needs the machine to tell: a gloo world must fit the CPU cores (world_limit); cuda and nccl need a
        GPU torch can see (imports torch only then; NCCL's worlds are capped by its GPUs, world_cap)."""
        if self.backend == "gloo":
            cores, limit = usable_cores(), self.world_limit()
            for name in ("min_world", "max_world"):
                if getattr(self, name) > limit:
                    per = f" ÷ {self.threads} threads per rank ({_BY_FIELD['threads'].env})" if self.threads > 1 else ""
                    raise SettingError(f"{self.where(name)}: more gloo ranks than this machine runs: at most {limit} "
                                       f"({RANKS_PER_CORE} per CPU core × the {cores} core(s) this process may use"
                                       f"{per}); set {_BY_FIELD[name].env} ≤ {limit}")
        if self.device != "cuda" and self.backend != "nccl":
            return
        import torch

        if torch.cuda.is_available():
            return
        if self.device == "cuda":
            raise SettingError(f"{self.where('device')}: no CUDA GPU is visible to torch; use {self.fix('device', 'cpu')}")
        raise SettingError(f"{self.where('backend')}: no CUDA GPU is visible to torch (NCCL puts rank r on cuda:r); "
                           f"use {self.fix('backend', 'gloo')}")

    def world_limit(self) -> int:
        """The largest gloo world this machine runs: RANKS_PER_CORE × usable cores ÷ threads per rank (never below
        the default world 4: threads ≤ cores)."""
        return RANKS_PER_CORE * usable_cores() // self.threads

    def world_cap(self) -> int:
        """The largest world this box runs the gates at: max_world, capped by the GPUs under NCCL."""
        if self.backend != "nccl":
            return self.max_world
        import torch

        return min(self.max_world, torch.cuda.device_count())

    def per_node(self, world: int) -> int:
        """Ranks per node of a spawned pool of `world` ranks: ranks_per_node where set (emulated nodes), capped
        by the world; else the whole pool, one host."""
        return min(self.ranks_per_node or world, world)

    def to_dict(self) -> dict:
        """Every field as resolved, and where each came from: JSON-able, what a child process of an entry point
        gets (from_dict) instead of reading the knobs again."""
        return {**{f.name: getattr(self, f.name) for f in fields(self) if f.name != "sources"},
                "sources": dict(self.sources)}

    @classmethod
    def from_dict(cls, d: dict) -> "Settings":
        return cls(**d)

    def replace(self, **changes) -> "Settings":
        """A copy with `changes` (by field name), checked as any Settings; each named as set by its field."""
        return replace(self, **changes, sources={**self.sources, **{k: k for k in changes}})

    def export(self, environ: dict) -> dict:
        """Write the knobs set by command-line options into their variables in `environ`, a child process's fresh
        env mapping (never this process's: nothing here steers another module through os.environ); returns it.
        Derived values (the backend that follows the device) are not written: a child derives them alike, and a
        child given another device must not inherit this one's backend."""
        for name, src in self.sources.items():
            if src.startswith("--"):
                environ[_BY_FIELD[name].env] = str(getattr(self, name))
        return environ

    def setup_device(self) -> None:
        """The CUDA set-up of a gate run (plugin and self-test): deterministic algorithms (the bit-exact gates
        need them; cuBLAS needs its workspace setting for that) and TF32 off. Nothing on the CPU."""
        if self.device == "cuda":
            cuda_setup(deterministic=True)


# -- this process's one Settings ------------------------------------------------------------------------------

_CURRENT: Settings | None = None


def install(s: Settings) -> Settings:
    """Make `s` this process's Settings: called by the entry point that built them (the plugin's configure, a
    CLI's main, a pool rank's start with its parent's copy), once. Returns `s`."""
    global _CURRENT
    if not isinstance(s, Settings):
        raise TypeError(f"install() takes a Settings, got {type(s).__name__}")
    _CURRENT = s
    return s


def current() -> Settings:
    """This process's Settings, as its entry point installed them. In a process no entry point started (a script
    that calls verify's API directly) the environment's, built on this first call and installed: once, never
    re-read (a later change of os.environ changes nothing)."""
    if _CURRENT is None:
        install(Settings.from_env())
    return _CURRENT


@contextlib.contextmanager
def using(s: Settings):
    """`s` as this process's Settings inside the block, the previous ones after (tests; a benchmark comparing
    pool start methods). Pools started inside keep `s`: a pool is built with its Settings."""
    global _CURRENT
    before = _CURRENT
    install(s)
    try:
        yield s
    finally:
        _CURRENT = before


# -- the process environment beyond the knobs: read here, written only by set_library_env --------------------

def launcher_var(name: str, default: str | None = None) -> str | None:
    """A variable a launcher or the system sets for this process (torchrun's RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR...; SLURM_JOB_ID; CUDA_VISIBLE_DEVICES; hypothesis' own HYPOTHESIS_STORAGE_DIRECTORY), or
    `default`. Never a knob: those are Settings' fields (a TypeError says so)."""
    if name in _BY_ENV:
        raise TypeError(f"{name} is the variable of knob {_BY_ENV[name].field!r}: read Settings.{_BY_ENV[name].field}")
    return os.environ.get(name, default)


def child_environ(drop=(), drop_prefixes=()) -> dict:
    """A fresh copy of this process's environment, for a child process's `env=` (less the names in `drop` and
    those starting with `drop_prefixes`): a subprocess is steered through its own mapping, never os.environ."""
    return {k: v for k, v in os.environ.items() if k not in drop and not k.startswith(tuple(drop_prefixes))}


def set_library_env(values: dict, *, keep_set: bool = False) -> None:
    """The one writer of this process's environment, for variables a library reads IN-PROCESS, where no argument
    reaches it: in a freshly started rank, torchrun's RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE (Accelerate
    decides on data parallelism from them) and OMP_NUM_THREADS (verify/_internal/ranks/worker.py); TORCH_FR_BUFFER_SIZE
    (torch sizes the flight recorder from it when a process group is made: verify/_internal/ranks/comm.py); CUBLAS_WORKSPACE_CONFIG
    (cuBLAS, which is not deterministic without it: cuda_setup); a probe's rendezvous variables (env:// init,
    verify/memory/_zygote.py); what a framework's teardown removed from a rank (verify/_internal/cases/pull.py). Never a knob, never
    to steer verify's own modules. keep_set: a variable already set keeps its value."""
    for k, v in values.items():
        if keep_set and k in os.environ:
            continue
        if k in _BY_ENV:
            raise TypeError(f"{k} is the variable of knob {_BY_ENV[k].field!r}: pass Settings, not the environment")
        os.environ[k] = str(v)


def cuda_setup(deterministic: bool) -> None:
    """The one CUDA set-up (a gate run's process, a NCCL pool rank): cuBLAS's workspace setting, without which
    it cannot be deterministic; deterministic algorithms where asked; TF32 off (fp32_only)."""
    set_library_env({"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}, keep_set=True)
    import torch

    if deterministic:
        torch.use_deterministic_algorithms(True)
    fp32_only()


def fp32_only() -> None:
    """TF32 off for matmuls and convolutions: every GPU measurement and gate here means true fp32, as the
    anchor measured it. (Newer torch prefers fp32_precision and may warn; the effect is the same.)"""
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one, else os.cpu_count())."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _registered(profile: str) -> bool:
    """Whether hypothesis knows `profile` (its own "default", or a user's register_profile); False without it."""
    try:
        from hypothesis import settings
        from hypothesis.errors import InvalidArgument
    except ImportError:
        return False
    try:
        settings.get_profile(profile)
        return True
    except InvalidArgument:
        return False


def _number(kind, text: str, env: str, what: str):
    try:
        return kind(text)
    except ValueError:
        raise SettingError(f"{env}={text}: must be {what}") from None


def check_report_dir(path: str, option: str) -> None:
    """SettingError naming `option` unless a report can be written in folder `path`. Leaves nothing behind:
    folders it had to create for the probe are removed again (the report writer makes them)."""
    shown, path = path, os.path.abspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise SettingError(f"{option} {shown}: exists and is not a directory; pass a directory")
    made, p = [], path
    while not os.path.exists(p):
        made.append(p)
        p = os.path.dirname(p)
    try:
        os.makedirs(path, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as e:
        raise SettingError(f"{option} {shown}: cannot write there ({e.strerror or e}); pass a writable directory") from None
    finally:
        for d in made:  # deepest first
            try:
                os.rmdir(d)
            except OSError:
                pass

