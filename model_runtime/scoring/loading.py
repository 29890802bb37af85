"""Loading: a local Hugging Face checkpoint directory or a preset, patched for packed inputs."""

from __future__ import annotations

import importlib.util
import logging
import math
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from model_runtime.kernels.registry import KernelBackends, select_backends
from model_runtime.model.architectures import architecture_for
from model_runtime.model.causal_lm import PackedCausalLM, PatchReport, patch_for_packing
from model_runtime.scoring.checkpoint import (CheckpointSpec, assert_fully_loaded, check_checkpoint, safetensors_files,
                                              weights_file)
from model_runtime.scoring.checkpoint_config import build_meta_model, hf_config
from model_runtime.scoring.checkpoint_error import CheckpointError
from model_runtime.scoring.presets import PRESETS, build_config
from model_runtime.scoring.content_hash import START_HASH_THREADS, content_version
from model_runtime.scoring.weights import files_snapshot, non_finite, non_finite_error

log = logging.getLogger(__name__)

MOE_ARCHITECTURES = ("qwen3_5_moe", "qwen3_next")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    """A packed model ready to score, with what /v1/models reports about it."""

    model: PackedCausalLM
    name: str
    architecture: str
    vocab_size: int
    max_model_len: int
    dtype: torch.dtype
    device: torch.device
    weights_version: str
    backends: KernelBackends
    patch_report: PatchReport
    source: str  # the checkpoint path or "preset:<name>"
    source_files: tuple | None = None  # the checkpoint's files as its weights were read (``files_snapshot``)

    @property
    def dtype_name(self) -> str:
        return _dtype_name(self.dtype)

    def runs_family(self, family: str) -> bool:
        """Whether this model calls the kernel family: a dense model runs no ``moe_*`` family."""
        return self.architecture in MOE_ARCHITECTURES or not family.startswith("moe_")

    @property
    def kernel_names(self) -> dict[str, str]:
        """The backend of each kernel family this model runs, as /v1/models and the metrics name them."""
        return {family: name for family, name in self.backends.names.items() if self.runs_family(family)}

    @property
    def slow_kernels(self) -> tuple[str, ...]:
        """The families this model runs on a slow reference (``--allow-slow-kernels``)."""
        return tuple(family for family in self.backends.fallbacks if self.runs_family(family))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _on_disk(checked: CheckpointSpec, snapshot: tuple) -> str:
    """"4 safetensors files, 17.9 GiB": the files checked, sized as ``files_snapshot`` found them (no file is read again)."""
    sizes = {name: size for name, size, _ in snapshot}
    total = sum(sizes.get(file.name, 0) for file in checked.files)
    count = len(checked.files)
    return f"{count} safetensors file{'' if count == 1 else 's'}, {total / 2**30:.1f} GiB"


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """float32 on CPU and bfloat16 on CUDA unless asked otherwise."""
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)} or 'auto'")
    return DTYPES[dtype]


