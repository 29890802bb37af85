"""What a checkpoint directory holds, checked against what the model needs, before any weight is read.

``check_checkpoint(path)`` reads ``config.json`` and the safetensors headers (names, shapes,
dtypes; no tensor data), builds the Hugging Face model on the meta device from the config
(``checkpoint_config``), and maps every checkpoint name onto the model's names the way Hugging
Face's loader does for the layouts the Qwen3.5 / Qwen3-Next families ship in:

- ``model.language_model.*`` (a multimodal ``*ForConditionalGeneration`` checkpoint) -> ``model.*``;
- names without the ``model.`` prefix (a checkpoint of the bare decoder) -> ``model.*``;
- per-expert ``...mlp.experts.{e}.{gate,up,down}_proj.weight`` -> the fused
  ``...mlp.experts.gate_up_proj`` ``[E, 2I, D]`` and ``...mlp.experts.down_proj`` ``[E, D, I]``;
- ``lm_head.weight`` may be absent when the config ties it to the embedding; stored, it must hold
  the embedding's values (the only tensor data the check reads);
- FP8 (``quant_method: fp8``, block-scaled ``weight_scale_inv``) weights count as the weight they
  dequantize to (see ``model_runtime.scoring.fp8``).

Vision-tower (``model.visual.*``, ``visual.*``) and multi-token-prediction (``mtp.*``) tensors
are never loaded and are ignored. Anything else is refused with ``CheckpointError``
(``checkpoint_error``): a tensor the model needs that no file holds, a tensor no part of the model
takes (a second copy of one under another prefix too), a shape that differs, or a tensor stored as
integers (Hugging Face's loader would cast it to float). Nothing is ever left at its random initialisation. The loader re-checks what Hugging Face
actually loaded (``assert_fully_loaded``), so a layout this module maps wrongly still fails loudly.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from model_runtime.model.architectures import UnsupportedModelError, architecture_for
from model_runtime.scoring.checkpoint_config import (config_default_positions, context_length, fp8_block_size,
                                                     model_tensors, quantization_method, read_config,
                                                     refuse_odd_text_config, refuse_other_forward_settings,
                                                     refuse_top_level_rope)
from model_runtime.scoring.checkpoint_error import CheckpointError, quoted_names
from model_runtime.wording import counted

IGNORED_PREFIXES = ("model.visual.", "visual.", "mtp.")  # never loaded: the vision tower, multi-token prediction
FP8_SCALE_SUFFIX = "_scale_inv"  # "<name>.weight_scale_inv" scales "<name>.weight" block by block

_EXPERT_KEY = re.compile(r"^(?P<base>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


@dataclass(frozen=True)
class CheckpointSpec:
    """A checked checkpoint: what it holds, in the model's own tensor names."""

    path: Path
    model_type: str  # config.json's model_type (qwen3_5, qwen3_5_text, ...)
    architecture: str  # the family, as /v1/models names it (qwen3_5, qwen3_5_moe, qwen3_next)
    tensors: dict[str, tuple[int, ...]]  # model tensor name -> shape, as loaded (fused experts, FP8 dequantized)
    config: dict  # config.json as read (a multimodal config's head tie as its top level says)
    max_model_len: int  # the context the config allows (yarn rope scaling raises it)
    quantization: str | None = None  # "fp8" when weights are dequantized at load, else None
    files: tuple[Path, ...] = field(default=())  # the safetensors files read, in order


def check_checkpoint(path: Path, *, expected: dict[str, tuple[int, ...]] | None = None) -> CheckpointSpec:
    """Checks ``path`` (config.json + safetensors) against the model its config describes.

    With ``expected`` (the served model's tensor names -> shapes, e.g. a previous spec's
    ``tensors``) the checkpoint must also hold exactly those names with those shapes
    (``kind="incompatible"`` otherwise). Raises ``CheckpointError``; reads no tensor data but a
    stored head of a config that ties it to the embedding (``_refuse_a_second_tied_head``).
    """
    path = Path(path)
    config = read_config(path)
    model_type = config.get("model_type")
    try:
        architecture = architecture_for(model_type)
    except UnsupportedModelError as exc:
        raise CheckpointError("unsupported", f"{path}: {exc}") from None
    refuse_odd_text_config(path, config)
    refuse_top_level_rope(path, config)
    context_length(config, path=path)  # its fields named before transformers' own, less direct, refusals
    quantization = quantization_method(path, config)
    files = safetensors_files(path)
    stored, dtypes = _read_headers(path, files)
    _refuse_non_float(path, dtypes)
    if quantization == "fp8":
        stored = _fp8_weight_shapes(path, config, stored, dtypes)
    else:
        _refuse_float8(path, dtypes)
    needed, aliases = model_tensors(path, config)
    # against a served model (an update) such a config is one the served model does not share
    refuse_other_forward_settings(path, config, "unsupported" if expected is None else "incompatible")
    tensors = _match(path, stored, needed, aliases)
    _refuse_a_second_tied_head(path, files, stored, needed, aliases)
    if expected is not None:
        _compare(path, tensors, expected)
    return CheckpointSpec(
        path=path,
        model_type=model_type,
        architecture=architecture.name,
        tensors=tensors,
        config=config,
        max_model_len=context_length(config, default_positions=config_default_positions(config), path=path),
        quantization=quantization,
        files=tuple(files),
    )


