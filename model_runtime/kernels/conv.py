"""Causal depthwise conv1d over a packed row, with the conv window reset at every segment.

Legend: T = tokens in the row, C = channels, W = kernel width.

Backends share one signature: ``fn(x_TC, weight_CW, packed, splits=None) -> y_TC`` with SiLU
applied. With ``splits`` (channel counts, e.g. the q, k and v widths) they return one tensor
per split instead; a backend that can write the splits contiguously at no extra cost does so
(fla's delta rule copies non-contiguous q, k and v before it starts).

A segment with a parent in ``packed.links`` (a shared prefix) sees its parent's last inputs in
its window. The reference reads them directly; the fast backends convolve the row as if every
segment started from zeros, then ``continue_windows`` recomputes the first ``W - 1`` outputs of
every continuation from a small row of parent tails and continuation heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model_runtime.model.packing import PackedBatch


def _check(x_TC: torch.Tensor, weight_CW: torch.Tensor, packed: PackedBatch) -> None:
    if x_TC.dim() != 2:
        raise ValueError(f"conv1d expects x of shape [T, C], got {tuple(x_TC.shape)}")
    if weight_CW.dim() != 2 or weight_CW.shape[0] != x_TC.shape[1]:
        raise ValueError(f"conv1d weight must be [C={x_TC.shape[1]}, W], got {tuple(weight_CW.shape)}")
    if x_TC.shape[0] != packed.total_tokens:
        raise ValueError(f"x has {x_TC.shape[0]} tokens but the packed row has {packed.total_tokens}")


def _split(y_TC: torch.Tensor, splits):
    return y_TC if splits is None else y_TC.split(list(splits), dim=-1)


def causal_conv1d_reference(x_TC: torch.Tensor, weight_CW: torch.Tensor, packed: PackedBatch, splits=None):
    """Exact reference: one zero-padded convolution per segment, in the weight's dtype; a
    continuation's window starts with its parent's last ``W - 1`` inputs."""
    _check(x_TC, weight_CW, packed)
    width = weight_CW.shape[1]
    parents = packed.linked.parent_bounds if packed.links is not None else (None,) * packed.num_segments
    out = []
    for (start, end), parent in zip(packed.segments(), parents):
        lead = min(width - 1, parent[1] - parent[0]) if parent is not None else 0
        rows = x_TC[start:end] if not lead else torch.cat([x_TC[parent[1] - lead : parent[1]], x_TC[start:end]])
        seg_1CT = rows.t().unsqueeze(0).to(weight_CW.dtype)
        y_1CT = F.conv1d(seg_1CT, weight_CW.unsqueeze(1), padding=width - 1, groups=weight_CW.shape[0])
        out.append(F.silu(y_1CT[0, :, lead : lead + end - start]).t())
    return _split(torch.cat(out, dim=0).to(x_TC.dtype), splits)


def causal_conv1d_fla(x_TC: torch.Tensor, weight_CW: torch.Tensor, packed: PackedBatch, splits=None):
    """fla's Triton varlen conv: the window restarts at every ``cu_seqlens`` boundary.

    SiLU runs as its own step on the conv's output in the input dtype, not inside fla's kernel:
    this is where Hugging Face rounds when ``causal_conv1d`` is not installed (the only case in
    which this backend is chosen), conv output to bf16, then SiLU to bf16. fla's fused SiLU rounds
    once, and that one rounding, amplified by the layers, is most of the distance from Hugging
    Face (bench/parity_probe.py measures it). With
    ``splits`` the SiLU step writes each split to its own contiguous tensor, which is the copy
    fla's delta rule would otherwise make of q, k and v.

    fla 0.6 exports it from ``fla.modules.causal_conv1d`` (``fla.modules.convolution`` is an
    alias kept for older code) and returns ``(y, final_state)``.
    """
    _check(x_TC, weight_CW, packed)
    fn = _fla_conv()
    y = fn(
        x=x_TC.unsqueeze(0),
        weight=weight_CW,
        bias=None,
        activation=None,
        cu_seqlens=packed.cu_seqlens_long,
        cu_seqlens_cpu=packed.cu_seqlens_host_long,
    )
    y_TC = (y[0] if isinstance(y, tuple) else y)[0]
    if splits is None:
        out = F.silu(y_TC)
    else:
        out = tuple(F.silu(part).contiguous() for part in y_TC.split(list(splits), dim=-1))
    return continue_windows(causal_conv1d_fla, x_TC, weight_CW, packed, splits, out)


def continue_windows(conv_fn, x_TC: torch.Tensor, weight_CW: torch.Tensor, packed: PackedBatch, splits, out):
    """Rewrites, in ``out`` (``conv_fn``'s output for ``packed`` read as if no segment had a parent),
    the first ``W - 1`` outputs of every continuation with windows that start in its parent.

    The recomputed outputs come from ``conv_fn`` itself over a small row (each parent's last
    ``W - 1`` inputs, then the continuation's first ones), so they round exactly as the rest.
    """
    if packed.links is None:
        return out
    windows = packed.linked.conv_windows(weight_CW.shape[1])
    if windows.out_rows.numel() == 0:
        return out
    fixed = conv_fn(x_TC.index_select(0, windows.gather_rows), weight_CW, windows.packed, splits=splits)
    for part, new in zip((out,) if splits is None else out, (fixed,) if splits is None else fixed):
        part.index_copy_(0, windows.out_rows, new.index_select(0, windows.in_rows))
    return out


def _fla_conv():
    try:
        from fla.modules.causal_conv1d import causal_conv1d
    except ImportError:  # fla < 0.5
        from fla.modules.convolution import causal_conv1d
    return causal_conv1d


def causal_conv1d_tridao(x_TC: torch.Tensor, weight_CW: torch.Tensor, packed: PackedBatch, splits=None):
    """The ``causal_conv1d`` CUDA package; ``seq_idx`` tells it where every segment starts.

    SiLU stays inside the kernel here: when the package is installed Hugging Face calls the same
    kernel with the same fused activation, so both round alike.
    """
    _check(x_TC, weight_CW, packed)
    from causal_conv1d import causal_conv1d_fn

    seq_idx_1T = torch.repeat_interleave(
        torch.arange(packed.num_segments, device=x_TC.device, dtype=torch.int32),
        torch.tensor(packed.lengths, device=x_TC.device),
    ).unsqueeze(0)
    # The kernel wants channels-last memory for seq_idx: [1, C, T] viewed from a [1, T, C] tensor.
    x_1CT = x_TC.unsqueeze(0).transpose(1, 2)
    y_1CT = causal_conv1d_fn(x_1CT, weight_CW, None, seq_idx=seq_idx_1T, activation="silu")
    return continue_windows(causal_conv1d_tridao, x_TC, weight_CW, packed, splits, _split(y_1CT[0].t(), splits))