def load_model(
    spec: str = "tiny",
    *,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    allow_slow_kernels: bool = False,
    kernel_overrides: dict[str, str] | None = None,
    served_name: str | None = None,
    moe_implementation: str | None = None,
    kernel_device: str | torch.device | None = None,
    worker_pool: bool = False,
    weights_later: bool = False,
    weights_version: str | None = None,
    expert_gemm: str | Path | None = None,
) -> LoadedModel:
    """Loads ``spec`` (a preset name or a checkpoint directory) and patches it for packing.

    ``kernel_device`` is where the model will run when that is not where it is loaded (FSDP
    loads a large model on the CPU and shards it onto the GPUs): kernels are chosen for it, and
    the result's ``device`` is it. ``worker_pool`` chooses the kernels that are fastest in a
    worker pool's process (``select_backends``), ``expert_gemm`` names the experts' CUTLASS library
    (``--expert-gemm``; None: ``expert_gemm.library_path()``'s default).

    ``weights_later`` (a checkpoint only) builds the model on the meta device, without reading a
    weight: FSDP shards it first, then each rank reads only its own shards' bytes
    (``model_runtime.scoring.weights.materialize``), so a host holds one copy, not one per rank.

    ``moe_implementation`` picks how Hugging Face runs MoE experts: ``grouped_mm`` (one grouped
    matrix product over all experts, the default) or ``eager`` (a Python loop over experts).

    A checkpoint's ``weights_version`` is its content hash (``content_hash.content_version``, hashed
    beside the load), as a weight update's default is: the same bytes are the same version on
    every replica and after a copy. ``weights_version`` names it instead (the worker pool hashes
    once for all its ranks).
    """
    device = torch.device(device) if device is not None else default_device()
    run_on = torch.device(kernel_device) if kernel_device is not None else device
    if run_on.type == "cuda" and run_on.index is not None:
        # Triton kernels (the head, the conv, the norms) launch on the current GPU: make it this one
        torch.cuda.set_device(run_on)
    torch_dtype = resolve_dtype(dtype, run_on)
    backends = select_backends(run_on, allow_slow=allow_slow_kernels, overrides=kernel_overrides, worker_pool=worker_pool,
                               expert_gemm=expert_gemm)
    started = time.perf_counter()
    if spec in PRESETS:
        log.info("loading %s from preset:%s: random weights, as %s on %s", served_name or spec, spec,
                 _dtype_name(torch_dtype), device)
        hf_kwargs = _hf_kwargs(PRESETS[spec].model_type, moe_implementation)
        hf_model, model_type, version, name = _build_preset(spec, torch_dtype, device, hf_kwargs)
        source, source_files = f"preset:{spec}", None
        max_model_len = int(getattr(hf_model.config, "max_position_embeddings", 0) or 0)
    else:
        path = Path(spec)
        if not path.is_dir():
            known = ", ".join(sorted(PRESETS))
            raise FileNotFoundError(f"--model {str(path)!r} is neither a checkpoint directory nor a preset ({known})")
        checked = check_checkpoint(path)  # refuses before a byte of weights is read
        source_files = files_snapshot(path)
        log.info("loading %s from %s: %s, as %s on %s%s", served_name or path.name, path, _on_disk(checked, source_files),
                 _dtype_name(torch_dtype), device, " (built empty: each rank reads its own shards once sharded)"
                 if weights_later else "")
        model_type, max_model_len = checked.model_type, checked.max_model_len
        hf_kwargs = _hf_kwargs(model_type, moe_implementation)
        with ThreadPoolExecutor(1) as hasher:  # xxhash releases the GIL: the hash runs beside the load
            hashed = hasher.submit(_timed_content_version, path) if weights_version is None else None
            if weights_later:
                hf_model = _empty_checkpoint_model(checked, torch_dtype, hf_kwargs)
            else:
                hf_model = _load_checkpoint(checked, torch_dtype, device, hf_kwargs)
        version, name, source = weights_version or hashed.result(), path.name, str(path)
    architecture = architecture_for(model_type)
    model, report = patch_for_packing(hf_model, architecture, backends)
    model.eval().requires_grad_(False)
    loaded = LoadedModel(
        model=model,
        name=served_name or name,
        architecture=architecture.name,
        vocab_size=model.vocab_size,
        max_model_len=max_model_len,
        dtype=torch_dtype,
        device=run_on,
        weights_version=version,
        backends=backends,
        patch_report=report,
        source=source,
        source_files=source_files,
    )
    log.info(
        "loaded %s (%s, %s on %s) in %.1fs: %s; kernels %s",
        loaded.name, loaded.architecture, loaded.dtype_name, device, time.perf_counter() - started, report, backends.names,
    )
    return loaded


def estimated_weight_bytes(spec: str, dtype: torch.dtype) -> int:
    """Bytes the weights of ``spec`` take in ``dtype``, without building them.

    A preset is instantiated on the meta device (no memory) and its parameters counted; a
    checkpoint directory counts the tensors in the safetensors headers of the files it is read from
    (a vision tower that is never loaded is counted too, so the estimate errs high), at ``dtype``'s width.
    """
    itemsize = dtype.itemsize
    if spec in PRESETS:
        from transformers import AutoModelForCausalLM

        preset = PRESETS[spec]
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(build_config(preset), dtype=dtype, **_hf_kwargs(preset.model_type, None))
        return sum(p.numel() for p in model.parameters()) * itemsize
    from safetensors import safe_open

    try:
        files = safetensors_files(Path(spec))
    except CheckpointError:  # the check names it; an estimate errs high
        files = sorted(Path(spec).glob("*.safetensors"))
    elements = 0
    for file in files:
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                elements += math.prod(f.get_slice(key).get_shape())
    return elements * itemsize


