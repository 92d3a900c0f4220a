"""xtrain's CLI plumbing: the command lines' shared one-line errors (exit 2), integer types, progress bar and
device checks (_xtrain_cli, which the harness uses too: xtrain_core imports nothing of the harness), and what only
xtrain's command line reads (a seed's range, a positive float, a text file, torchrun's environment)."""
from __future__ import annotations

import argparse

from _xtrain_cli import (PROG, Parser, Progress, UsageError, available_memory, check_fits, fail,  # noqa: F401
                         int_at_least, positive_int, resolve_device)

SEED_MAX = 2**63 - 1  # torch.manual_seed takes a signed 64-bit integer


def positive_float(text: str) -> float:
    """A finite number > 0 (inf and nan are numbers to float(), not to an optimizer)."""
    import math

    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}") from None
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {v}")
    return v


CHUNK = 1 << 20  # bytes read at a time from a --data/--docs file: its size never sets the memory a check takes


def text_file(flag: str, path: str) -> None:
    """UsageError unless `path` is a regular, readable, UTF-8 text file (one line naming the flag)."""
    import os

    fix = "pass a UTF-8 text file" + (" or omit --data" if flag == "--data" else ", one document per line")
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path}: is a directory; {fix}")
    if not os.path.exists(path):
        raise UsageError(f"{flag} {path}: no such file; {fix}")
    if not os.path.isfile(path):
        raise UsageError(f"{flag} {path}: not a regular file; {fix}")
    import codecs

    decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
    try:  # in chunks: a file of any size is checked in bounded memory (xtrain_core/data.py streams it too)
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                decoder.decode(chunk)
                offset += len(chunk)
            decoder.decode(b"", final=True)
    except UnicodeDecodeError as e:  # e.start counts from the bytes the decoder still held, not the chunk
        held = len(e.object) - len(chunk)
        raise UsageError(f"{flag} {path}: not UTF-8 text (byte {offset - held + e.start}); {fix}") from None
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot read it ({e.strerror}); {fix}") from None


def torchrun_env() -> tuple[int, int, int] | None:
    """(rank, world, local_rank) when launched by torchrun (its RANK/WORLD_SIZE/LOCAL_RANK env), else None."""
    import os

    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0"))
