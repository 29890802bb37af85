"""Hugging Face transformers the way trainers usually score, and a packscore model sharing its weights.

``build_twin`` draws one random-weight model of a preset shape, patches it for packing and
keeps the original token mixers, so ``twin.hf()`` (a context manager) can put them back for
an unpatched Hugging Face forward over the very same weights: one copy in memory, no
question of whether two models were initialised alike.

The two Hugging Face forms of the benchmark:
- ``score_padded``: length-sorted, right-padded batches with an attention mask, as many
  tokens per batch as memory allows (``token_budget`` counts padded tokens);
- ``score_single``: one sequence per forward, no padding.
Both take ``model(...).logits``, a float32 ``log_softmax``, gather the targets and compute
entropy as ``-(p * log p).sum(-1)``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from model_runtime.kernels.registry import select_backends
from model_runtime.model.architectures import architecture_for
from model_runtime.model.causal_lm import patch_for_packing
from model_runtime.scoring.loading import LoadedModel, _hf_kwargs
from model_runtime.scoring.presets import PRESETS, build_config


# Where each swappable kernel family lives on the packed model: (layer class name, attribute).
_SWAPPABLE = {"attention": ("PackedAttention", "attention_fn"), "gate_projection": ("PackedGatedDeltaNet", "gate_projection_fn"),
              "conv1d": ("PackedGatedDeltaNet", "conv_fn"),
              # between the grouped backends only: the block runs its other products in tiles when built with tiled
              "moe_experts": ("PackedSparseMoe", "experts_fn"), "moe_router": ("PackedSparseMoe", "top_k_fn"),
              "moe_shared": ("PackedSparseMoe", "shared_fn")}


@contextlib.contextmanager
def kernel_backend(model, family: str, name: str):
    """Every layer of the packed ``model`` runs backend ``name`` of ``family`` (attention,
    gate_projection, conv1d, moe_experts, moe_router, moe_shared or elementwise) for the duration of the block: one loaded model, timed both ways."""
    from model_runtime.kernels.registry import REGISTRY

    if family == "elementwise":  # every module's ModuleOps (layers and the model's own norms)
        from model_runtime.model.layers import ModuleOps

        ops = ModuleOps(REGISTRY[family][name]())
        holders = [m for m in model.modules() if isinstance(getattr(m, "ops", None), ModuleOps)]
        saved = [m.ops for m in holders]
        for m in holders:
            m.ops = ops
        try:
            yield
        finally:
            for m, old in zip(holders, saved):
                m.ops = old
        return
    if family not in _SWAPPABLE:
        raise ValueError(f"cannot swap {family!r} on a loaded model; swappable: {sorted(_SWAPPABLE) + ['elementwise']}")
    cls, attr = _SWAPPABLE[family]
    fn = REGISTRY[family][name]
    layers = [m for m in model.modules() if type(m).__name__ == cls]
    saved = [getattr(m, attr) for m in layers]
    for m in layers:
        setattr(m, attr, fn)
    try:
        yield
    finally:
        for m, old in zip(layers, saved):
            setattr(m, attr, old)


@contextlib.contextmanager
def kernel_swaps(model, spec: str):
    """``kernel_backend`` for every ``family=backend`` of ``spec`` (comma-separated; "default"
    swaps nothing)."""
    with contextlib.ExitStack() as stack:
        if spec != "default":
            for part in spec.split(","):
                stack.enter_context(kernel_backend(model, *part.split("=")))
        yield


@dataclass
class Twin:
    loaded: LoadedModel
    hf_model: nn.Module
    _originals: list = field(default_factory=list)  # (layer, attribute, original mixer)

    @contextlib.contextmanager
    def hf(self):
        """The unpatched Hugging Face model (same weights) for the duration of the block."""
        packed = [(layer, attr, getattr(layer, attr)) for layer, attr, _ in self._originals]
        for layer, attr, original in self._originals:
            setattr(layer, attr, original)
        try:
            yield self.hf_model
        finally:
            for layer, attr, module in packed:
                setattr(layer, attr, module)


def build_twin(
    preset: str,
    *,
    num_layers: int | None = None,
    device: str | torch.device = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    moe_implementation: str | None = None,
    kernel_overrides: dict[str, str] | None = None,
) -> Twin:
    """A random-weight preset (optionally its first ``num_layers`` layers), packed, plus its HF twin."""
    from transformers import AutoModelForCausalLM

    spec = PRESETS[preset]
    device = torch.device(device)
    overrides = {} if num_layers is None else {"num_hidden_layers": num_layers}
    config = build_config(spec, **overrides)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(spec.seed)
        with torch.device(device):
            hf_model = AutoModelForCausalLM.from_config(config, dtype=dtype, **_hf_kwargs(spec.model_type, moe_implementation))
    hf_model.eval().requires_grad_(False)
    originals = []
    for layer, kind in zip(hf_model.model.layers, hf_model.config.layer_types):
        attr = "linear_attn" if kind == "linear_attention" else "self_attn"
        originals.append((layer, attr, getattr(layer, attr)))
        originals.append((layer, "mlp", layer.mlp))  # the sparse-MoE block is swapped too
    backends = select_backends(device, overrides=kernel_overrides)
    model, report = patch_for_packing(hf_model, architecture_for(spec.model_type), backends)
    model.eval().requires_grad_(False)
    name = preset if num_layers is None else f"{preset}[:{num_layers}]"
    loaded = LoadedModel(
        model=model,
        name=name,
        architecture=architecture_for(spec.model_type).name,
        vocab_size=model.vocab_size,
        max_model_len=int(getattr(config, "max_position_embeddings", 0) or 0),
        dtype=dtype,
        device=device,
        weights_version=f"preset:{name}#seed{spec.seed}",
        backends=backends,
        patch_report=report,
        source=f"preset:{name}",
    )
    return Twin(loaded, hf_model, originals)


def set_moe_implementation(model: nn.Module, implementation: str) -> str:
    """Switches Hugging Face's experts dispatch (read from the shared config on every call)."""
    config = model.config
    if hasattr(config, "_experts_implementation_internal"):
        config._experts_implementation_internal = implementation
    else:
        config._experts_implementation = implementation
    return config._experts_implementation


