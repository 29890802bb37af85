"""The routed experts' two products as one CUTLASS kernel over a tile-aligned expert layout (Hopper).

Legend: R = rows of the layout (a multiple of the tile's M), K = a product's inner size, N = its
outputs, E = experts, M = tiles of the layout (R / tile rows).

``torch._grouped_mm`` runs CUTLASS's pointer-array grouped kernel: every time a CTA moves on to
another expert it rewrites its TMA descriptors, and with 256 experts of about 2,000 rows that is
nearly every tile. ``csrc/expert_gemm_sm90.cu`` lays the rows out so that each expert starts on a
multiple of the tile's rows (``expert_layout``); then every tile belongs to one expert, named by
``tile_expert[m]``, and one descriptor per operand serves all of them (the weights' as a batch of
E). Each output is the same wgmma products in K order into float32 accumulators, rounded once:
``torch._grouped_mm``'s numbers bit for bit (tests/gpu/test_moe_fused.py), in less time (figures
in docs/moe.md).

The kernel is compiled ahead of time into a shared library with a C ABI, loaded with ctypes and
run on PyTorch's current stream:

    python -m model_runtime.kernels.expert_gemm --cutlass /path/to/cutlass   # about a minute

writes ``$PACKSCORE_CACHE_DIR/kernels/libpackscore_expert_gemm-<source hash>.so`` (the Docker
image builds it, see the Dockerfile); ``--expert-gemm`` names another file, passed down to the
backend choice (``select_backends(expert_gemm=...)``, bound into the ``expert_tiles`` backends),
or, where none is passed, ``$PACKSCORE_EXPERT_GEMM`` (``library_path``). Where no library
matching this source loads, or the GPU is not an sm_90 one, ``unavailable_reason()`` says why
and the ``expert_tiles`` backend is skipped for ``grouped_mm_fused_scatter``.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from model_runtime.kernels.cache import packscore_cache_dir

SOURCE = Path(__file__).with_name("csrc") / "expert_gemm_sm90.cu"
ABI_VERSION = 2  # csrc/expert_gemm_sm90.cu's kAbiVersion
CUTLASS_VERSION = "v4.7.0"  # the headers the source is written against


@functools.cache
def source_hash() -> str:
    """The source's hash, read once: an experts' call without a bound library resolves the default path each time."""
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]


def default_library_path() -> Path:
    return packscore_cache_dir() / "kernels" / f"libpackscore_expert_gemm-{source_hash()}.so"


def library_path(named: str | os.PathLike | None = None) -> Path:
    """``named`` (``--expert-gemm``); without it ``$PACKSCORE_EXPERT_GEMM`` (read here only, for
    callers that pass none), else ``default_library_path()``."""
    named = named or os.environ.get("PACKSCORE_EXPERT_GEMM")
    return Path(named) if named else default_library_path()


def _library(named: str | os.PathLike | None = None) -> tuple[ctypes.CDLL | None, str | None]:
    """The library at ``library_path(named)``, or None and why not."""
    return _load(library_path(named))


@functools.cache
def _load(path: Path) -> tuple[ctypes.CDLL | None, str | None]:
    """The loaded library, or None and why not (cached: one load per file and process)."""
    if not path.is_file():
        return None, (f"no library at {path} (build it: python -m model_runtime.kernels.expert_gemm --cutlass DIR, "
                      "or name one with --expert-gemm or PACKSCORE_EXPERT_GEMM)")
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as err:
        return None, f"loading {path} failed: {err}"
    try:
        lib.pse_abi_version.restype = ctypes.c_int
        lib.pse_tile_rows.restype = ctypes.c_int
        lib.pse_workspace_bytes.restype = ctypes.c_size_t
        lib.pse_workspace_bytes.argtypes = [ctypes.c_int] * 6
        lib.pse_check_silu_layout.restype = ctypes.c_int
        lib.pse_expert_mm_silu_workspace_bytes.restype = ctypes.c_size_t
        lib.pse_expert_mm_silu_workspace_bytes.argtypes = [ctypes.c_int] * 6
        for fn in (lib.pse_expert_mm, lib.pse_expert_mm_silu):
            fn.restype = ctypes.c_int
            fn.argtypes = ([ctypes.c_void_p] * 4 + [ctypes.c_int] * 4
                           + [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_void_p])
    except AttributeError as err:
        return None, f"{path} is not a packscore expert-GEMM library: {err}"
    if lib.pse_abi_version() != ABI_VERSION:
        return None, f"{path} has ABI {lib.pse_abi_version()}, this packscore wants {ABI_VERSION}: rebuild it"
    return lib, None


def unavailable_reason(library: str | os.PathLike | None = None) -> str | None:
    """None when the kernel of ``library`` (``library_path``) can run on the current CUDA device,
    else why not."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    if torch.cuda.get_device_capability() != (9, 0):
        return f"built for sm_90a (H100, H200), this GPU is sm_{''.join(map(str, torch.cuda.get_device_capability()))}"
    return _library(library)[1]


