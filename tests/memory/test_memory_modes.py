"""The memory-modes study (benchmarks/memory_modes.py): `python -m benchmarks.memory_modes` end to end on
the CPU (FSDP2 through torchrun), a mode past its time, and its bad input (one line,
exit 2)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from tests.helpers.memory import ENV, REPO

from benchmarks.memory_modes import main as modes_main

# -- the modes runner -------------------------------------------------------------------------------

@pytest.mark.parametrize("args,needle", [
    (["--modes", "xtrain,zero3"], "unknown mode zero3"),
    (["--world", "100000", "--effective-batch", "200000"], "--world 100000 exceeds the"),
    (["--effective-batch", "5", "--world", "2"], "not divisible by --world 2"),
    (["--name", "a/b"], "--name a/b"),
])
def test_modes_bad_input_is_one_line_exit_2(args, needle, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        modes_main([*args, "--out", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err and err.startswith("benchmarks.memory_modes: error:")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.memory
@pytest.mark.distributed
@pytest.mark.slow
def test_modes_end_to_end_on_cpu(tmp_path):
    """FSDP2 (reshard after forward) through torchrun with 2 gloo ranks (E=8: 5 configurations per rank): the
    combined report, its fields, the mode flat at fixed B and within 15 % of its prediction. xtrain's flat buffer
    (the "xtrain" mode) is the same run as `verify.memory` at world 2, checked in test_memory_cli.py; the
    benchmark itself runs every mode (`--modes xtrain,torch_ddp,fsdp2,fsdp2_keep`). ~25 s on 2 cores."""
    cmd = [sys.executable, "-m", "benchmarks.memory_modes", "--effective-batch", "8", "--world", "2", "--device", "cpu",
           "--modes", "fsdp2", "--model", "small", "--seq-len", "256", "--warmup", "1", "--out", str(tmp_path),
           "--name", "mm"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=str(REPO),
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"benchmarks.memory_modes timed out; stderr tail: {err[-2000:]}")
    assert p.returncode == 0, out + err[-3000:]
    assert sorted(f.name for f in tmp_path.iterdir()) == ["mm.json", "mm.md", "mm.png"]
    rep = json.loads((tmp_path / "mm.json").read_text())
    assert rep["kind"] == "memory-modes" and rep["verdict"] == "PASS" and "git_commit" in rep
    s = rep["settings"]
    assert (s["effective_batch"], s["world_size"], s["device"], s["model_name"], s["seq_len"], s["warmup_steps"]) == \
        (8, 2, "cpu", "small", 256, 1)
    assert [m["mode"] for m in rep["modes"]] == ["fsdp2"]
    assert [m["trainer_class"] for m in rep["modes"]] == ["FSDP2Trainer"]
    for m in rep["modes"]:
        assert m["verdict"] == "PASS" and m["exit_code"] == 0 and m["model_check"] == "PASS"
        assert set(m["invariants"].values()) == {"PASS"} and m["flat_fixed_B"]["status"] == "PASS"
        assert [(r["N"], r["B"]) for r in m["rows"]] == [(1, 4), (2, 2), (4, 1), (1, 1), (2, 1)]
        for r in m["rows"]:
            assert len(r["measured"]) == 2 and r["predicted_bytes"] > 0 and r["terms"]
            assert all(0.85 < x < 1.15 for x in r["ratio"]), (m["mode"], r)
        inner = m["report"]
        assert inner["prediction"]["mode"] == m["mode"] and inner["prediction"]["probe"] == "cpu"
        assert all(x["process_group"] == dict(backend="gloo", world=2) for c in inner["configs"] for x in c["ranks"])
    fsdp = rep["modes"][0]["rows"]
    by = {(r["N"], r["B"]): r for r in fsdp}
    # FSDP2's no-sync window: every unit's unsharded gradient (P·4 bytes) joins the peak from N = 2 on
    P = rep["settings"]["n_params"]
    assert by[(2, 1)]["terms"]["unsharded gradients, every unit (no-sync window)"] == 4 * P
    assert by[(2, 1)]["peak_bytes"] - by[(1, 1)]["peak_bytes"] > 2 * P  # measured: the window costs memory
    md = (tmp_path / "mm.md").read_text()
    assert "**PASS**" in md and "## Measured vs predicted" in md and "is the peak flat in N?" in md and "mm.png" in md
    assert (tmp_path / "mm.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "[1/1] fsdp2: PASS" in err
    assert "meas/pred" in out and "verdict: PASS" in out


@pytest.mark.memory
@pytest.mark.distributed
@pytest.mark.slow
def test_a_mode_past_its_time_is_killed_whole_and_reported(tmp_path):
    """--budget: a mode that runs out of time is an ERROR line (exit 1), the next is not started, and nothing
    of the killed run survives (torchrun starts its ranks in sessions of their own: killed by pid)."""
    r = subprocess.run([sys.executable, "-m", "benchmarks.memory_modes", "--modes", "fsdp2,xtrain", "--budget", "6",
                        "--out", str(tmp_path)], capture_output=True, text=True, env=ENV, cwd=str(REPO), timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "[1/2] fsdp2: ERROR in" in r.stderr and "timed out after 6 s" in r.stderr
    assert "xtrain: ERROR in 0.0 s — not run: --budget 6 s spent" in r.stderr
    rep = json.loads((tmp_path / "memory-modes.json").read_text())
    assert rep["verdict"] == "FAIL" and [m["verdict"] for m in rep["modes"]] == ["ERROR", "ERROR"]
    run_dir = rep["modes"][0]["command"].split("--out ")[1].split()[0]
    alive = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            alive += [d] if run_dir.encode() in Path(f"/proc/{d}/cmdline").read_bytes() else []
        except OSError:
            pass
    assert not alive, f"processes of the killed run survive: {alive}"

