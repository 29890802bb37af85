"""Reading a safetensors checkpoint into a packed model's parameters, whole or shard by shard.

Legend: E = experts, I = expert intermediate size, D = hidden size.

The packed model (``model_runtime.model.causal_lm``) keeps Hugging Face's submodules under
shorter names: ``layers.3.mlp.down_proj.weight`` is the checkpoint's
``model.layers.3.mlp.down_proj.weight`` (``model.language_model.`` in a multimodal checkpoint,
whose ``model.visual.*`` tensors are never read), and an MoE layer's experts are one fused
parameter each (``experts.gate_up_proj`` ``[E, 2I, D]``: every expert's ``gate_proj`` then
``up_proj`` rows; ``experts.down_proj`` ``[E, D, I]``), stored per expert in checkpoints written by
``save_pretrained`` and fused in some others. ``plan_reads`` maps every parameter to the
checkpoint tensors it is made of, checks names and shapes before anything is read, and
``read_parameters`` reads them, only the rows of dim 0 a rank holds when FSDP sharded it.

Only safetensors are opened (a header and raw buffers, never a pickle). An update beside the old
weights reads them with positioned reads (``tensor_file.TensorFile``), never mapped; a read into
the model (at start, or an update in place) goes through safetensors' mapping, after, in place, a
positioned pass that checks the values and takes the content hash (``refuse_non_finite_reads``).

Example:
    >>> new = read_parameters(model, plan_reads(model, Path("step-120")))
    >>> swap_parameters(model, new)  # between two forwards
"""

from __future__ import annotations

import math
import os
import re
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from model_runtime.scoring.checkpoint import INDEX_NAME, check_checkpoint, safetensors_files
from model_runtime.scoring.checkpoint_config import refuse_other_forward
from model_runtime.scoring.checkpoint_error import CheckpointError
from model_runtime.scoring.content_hash import (CONTENT_VERSION_PREFIX, FLOAT_BITS, ReadDigests, finite_bits,
                                                scan_tensors)
from model_runtime.scoring.tensor_file import Staging, TensorFile, staging_for

_EXPERTS = re.compile(r"^(?P<layer>.*\.experts)\.(?P<which>gate_up_proj|down_proj)$")


@dataclass(frozen=True)
class ParameterRead:
    """Where one parameter of the packed model comes from."""

    param: str  # name in the packed model (``named_parameters``)
    shape: tuple[int, ...]  # the whole parameter's shape (before any FSDP sharding)
    parts: tuple[str, ...]  # checkpoint tensors, in the order they are combined
    combine: str  # "copy" (one tensor), "stack" (per-expert down_proj), "stack_pairs" (gate, up per expert)


@dataclass(frozen=True)
class ReadPlan:
    path: Path
    reads: tuple[ParameterRead, ...]


def _prefix(names) -> str:
    if any(n.startswith("model.language_model.") for n in names):
        return "model.language_model."
    if any(n.startswith("model.") for n in names):
        return "model."
    return ""  # a checkpoint of the bare decoder


def _checkpoint_name(param: str, prefix: str) -> str:
    return param if param.startswith("lm_head.") else prefix + param


def _stored_name(param: str, names: set, prefix: str) -> str:
    """``param``'s name in a checkpoint holding ``names``: under its usual ``prefix``, else under whichever
    prefix holds it (a checkpoint that mixes them, as Hugging Face's loader takes it)."""
    for candidate in (prefix, "model.language_model.", "model.", ""):
        if _checkpoint_name(param, candidate) in names:
            return _checkpoint_name(param, candidate)
    return _checkpoint_name(param, prefix)