def _token_scores(logits_BLV: torch.Tensor, ids_BL: torch.Tensor, first: int, last: int):
    """log-probs and entropies of positions ``first-1 .. last-2`` predicting tokens ``first .. last-1``."""
    logp = torch.log_softmax(logits_BLV[:, first - 1 : last - 1].float(), dim=-1)
    targets = ids_BL[:, first:last]
    logprobs = logp.gather(-1, targets[..., None])[..., 0]
    entropy = -(logp.exp() * logp).sum(-1)
    return logprobs, entropy


@torch.inference_mode()
def score_single(hf_model: nn.Module, sequences, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One forward per sequence, no padding; results stay on the GPU (no per-sequence sync)."""
    out = []
    for seq in sequences:
        ids = torch.as_tensor(np.asarray(seq.input_ids), dtype=torch.long, device=device)[None]
        logits = hf_model(input_ids=ids, use_cache=False).logits
        logprobs, entropy = _token_scores(logits, ids, seq.score_from, seq.length)
        del logits
        out.append((logprobs[0], entropy[0]))
    return out


def padded_batches(lengths, token_budget: int) -> list[list[int]]:
    """Length-sorted (longest first) batches whose padded size ``B * L_max`` fits ``token_budget``."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches, current = [], []
    for i in order:
        longest = lengths[current[0]] if current else lengths[i]
        if current and (len(current) + 1) * longest > token_budget:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


@torch.inference_mode()
def score_padded(hf_model: nn.Module, sequences, device, token_budget: int):
    """Right-padded, length-sorted batches with an attention mask; results in input order."""
    lengths = [s.length for s in sequences]
    out: list = [None] * len(sequences)
    for batch in padded_batches(lengths, token_budget):
        longest = max(lengths[i] for i in batch)
        ids = torch.zeros(len(batch), longest, dtype=torch.long)
        mask = torch.zeros(len(batch), longest, dtype=torch.long)
        for row, i in enumerate(batch):
            ids[row, : lengths[i]] = torch.as_tensor(np.asarray(sequences[i].input_ids))
            mask[row, : lengths[i]] = 1
        ids, mask = ids.to(device), mask.to(device)
        logits = hf_model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        first = min(sequences[i].score_from for i in batch)
        logprobs, entropy = _token_scores(logits, ids, first, longest)
        del logits
        for row, i in enumerate(batch):
            seq = sequences[i]
            window = slice(seq.score_from - first, seq.length - first)
            out[i] = (logprobs[row, window], entropy[row, window])
        del logprobs, entropy
    return out


# Padded-token budgets tried from the largest. Above about 32k tokens the float32 log_softmax,
# its exp and the entropy product of a 248,320-word vocabulary (4 bytes each per token and word)
# do not fit next to 9B-shape weights, so larger budgets would only cost failed attempts.
PADDED_BUDGETS = (32768, 24576, 16384, 12288, 8192, 4096)


def score_padded_fitting(hf_model: nn.Module, sequences, device, budgets=PADDED_BUDGETS):
    """``score_padded`` with the largest padded-token budget that does not run out of memory.

    Returns ``(results, budget)``. Each budget is tried on the whole workload (this is the
    untimed pass); an out-of-memory error moves on to the next smaller budget.
    """
    longest = max(s.length for s in sequences)
    for budget in budgets:
        budget = max(budget, longest)
        try:
            return score_padded(hf_model, sequences, device, budget), budget
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
    raise RuntimeError(f"Hugging Face padded scoring ran out of memory at every budget down to {budgets[-1]} tokens")


def to_numpy(results) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(lp.float().cpu().numpy(), ent.float().cpu().numpy()) for lp, ent in results]


def diff_stats(ours, theirs) -> dict:
    """max and mean |difference| of log-probs and entropies, over ``(logprobs, entropy)`` pairs."""
    d_lp = np.concatenate([np.abs(np.asarray(a[0]) - np.asarray(b[0])) for a, b in zip(ours, theirs)])
    d_ent = np.concatenate([np.abs(np.asarray(a[1]) - np.asarray(b[1])) for a, b in zip(ours, theirs)])
    return {
        "logprob_max": float(d_lp.max()),
        "logprob_mean": float(d_lp.mean()),
        "entropy_max": float(d_ent.max()),
        "entropy_mean": float(d_ent.mean()),
    }


def hf_uses_fla() -> str:
    """Where Hugging Face's chunk_gated_delta_rule goes: the module of the implementation it wraps."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    seen, stack = set(), [m.torch_chunk_gated_delta_rule]
    while stack:
        fn = stack.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        module = getattr(fn, "__module__", "") or ""
        if module.startswith("fla"):
            return module
        for cell in getattr(fn, "__closure__", None) or ():
            if callable(cell.cell_contents):
                stack.append(cell.cell_contents)
        if hasattr(fn, "__wrapped__"):
            stack.append(fn.__wrapped__)
    return "torch fallback"