INDEX_NAME = "model.safetensors.index.json"


def index_shards(path: Path) -> list | None:
    """The shard names ``model.safetensors.index.json`` lists, as written (not yet checked to be
    file names), sorted; None where the directory has no index. A file that is no index raises."""
    index = path / INDEX_NAME
    if not index.is_file():
        return None
    try:
        content = json.loads(index.read_text())
    except (OSError, ValueError) as exc:  # no read permission, or cut short (still being written), as config.json
        raise CheckpointError("unreadable", f"{index} cannot be read: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        return sorted(set(content["weight_map"].values()), key=str)
    except (KeyError, TypeError, AttributeError):
        raise CheckpointError("unsupported", f"{index} is not a safetensors index: it has no weight_map object") from None


def indexed_files(path: Path) -> tuple[list[Path], list[str]] | None:
    """The shard files ``model.safetensors.index.json`` lists, and the names of those that are no
    file (an interrupted download); None where the directory has no index. An index that is none,
    or that names shards outside the directory, raises."""
    names = index_shards(path)
    if names is None:
        return None
    # A shard is a file of this directory, as Hugging Face writes them: never a path elsewhere.
    odd = [n for n in names if not isinstance(n, str) or Path(n).name != n or n in (".", "..")]
    if odd:
        raise CheckpointError("unsupported", f"{path / INDEX_NAME} names shards that are not files of {path}: {quoted_names(odd)}")
    files = [path / name for name in names]
    return files, [f.name for f in files if not f.is_file()]


SINGLE_FILE = "model.safetensors"


def safetensors_files(path: Path) -> list[Path]:
    """The weight files read: those ``model.safetensors.index.json`` lists when there is one (a
    ``model.safetensors`` beside them is not read), else ``model.safetensors`` alone; no other
    ``*.safetensors``. Hugging Face's loader is told to read the same (``weights_file``)."""
    indexed = indexed_files(path)
    if indexed is not None:
        files, absent = indexed
        if absent:
            # save_pretrained of a single file over a sharded save deletes the shards and leaves the index
            stale = f"; a {SINGLE_FILE} is beside it: if that is the newer save, remove the index" if (path / SINGLE_FILE).is_file() else ""
            raise CheckpointError("incomplete", f"{path}: shards listed in {INDEX_NAME} are missing: {quoted_names(absent)}{stale}")
        return files
    single = path / SINGLE_FILE
    if single.exists() or single.is_symlink():  # one that is no regular file is refused as such by the header read
        return [single]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        extra = f" (found {quoted_names(pickles)}: pickled weights are never read)" if pickles else ""
        raise CheckpointError("unsupported", f"{path} has no *.safetensors weights; packscore loads safetensors only{extra}")
    names = quoted_names(f.name for f in files)  # Hugging Face's loader would fail on these once the port is bound
    raise CheckpointError("unsupported", f"{path} has neither {SINGLE_FILE} nor {INDEX_NAME}, which Hugging Face's loader "
                          f"reads, but {names}: name a single file {SINGLE_FILE}, or add the {INDEX_NAME} listing the shards")


def weights_file(path: Path) -> str:
    """What Hugging Face's loader must read (its config's ``transformers_weights``) to read ``safetensors_files``:
    by itself it reads a ``model.safetensors`` before an index, and config.json's own ``transformers_weights`` first."""
    return INDEX_NAME if (path / INDEX_NAME).is_file() else SINGLE_FILE


def assert_fully_loaded(path: Path, info: dict) -> None:
    """Refuses a model Hugging Face loaded with gaps: ``info`` is ``from_pretrained``'s loading info."""
    missing = sorted(info.get("missing_keys") or ())
    unexpected = sorted(k for k in info.get("unexpected_keys") or () if not k.startswith(IGNORED_PREFIXES))
    mismatched = [str(m[0]) if isinstance(m, (tuple, list)) else str(m) for m in info.get("mismatched_keys") or ()]
    errors = [str(e) for e in info.get("error_msgs") or ()]
    if missing or unexpected:
        raise CheckpointError("incomplete", _gaps_message(path, missing, unexpected, mismatched, after_load=True))
    if mismatched or errors:
        raise CheckpointError("incompatible", f"{path}: loading reported differing shapes or errors: {quoted_names(mismatched + errors)}")


# Reading.


def _read_headers(path: Path, files: list[Path]) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    stored_in: dict[str, str] = {}
    for file in files:
        if not file.is_file():  # a pipe would hold the start forever; a directory or a device holds no weights
            raise CheckpointError("unsupported", f"{file} is not a regular file (a directory, a pipe, a device or a "
                                  "broken link); a checkpoint's weights are *.safetensors files")
        try:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    if key in shapes:
                        raise CheckpointError("incompatible", f"{path}: tensor {key!r} is stored twice, in {stored_in[key]} "
                                              f"and again in {file.name}; Hugging Face's loader would take one copy")
                    stored_in[key] = file.name
                    piece = f.get_slice(key)
                    shapes[key] = tuple(int(d) for d in piece.get_shape())
                    dtypes[key] = piece.get_dtype()
        except CheckpointError:
            raise
        except Exception as exc:  # safetensors raises its own error type for a corrupt header
            from model_runtime.scoring.tensor_file import cut_in_header, has_header  # torch: imported only when needed

            try:  # safetensors words a permission or I/O error as another ("No such file or directory")
                open(file, "rb").close()
            except OSError as cause:
                raise CheckpointError("unreadable", f"{file} cannot be read: {cause.strerror or cause}") from None
            if _is_lfs_pointer(file):  # a clone without git-lfs: the pointer's first bytes read as a huge header length
                raise CheckpointError("unsupported", f"{file} is a Git LFS pointer, not the weights it names: fetch them "
                                      "(git lfs pull, or huggingface-cli download)") from None
            if has_header(file) or cut_in_header(file):  # a safetensors file cut short (being written?) or damaged
                raise CheckpointError("unreadable", f"{file} is a safetensors file that fails to read: {exc}") from None
            raise CheckpointError("unsupported", f"{file} is not a readable safetensors file: {exc}") from None
    return shapes, dtypes


LFS_POINTER = b"version https://git-lfs.github.com/spec/"  # how a Git LFS pointer file begins


def _is_lfs_pointer(file: Path) -> bool:
    try:
        with open(file, "rb") as f:
            return f.read(len(LFS_POINTER)) == LFS_POINTER
    except OSError:
        return False


FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # safetensors' names of the float dtypes Hugging Face's loader casts from


def _refuse_non_float(path: Path, dtypes: dict[str, str]) -> None:
    """Integer, boolean or complex tensors: Hugging Face's loader casts them to the model's float dtype
    (an integer-quantized weight without its quantization_config would serve as garbage)."""
    odd = sorted(f"{k} {d}" for k, d in dtypes.items()
                 if d not in FLOAT_DTYPES and not d.startswith("F8") and not k.startswith(IGNORED_PREFIXES))
    if odd:
        raise CheckpointError(
            "unsupported", f"{path}: tensors stored in a dtype that is no float: {quoted_names(odd)}; "
            "packscore loads float32, float16, bfloat16 and float64 weights (and FP8 ones with their quantization_config)")


def _refuse_float8(path: Path, dtypes: dict[str, str]) -> None:
    float8 = sorted(k for k, d in dtypes.items() if d.startswith("F8") and not k.startswith(IGNORED_PREFIXES))
    if float8:
        raise CheckpointError(
            "unsupported", f"{path}: float8 tensors without an FP8 quantization_config in config.json: {quoted_names(float8)}"
        )


def _fp8_weight_shapes(path: Path, config: dict, stored: dict, dtypes: dict) -> dict[str, tuple[int, ...]]:
    """Checkpoint names -> shapes with each FP8 weight's scale checked and folded into it."""
    block = fp8_block_size(config)
    out = {k: v for k, v in stored.items() if not k.endswith(FP8_SCALE_SUFFIX)}
    if not any(k.endswith(FP8_SCALE_SUFFIX) for k in stored):
        raise CheckpointError(
            "incompatible",
            f"{path}: config.json declares FP8 quantization (quant_method 'fp8') but no tensor in the files is "
            f"float8 with a weight{FP8_SCALE_SUFFIX} scale; the config does not describe these weights",
        )
    for key in stored:
        if not key.endswith(FP8_SCALE_SUFFIX) or key.startswith(IGNORED_PREFIXES):
            continue
        weight = key[: -len(FP8_SCALE_SUFFIX)]
        if weight not in stored:
            raise CheckpointError("incomplete", f"{path}: FP8 scale {key!r} has no weight {weight!r}")
        if not dtypes[weight].startswith("F8"):
            raise CheckpointError("incompatible", f"{path}: {weight!r} has an FP8 scale but is stored as {dtypes[weight]}")
        want = fp8_scale_shape(stored[weight], block)
        if stored[key] != want and not (block is None and math.prod(stored[key]) == 1):
            raise CheckpointError(
                "incompatible", f"{path}: FP8 scale {key!r} is {list(stored[key])}, expected {list(want)} for weight {list(stored[weight])} in blocks {block}"
            )
    unscaled = sorted(k for k, d in dtypes.items() if d.startswith("F8") and k + FP8_SCALE_SUFFIX not in stored and not k.startswith(IGNORED_PREFIXES))
    if unscaled:
        raise CheckpointError("incomplete", f"{path}: FP8 weights without a {FP8_SCALE_SUFFIX} scale: {quoted_names(unscaled)}")
    return out


def fp8_scale_shape(weight_shape: tuple[int, ...], block: tuple[int, int] | None) -> tuple[int, ...]:
    """The scale a block-quantized weight carries: the last two dims divided into blocks, rounded up."""
    if block is None or len(weight_shape) < 2:
        return ()
    *lead, rows, cols = weight_shape
    return (*lead, -(-rows // block[0]), -(-cols // block[1]))


# Matching against the model.


def _match(path: Path, stored: dict, needed: dict, aliases: dict) -> dict[str, tuple[int, ...]]:
    """Maps checkpoint names onto ``needed``; raises naming what is missing, unused or misshapen."""
    known = needed.keys() | aliases.keys()
    provided: dict[str, tuple[int, ...]] = {}
    stored_as: dict[str, str] = {}  # model name -> the checkpoint's own name of it
    unexpected: list[str] = []
    mismatched: list[str] = []
    experts: dict[str, dict[str, dict[int, tuple[str, tuple[int, ...]]]]] = {}
    seen: dict = {}  # a model name (or expert) -> the first checkpoint name of it
    for key, shape in stored.items():
        if key.startswith(IGNORED_PREFIXES):
            continue
        name = _model_name(key, known)
        match = _EXPERT_KEY.match(name)
        expert = (match["base"], match["proj"], int(match["expert"])) if match else None
        if (expert or name) in seen:  # another prefix of the same tensor: Hugging Face loads one of the two
            unexpected.append(f"{key}, a second copy of {seen[expert or name]}")
            continue
        seen[expert or name] = key
        if name not in known and match and f"{match['base']}.gate_up_proj" in needed:
            experts.setdefault(match["base"], {}).setdefault(match["proj"], {})[int(match["expert"])] = (key, shape)
            continue
        if name not in known:
            unexpected.append(key)
            continue
        target = aliases.get(name, name)
        if shape != needed[target]:
            mismatched.append(f"{key} {list(shape)} (model: {list(needed[target])})")
        provided[target] = shape
        stored_as[target] = key
    missing = [n for n in needed if n not in provided and n.rsplit(".", 1)[0] not in experts]
    for base, projections in experts.items():
        fused = [f"{base}.gate_up_proj", f"{base}.down_proj"]
        if all(name in stored_as for name in fused):  # the fused layout is whole: one by one is left over
            unexpected.extend(key for have in projections.values() for key, _ in sorted(have.values()))
            continue
        # one by one it is, and a fused tensor beside it would be left unused
        unexpected.extend(stored_as[name] for name in fused if name in stored_as)
        _fuse_experts(base, projections, needed, provided, missing, unexpected, mismatched)
    multimodal = any(k.startswith("model.language_model.") for k in stored)
    missing = [_stored_name(n, multimodal) for n in missing if n not in provided]
    if missing or unexpected:
        raise CheckpointError("incomplete", _gaps_message(path, missing, unexpected, mismatched))
    if mismatched:
        raise CheckpointError("incompatible", f"{path}: tensor shapes differ from what config.json describes: {quoted_names(mismatched)}")
    return {name: needed[name] for name in needed}


def _refuse_a_second_tied_head(path: Path, files: list[Path], stored: dict, needed: dict, aliases: dict) -> None:
    """A tied config (the head is the embedding) whose files also hold the head: the same values serve;
    others, which the tied model would leave unused (Hugging Face's loader unties them), are refused."""
    known = needed.keys() | aliases.keys()
    by_name = {_model_name(key, known): key for key in stored if not key.startswith(IGNORED_PREFIXES)}
    for alias, target in aliases.items():
        if alias not in by_name or target not in by_name:
            continue
        import torch  # only for a checkpoint that stores a tied tensor twice
        from safetensors import safe_open
        values = {}
        for file in files:
            with safe_open(file, framework="pt") as f:
                for key in {by_name[alias], by_name[target]} & set(f.keys()):
                    values[key] = f.get_tensor(key).float()
        if not torch.equal(values[by_name[alias]], values[by_name[target]]):
            raise CheckpointError(
                "incomplete", f"checkpoint {path}: 1 tensor in the files is not used by the model ({by_name[alias]}): "
                f"config.json ties it to {by_name[target]} (tie_word_embeddings) and it holds other values; set "
                "tie_word_embeddings to false to serve it, or drop it to serve the embedding as the head")


def _model_name(key: str, known) -> str:
    if key.startswith("model.language_model."):
        key = "model." + key[len("model.language_model.") :]
    if key not in known:
        expert = _EXPERT_KEY.match(key)  # per expert: known by its layer's fused tensor
        if (f"model.{expert['base']}.gate_up_proj" if expert else f"model.{key}") in known:  # a checkpoint of the bare decoder
            key = f"model.{key}"
    return key


def _stored_name(name: str, multimodal: bool) -> str:
    """A missing model tensor as this checkpoint would name it (a ``multimodal`` checkpoint keeps
    the decoder under ``model.language_model.``)."""
    if multimodal and name.startswith("model."):
        return "model.language_model." + name[len("model.") :]
    return name


def _fuse_experts(base, projections, needed, provided, missing, unexpected, mismatched) -> None:
    """Per-expert gate/up/down weights of one MoE layer against its fused ``gate_up_proj`` / ``down_proj``."""
    fused_gate_up, fused_down = f"{base}.gate_up_proj", f"{base}.down_proj"
    count = needed[fused_gate_up][0]
    for proj in ("gate_proj", "up_proj", "down_proj"):
        have = projections.get(proj, {})
        missing.extend(f"{base}.{e}.{proj}.weight" for e in range(count) if e not in have)
        unexpected.extend(key for e, (key, _) in sorted(have.items()) if e >= count)
    shapes = {proj: {s for e, (_, s) in projections.get(proj, {}).items() if e < count} for proj in ("gate_proj", "up_proj", "down_proj")}
    if any(len(s) != 1 for s in shapes.values()):
        if all(shapes.values()):
            mismatched.append(f"{base}.*: experts of one layer differ in shape")
        return
    (gate,), (up,), (down,) = shapes["gate_proj"], shapes["up_proj"], shapes["down_proj"]
    got = {fused_gate_up: (count, gate[0] + up[0], gate[1]), fused_down: (count, *down)}
    for name, shape in got.items():
        if name not in needed:
            continue
        if shape != needed[name] or gate != up:
            mismatched.append(f"{base}.*.{name.rsplit('.', 1)[1]} {list(shape)} (model: {list(needed[name])})")
        provided[name] = shape


def _compare(path: Path, tensors: dict, expected: dict) -> None:
    expected = {k: tuple(v) for k, v in expected.items()}
    absent = [k for k in expected if k not in tensors]
    extra = [k for k in tensors if k not in expected]
    differ = [f"{k} {list(tensors[k])} (served: {list(expected[k])})" for k in expected if k in tensors and tensors[k] != expected[k]]
    if absent or extra or differ:
        parts = _parts((absent, "served tensor", "absent"), (extra, "tensor", "not in the served model"), (differ, "shape", None))
        raise CheckpointError("incompatible", f"{path} does not have the served model's architecture: " + "; ".join(parts))


def _gaps_message(path, missing, unexpected, mismatched, after_load: bool = False) -> str:
    parts = _parts((missing, "tensor", "the model needs", "missing"), (unexpected, "tensor", "in the files", "not used by the model"),
                   (mismatched, "shape", None))
    when = " after loading" if after_load else ""
    return f"checkpoint {path} is incomplete{when}: " + "; ".join(parts) + "; nothing is served from it (no tensor is ever left random)"


def _parts(*groups) -> list[str]:
    """One phrase per non-empty group: (items, noun, state) or (items, noun, qualifier, state);
    a state of None means the items differ."""
    out = []
    for items, noun, *words in groups:
        if not items:
            continue
        *qualifier, state = words
        subject = " ".join([counted(len(items), noun), *qualifier])
        verb = "differ" if state is None else f"{_are(items)} {state}"
        out.append(f"{subject} {verb} ({quoted_names(items)})")
    return out


def _are(items) -> str:
    return "is" if len(items) == 1 else "are"
