"""The mesh a trainer runs on: data parallel × pipeline stages × context parallel × tensor parallel.

    verify.Mesh(dp=1, pp=2, tp=2)      4 ranks; rank = ((dp_i·pp + pp_i)·cp + cp_i)·tp + tp_i (tp innermost)
    verify.Mesh(dp=2, cp=2)            cp rank c holds tokens [c·S/cp, (c+1)·S/cp) of every row (cp_slice)

`device_mesh(spec)` builds the DeviceMesh once per process, so adapters and the harness agree on who holds
what. `assemble(owned, mesh, what)`: per dp replica, name -> tensor, the union over pp stages (owned once), the
tp and cp ranks of a stage agreeing bit for bit; keyed by the FULL model's names (DTensors gathered: case.py).

Design: docs/design/distributed.md, "Mesh axes".
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Mesh", "AXES", "device_mesh", "assemble", "MeshError", "check_spec", "mesh_axes", "mesh_sizes", "meshes",
           "unsupported", "cp_slice"]

AXES = ("dp", "pp", "cp", "tp")  # outermost first: the order of init_device_mesh's dims (cp only where > 1)


class MeshError(ValueError):
    """What the ranks own does not assemble into one model (a name owned twice, by no stage, or tp ranks
    disagreeing); str(e) names the replica, the stage(s) and the parameter."""


@dataclass(frozen=True)
class Mesh:
    """dp × pp × cp × tp ranks. Frozen; `size` ranks in all; coords(rank) -> (dp_i, pp_i, tp_i), cp_of(rank)."""

    dp: int = 1
    pp: int = 1
    tp: int = 1
    cp: int = 1

    def __post_init__(self):
        for axis in AXES:
            v = getattr(self, axis)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"Mesh.{axis} must be an integer ≥ 1, got {v!r}")

    @property
    def size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    def coords(self, rank: int) -> tuple[int, int, int]:
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside {self} ({self.size} ranks)")
        return rank // (self.pp * self.cp * self.tp), rank // (self.cp * self.tp) % self.pp, rank % self.tp

    def cp_of(self, rank: int) -> int:
        return rank // self.tp % self.cp

    def rank(self, dp_i: int, pp_i: int, tp_i: int, cp_i: int = 0) -> int:
        return ((dp_i * self.pp + pp_i) * self.cp + cp_i) * self.tp + tp_i

    def stage_ranks(self, dp_i: int, pp_i: int) -> list[int]:
        """The ranks of one replica's stage: its cp × tp ranks, which hold one gradient between them."""
        return [self.rank(dp_i, pp_i, t, c) for c in range(self.cp) for t in range(self.tp)]

    def axes(self) -> tuple[str, ...]:
        """The axes wider than one rank, outermost first."""
        return tuple(a for a in AXES if getattr(self, a) > 1)

    def __str__(self):
        return f"mesh dp={self.dp} pp={self.pp} tp={self.tp}" + (f" cp={self.cp}" if self.cp > 1 else "")


def cp_slice(x, y, mesh: Mesh, rank: int):
    """The tokens of every row that cp rank `rank` holds: [c·S/cp, (c+1)·S/cp) of dim 1 (ValueError where cp does
    not divide S: declare mesh_sizes={'cp': ...} among the divisors of your rows' length)."""
    if mesh.cp == 1:
        return x, y
    S = y.shape[1]
    if S % mesh.cp:
        raise ValueError(f"{mesh}: cp={mesh.cp} does not divide the rows' {S} tokens")
    c, n = mesh.cp_of(rank), S // mesh.cp
    return x[:, c * n:(c + 1) * n], y[:, c * n:(c + 1) * n]


def check_spec(spec) -> None:
    """Spec's own validation of its mesh fields (ValueError naming the field and the numbers)."""
    if not isinstance(spec.mesh, Mesh):
        raise ValueError(f"Spec.mesh must be a verify.Mesh, got {spec.mesh!r}")
    c = spec.pipeline_chunks
    if not isinstance(c, int) or isinstance(c, bool) or c < 1 or spec.accum_steps % c:
        raise ValueError(f"Spec.pipeline_chunks must be an integer ≥ 1 dividing accum_steps={spec.accum_steps}, got {c!r}")


def mesh_axes(axes, error=ValueError) -> tuple[str, ...]:
    """Adapter.mesh_axes, validated and outermost first. dp alone is no mesh: that is data_parallel=True."""
    given = tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)
    if any(a not in AXES for a in given) or len(set(given)) != len(given) or given == ("dp",):
        raise error(f"mesh_axes must name distinct axes among {', '.join(AXES)} (not dp alone: that is "
                    f"data_parallel=True), got {axes!r}")
    return tuple(a for a in AXES if a in given)


def mesh_sizes(sizes, axes, error=ValueError) -> dict | None:
    """Adapter.mesh_sizes, validated: None (every size), or {axis: sizes it supports} over the declared
    `axes`, each a non-empty set of integers ≥ 2 (1, the unsplit axis, always works). A tp model of hidden
    size 16 declares {"tp": (2, 4, 8, 16)}: torch refuses an uneven DTensor shard (tp=3)."""
    if sizes is None:
        return None
    fix = f"mesh_sizes must map axes among {', '.join(axes) or 'the declared mesh_axes'} to sizes ≥ 2, e.g. {{'tp': (2, 4)}}"
    if not isinstance(sizes, dict) or not sizes or any(a not in axes for a in sizes):
        raise error(f"{fix}; got {sizes!r}")
    out = {}
    for a in (a for a in AXES if a in sizes):
        v = tuple(sizes[a]) if isinstance(sizes[a], (tuple, list, set, frozenset, range)) else (sizes[a],)
        if not v or any(not isinstance(n, int) or isinstance(n, bool) or n < 2 for n in v):
            raise error(f"{fix}; got {a!r}: {sizes[a]!r}")
        out[a] = tuple(sorted(set(v)))
    return out


