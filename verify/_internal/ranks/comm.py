"""Counting collectives: the c10d flight recorder, behind one small module.

The recorder records inside each c10d backend, so it sees every path (DDP's C++ reducer, the backend object,
another thread, a private group) that CommDebugMode misses; not traffic outside c10d. It is private API, so
everything version-specific is here: enable() before the process group exists, read both `_dump_fr_trace`
and `_dump_nccl_trace` and merge, `Recorder.read()` returning only newer entries and raising if the ring
overflowed. Entries belong to the last `mark(label)` at or before their creation time.

Design: docs/design/distributed.md, "The collective counter".
"""
from __future__ import annotations

import pickle
import threading
import time
from dataclasses import dataclass

from verify._internal.settings import launcher_var, set_library_env

DEFAULT_RING = 512  # entries; a dump costs ~12 µs per entry held, so keep it small

# c10d ScalarType names as the recorder writes them -> element size in bytes
_ELEM = {"Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4, "Short": 2, "Char": 1,
         "Byte": 1, "Bool": 1, "ComplexFloat": 8, "ComplexDouble": 16, "Float8_e4m3fn": 1, "Float8_e5m2": 1}
_FLOATING = {"Float", "Double", "Half", "BFloat16", "ComplexFloat", "ComplexDouble", "Float8_e4m3fn",
             "Float8_e5m2"}
_TORCH_NAME = {"Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16",
               "Long": "int64", "Int": "int32", "Bool": "bool", "Byte": "uint8", "Char": "int8"}
# an operation's family -> how it shows in c10d's names, case and underscores dropped (longest match first:
# "reducescatter" before a plain "reduce")
_FAMILIES = (("reduce_scatter", "reducescatter"), ("all_gather", "allgather"), ("all_reduce", "allreduce"),
             ("broadcast", "broadcast"), ("barrier", "barrier"), ("all_to_all", "alltoall"), ("send", "send"),
             ("recv", "recv"))


# gloo has no reduce-scatter: torch runs reduce_scatter_tensor (reduce_scatter_single, the functional collective,
# DTensor's Partial -> Shard, FSDP2's) as ONE all-reduce of its whole input, and gloo's recorder writes just that
# all-reduce (torch 2.13, seen); nothing recorded tells the two apart. The list form, dist.reduce_scatter(out, chunks),
# runs as one all-reduce per chunk. (backend, the family a trainer calls) -> the family the recorder writes.
RECORDED_AS = {("gloo", "reduce_scatter"): "all_reduce"}


def recorded(fam: str, backend: str | None) -> str:
    """The family `backend`'s recorder writes for a call of family `fam` (reduce_scatter -> all_reduce on gloo)."""
    return RECORDED_AS.get((backend, fam), fam)


def family(op: str) -> str:
    """The one op-name normaliser: c10d gives one operation different names on different paths and backends
    (all_gather, _allgather_base, allgather_into_tensor_coalesced, ... are "all_gather"). An op of no known
    family is its own, lower-cased."""
    o = op.lower().replace("_", "")
    return next((name for name, shown in _FAMILIES if shown in o), op.lower())


def enable(ring: int | None = None, *, nccl: bool = False) -> int:
    """Turn the recorder on for process groups created from now on; returns the ring size.
    TORCH_FR_BUFFER_SIZE is read by gloo and (torch 2.11, checked on 2×H200) NCCL; older NCCL builds read only
    TORCH_NCCL_TRACE_BUFFER_SIZE, so NCCL users get both (newer torch warns that it is deprecated)."""
    ring = int(launcher_var("TORCH_FR_BUFFER_SIZE") or ring or DEFAULT_RING)
    set_library_env({"TORCH_FR_BUFFER_SIZE": ring})  # torch reads it in this process, making the group
    if nccl:
        set_library_env({"TORCH_NCCL_TRACE_BUFFER_SIZE": ring}, keep_set=True)
    return ring


@dataclass(frozen=True)
class Collective:
    """One recorded collective, as the harness reports it."""

    record_id: int
    source: str  # which dump it came from: "fr" or "nccl"
    backend: str  # "gloo" | "nccl" | ...
    op: str  # "all_reduce", "allreduce_coalesced", "broadcast", "all_gather", ...
    sizes: tuple  # input tensor shapes
    dtypes: tuple  # input dtypes, c10d names ("Float", "Long", ...)
    pg: str  # process group: "id 'name'"
    thread: str  # recording thread id (= Python's threading ident); "?" where the recorder has none
    time_ns: int
    group: str = ""  # the group's c10d name (group_links' key); "" where the recorder has none

    @property
    def numel(self) -> int:
        n = 0
        for s in self.sizes:
            k = 1
            for d in s:
                k *= int(d)
            n += k
        return n

    @property
    def nbytes(self) -> int:
        total = 0
        for s, d in zip(self.sizes, self.dtypes):
            k = 1
            for x in s:
                k *= int(x)
            total += k * _ELEM.get(d, 4)
        return total

    @property
    def floating(self) -> bool:
        return any(d in _FLOATING for d in self.dtypes)

    @property
    def kind(self) -> str:
        """'gradient' (a reduction, or any non-broadcast collective, of floating data), 'broadcast'
        (DDP's parameter/buffer sync), 'metadata' (integer-only: DDP's shape check, its one-time bucket
        rebuild), 'barrier'."""
        if family(self.op) == "barrier":
            return "barrier"
        if family(self.op) == "broadcast":
            return "broadcast" if self.floating else "metadata"
        if not self.floating:
            return "metadata"
        return "gradient"

    def describe(self, main_thread: str | None = None) -> str:
        dt = "/".join(sorted({_TORCH_NAME.get(d, d) for d in self.dtypes})) or "?"
        shapes = ",".join("[" + "×".join(str(int(x)) for x in s) + "]" for s in self.sizes)
        known = main_thread is not None and self.thread not in ("?", "")  # older recorders: no thread id
        where = f", from thread {self.thread} (not the main thread)" if known and self.thread != main_thread else ""
        return (f"{self.backend}:{self.op} {dt} {shapes} = {self.numel} elements, {fmt_bytes(self.nbytes)}, "
                f"process group {self.pg}{where}")


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


