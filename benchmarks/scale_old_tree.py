"""Make DIR a copy of this tree as it was before the scale tier, for a side-by-side run (reports/scale/): the harness
without freeing the last trainer before building the next on CUDA, and the Llama recipe initialised on the CPU and
then moved (as the trainer of the issue's 134M measurement was). Only those two lines differ.

    python -m benchmarks.scale_old_tree DIR
"""
import pathlib
import shutil
import sys


def main(argv=None) -> int:
    dst = pathlib.Path((sys.argv[1:] if argv is None else argv)[0])
    src = pathlib.Path(__file__).resolve().parents[1]
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".git", ".venv", "__pycache__", "reports"))
    for rel, new, old in [
        ("verify/_internal/protocol.py", "        if str(spec.device).startswith(\"cuda\"):\n            gc.collect()", None),
        ("examples/llama_scale.py", "    with torch.device(spec.device):\n        model = Llama(SIZES[o.size], o)\n"
         "    return model.to(spec.dtype)", "    model = Llama(SIZES[o.size], o)\n    return model.to(spec.device, spec.dtype)"),
    ]:
        p = dst / rel
        text = p.read_text()
        if new not in text:
            raise SystemExit(f"{rel}: the line to revert is not there")
        if old is None:  # drop the line and its comment
            start = text.index(new)
            end = text.index("\n", start + len(new)) + 1
            text = text[:start] + text[end:]
        else:
            text = text.replace(new, old)
        p.write_text(text)
    print(f"wrote {dst}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
