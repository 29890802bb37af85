"""Applies parallelism to a loaded packed model from the outside (the model files import nothing
from ``torch.distributed``).

FSDP2 layout
------------
Parameters are sharded over the whole world: the ``dp`` and ``sp`` mesh axes flattened into one
``dp_sp`` axis. The point of ``--fsdp`` is to serve a model that does not fit on one GPU; sharding
only over ``sp`` would divide memory by ``sp`` (by nothing when ``sp == 1``), while the flattened
axis divides it by the world size. The price is lockstep: every layer's all-gather involves every
rank, so every rank runs every forward together, and a group without a row runs a dummy one
(``runner.ParallelScorer.idle_step``). The worker pool schedules in steps for that reason.

Units (one all-gather each, resharded right after use so only one layer is whole at a time):
- each decoder layer: ``PackedCausalLM.forward`` calls the layer's norms, token mixer and MLP
  directly rather than the layer module, so the four are grouped as one FSDP unit
  (``fully_shard([...])``) whose hooks fire on the submodules that actually run;
- the LM head (when not tied to the embedding): ``model_runtime.scoring.head`` reads
  ``model.lm_head.weight`` outside any forward, so ``unsharded_head_weight`` all-gathers it
  explicitly for the head and frees it afterwards. The head is the largest single tensor
  (248,320 x hidden), so it is sharded like everything else rather than kept whole everywhere;
- the root (embedding, final norm, rotary buffers), resharded after the forward too: in
  inference nothing would ever reshard it otherwise.
"""

from __future__ import annotations

from contextlib import contextmanager

from torch import nn

from model_runtime.parallel.dims import ParallelDims
from model_runtime.parallel.ulysses import check_heads


def _layer_parts(layer: nn.Module) -> list[nn.Module]:
    mixer = getattr(layer, "linear_attn", None)
    if mixer is None:
        mixer = getattr(layer, "self_attn", None)
    parts = [layer.input_layernorm, mixer, layer.post_attention_layernorm, layer.mlp]
    if any(p is None for p in parts):
        raise ValueError(f"decoder layer {type(layer).__name__} lacks a norm, token mixer or MLP")
    return parts


def parallelize(model: nn.Module, *, dims: ParallelDims, mesh) -> nn.Module:
    """Checks that ``dims.sp`` can split the model's heads and, with ``dims.fsdp``, shards it.

    ``mesh`` is ``dims.build_mesh(...)``. Returns the model (modified in place).
    """
    check_heads(model.config, dims.sp)
    if not dims.fsdp:
        return model
    from torch.distributed.fsdp import fully_shard

    fsdp_mesh = dims.fsdp_mesh(mesh)
    for i, layer in enumerate(model.layers):
        parts = _layer_parts(layer)
        covered = {id(p) for part in parts for p in part.parameters()}
        left = [name for name, p in layer.named_parameters() if id(p) not in covered]
        if left:
            raise ValueError(f"layer {i} has parameters outside its norms, mixer and MLP: {left}")
        fully_shard(parts, mesh=fsdp_mesh, reshard_after_forward=True)
    if model.lm_head.weight is not model.embed_tokens.weight:
        fully_shard(model.lm_head, mesh=fsdp_mesh, reshard_after_forward=True)
    fully_shard(model, mesh=fsdp_mesh, reshard_after_forward=True)
    return model


@contextmanager
def unsharded_head_weight(model: nn.Module):
    """Yields ``model.lm_head.weight`` whole, all-gathering it when FSDP sharded it.

    Collective under FSDP: every rank must enter it once per forward, in the same order.
    """
    from torch.distributed.fsdp import FSDPModule

    # A tied head lives in the root's unit (with the embedding), an untied one in its own.
    owner = model.lm_head if isinstance(model.lm_head, FSDPModule) else model
    if not isinstance(owner, FSDPModule):
        yield model.lm_head.weight
        return
    owner.unshard()
    try:
        yield model.lm_head.weight
    finally:
        owner.reshard()