@dataclass(frozen=True)
class TiledProduct:
    """A product over a tile-aligned expert layout: ``mm(x_RK, w_ENK, tile_expert_M)`` gives
    ``[R, N]``, the rows of tile m times ``w_ENK[tile_expert[m]].T`` (tiles of -1 unwritten).
    ``mm_silu``, where given, gives the experts' ``silu(gate) * up`` ``[R, N / 2]`` straight from
    ``w_ENK`` = gate rows then up rows (``expert_mm_silu``)."""

    tile_rows: int
    mm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    mm_silu: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None


def expert_layout(counts_E: torch.Tensor, tile_rows: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert's first row where every expert starts on a multiple of ``tile_rows``
    (``starts_E``, in the order of the experts), and the expert of each of the ``rows //
    tile_rows`` tiles (``tile_expert_M``, int32, -1 past the last expert's rows)."""
    tiles_E = (counts_E.long() + tile_rows - 1) // tile_rows
    ends_E = torch.cumsum(tiles_E, 0)
    starts_E = (ends_E - tiles_E) * tile_rows
    tile = torch.arange(rows // tile_rows, device=counts_E.device)
    tile_expert = torch.searchsorted(ends_E, tile, right=True)
    return starts_E, torch.where(tile_expert < counts_E.shape[0], tile_expert, -1).to(torch.int32)


def layout_rows(pairs: int, experts: int, tile_rows: int) -> int:
    """Rows that hold ``pairs`` routed rows however they fall on ``experts``: each expert's last
    tile wastes at most ``tile_rows - 1``."""
    return -(-(pairs + experts * (tile_rows - 1)) // tile_rows) * tile_rows


# Gate (and up) columns of one N tile of the fused SiLU product: I must be a multiple of it.
SILU_PAIR_COLUMNS = 64


# Each kernel's C function and the one that sizes its workspace.
_KERNELS = {"expert_mm": ("pse_expert_mm", "pse_workspace_bytes"),
            "expert_mm_silu": ("pse_expert_mm_silu", "pse_expert_mm_silu_workspace_bytes")}


def _run(name: str, x_RK: torch.Tensor, w_ENK: torch.Tensor, tile_expert_M: torch.Tensor, out_columns: int,
         library: str | os.PathLike | None = None):
    """Checks the operands, then runs kernel ``name`` of ``library`` (``library_path``) on
    PyTorch's current stream into a new ``[R, out_columns]`` tensor."""
    lib, reason = _library(library)
    if lib is None:
        raise RuntimeError(f"the expert GEMM library is not loaded: {reason}")
    if x_RK.dtype != torch.bfloat16 or w_ENK.dtype != torch.bfloat16:
        raise ValueError(f"{name} takes bfloat16 operands, got {x_RK.dtype} and {w_ENK.dtype}")
    if not (x_RK.is_contiguous() and w_ENK.is_contiguous() and tile_expert_M.is_contiguous()):
        raise ValueError(f"{name} takes contiguous operands")
    (R, K), (E, N, Kw) = x_RK.shape, w_ENK.shape
    tile = lib.pse_tile_rows()
    if K != Kw or R % tile or tile_expert_M.shape != (R // tile,) or tile_expert_M.dtype != torch.int32:
        raise ValueError(f"{name}: x {tuple(x_RK.shape)} (rows a multiple of {tile}), w {tuple(w_ENK.shape)}, "
                         f"tile_expert {tuple(tile_expert_M.shape)} {tile_expert_M.dtype} do not fit")
    out = x_RK.new_empty(R, out_columns)
    device = x_RK.device
    index = device.index if device.index is not None else torch.cuda.current_device()
    sm_count = torch.cuda.get_device_properties(index).multi_processor_count
    kernel, workspace_bytes = (getattr(lib, f) for f in _KERNELS[name])
    size = workspace_bytes(R, K, N, E, sm_count, index)
    workspace = torch.empty(size, dtype=torch.uint8, device=device) if size else None
    status = kernel(x_RK.data_ptr(), w_ENK.data_ptr(), out.data_ptr(), tile_expert_M.data_ptr(), R, K, N, E,
                    None if workspace is None else workspace.data_ptr(), size, sm_count, index,
                    torch.cuda.current_stream(device).cuda_stream)
    if status != 0:
        raise RuntimeError(f"the {name} kernel failed (status {status}) on x {tuple(x_RK.shape)}, w {tuple(w_ENK.shape)}")
    return out


def expert_mm(x_RK: torch.Tensor, w_ENK: torch.Tensor, tile_expert_M: torch.Tensor,
              library: str | os.PathLike | None = None) -> torch.Tensor:
    """The CUTLASS kernel (see the module docstring); bf16, contiguous, on the current stream."""
    return _run("expert_mm", x_RK, w_ENK, tile_expert_M, w_ENK.shape[1], library)


def silu_layout_check(library: str | os.PathLike | None = None) -> int:
    """The library's host-side check of the layout facts ``expert_mm_silu`` rests on (which
    accumulator holds which column, which weight row each tile row reads): 0 when they hold, else
    which failed (csrc/expert_gemm_sm90.cu, ``check_silu_layout``). Needs the library, not a GPU."""
    return _silu_layout_check(library_path(library))


@functools.cache
def _silu_layout_check(path: Path) -> int:
    lib, reason = _load(path)
    if lib is None:
        raise RuntimeError(f"the expert GEMM library is not loaded: {reason}")
    return int(lib.pse_check_silu_layout())


def expert_mm_silu(x_RK: torch.Tensor, w_E2IK: torch.Tensor, tile_expert_M: torch.Tensor,
                   library: str | os.PathLike | None = None) -> torch.Tensor:
    """``silu(gate) * up`` ``[R, I]`` of the experts' gate/up product, in the product's epilogue:
    ``w_E2IK`` holds every expert's I gate rows then its I up rows (``gate_up_proj`` as it is
    stored); the kernel reads tile t's gate rows ``[64t, 64t + 64)`` and the up rows beside them
    through one TMA box, so each thread holds a gate column and its up column. Rounded as ATen
    rounds ``F.silu(gate) * up`` on the product's bf16 outputs: equal to ``moe_triton.silu_mul_rows``
    of ``expert_mm`` bit for bit (tests/gpu/test_moe_fused.py). I a multiple of 64."""
    if w_E2IK.shape[1] % (2 * SILU_PAIR_COLUMNS):
        raise ValueError(f"expert_mm_silu needs 2I a multiple of {2 * SILU_PAIR_COLUMNS}, got {w_E2IK.shape[1]}")
    failed = silu_layout_check(library)
    if failed != 0:
        raise RuntimeError(f"the expert GEMM library's SiLU layout check failed ({failed}): "
                           "use --kernels moe_experts=expert_tiles")
    return _run("expert_mm_silu", x_RK, w_E2IK, tile_expert_M, w_E2IK.shape[1] // 2, library)


def expert_mm_reference(x_RK: torch.Tensor, w_ENK: torch.Tensor, tile_expert_M: torch.Tensor,
                        tile_rows: int) -> torch.Tensor:
    """The plain reference: each expert's tiles times its weight by ``torch.matmul`` (tiles of -1
    left as zeros)."""
    out = x_RK.new_zeros(x_RK.shape[0], w_ENK.shape[1])
    rows_expert = tile_expert_M.long().repeat_interleave(tile_rows)
    for e in torch.unique(tile_expert_M).tolist():
        if e >= 0:
            rows = (rows_expert == e).nonzero().squeeze(1)
            out[rows] = x_RK[rows] @ w_ENK[e].T
    return out


def expert_mm_silu_reference(x_RK: torch.Tensor, w_E2IK: torch.Tensor, tile_expert_M: torch.Tensor,
                             tile_rows: int) -> torch.Tensor:
    """The plain reference of ``expert_mm_silu``: the product, then ``F.silu(gate) * up``."""
    gate_up = expert_mm_reference(x_RK, w_E2IK, tile_expert_M, tile_rows)
    half = w_E2IK.shape[1] // 2
    return torch.nn.functional.silu(gate_up[:, :half]) * gate_up[:, half:]


def cutlass_product(silu: bool = False, library: str | os.PathLike | None = None) -> TiledProduct:
    """The CUTLASS kernel's products of ``library`` (``library_path``); with ``silu`` also its
    gate/up product with the SiLU in the epilogue."""
    lib, reason = _library(library)
    if lib is None:
        raise RuntimeError(f"the expert GEMM library is not loaded: {reason}")
    return TiledProduct(lib.pse_tile_rows(), functools.partial(expert_mm, library=library),
                        functools.partial(expert_mm_silu, library=library) if silu else None)


def reference_product(tile_rows: int = 128, silu: bool = False) -> TiledProduct:
    return TiledProduct(tile_rows, functools.partial(expert_mm_reference, tile_rows=tile_rows),
                        functools.partial(expert_mm_silu_reference, tile_rows=tile_rows) if silu else None)


def build(cutlass_dir: Path, out: Path | None = None, nvcc: str | None = None) -> Path:
    """Compiles the library (sm_90a, CUDA runtime linked statically) and returns its path."""
    nvcc = nvcc or shutil.which("nvcc") or str(Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "nvcc")
    if not Path(nvcc).is_file():
        raise FileNotFoundError(f"nvcc not found (looked on PATH and at {nvcc}); pass --nvcc or set CUDA_HOME")
    include = Path(cutlass_dir) / "include"
    if not (include / "cutlass" / "cutlass.h").is_file():
        raise FileNotFoundError(f"{include} holds no CUTLASS headers (clone NVIDIA/cutlass at {CUTLASS_VERSION})")
    out = Path(out) if out else default_library_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    cuda_root = Path(nvcc).resolve().parent.parent
    extra = [f"-I{p}" for p in (cuda_root / "include" / "cccl",) if p.is_dir()]
    extra += [f"-L{p}" for p in (cuda_root / "lib", cuda_root / "lib64") if p.is_dir()]
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        target = Path(tmp) / out.name
        cmd = [nvcc, "-std=c++17", "-O3", "-DNDEBUG", "-gencode=arch=compute_90a,code=sm_90a", "-Xcompiler", "-fPIC",
               "--expt-relaxed-constexpr", "-diag-suppress", "20012", "-shared", "-cudart", "static", f"-I{include}",
               *extra, str(SOURCE), "-o", str(target)]
        print(f"compiling {SOURCE.name} against {include} (about a minute) ...", file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True)
        os.replace(target, out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m model_runtime.kernels.expert_gemm",
        description="Build packscore's CUTLASS expert-GEMM library for Hopper GPUs (the MoE experts' "
                    "'expert_tiles' kernel) and print its path.")
    parser.add_argument("--cutlass", type=Path, required=True, help=f"a CUTLASS checkout ({CUTLASS_VERSION})")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"where to write the library (default: {default_library_path()}, where packscore looks)")
    parser.add_argument("--nvcc", default=None, help="the CUDA compiler (default: nvcc on PATH, else $CUDA_HOME/bin/nvcc)")
    args = parser.parse_args(argv)
    print(build(args.cutlass, args.out, args.nvcc))


if __name__ == "__main__":
    main()
