"""Where a packed forward's time goes: GPU kernels grouped by what they do, plus the idle gaps.

``profile_row`` runs one row under ``torch.profiler``, sums every CUDA kernel's time into a
category by its name, and compares the sum with the wall time of the row: the remainder is
time the GPU sat idle (launch overhead, Python, packing, host copies).
"""

from __future__ import annotations

import re
import time
from collections import defaultdict

import torch

# First match wins; names are lower-cased before matching.
CATEGORIES = (
    ("attention", re.compile(r"flash|fmha|attn")),
    ("head_softmax", re.compile(r"logprob_entropy")),
    ("gdn", re.compile(r"chunk|l2norm|solve_tril|recompute_w_u|delta_rule|cumsum|merge_16x16|prepare_wy")),
    ("conv", re.compile(r"conv1d|causal_conv")),
    ("matmul", re.compile(r"gemm|nvjet|xmma|cutlass|cublas|matmul|splitk|sm90_|wgmma|grouped_mm")),
    ("fused_elementwise", re.compile(r"^triton_")),
    ("copies", re.compile(r"memcpy|memset|copy_|cat_|catarray")),
)


def categorize(kernel_name: str) -> str:
    name = kernel_name.lower()
    for category, pattern in CATEGORIES:
        if pattern.search(name):
            return category
    return "other_elementwise"


def profile_row(run, *, top: int = 25) -> dict:
    """Profiles ``run()`` (one synchronised scoring call) and returns the breakdown in ms."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=True) as prof:
        started = time.perf_counter()
        run()
        sync()
        wall_ms = (time.perf_counter() - started) * 1e3
    per_category: dict[str, float] = defaultdict(float)
    per_kernel: dict[str, float] = defaultdict(float)
    launches = 0
    for event in prof.events():
        if event.device_type != DeviceType.CUDA:
            continue
        ms = (event.time_range.end - event.time_range.start) / 1e3
        per_category[categorize(event.name)] += ms
        per_kernel[event.name] += ms
        launches += 1
    busy_ms = sum(per_category.values())
    per_category["gpu_idle (launch, python, packing, host)"] = max(0.0, wall_ms - busy_ms)
    kernels = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:top]
    return {
        "top_ops_by_shape_ms": _top_ops_by_shape(prof, top),
        "wall_ms": wall_ms,
        "gpu_busy_ms": busy_ms,
        "kernel_launches": launches,
        "categories_ms": dict(sorted(per_category.items(), key=lambda kv: -kv[1])),
        "top_kernels_ms": [{"name": n[:120], "ms": ms, "category": categorize(n)} for n, ms in kernels],
    }


def _top_ops_by_shape(prof, top: int) -> list[dict]:
    """The operators that launched the most device time, one row per (name, input shapes): which
    call a copy or a fill comes from (``aten::copy_`` of ``[[65536, 2048], ...]``)."""
    rows = []
    for e in prof.key_averages(group_by_input_shape=True):
        ms = getattr(e, "self_device_time_total", 0) / 1e3
        if ms > 0 and e.key.startswith("aten::"):
            rows.append({"op": e.key, "shapes": str(e.input_shapes)[:160], "calls": e.count, "ms": ms})
    return sorted(rows, key=lambda r: -r["ms"])[:top]


def format_breakdown(breakdown: dict) -> str:
    wall = breakdown["wall_ms"]
    lines = [f"wall {wall:.1f} ms, GPU busy {breakdown['gpu_busy_ms']:.1f} ms, {breakdown['kernel_launches']} kernels"]
    for name, ms in breakdown["categories_ms"].items():
        lines.append(f"  {name:<45s} {ms:9.1f} ms  {100 * ms / wall:5.1f}%")
    lines.append("top aten operators by their kernels' time, with input shapes:")
    for r in breakdown.get("top_ops_by_shape_ms", []):
        lines.append(f"  {r['ms']:9.2f} ms  {r['calls']:5d} x {r['op']} {r['shapes']}")
    lines.append("top kernels:")
    for k in breakdown["top_kernels_ms"]:
        lines.append(f"  {k['ms']:9.2f} ms  [{k['category']}] {k['name']}")
    return "\n".join(lines)


MODULE_PARTS = ("linear_attn", "self_attn", "mlp")  # a decoder layer's token mixer and its MLP / MoE block


def module_times(layers, run) -> dict:
    """Device time of every decoder layer's token mixer and MLP during ``run()``, in ms, summed
    by kind (``linear_attn``, ``self_attn``, ``mlp``) with each kind's count; what is left of the
    wall time (``other_ms``) is the residual adds and norms, the embedding and the head.
    CUDA events around each module's forward; on the CPU, wall time."""
    cuda = torch.cuda.is_available()
    marks: list[tuple[str, object, object]] = []
    handles = []

    def now():
        if cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def attach(module, kind):
        opened = []
        handles.append(module.register_forward_pre_hook(lambda mod, args: opened.append(now())))
        handles.append(module.register_forward_hook(lambda mod, args, out: marks.append((kind, opened.pop(), now()))))

    for layer in layers:
        for part in MODULE_PARTS:
            if hasattr(layer, part):
                attach(getattr(layer, part), part)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    try:
        sync()
        started = time.perf_counter()
        run()
        sync()
        wall_ms = (time.perf_counter() - started) * 1e3
    finally:
        for h in handles:
            h.remove()
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for kind, start, end in marks:
        totals[kind] += start.elapsed_time(end) if cuda else (end - start) * 1e3
        counts[kind] += 1
    out = {"wall_ms": wall_ms, "other_ms": wall_ms - sum(totals.values())}
    for kind in totals:
        out[kind] = {"ms": totals[kind], "count": counts[kind], "ms_each": totals[kind] / counts[kind]}
    return out