def held_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters by name, as held between forwards (FSDP shards, not whole tensors).

    Take it between two forwards and hand it to a loading thread: during an FSDP forward the
    modules hold the gathered whole parameters instead, so ``named_parameters`` would return those.
    """
    return dict(model.named_parameters())


def parameter_reads(params: dict[str, torch.Tensor], names) -> list[ParameterRead]:
    """How every parameter of ``model`` is read from a checkpoint holding tensors ``names``.

    The prefix (``model.`` or a multimodal checkpoint's ``model.language_model.``) and the experts'
    layout (fused, or one tensor per expert as ``save_pretrained`` writes them) follow ``names``.
    """
    names = set(names)
    prefix = _prefix(names)
    reads = []
    for param, p in params.items():
        shape = tuple(p.shape)  # a DTensor reports its whole shape
        name = _stored_name(param, names, prefix)
        m = _EXPERTS.match(param)
        if m is None or name in names:
            reads.append(ParameterRead(param, shape, (name,), "copy"))
            continue
        first = ".0.down_proj.weight"  # per expert: the prefix that holds the layer's first expert
        base = _stored_name(m["layer"] + first, names, prefix)[: -len(first)]
        if m["which"] == "down_proj":
            parts = tuple(f"{base}.{e}.down_proj.weight" for e in range(shape[0]))
            reads.append(ParameterRead(param, shape, parts, "stack"))
        else:
            parts = tuple(n for e in range(shape[0]) for n in (f"{base}.{e}.gate_proj.weight", f"{base}.{e}.up_proj.weight"))
            reads.append(ParameterRead(param, shape, parts, "stack_pairs"))
    return reads


def _header_names(path: Path) -> set[str]:
    from safetensors import safe_open

    names: set[str] = set()
    for file in safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            names.update(f.keys())
    return names


def plan_reads(model: nn.Module, path: Path, params: dict[str, torch.Tensor] | None = None) -> ReadPlan:
    """Checks the checkpoint at ``path`` against ``model`` and maps every parameter to its tensors.

    ``check_checkpoint`` (the check made at start) compares it with the served model's tensors,
    raising ``CheckpointError``: ``unsupported``, ``incomplete`` (naming the first missing or
    left-over tensors) or ``incompatible`` (naming the shapes that differ, or the config's
    settings that would compute otherwise than the served model's). Reads the config and the
    safetensors headers only.
    """
    path = Path(path)
    params = held_parameters(model) if params is None else params
    served = {_checkpoint_name(param, "model."): tuple(p.shape) for param, p in params.items()}
    spec = check_checkpoint(path, expected=served)
    refuse_other_forward(path, getattr(model, "config", None), spec.config)
    if spec.quantization is not None:
        raise CheckpointError("unsupported", f"{path}: weight updates read unquantized checkpoints; this one is {spec.quantization}")
    names = _header_names(path)
    reads = parameter_reads(params, names)
    unknown = [n for r in reads for n in r.parts if n not in names]
    if unknown:  # a layout the check accepts and this reader does not know: refuse, never guess
        raise CheckpointError("incomplete", f"{path}: the weight reader finds no {', '.join(unknown[:5])}")
    return ReadPlan(path, tuple(reads))


def local_rows(p: torch.Tensor) -> slice | None:
    """Rows of dim 0 this rank holds of ``p`` (an FSDP2 ``Shard(0)`` DTensor), or None for all.

    FSDP2 splits dim 0 as ``torch.chunk`` does: ``ceil(n / world)`` rows per rank, the last
    ranks holding fewer or none.
    """
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(p, DTensor):
        return None
    placements = p.placements
    if len(placements) != 1 or not isinstance(placements[0], Shard) or placements[0].dim != 0:
        raise ValueError(f"expected FSDP's Shard(0) placement, got {placements}")
    mesh = p.device_mesh
    world, rank = mesh.size(), mesh.get_local_rank()
    n = p.shape[0]
    per = math.ceil(n / world)
    lo = min(n, rank * per)
    return slice(lo, min(n, lo + per))


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds of ``p`` (its FSDP shard, or ``p`` itself)."""
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else p.data


def read_parameters(
    model: nn.Module,
    plan: ReadPlan,
    *,
    params: dict[str, torch.Tensor] | None = None,
    threads: int | None = None,
    into_model: bool = False,
    digests: ReadDigests | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict[str, torch.Tensor]:
    """New tensors for every parameter of ``model`` (this rank's rows of a sharded one).

    Each takes its parameter's device and dtype (bf16 on CUDA, as loaded at start); ``model`` is
    not touched, unless ``into_model``:
    then each tensor is copied into its parameter as it is read (the in-place update when a
    second copy does not fit, after ``refuse_non_finite_reads``; at start, checked afterwards)
    and nothing is returned. ``threads`` tensors are
    read at a time (default 8 beside the model, 4 into it; reads from the page cache and
    host-to-device copies release the GIL). On CUDA the copies run on a side stream, so a forward
    on the default stream is not held up; they are finished before this returns. ``digests`` (beside the old weights, whole tensors) collects the
    content hash's pieces of every tensor read, from the bytes read (``content_version(read=...)``).
    ``progress(nbytes)`` is called from the reading threads as each tensor is read (a pool rank's ``LoadProgress``).
    """
    from safetensors import SafetensorError

    params = held_parameters(model) if params is None else params
    threads = threads or (4 if into_model else 8)
    if digests is not None and (into_model or any(local_rows(p) is not None for p in params.values())):
        raise ValueError("digests need whole tensors read beside the model")
    device = next(local_tensor(p) for p in params.values()).device
    staging = staging_for(device) if device.type == "cuda" and not into_model else None
    if staging is not None:
        stream = staging.stream
    else:
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    if stream is not None and into_model:
        stream.wait_stream(torch.cuda.current_stream(device))  # the last forward is done with the old weights
    try:
        with ExitStack() as stack:
            # Beside the old weights: positioned reads (a file cut short is an error, not SIGBUS),
            # on CUDA through the process's page-locked staging buffers. Into the model (at start,
            # or in place): the mapping.
            opener = _MappedFile if into_model else TensorFile
            source: dict[str, TensorFile | _MappedFile] = {}  # checkpoint tensor name -> the open file holding it
            for file in safetensors_files(plan.path):  # with an index, its shards only (as Hugging Face reads)
                f = stack.enter_context(opener(file))
                source.update(dict.fromkeys(f.keys(), f))

            def read(r: ParameterRead) -> tuple[str, torch.Tensor]:
                p = params[r.param]
                target = local_tensor(p)
                with torch.cuda.stream(stream) if stream is not None else nullcontext():
                    if into_model:
                        got = _read_rows(r, source, local_rows(p))
                    else:
                        got = _read_positioned(r, source, local_rows(p), target.device, staging, digests)
                    if tuple(got.shape) != tuple(target.shape):
                        raise CheckpointError(
                            "incompatible", f"{r.param}: read {list(got.shape)} for a local tensor of {list(target.shape)}"
                        )
                    if into_model:
                        with torch.no_grad():
                            target.copy_(got)
                        got = None
                    else:
                        got = got.to(dtype=target.dtype).contiguous()
                if progress is not None:
                    progress(target.nbytes)
                return r.param, got

            with ThreadPoolExecutor(max(1, threads)) as ex:
                out = dict(ex.map(read, plan.reads))
        if stream is not None:
            stream.synchronize()
    except (SafetensorError, OSError) as error:
        raise CheckpointError("unreadable", f"checkpoint {plan.path}: reading the weights failed: {error}") from None
    if not into_model:
        _refuse_non_finite(plan, non_finite(out.items()))
    return {} if into_model else out


def check_threads() -> int:
    """Threads of the in-place check pass: half the host's cores, 2 to 8; fewer leave a large host's
    memory bandwidth unused, more only contend (timings in docs/weights-loading.md)."""
    return max(2, min(8, (os.cpu_count() or 2) // 2))


def refuse_non_finite_reads(model: nn.Module, plan: ReadPlan, *, content: bool = False,
                            threads: int | None = None) -> str | None:
    """The pass before an update in place, which may copy nothing in before every tensor is known
    finite: reads every checkpoint tensor ``read_parameters`` would read once (whole, with
    positioned reads, ``scan_tensors``; ``threads`` at a time, ``check_threads()`` by default, at
    nice ``BACKGROUND_NICE``) and refuses the checkpoint, naming them, if any holds NaN
    or infinity. With ``content`` it returns the content version, hashed from the same bytes (and
    the tensors the model does not read): ``content_version(plan.path)``, without a read of its
    own; else None. It touches no model, so it runs while the old weights still serve."""
    try:
        version, bad = scan_tensors(plan.path, content=content, finite={n for r in plan.reads for n in r.parts},
                                    threads=check_threads() if threads is None else threads)
    except OSError as error:
        raise CheckpointError("unreadable", f"checkpoint {plan.path}: reading the weights failed: {error}") from None
    if bad:
        raise non_finite_error(f"checkpoint {plan.path}", bad)
    return version


def non_finite(named, chunk: int = 1 << 26) -> list[str]:
    """The names of ``(name, tensor)`` pairs whose values hold NaN or infinity, with one host sync;
    chunks of ``chunk`` elements bound the temporary mask (an embedding's would be a gigabyte)."""
    names, flags = [], []
    for name, t in named:
        if t is None or not t.is_floating_point() or t.numel() == 0:
            continue
        flat = t.reshape(-1)
        if flat.device.type == "cpu":  # small pieces: NumPy's temporary is as wide as the values
            flags.append(all(_finite_on_host(part) for part in flat.split(min(chunk, HOST_CHECK_CHUNK))))
        else:
            flags.append(torch.stack([torch.isfinite(part).all() for part in flat.split(chunk)]).all())
        names.append(name)
    on_device = [f for f in flags if isinstance(f, torch.Tensor)]
    if on_device:
        finite = iter(torch.stack(on_device).cpu().tolist())
        flags = [next(finite) if isinstance(f, torch.Tensor) else f for f in flags]
    return [name for name, ok in zip(names, flags) if not ok]


HOST_CHECK_CHUNK = 1 << 22  # elements a host tensor is checked in at a time

def _finite_on_host(flat: torch.Tensor) -> bool:
    """Whether a 1-D CPU tensor is all finite, by its bits: ``torch.isfinite`` widens every bf16
    value first, and NumPy releases the GIL, so reading threads check side by side."""
    if flat.dtype not in FLOAT_BITS:  # other formats: widened
        return bool(torch.isfinite(flat.float()).all())
    return finite_bits(flat.view(torch.uint8).numpy(), flat.dtype)


def non_finite_error(where: str, names: list[str]) -> CheckpointError:
    """The refusal of a checkpoint whose tensors ``names`` hold NaN or infinity."""
    shown = ", ".join(names[:5]) + (f", ... and {len(names) - 5} more" if len(names) > 5 else "")
    tensors = "1 weight tensor holds" if len(names) == 1 else f"{len(names)} weight tensors hold"
    return CheckpointError("non_finite", f"{where}: {tensors} NaN or infinite values ({shown}); nothing is served from it")


def _refuse_non_finite(plan: ReadPlan, bad: list[str]) -> None:
    """Refuses the checkpoint when ``bad`` (parameter names) is not empty, naming its tensors as its files do."""
    if bad:
        stored = {r.param: r.parts[0] if r.combine == "copy" else r.param for r in plan.reads}
        raise non_finite_error(f"checkpoint {plan.path}", [stored.get(name, name) for name in bad])


class _MappedFile:
    """safetensors' own mapped reader behind ``TensorFile``'s ``keys`` and ``read``: a tensor read
    into the model is a view of the page cache, copied once, faster there than positioned reads
    (docs/weights.md); a file cut short while mapped faults (SIGBUS), so an update beside the old
    weights, the path a serving process takes, uses ``TensorFile``."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        self._file = safe_open(path, framework="pt").__enter__()

    def keys(self) -> list[str]:
        return list(self._file.keys())

    def read(self, name: str, rows: slice | None = None) -> torch.Tensor:
        piece = self._file.get_slice(name)
        return piece[:] if rows is None else piece[rows.start : rows.stop]

    def __enter__(self) -> "_MappedFile":
        return self

    def __exit__(self, *exc) -> None:
        self._file.__exit__(*exc)


def _parts(r: ParameterRead, rows: slice | None) -> list[tuple[str, slice | None]]:
    """The checkpoint tensors holding the parameter's rows ``rows`` of dim 0 (all when None), in
    the order they are combined, each with its own rows: a copied tensor's rows, or each expert's
    whole tensors (its gate then its up rows for a gate/up pair)."""
    if r.combine == "copy":
        return [(r.parts[0], rows)]
    experts = range(r.shape[0]) if rows is None else range(rows.start, rows.stop)
    per = 1 if r.combine == "stack" else 2
    return [(r.parts[per * e + k], None) for e in experts for k in range(per)]


def _read_rows(r: ParameterRead, source: dict, rows: slice | None) -> torch.Tensor:
    """The parameter's rows ``rows`` of dim 0 (all when None), read from the checkpoint's mapping."""
    parts = [source[name].read(name, part_rows) for name, part_rows in _parts(r, rows)]
    if r.combine == "copy":
        return parts[0]
    if not parts:
        return torch.empty((0, *r.shape[1:]))
    if r.combine == "stack":
        return torch.stack(parts)
    return torch.stack([torch.cat(parts[i:i + 2]) for i in range(0, len(parts), 2)])  # gate rows, then up rows


def _read_positioned(r: ParameterRead, source: dict[str, TensorFile], rows: slice | None, device: torch.device,
                     staging: Staging | None, digests: ReadDigests | None = None) -> torch.Tensor:
    """What ``_read_rows`` reads, in the checkpoint's dtype, as one new tensor on ``device``, with
    positioned reads (through ``staging`` to a GPU, the copies queued on the current stream).

    A parameter's bytes are its parts' bytes one after another: a stacked expert tensor is each
    expert's tensor in turn, and gate then up rows concatenated are the gate's bytes then the up's.
    """
    pieces = _parts(r, rows)
    if not pieces:
        return torch.empty((0, *r.shape[1:]), device=device)
    located = [source[name].locate(name, part_rows) for name, part_rows in pieces]
    dtype, shape = located[0][0], located[0][1]
    if r.combine != "copy":
        per = 1 if r.combine == "stack" else 2
        first = [loc[:2] for loc in located[:per]]
        alike = all(loc[:2] == first[i % per] for i, loc in enumerate(located))
        if not alike or len({d for d, _ in first}) > 1 or len({s[1:] for _, s in first}) > 1 or not shape:
            raise CheckpointError("incompatible", f"{r.param}: its experts' tensors differ in dtype or shape")
        rows_of_one = sum(s[0] for _, s in first)  # gate rows + up rows
        shape = (len(located) // per, rows_of_one, *shape[1:])
    out = torch.empty(sum(loc[3] for loc in located), dtype=torch.uint8, device=device)
    at = 0
    for (name, part_rows), loc in zip(pieces, located):
        digest = None if digests is None else digests.of(name)
        source[name].read_into(out[at:at + loc[3]], name, part_rows, staging, digest)
        at += loc[3]
    return out.view(dtype).reshape(shape)


def swap_parameters(model: nn.Module, new: dict[str, torch.Tensor]) -> None:
    """Makes ``new`` the model's weights. Call between forwards.

    A whole parameter is re-pointed at its new tensor (the old one is freed when no forward holds
    it). An FSDP shard is copied into place instead: FSDP keeps views of its sharded storage for
    its all-gathers, which a re-pointed tensor would leave behind.
    """
    from torch.distributed.tensor import DTensor

    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(new))
    if missing:
        raise ValueError(f"no new tensor for {len(missing)} parameters: {missing[:5]}")
    current = torch.cuda.current_stream() if any(t.is_cuda for t in new.values()) else None
    with torch.no_grad():
        for name, p in params.items():
            t = new[name]
            if isinstance(p, DTensor):
                p.to_local().copy_(t)
            else:
                if t.is_cuda and current is not None:
                    t.record_stream(current)  # allocated on the loader's stream, used on this one
                p.data = t


def files_snapshot(path: Path) -> tuple:
    """The name, size and modification time of every file of checkpoint ``path`` its weights are
    read from (config.json, the index, and the files ``safetensors_files`` reads): what
    must stay unchanged while its tensors are read and hashed, so that the version names what was
    read. Other files (optimizer state a trainer saves beside, a pickle, a tmp file) are never read
    and may change meanwhile."""
    try:
        read = {f.name for f in safetensors_files(Path(path))}
    except CheckpointError:  # an index being rewritten, shards not all there yet: every candidate, so a change shows
        read = None
    return tuple(sorted((f.name, st.st_size, st.st_mtime_ns) for f in Path(path).iterdir()
                        if (f.name in ("config.json", INDEX_NAME)
                            or (f.name in read if read is not None else f.name.endswith(".safetensors")))
                        and f.is_file() for st in [f.stat()]))


def checkpoint_changed(path: Path, before: tuple) -> CheckpointError | None:
    """The refusal of a checkpoint whose files changed since ``before`` (``files_snapshot``), naming
    them, or None: the weights read could mix two versions, and a content hash would name neither."""
    changed = _changed_since(path, before)
    return None if changed is None else CheckpointError(
        "unreadable", f"checkpoint {path}: its files changed while they were read ({changed}); "
        "nothing was swapped: retry once they are complete")


def changed_in_place(path: Path, before: tuple) -> CheckpointError | None:
    """``checkpoint_changed`` for files that changed while they were copied in place: the caller says
    what became of the served weights (copied back, or a mix)."""
    changed = _changed_since(path, before)
    return None if changed is None else CheckpointError(
        "unreadable", f"checkpoint {path}: its files changed while they were copied in place ({changed})")


def _changed_since(path: Path, before: tuple) -> str | None:
    now = files_snapshot(path)
    if now == before:
        return None
    changed = sorted({entry[0] for entry in set(now) ^ set(before)})
    return f"{', '.join(changed[:5])}{', ...' if len(changed) > 5 else ''}; still being written?"


PRESET_VERSION_PREFIX = "preset:"  # a preset's version (scoring/loading.py); reserved likewise
# Weights copied in place from files that changed meanwhile: no pinned request may match them.
MIXED_VERSION_PREFIX = "mixed:"
# The names packscore gives, which a version given may not take: earlier builds named content
# hashes "sha256-", which replicas not yet upgraded still report.
RESERVED_VERSION_PREFIXES = (CONTENT_VERSION_PREFIX, "sha256-", PRESET_VERSION_PREFIX, MIXED_VERSION_PREFIX)


def mixed_version() -> str:
    """A new name for weights that are no checkpoint's (an update in place cut short)."""
    return f"{MIXED_VERSION_PREFIX}{uuid.uuid4().hex[:12]}"


def _tied_slots(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """The (module, name) slots of each parameter that more than one slot holds (a head tied to
    the embedding)."""
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                slots.setdefault(id(p), []).append((module, name))
    return [s for s in slots.values() if len(s) > 1]


def materialize(model: nn.Module, path: Path, device: torch.device) -> None:
    """Gives a model built on the meta device (and FSDP-sharded, or not) its weights from ``path``.

    Each rank allocates and reads only its own shards. The rotary embedding's buffers, computed
    from the config, are rebuilt on ``device``; any other buffer would be left uninitialised, so
    one is refused.
    """
    plan = plan_reads(model, path)  # checked before any memory is taken
    ties = _tied_slots(model)
    model.to_empty(device=device)
    for (owner, name), *others in ties:  # to_empty gives each module of a tie its own new tensor
        for module, other in others:
            if getattr(module, other) is not getattr(owner, name):
                setattr(module, other, getattr(owner, name))
    rotary = model.rotary_emb
    with torch.device(device):
        fresh = type(rotary)(rotary.config)
    for name, buf in fresh.named_buffers():
        setattr(rotary, name, buf)
    others = [n for n, _ in model.named_buffers() if not n.startswith("rotary_emb.")]
    if others:
        raise ValueError(f"buffers outside the rotary embedding would be left uninitialised: {others[:5]}")
    read_parameters(model, plan, into_model=True)
    _refuse_non_finite(plan, non_finite((n, local_tensor(p)) for n, p in held_parameters(model).items()))