def _hf_kwargs(model_type: str, moe_implementation: str | None) -> dict:
    if architecture_for(model_type).name in MOE_ARCHITECTURES:
        return {"experts_implementation": moe_implementation or "grouped_mm"}
    return {}


def _build_preset(name: str, dtype: torch.dtype, device: torch.device, hf_kwargs: dict):
    from transformers import AutoModelForCausalLM

    preset = PRESETS[name]
    config = build_config(preset)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(preset.seed)
        # Weights are drawn on the CPU for the tiny preset (bitwise the same everywhere) and on
        # the target device for the large shapes (seconds instead of minutes).
        build_device = torch.device("cpu") if name == "tiny" else device
        with torch.device(build_device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, **hf_kwargs)
    model = model.to(device)
    return model, preset.model_type, f"preset:{name}#seed{preset.seed}", name


def _empty_checkpoint_model(checked: CheckpointSpec, dtype: torch.dtype, hf_kwargs: dict):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config(checked.config), dtype=dtype, **hf_kwargs)


def _load_checkpoint(checked: CheckpointSpec, dtype: torch.dtype, device: torch.device, hf_kwargs: dict):
    """Hugging Face's loader on a checked checkpoint; refuses the model if anything was left unloaded."""
    from transformers import AutoModelForCausalLM

    # For qwen3_5 / qwen3_5_moe multimodal checkpoints the CausalLM class takes the text part
    # only: the vision tower's weights are skipped and never allocated.
    kwargs = dict(hf_kwargs)
    if checked.quantization == "fp8":
        model, info = _load_fp8(checked, dtype, kwargs)
    else:
        if device.type != "cpu" and importlib.util.find_spec("accelerate") is not None:
            kwargs["device_map"] = str(device)  # stream shards straight to the GPU
        config = hf_config(checked.config)  # the config as checked: its head tie included
        config.transformers_weights = weights_file(checked.path)  # the files checked, as an update reads them
        with _loading_bar_on_a_terminal_only():
            model, info = AutoModelForCausalLM.from_pretrained(
                checked.path, config=config, dtype=dtype, use_safetensors=True, output_loading_info=True, **kwargs,
            )
    assert_fully_loaded(checked.path, info)
    model = model.to(device)
    bad = non_finite(model.named_parameters())
    if bad:  # it would score NaN for every token: refused like any other broken checkpoint
        raise non_finite_error(f"checkpoint {checked.path}", bad)
    return model


def _load_fp8(checked: CheckpointSpec, dtype: torch.dtype, hf_kwargs: dict):
    """FP8 weights dequantized here (see fp8.py), then loaded by Hugging Face as plain weights,
    with its own name mapping (prefixes, per-expert tensors)."""
    from model_runtime.scoring.fp8 import read_dequantized

    meta = build_meta_model(checked.config)  # the causal LM class and its (text) config, unquantized
    state_dict = read_dequantized(checked, dtype)
    log.info("%s: FP8 weights dequantized to %s at load", checked.path, _dtype_name(dtype))
    with _loading_bar_on_a_terminal_only():
        return type(meta).from_pretrained(
            None, config=meta.config, state_dict=state_dict, dtype=dtype, output_loading_info=True, **hf_kwargs
        )


@contextmanager
def _loading_bar_on_a_terminal_only():
    """Hugging Face's "Loading weights" bar, off a terminal (a container's log, ``2> file``), writes a
    redraw per update into the log: it shows on a terminal only. The setting is restored after."""
    from transformers.utils import logging as hf_logging

    if sys.stderr.isatty() or not hf_logging.is_progress_bar_enabled():
        yield
        return
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()


def _timed_content_version(path: Path) -> str:
    started = time.perf_counter()
    version = content_version(path, threads=START_HASH_THREADS)
    log.info("%s: weights version %s (content hash, %.1fs)", path, version, time.perf_counter() - started)
    return version