class RecorderError(RuntimeError):
    """The recorder cannot give a complete count (off, or its ring overflowed)."""


# Point-to-point ops (a pipeline's activations and gradients): gloo's flight recorder (torch 2.11 / 2.13, seen)
# records none of them, so record_p2p() hooks ProcessGroup.send / recv — below dist.send, isend and
# batch_isend_irecv, on every backend — into a ring of the recorder's entry format, and the recorders' own
# send / recv entries are dropped (one source for p2p, whatever the backend records itself).
_P2P: dict = {}  # "ring": deque of entries, "next": the next record_id


def record_p2p() -> None:
    """Hook ProcessGroup.send / recv / recv_anysource (idempotent): each call becomes an entry ("p2p" source)."""
    import collections

    import torch

    if _P2P:
        return
    _P2P.update(ring=collections.deque(maxlen=int(launcher_var("TORCH_FR_BUFFER_SIZE") or DEFAULT_RING)), next=0)
    PG = torch._C._distributed_c10d.ProcessGroup
    names = {v: k for k, v in _TORCH_NAME.items()}
    for op in ("send", "recv", "recv_anysource"):
        orig = getattr(PG, op)

        def hooked(self, tensors, *args, _orig=orig, _op=op, **kwargs):
            rid, _P2P["next"] = _P2P["next"], _P2P["next"] + 1
            _P2P["ring"].append(dict(
                record_id=rid, profiling_name=f"{self.name()}:{_op.split('_')[0]}", pg_id=self.group_name,
                process_group=(self.group_name, self.group_desc), input_sizes=[list(t.shape) for t in tensors],
                input_dtypes=[names.get(str(t.dtype).removeprefix("torch."), str(t.dtype)) for t in tensors],
                thread_id=str(threading.get_ident()), time_created_ns=time.time_ns()))
            return _orig(self, tensors, *args, **kwargs)

        setattr(PG, op, hooked)


def _dumps() -> list[tuple[str, list[dict]]]:
    import torch

    c10d = torch._C._distributed_c10d
    out = [("p2p", list(_P2P["ring"]))] if _P2P else []
    for source, name in (("fr", "_dump_fr_trace"), ("nccl", "_dump_nccl_trace")):
        fn = getattr(c10d, name, None)
        if fn is None:
            continue
        try:
            raw = fn(includeStackTraces=False)
        except TypeError:  # older signature without keywords
            raw = fn(True, False, False)
        except RuntimeError:  # e.g. NCCL dump on a build/process without NCCL groups
            continue
        entries = pickle.loads(raw).get("entries", []) if raw else []
        out.append((source, entries))
    return out


def _parse(source: str, e: dict) -> Collective:
    name = str(e.get("profiling_name", "?"))
    backend, _, op = name.partition(":") if ":" in name else ("?", "", name)
    pg = e.get("process_group")
    pg_name = pg[1] if isinstance(pg, (tuple, list)) and len(pg) > 1 else ""
    return Collective(
        record_id=int(e["record_id"]), source=source, backend=backend, op=op.lower(),
        sizes=tuple(tuple(s) for s in e.get("input_sizes", ())), dtypes=tuple(e.get("input_dtypes", ())),
        pg=f"{e.get('pg_id', '?')} {pg_name!r}", thread=str(e.get("thread_id", "?")),
        time_ns=int(e.get("time_created_ns", 0)), group=str(pg[0]) if isinstance(pg, (tuple, list)) and pg else "")


INTRA, INTER = "intra-node", "inter-node"
LINKS = (INTRA, INTER)


