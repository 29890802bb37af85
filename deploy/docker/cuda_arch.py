"""Build-stage helper: compile causal-conv1d for the GPUs named in TORCH_CUDA_ARCH_LIST only.

Why this exists: causal-conv1d's setup.py passes its own fixed list of
`-gencode arch=compute_XX,code=sm_XX` flags (sm_75 up to sm_121), and
torch.utils.cpp_extension drops TORCH_CUDA_ARCH_LIST as soon as any `arch` flag is
present. Left alone, `TORCH_CUDA_ARCH_LIST=9.0` is silently ignored and the build
compiles every kernel for about ten architectures. This script keeps only the
requested ones, fails loudly when the source no longer looks as expected, and checks
the built wheel for the requested SASS afterwards.

Usage (see the Dockerfile):
    python cuda_arch.py patch  causal_conv1d-X.Y.Z/setup.py   # reads TORCH_CUDA_ARCH_LIST
    python cuda_arch.py check  dist/causal_conv1d-*.whl       # runs cuobjdump --list-elf
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# Two consecutive appends in causal-conv1d's setup.py:
#     cc_flag.append("-gencode")
#     cc_flag.append("arch=compute_90,code=sm_90")
_GENCODE_PAIR = re.compile(
    r'^(?P<indent>[ \t]*)cc_flag\.append\("-gencode"\)[ \t]*\n'
    r'[ \t]*cc_flag\.append\("arch=compute_(?P<arch>\d+),code=sm_(?P=arch)"\)[ \t]*$',
    re.MULTILINE,
)
_SM_IN_ELF_NAME = re.compile(r"\bsm_(\d+a?)\b")


def _show(arches: set[str]) -> str:
    """`{"120", "90"}` -> `"sm_90, sm_120"` (numeric order)."""
    ordered = sorted(arches, key=lambda a: (int(a.rstrip("a")), a))
    return ", ".join(f"sm_{a}" for a in ordered) or "none"


def parse_arch_list(arch_list: str) -> set[str]:
    """`"9.0"` -> `{"90"}`; `"8.0;9.0+PTX"` -> `{"80", "90"}` (the PTX suffix is not kept)."""
    arches = set()
    for item in re.split(r"[;\s,]+", arch_list.strip()):
        if not item:
            continue
        m = re.fullmatch(r"(\d+)\.(\d+)(a?)(\+PTX)?", item)
        if m is None:
            raise ValueError(f"cannot read {item!r} in TORCH_CUDA_ARCH_LIST={arch_list!r}; expected e.g. '9.0'")
        arches.add(f"{m.group(1)}{m.group(2)}{m.group(3)}")
    if not arches:
        raise ValueError("TORCH_CUDA_ARCH_LIST is empty")
    return arches


def restrict_gencode(source: str, wanted: set[str]) -> tuple[str, set[str], set[str]]:
    """Replace every gencode pair whose arch is not wanted by `pass`.

    Returns (new source, arches kept, arches dropped). `pass` keeps the enclosing
    `if` blocks syntactically valid.
    """
    kept: set[str] = set()
    dropped: set[str] = set()

    def replace(m: re.Match[str]) -> str:
        arch = m.group("arch")
        if arch in wanted:
            kept.add(arch)
            return m.group(0)
        dropped.add(arch)
        return f"{m.group('indent')}pass  # sm_{arch} dropped (TORCH_CUDA_ARCH_LIST)"

    return _GENCODE_PAIR.sub(replace, source), kept, dropped


def patch(setup_py: Path, arch_list: str) -> None:
    wanted = parse_arch_list(arch_list)
    new_source, kept, dropped = restrict_gencode(setup_py.read_text(), wanted)
    missing = wanted - kept
    if missing:
        raise SystemExit(
            f"{setup_py}: no gencode pair for {_show(missing)} (found {_show(kept | dropped)}); "
            "the upstream setup.py changed, update this script"
        )
    compile(new_source, str(setup_py), "exec")  # a broken edit fails here, not in nvcc
    setup_py.write_text(new_source)
    print(f"{setup_py}: kept {_show(kept)}; dropped {_show(dropped)}")


def arches_in_listing(listing: str) -> set[str]:
    """Architectures named by `cuobjdump --list-elf` lines such as `ELF file 1: x.sm_90.cubin`."""
    return set(_SM_IN_ELF_NAME.findall(listing))


def check(wheel: Path, arch_list: str) -> None:
    wanted = parse_arch_list(arch_list)
    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(wheel) as zf:
            libs = [n for n in zf.namelist() if n.endswith(".so")]
            if not libs:
                raise SystemExit(f"{wheel}: no compiled extension inside; was the CUDA build skipped?")
            zf.extractall(tmp, members=libs)
        found: set[str] = set()
        for lib in libs:
            listing = subprocess.run(
                ["cuobjdump", "--list-elf", os.path.join(tmp, lib)],
                check=True, capture_output=True, text=True,
            ).stdout
            found |= arches_in_listing(listing)
    if found != wanted:
        raise SystemExit(f"{wheel}: SASS for {_show(found)}, expected exactly {_show(wanted)}")
    print(f"{wheel}: SASS for {_show(found)} only")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["patch", "check"])
    parser.add_argument("path", type=Path)
    parser.add_argument("--arch-list", default=os.environ.get("TORCH_CUDA_ARCH_LIST", ""),
                        help="default: $TORCH_CUDA_ARCH_LIST")
    args = parser.parse_args(argv)
    if args.command == "patch":
        patch(args.path, args.arch_list)
    else:
        check(args.path, args.arch_list)


if __name__ == "__main__":
    sys.exit(main())
