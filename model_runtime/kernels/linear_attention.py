"""Gated delta rule over a packed row, with the recurrent state reset at every segment.

Legend: T = tokens, Hk = key heads, Hv = value heads, K = key dim, V = value dim.

Backends share one signature:
``fn(q_THK, k_THK, v_THV, g_TH, beta_TH, packed) -> o_THV``
where q and k are l2-normalised inside the kernel, q is scaled by ``K ** -0.5``, ``g`` is the
log-decay (float32, <= 0) and ``beta`` the write strength. When ``Hv > Hk`` every key head
serves ``Hv // Hk`` consecutive value heads (``repeat_interleave``). A segment with a parent in
``packed.links`` (a shared prefix) starts from its parent's final state instead of zeros.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from model_runtime.model.packing import PackedBatch

log = logging.getLogger(__name__)

FLA_CHUNK = 64  # chunk_gated_delta_rule's chunk_size, which packscore leaves at fla's default


def _check(q_THK, k_THK, v_THV, g_TH, beta_TH, packed: PackedBatch) -> None:
    T, Hk, K = q_THK.shape
    if k_THK.shape != q_THK.shape:
        raise ValueError(f"q and k must share a shape, got {tuple(q_THK.shape)} and {tuple(k_THK.shape)}")
    if v_THV.shape[0] != T or g_TH.shape != v_THV.shape[:2] or beta_TH.shape != v_THV.shape[:2]:
        raise ValueError(
            f"v [T, Hv, V], g and beta [T, Hv] must match T={T}: got v {tuple(v_THV.shape)}, "
            f"g {tuple(g_TH.shape)}, beta {tuple(beta_TH.shape)}"
        )
    if v_THV.shape[1] % Hk:
        raise ValueError(f"value heads ({v_THV.shape[1]}) must be a multiple of key heads ({Hk})")
    if T != packed.total_tokens:
        raise ValueError(f"inputs have {T} tokens but the packed row has {packed.total_tokens}")


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_rule_reference(q_THK, k_THK, v_THV, g_TH, beta_TH, packed: PackedBatch) -> torch.Tensor:
    """Exact float32 reference: the token-by-token recurrence, one segment at a time.

    For each token: ``S <- exp(g) S``; ``S <- S + k (beta (v - k^T S))^T``; ``o = q^T S``, with
    ``S`` of shape ``[Hv, K, V]`` starting from zeros in every segment, or from the final state
    of the segment's parent (``packed.links``).
    """
    _check(q_THK, k_THK, v_THV, g_TH, beta_TH, packed)
    out_dtype = v_THV.dtype
    group = v_THV.shape[1] // q_THK.shape[1]
    q = _l2norm(q_THK.float().repeat_interleave(group, dim=1)) * q_THK.shape[-1] ** -0.5
    k = _l2norm(k_THK.float().repeat_interleave(group, dim=1))
    v, decay, beta = v_THV.float(), g_TH.float().exp(), beta_TH.float()
    o = torch.empty_like(v)
    Hv, K, V = v.shape[1], k.shape[-1], v.shape[-1]
    # The per-head products as the batched matrix products einsum would make of them (the same
    # bits), with the views made once: the loop's cost is its per-token calls.
    k_rows_TH1K, q_rows_TH1K, k_cols_THK1 = k.unsqueeze(-2), q.unsqueeze(-2), k.unsqueeze(-1)
    decay_TH11, beta_TH1 = decay[:, :, None, None], beta[:, :, None]
    parents = packed.links.parents if packed.links is not None else (-1,) * packed.num_segments
    final_states = {}
    for i, (start, end) in enumerate(packed.segments()):
        state_HKV = final_states[parents[i]] if parents[i] >= 0 else v.new_zeros(Hv, K, V)
        for t in range(start, end):
            state_HKV = state_HKV * decay_TH11[t]
            predicted_HV = torch.matmul(k_rows_TH1K[t], state_HKV).squeeze(-2)
            delta_HV = (v[t] - predicted_HV) * beta_TH1[t]
            state_HKV = state_HKV + k_cols_THK1[t] * delta_HV[:, None, :]
            o[t] = torch.matmul(q_rows_TH1K[t], state_HKV).squeeze(-2)
        final_states[i] = state_HKV
    return o.to(out_dtype)


def gated_delta_rule_fla(q_THK, k_THK, v_THV, g_TH, beta_TH, packed: PackedBatch) -> torch.Tensor:
    """fla's chunked Triton kernel in varlen mode (state restarts at every ``cu_seqlens`` entry).

    fla >= 0.5 maps value head ``h`` to key head ``h // (Hv // Hk)`` itself (grouped value
    attention), which is exactly ``repeat_interleave``; older versions get repeated q and k.
    With prefix links it runs over the root segments (which come first in the row), keeping
    their states, then over the others, each from its parent's (``chunked_on_linked_row``).
    """
    _check(q_THK, k_THK, v_THV, g_TH, beta_TH, packed)
    group = v_THV.shape[1] // q_THK.shape[1]
    if group > 1 and not _fla_supports_gva():
        q_THK = q_THK.repeat_interleave(group, dim=1)
        k_THK = k_THK.repeat_interleave(group, dim=1)
    g_TH = g_TH.float()
    if packed.links is None:
        return _fla_chunk(q_THK, k_THK, v_THV, g_TH, beta_TH, packed, None, keep_final=False)[0]
    return chunked_on_linked_row(_fla_chunk, q_THK, k_THK, v_THV, g_TH, beta_TH, packed)


def chunked_on_linked_row(chunk, q_THK, k_THK, v_THV, g_TH, beta_TH, packed: PackedBatch) -> torch.Tensor:
    """A row with prefix links through ``chunk`` (``_fla_chunk``'s signature: a varlen call
    from given initial states, computed in ``FLA_CHUNK``-token chunks from every segment's start),
    as its unshared sequences would be (``StateChunks``): the roots first, keeping their states
    at their last chunk boundary; then, where a parent ends off a boundary, the chunk that
    straddles its end, once per continuation; then the rest of every other segment."""
    layout = packed.linked
    split = layout.state_chunks(FLA_CHUNK)
    r, xs = layout.root_tokens, (q_THK, k_THK, v_THV, g_TH, beta_TH)
    o_roots, final_NHKV = chunk(*(x[:r] for x in xs), split.roots, None, keep_final=True)
    zero = final_NHKV.new_zeros(1, *final_NHKV.shape[1:])
    if split.heads is None:
        states = torch.cat([final_NHKV, zero])
    else:
        at_boundary = torch.cat([final_NHKV, zero]).index_select(0, split.root_states)
        initial = torch.cat([at_boundary, zero]).index_select(0, split.head_states)
        o_heads, head_final = chunk(*(x.index_select(0, split.head_rows) for x in xs), split.heads, initial, keep_final=True)
        states = torch.cat([at_boundary, head_final, zero])
    o_rest, _ = chunk(*(x[r:] for x in xs), split.rest, states.index_select(0, split.rest_states), keep_final=False)
    o_THV = torch.cat([o_roots, o_rest])
    if split.heads is not None:
        o_THV.index_copy_(0, split.out_rows, o_heads.index_select(0, split.in_rows))
    return o_THV


def _fla_chunk(q_THK, k_THK, v_THV, g_TH, beta_TH, packed: PackedBatch, initial_NHKV, *, keep_final: bool):
    """One varlen call from ``initial_NHKV`` (None: zeros); returns ``(o_THV, final states
    [N, Hv, K, V] in float32, or None unless ``keep_final``)``."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    _pin_fla_kernels()
    kwargs = {"cu_seqlens_cpu": packed.cu_seqlens_host_long} if _fla_accepts("cu_seqlens_cpu") else {}
    if _fla_accepts("chunk_indices"):
        kwargs["chunk_indices"] = packed.chunk_table(FLA_CHUNK)
    q_normalised = _l2norm_fixed_key(q_THK)
    if q_normalised is not None:
        q_THK, k_THK = q_normalised, _l2norm_fixed_key(k_THK)
    o, final = chunk_gated_delta_rule(
        q_THK.unsqueeze(0),
        k_THK.unsqueeze(0),
        v_THV.unsqueeze(0),
        g=g_TH.unsqueeze(0),
        beta=beta_TH.unsqueeze(0),
        scale=q_THK.shape[-1] ** -0.5,
        initial_state=initial_NHKV,
        output_final_state=keep_final,
        cu_seqlens=packed.cu_seqlens_long,
        use_qk_l2norm_in_kernel=q_normalised is None,
        **kwargs,
    )
    return o[0], final


# fla's in-kernel q/k L2 norm (``l2norm_fwd``) autotunes 25 configurations, each compiled, for
# every new ``NB = ceil(rows / 65536)``: every new row size would pay seconds of compilation
# mid-request. Its kernel does not read NB (NB only keys the autotuning), so calling the same
# kernel with NB fixed computes the same values and tunes once.
_L2NORM_NB = 1
_L2NORM_KERNEL: object | None = None


def _l2norm_fixed_key(x_THK: torch.Tensor) -> torch.Tensor | None:
    """``x`` L2-normalised over its last dim by fla's own kernel with its autotuning key fixed,
    or None where that kernel is not there (then fla normalises inside the delta rule)."""
    global _L2NORM_KERNEL
    if _L2NORM_KERNEL is None:
        try:
            from fla.modules.norm.l2norm import l2norm_fwd_kernel

            _L2NORM_KERNEL = l2norm_fwd_kernel
        except ImportError as err:
            _L2NORM_KERNEL = False
            log.warning("fla has no l2norm_fwd_kernel (%s): fla normalises q and k inside the delta rule, "
                        "autotuning again for every new row size (seconds of compilation mid-request)", err)
    if _L2NORM_KERNEL is False or not x_THK.is_cuda or x_THK.shape[-1] > 512:
        return None
    import triton

    D = x_THK.shape[-1]
    x_RD = x_THK.reshape(-1, D).contiguous()
    rows = x_RD.shape[0]
    y_RD = torch.empty_like(x_RD)
    rstd_R = torch.empty(rows, dtype=torch.float32, device=x_RD.device)
    _L2NORM_KERNEL[lambda meta: (triton.cdiv(rows, meta["BT"]),)](
        x=x_RD, y=y_RD, rstd=rstd_R, eps=1e-6, T=rows, D=D, BD=triton.next_power_of_2(D), NB=_L2NORM_NB
    )
    return y_RD.view(x_THK.shape)


_SIGNATURE: dict | None = None


def _fla_signature() -> dict:
    global _SIGNATURE
    if _SIGNATURE is None:
        import inspect

        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        doc = inspect.getdoc(chunk_gated_delta_rule) or ""
        _SIGNATURE = {
            "params": frozenset(inspect.signature(chunk_gated_delta_rule).parameters),
            # fla documents GVA in the docstring of the versions that implement it.
            "gva": "GVA" in doc or "HV" in doc,
        }
    return _SIGNATURE


def _fla_accepts(name: str) -> bool:
    return name in _fla_signature()["params"]


def _fla_supports_gva() -> bool:
    """Whether the installed fla accepts more value heads than key heads (checked once)."""
    return _fla_signature()["gva"]


# fla autotunes each kernel of its forward once per process, by timing, and three configurations
# of its q/k L2 norm lay the reduction out otherwise and round the 9B's keys otherwise: two
# processes could answer one request with other bits. On Hopper every forward kernel is pinned to
# fla's own pick on the 9B's packed row (bench/fla_configs.py, docs/kernels.md), so every process
# computes alike and none tunes at start. PACKSCORE_FLA_AUTOTUNE=1 leaves fla's
# autotuning alone; other GPUs keep it (their fastest configurations were not measured).
FLA_FORWARD_KERNELS = {
    # name: (module, kernel)
    "cumsum": ("fla.ops.utils.cumsum", "chunk_local_cumsum_scalar_kernel"),
    "kkt_solve": ("fla.ops.gated_delta_rule.chunk_fwd", "chunk_gated_delta_rule_fwd_kkt_solve_kernel"),
    "w_u": ("fla.ops.gated_delta_rule.wy_fast", "recompute_w_u_fwd_kernel"),
    "state": ("fla.ops.common.chunk_delta_h", "chunk_gated_delta_rule_fwd_kernel_h_blockdim64"),
    "output": ("fla.ops.common.chunk_o", "chunk_fwd_kernel_o"),
    "l2norm": ("fla.modules.norm.l2norm", "l2norm_fwd_kernel"),
}
FLA_FORWARD_PINS = {
    # name: the configuration's meta-parameters, num_warps and num_stages (where it has them);
    # each is what fla's own tuning picked on the 9B's row, no other one faster beyond the timing's spread
    "cumsum": {"num_warps": 2},
    "kkt_solve": {"BK": 64, "num_warps": 1},  # not 4 warps: a much slower forward (docs/kernels.md)
    "w_u": {"num_warps": 4, "num_stages": 3},
    "state": {"BV": 64, "num_warps": 4, "num_stages": 4},
    "output": {"BK": 64, "BV": 64, "num_warps": 4, "num_stages": 3},
    "l2norm": {"BT": 8, "num_warps": 4},  # BT 8 with 8 warps, BT 8 or 16 with 16: other bits
}


def fla_tuner(name: str):
    """fla's autotuner of the forward kernel ``name`` (a key of FLA_FORWARD_KERNELS), or None."""
    import importlib

    module, kernel = FLA_FORWARD_KERNELS[name]
    try:
        tuner = getattr(importlib.import_module(module), kernel, None)
    except ImportError:
        return None
    while tuner is not None and not hasattr(tuner, "configs"):  # under triton.heuristics
        tuner = getattr(tuner, "fn", None)
    return tuner


def config_matches(config, pin: dict) -> bool:
    """Whether a ``triton.Config`` has every value of ``pin`` (meta-parameters, num_warps, num_stages)."""
    fields = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    return all((fields[k] if k in fields else config.kwargs.get(k)) == v for k, v in pin.items())


def pinned_config(configs, pin: dict):
    """The first of ``configs`` that matches ``pin``, or None where fla no longer offers it."""
    return next((c for c in configs if config_matches(c, pin)), None)


@functools.cache
def _pin_fla_kernels() -> tuple[str, ...]:
    """Pins fla's forward kernels on Hopper (see above); the names pinned."""
    if not torch.cuda.is_available():
        return ()
    opted_out = os.environ.get("PACKSCORE_FLA_AUTOTUNE") == "1"
    capability = torch.cuda.get_device_capability()
    if opted_out or capability != (9, 0):
        log.warning("fla's forward kernels are tuned by timing in each process (%s): two processes "
                    "(servers, pool ranks) can score one sequence with other bits (docs/kernels.md)",
                    "PACKSCORE_FLA_AUTOTUNE=1" if opted_out else f"no pins for sm_{capability[0]}{capability[1]}")
        return ()
    pinned, unpinned = [], []
    for name, pin in FLA_FORWARD_PINS.items():
        tuner = fla_tuner(name)
        chosen = pinned_config(getattr(tuner, "configs", ()), pin)
        if chosen is None:  # a kernel or configuration fla no longer offers stays autotuned
            unpinned.append(name)
            continue
        tuner.configs = [chosen]
        tuner.cache.clear()
        pinned.append(name)
    if unpinned:
        log.warning("fla's %s kernels are tuned by timing in each process (this fla does not offer their pinned "
                    "configurations): two processes can score one sequence with other bits (docs/kernels.md)",
                    ", ".join(unpinned))
    return tuple(pinned)
