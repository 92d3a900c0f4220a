"""The collective counter (verify/_internal/ranks/comm.py): it must see every path a trainer could use, attribute to
the harness's windows, classify DDP's non-gradient traffic, and refuse to undercount."""
import pytest

from verify._internal.ranks.comm import Collective, Windows, _parse
from tests.helpers.dist_jobs import overflow_recorder, probe_counter, recorder_reads_clean, windows_drained_per_step
from verify._internal.gates.worlds import max_world
from verify._internal.ranks.pool import get_pool

pytestmark = pytest.mark.distributed


@pytest.mark.skipif(max_world() < 2, reason="needs world ≥ 2")
def test_counter_sees_every_path():
    """dist.all_reduce, coalesced, the backend object, a helper thread, a private group (the last three
    are invisible to CommDebugMode: a dispatch mode of the calling thread), DDP's C++ reducer; sizes, dtypes, group and thread."""
    for rank, seen in enumerate(get_pool(2).run(probe_counter)):
        ops = lambda w: [(op, n) for op, n, *_ in seen[w]]  # noqa: E731
        assert ops("dist.all_reduce") == [("all_reduce", 7)], seen
        assert [n for _, n, *_ in seen["all_reduce_coalesced"]] == [7], seen  # [3] + [4] in ONE collective
        assert "reduce" in seen["all_reduce_coalesced"][0][0]
        assert ops("backend object") == [("all_reduce", 9)], seen
        (op, n, dt, kind, pg, off_main, nbytes), = seen["helper thread"]
        assert (op, n, nbytes) == ("all_reduce", 5, 20) and off_main, seen  # thread "?" on old recorders
        (op, n, dt, kind, pg, off_main, nbytes), = seen["private group"]
        assert (op, n) == ("all_reduce", 6) and not pg.startswith("0 "), seen
        # DDP: construction = shape check (integer all_gather) + parameter broadcast; backward = its bucket
        assert {k for *_, k, _pg, _t, _b in seen["DDP construction"]} <= {"metadata", "broadcast"}
        assert any(k == "broadcast" and n == 15 for _, n, _d, k, *_ in seen["DDP construction"]), seen
        assert [(op, n, k) for op, n, _d, k, *_ in seen["DDP backward"]] == [("all_reduce", 15, "gradient")], seen
        (op, n, dt, kind, pg, off_main, nbytes), = seen["broadcast"]
        assert (op, n, dt, kind, nbytes) == ("broadcast", 2, ("Double",), "broadcast", 16), seen
        assert seen.get("end", []) == [], f"rank {rank}: {seen}"


def test_ring_overflow_is_an_error_not_an_undercount():
    pool = get_pool(1)
    msg = pool.run(overflow_recorder, 600)[0]  # ring of 512 entries
    assert "overflowed" in msg and "TORCH_FR_BUFFER_SIZE" in msg, msg
    assert pool.run(recorder_reads_clean) == [1]  # and the next read is whole again


def test_a_run_longer_than_the_ring_is_read_step_by_step():
    """torchtitan's FSDP2 at N=5, K=3 issued more collectives in one run than the 512-entry ring holds: Windows
    with a recorder reads it at each step's end ("after"), so the ring need hold one step."""
    assert get_pool(1).run(windows_drained_per_step, 300, 3)[0] == [300, 300, 300]


def test_windows_attribute_by_creation_time():
    w = Windows()
    w.marks = [(100, "a"), (200, "b"), (300, "c")]

    def c(t):
        return Collective(0, "fr", "gloo", "all_reduce", ((3,),), ("Float",), "0 'default_pg'", "1", t)

    got = w.attribute([c(50), c(100), c(199), c(200), c(10**9)])
    assert [x.time_ns for x in got[None]] == [50]
    assert [x.time_ns for x in got["a"]] == [100, 199]
    assert [x.time_ns for x in got["b"]] == [200]
    assert [x.time_ns for x in got["c"]] == [10**9]
    # a framework's thread (verify.Pull) appends its marks too: two threads may append out of time order
    w.marks = [(100, "a"), (300, "c"), (200, "b")]
    got = w.attribute([c(250), c(350)])
    assert [x.time_ns for x in got["b"]] == [250] and [x.time_ns for x in got["c"]] == [350]


def test_parse_tolerates_missing_keys_and_classifies():
    """torch 2.11 and 2.13 entries differ in optional keys; only record_id is required."""
    e = _parse("nccl", {"record_id": 3, "profiling_name": "nccl:allreduce_coalesced",
                        "input_sizes": [[2, 3], [4]], "input_dtypes": ["BFloat16", "BFloat16"]})
    assert (e.backend, e.op, e.numel, e.nbytes, e.kind) == ("nccl", "allreduce_coalesced", 10, 20, "gradient")
    assert _parse("fr", {"record_id": 1, "profiling_name": "gloo:broadcast", "input_sizes": [[18]],
                         "input_dtypes": ["Int"]}).kind == "metadata"  # DDP's bucket rebuild
    assert _parse("fr", {"record_id": 1, "profiling_name": "gloo:all_gather", "input_sizes": [[1]],
                         "input_dtypes": ["Long"]}).kind == "metadata"  # DDP's shape check
    assert _parse("fr", {"record_id": 2, "profiling_name": "gloo:broadcast", "input_sizes": [[5]],
                         "input_dtypes": ["Float"]}).kind == "broadcast"
    assert "float32 [3×4]" in _parse("fr", {"record_id": 2, "profiling_name": "gloo:all_reduce",
                                            "input_sizes": [[3, 4]], "input_dtypes": ["Float"]}).describe()


def test_thread_is_named_only_when_the_recorder_knows_it():
    base = {"record_id": 1, "profiling_name": "gloo:all_reduce", "input_sizes": [[3]], "input_dtypes": ["Float"]}
    assert "from thread 9 (not the main thread)" in _parse("fr", {**base, "thread_id": "9"}).describe("1")
    assert "thread" not in _parse("fr", {**base, "thread_id": "1"}).describe("1")  # the main thread
    assert "thread" not in _parse("fr", base).describe("1")  # older recorders carry no thread id