def group_links(per_node: int | None = None) -> dict[str, str]:
    """Each process group of this process, by c10d name -> INTRA or INTER: INTER when its ranks live on more than
    one node. torchrun numbers ranks node by node, so node = rank // LOCAL_WORLD_SIZE (per_node). A pool's ranks
    are one host's: their LOCAL_WORLD_SIZE is the world (every group INTRA), or XTRAIN_RANKS_PER_NODE where
    that knob emulates nodes (verify/_internal/ranks/worker.py)."""
    import torch.distributed as dist

    per_node = per_node or int(launcher_var("LOCAL_WORLD_SIZE") or dist.get_world_size())
    out = {}
    for pg, name in list(dist.distributed_c10d._world.pg_names.items()):
        nodes = {r // per_node for r in dist.get_process_group_ranks(pg)}
        out[str(name)] = INTER if len(nodes) > 1 else INTRA
    return out


def link_of(c: Collective, links: dict) -> str:
    """The link collective `c` crosses, by its group (group_links' map). A group of unknown nodes counts as
    inter-node: the costlier link, never under-reported."""
    return links.get(c.group, INTER)


class Recorder:
    """Reads new flight-recorder entries since the last read (per process; one per rank)."""

    def __init__(self):
        self._last: dict[str, int] = {}  # source -> highest record_id already returned
        self.main_thread = str(threading.main_thread().ident)

    def read(self) -> list[Collective]:
        """Entries recorded since the previous read, oldest first. Raises RecorderError on overflow."""
        seen, out = set(), []
        for source, entries in _dumps():
            last = self._last.get(source, -1)
            new = [e for e in entries if int(e["record_id"]) > last]
            if not new:
                continue
            first = min(int(e["record_id"]) for e in new)
            self._last[source] = max(int(e["record_id"]) for e in new)  # the next read starts clean
            if first > last + 1:
                raise RecorderError(
                    f"flight recorder ({source}) lost entries {last + 1}..{first - 1}: its ring of "
                    f"{launcher_var('TORCH_FR_BUFFER_SIZE', '?')} entries overflowed between two reads; "
                    f"raise TORCH_FR_BUFFER_SIZE or read more often")
            for e in new:
                if _P2P and source != "p2p" and family(str(e.get("profiling_name", "")).partition(":")[2]) in ("send", "recv"):
                    continue  # p2p comes from the hook alone (dropped after the overflow check: no false gap)
                # the same entry may come from both dumps on some builds: keep it once
                key = (e.get("record_id"), e.get("pg_id"), e.get("profiling_name"), e.get("time_created_ns"))
                if key not in seen:
                    seen.add(key)
                    out.append(_parse(source, e))
        out.sort(key=lambda c: (c.time_ns, c.record_id))
        return out

    def discard(self) -> None:
        """Forget everything recorded so far, overflowed or not: the next read() starts here."""
        for source, entries in _dumps():
            if entries:
                self._last[source] = max(self._last.get(source, -1), max(int(e["record_id"]) for e in entries))

    def check_recording(self, issue) -> None:
        """Self-test: `issue()` makes one collective; the recorder must report it, stamped with the clock
        the harness marks windows with (time.time_ns())."""
        self.read()
        t0 = time.time_ns()
        issue()
        t1 = time.time_ns()
        got = self.read()
        if not got:
            raise RecorderError("the c10d flight recorder recorded nothing: set TORCH_FR_BUFFER_SIZE (comm.enable()) "
                                "before the process group is created")
        if not all(t0 <= c.time_ns <= t1 for c in got):
            raise RecorderError(f"flight recorder timestamps {[c.time_ns for c in got]} are not on time.time_ns()'s "
                                f"clock ([{t0}, {t1}]): entries cannot be attributed to micro-steps")


class Windows:
    """Harness-controlled time marks; `attribute` assigns each entry to the window it was created in. A
    framework-owned loop (verify.Pull) marks again from its own thread, reusing the harness's labels."""

    def __init__(self, recorder: Recorder | None = None):
        self.marks: list[tuple[int, object]] = []
        self.recorder, self.seen = recorder, []

    def mark(self, label) -> None:
        self.marks.append((time.time_ns(), label))
        if self.recorder is not None and isinstance(label, tuple) and label[:1] == ("after",):
            # a step's end (drive): the ring is read here, so it need hold one step's collectives, not a run's
            # (torchtitan's FSDP2 at N=5, K=3: ~180 a step, a run past the 512-entry ring)
            self.seen += self.recorder.read()

    def collected(self) -> list[Collective]:
        """Every entry since the run began: those read at each step's end, then the rest."""
        return self.seen + (self.recorder.read() if self.recorder is not None else [])

    def attribute(self, entries: list[Collective]) -> dict:
        """label -> [Collective]; entries before the first mark go to None."""
        marks = sorted(self.marks, key=lambda m: m[0])  # two threads may append out of order
        out: dict = {label: [] for _, label in marks}
        times = [t for t, _ in marks]
        import bisect

        for c in entries:
            i = bisect.bisect_right(times, c.time_ns) - 1
            out.setdefault(marks[i][1] if i >= 0 else None, []).append(c)
        return out


_ACTIVE = threading.local()


def active_windows():
    """The Windows the harness is driving a trainer under in this thread (None outside drive()): how a
    trainer that runs its work in another thread (verify.Pull) marks its micro-steps."""
    return getattr(_ACTIVE, "windows", None)


def set_active(windows) -> None:
    _ACTIVE.windows = windows
