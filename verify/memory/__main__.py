"""`python -m verify.memory`: the memory command line (verify/memory/cli.py; `--help` for the flags). Its
trainer is --trainer, or the configured default trainer, whose adapter may bring a preset for its family
(Adapter(memory_preset=...): short trainer names, flags, an anchor)."""
from __future__ import annotations

import os
import sys

from verify._internal.cli import fail
from verify._internal.protocol import AdapterError, load_adapter
from verify._internal.settings import launcher_var
from verify._internal.trainers import default_trainer
from verify.memory.cli import Wing
from verify.memory.cli import main as _main


def preset() -> Wing:
    """The default trainer's preset; without a default trainer, --trainer is required."""
    ref = default_trainer()
    if ref is None:
        return Wing()
    try:
        adapter = load_adapter(ref, option="the default trainer")
    except AdapterError as e:
        fail(str(e))
    return adapter.memory_preset or Wing(default=ref)


def main(argv=None) -> int:
    return _main(argv, preset())


if __name__ == "__main__":
    code = main()
    if int(launcher_var("WORLD_SIZE", "1")) > 1:
        # gloo's teardown at interpreter exit sometimes aborts the process after a clean run; the group is
        # already destroyed and the report written, so leave without running it
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