def unsupported(mesh: Mesh, sizes: dict | None) -> str | None:
    """Why `mesh` is outside the adapter's mesh_sizes (one line), or None where it is supported."""
    for a, allowed in (sizes or {}).items():
        n = getattr(mesh, a)
        if n > 1 and n not in allowed:
            return f"{a}={n} is not among the adapter's mesh_sizes[{a!r}] = {allowed}"
    return None


def meshes(axes, world: int, sizes: dict | None = None) -> list:
    """Every verify.Mesh of exactly `world` ranks wider than one rank only along `axes` (dp, pp, tp) and
    within `sizes` (Adapter.mesh_sizes), fewest axes first (a failure shrinks toward the simplest mesh)."""
    top = lambda a: world if a in axes else 1  # noqa: E731
    out = [Mesh(dp=d, pp=p, cp=c, tp=world // (d * p * c)) for d in range(1, top("dp") + 1)
           for p in range(1, top("pp") + 1) for c in range(1, top("cp") + 1)
           if world % (d * p * c) == 0 and (world // (d * p * c) == 1 or "tp" in axes)]
    return sorted((m for m in out if unsupported(m, sizes) is None), key=lambda m: (len(m.axes()), m.dp, m.pp, m.cp))


_MESHES: dict = {}  # (mesh, device type, world) -> DeviceMesh, per process: building one creates process groups


def device_mesh(spec):
    """The DeviceMesh of `spec.mesh` over this process's default group (whose world must be mesh.size),
    dims ("dp", "pp", "tp"), with "cp" before "tp" where cp > 1; built once per process and mesh (group creation is a collective every rank
    enters, so all ranks must ask for the same meshes in the same order — they do: they run one case)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = spec.mesh
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"verify.device_mesh: {mesh} needs torch.distributed initialised (the harness runs "
                           f"mesh adapters on a pool of {mesh.size} ranks)")
    world = dist.get_world_size()
    if world != mesh.size:
        raise RuntimeError(f"verify.device_mesh: {mesh} needs a world of {mesh.size} ranks, this one has {world}")
    kind = str(spec.device).split(":")[0]
    key = (mesh, kind, world)
    if key not in _MESHES:
        dims = [a for a in AXES if a != "cp" or mesh.cp > 1]
        _MESHES[key] = init_device_mesh(kind, tuple(getattr(mesh, a) for a in dims), mesh_dim_names=tuple(dims))
    return _MESHES[key]


def assemble(owned: list[dict], mesh: Mesh, what: str) -> list[dict]:
    """owned[rank]: name -> full tensor (CPU) that rank returned. Returns, per dp replica, the union over
    its pp stages. Raises MeshError for a name two stages own, a stage's tp ranks that disagree (names or
    bits), or — `what` names the quantity, e.g. "gradient (step 0)" — nothing at all owned by a replica."""
    if len(owned) != mesh.size:
        raise ValueError(f"{len(owned)} ranks' {what} for {mesh} ({mesh.size} ranks)")
    out = []
    for d in range(mesh.dp):
        replica, by = {}, {}
        for s in range(mesh.pp):
            first = owned[mesh.rank(d, s, 0)]
            for r in mesh.stage_ranks(d, s)[1:]:
                other, who = owned[r], _who(mesh, r)
                if set(other) != set(first):
                    diff = sorted(set(other) ^ set(first))[:3]
                    raise MeshError(f"replica {d}, stage {s}: {who} own different {what} names ({diff}): every tp "
                                    f"(and cp) rank of a stage returns the same names")
                for name, v in first.items():
                    o = other[name]
                    if not (o.shape == v.shape and o.dtype == v.dtype and torch_equal(o, v)):
                        raise MeshError(f"replica {d}, stage {s}: {who} disagree on the full {what} of {name!r} "
                                        f"({_delta(o, v)}): the tp (and cp) ranks of a stage must hold one tensor, "
                                        f"bit for bit")
            for name, v in first.items():
                if name in by:
                    raise MeshError(f"replica {d}: {what} of {name!r} owned twice, by stage {by[name]} and "
                                    f"stage {s}: each parameter belongs to exactly one pipeline stage")
                by[name], replica[name] = s, v
        out.append(replica)
    return out


def _who(mesh: Mesh, rank: int) -> str:
    """'tp ranks 0 and 1' (a stage's first rank and `rank`), or with cp 'ranks (cp 0, tp 0) and (cp 1, tp 0)'."""
    t = rank % mesh.tp
    return f"tp ranks 0 and {t}" if mesh.cp == 1 else f"ranks (cp 0, tp 0) and (cp {mesh.cp_of(rank)}, tp {t})"


def missing(replica: dict, names, mesh: Mesh, d: int, what: str) -> None:
    """The names of the 1×1×1 reference that no stage of replica d owns: MeshError."""
    gone = [n for n in names if n not in replica]
    if gone:
        raise MeshError(f"replica {d}: {what} of {gone[:3]}{' …' if len(gone) > 3 else ''} owned by no stage "
                        f"(the names are the full model's, those of the 1×1×1 reference)")


def torch_equal(a, b) -> bool:
    """Bit for bit, NaN where the other has NaN (two ranks that both divided 0/0 hold one tensor: the judge, not
    this check, names the NaN)."""
    import torch

    if torch.equal(a, b):
        return True
    return a.is_floating_point() and bool(((a == b) | (a.isnan() & b.isnan())).all())


def _delta(a, b) -> str:
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
    return f"max|Δ| = {(a.double() - b.double()).abs().max().item():.3e}" if a.numel() else "empty"
