"""Copy the source of inductor-generated Triton kernels out of a compile cache, by kernel name.

A profile names its longest kernels (``triton_red_fused_...``, as bench_engine.py profile prints them, cut at
110 characters); this finds the kernels whose names start with a given prefix in the modules inductor wrote to its
cache (up to 8 a prefix) and writes each to OUT/<name>.py with the graph module's lines that launch it, so what the
kernel reads, reduces and writes can be read after the device machine has gone back.

    python3 tests/device/kernel_source.py --out $OUT/kernels NAME_PREFIX [NAME_PREFIX ...]
        [--cache /tmp/torchinductor_root]

One line per kernel written, or per prefix not found (exit 1 then).
"""

from __future__ import annotations

import argparse
import getpass
import re
import sys
import tempfile
from pathlib import Path

MAX_MODULE_BYTES = 8 << 20  # a graph module larger than this is not read (none has come near it)
MAX_PER_NAME = 8  # kernels written for one prefix (several graphs' kernels can share one)


def kernel_definitions(text: str, name: str) -> list[tuple[str, str]]:
    """(full kernel name, source) of every kernel in a graph module whose name starts with ``name``.

    Inductor writes each kernel as a string literal: ``async_compile.triton('NAME', '''<source>''', ...)``."""
    found = []
    for match in re.finditer(r"async_compile\.triton\(\s*'(" + re.escape(name) + r"[A-Za-z0-9_]*)',\s*'''", text):
        end = text.find("'''", match.end())
        if end >= 0:
            found.append((match.group(1), text[match.end() : end]))
    return found


def launch_lines(text: str, full_name: str) -> list[str]:
    """The graph module's lines that launch the kernel, with the two lines before each (its buffers' allocations)."""
    lines = text.splitlines()
    out: list[str] = []
    for i, line in enumerate(lines):
        if f"{full_name}.run(" in line:
            out.extend(lines[max(0, i - 2) : i + 1])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="+", help="kernel name prefixes, as a profile prints them")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    modules = [p for p in args.cache.rglob("*.py") if p.stat().st_size <= MAX_MODULE_BYTES]
    texts = {path: path.read_text(errors="replace") for path in modules}
    missing = 0
    for name in args.names:
        written: set[str] = set()  # one graph's kernel is written once, though several cached modules hold it
        for path, text in texts.items():
            for full_name, source in kernel_definitions(text, name) if name in text else []:
                if full_name in written or len(written) >= MAX_PER_NAME:
                    continue
                written.add(full_name)
                launches = launch_lines(text, full_name)
                dest = args.out / f"{full_name[:120]}.py"
                dest.write_text(f"# from {path}\n{source}\n# launched:\n" + "".join(f"# {ln}\n" for ln in launches))
                lines = len(source.splitlines())
                print(f"kernel {full_name}: {lines} lines from {path.name}, {len(launches)} launch lines")
        if not written:
            print(f"kernel {name}: not found in {len(modules)} modules under {args.cache}")
            missing += 1
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
