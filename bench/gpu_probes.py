"""The GPU suite's probes beside the benchmark: the machine (environment, bf16 matmul ceiling),
MoE experts grouped_mm against eager, and the GPU tests run as a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import numpy as np
import torch

from bench import suite_harness as H
from bench.suite_harness import GiB, Suite, log, sync


def environment() -> dict:
    import inspect

    import transformers
    import triton

    from model_runtime.kernels.attention import _varlen_has_gqa
    from model_runtime.kernels.linear_attention import _fla_signature
    from model_runtime.kernels.registry import select_backends
    from bench.hf_reference import hf_uses_fla

    info = {
        "gpu": torch.cuda.get_device_name(0),
        "gpu_memory_gib": torch.cuda.get_device_properties(0).total_memory / GiB,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "triton": triton.__version__,
        "python": sys.version.split()[0],
        "env": {k: os.environ.get(k) for k in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "PYTHONPATH")},
    }
    try:
        import fla

        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        sig = _fla_signature()
        info["fla"] = getattr(fla, "__version__", "?")
        info["fla_chunk_gated_delta_rule"] = str(inspect.signature(chunk_gated_delta_rule))
        info["fla_grouped_value_heads"] = sig["gva"]
        from model_runtime.kernels.conv import _fla_conv

        conv = _fla_conv()
        info["fla_causal_conv1d"] = f"{conv.__module__}.{conv.__name__}{inspect.signature(conv)}"
        x = torch.randn(1, 8, 32, device="cuda", dtype=torch.bfloat16)
        y = conv(x=x, weight=torch.randn(32, 4, device="cuda", dtype=torch.bfloat16), activation="silu")
        info["fla_causal_conv1d_returns"] = type(y).__name__ + (f" of {len(y)}" if isinstance(y, tuple) else "")
    except Exception as err:
        info["fla_error"] = f"{type(err).__name__}: {err}"
    from torch.nn.attention.varlen import varlen_attn

    info["varlen_attn"] = str(inspect.signature(varlen_attn))
    info["varlen_enable_gqa"] = _varlen_has_gqa()
    info["hf_chunk_gated_delta_rule"] = hf_uses_fla()
    info["backends_cuda"] = select_backends("cuda").names
    log(json.dumps(info, indent=1))
    return info


def matmul_ceiling() -> dict:
    """bf16 8192^3 products on random data through torch: 3 warm-ups, mean and median of 10."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    flop = 2.0 * n**3
    result = {
        "tflops_mean": flop / np.mean(times) / 1e12,
        "tflops_median": flop / np.median(times) / 1e12,
        "tflops_best": flop / np.min(times) / 1e12,
    }
    log(f"measured bf16 matmul ceiling: {result}")
    return result


class GpuClocks:
    """SM clock (MHz) and board power (W) sampled by ``nvidia-smi`` every 200 ms while the block
    runs; ``summary()`` gives their medians and extremes (empty where nvidia-smi is missing)."""

    def __enter__(self) -> "GpuClocks":
        self.lines: list[str] = []
        try:
            self._proc = subprocess.Popen(
                ["nvidia-smi", f"--id={_gpu_id()}", "--query-gpu=timestamp,clocks.sm,power.draw",
                 "--format=csv,noheader,nounits", "-lms", "200"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self._proc = None
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            out, _ = self._proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            out, _ = self._proc.communicate()
        self.lines = [line for line in out.splitlines() if line.strip()]

    def summary(self, skip_s: float = 0.0) -> dict:
        """Medians and extremes of the samples taken ``skip_s`` or more after the block began."""
        samples, first = [], None
        for line in self.lines:
            try:
                stamp, sm, watts = line.split(",")
                at = datetime.strptime(stamp.strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()
                sample = (float(sm), float(watts))
            except ValueError:
                continue
            first = at if first is None else first
            if at - first >= skip_s:
                samples.append(sample)
        if not samples:
            return {}
        sm, watts = np.array(samples).T
        return {"samples": len(samples), "sm_mhz_median": float(np.median(sm)), "sm_mhz_min": float(sm.min()),
                "sm_mhz_max": float(sm.max()), "power_w_median": float(np.median(watts)),
                "power_w_max": float(watts.max())}


def _gpu_id() -> str:
    """nvidia-smi's name of torch's current GPU (CUDA_VISIBLE_DEVICES renumbers them)."""
    try:
        return f"GPU-{torch.cuda.get_device_properties(torch.cuda.current_device()).uuid}"
    except Exception:  # no GPU here: nvidia-smi is absent too, and the samples stay empty
        return "0"


def matmul_sustained(seconds_each: float = 6.0,
                     shapes: tuple[tuple[int, int, int], ...] = ((8192, 8192, 8192), (65536, 4096, 12288))) -> dict:
    """bf16 products of each ``(M, K, N)`` back to back for ``seconds_each``: the rate a long
    forward can hold, clocks and power beside it. ``matmul_ceiling`` times ten products on an idle
    GPU; run after a timed pass, this says what the same GPU gives once hot. The rate is the median
    of windows of about 0.1 s after the first second."""
    out = {}
    for m, k, n in shapes:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()  # x @ W.T, as a Linear computes it
        flop = 2.0 * m * k * n
        a @ b
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        a @ b
        torch.cuda.synchronize()
        per_window = max(1, int(0.1 / max(time.perf_counter() - t0, 1e-4)))
        rates, start = [], time.perf_counter()
        with GpuClocks() as clocks:
            while time.perf_counter() - start < seconds_each:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                for _ in range(per_window):
                    a @ b
                end.record()
                end.synchronize()
                rates.append((time.perf_counter() - start, flop * per_window / (begin.elapsed_time(end) / 1e3) / 1e12))
        settled = [r for t, r in rates if t > 1.0] or [r for _, r in rates]
        out[f"{m}x{k}x{n}"] = {"tflops_median": float(np.median(settled)), "tflops_min": float(np.min(settled)),
                              "tflops_first_window": rates[0][1], "windows": len(rates), **clocks.summary(skip_s=1.0)}
        del a, b
        torch.cuda.empty_cache()
    log(f"sustained bf16 matmul rates: {out}")
    return out


def moe_experts(num_layers: int | None, row_tokens: int, spec=None) -> dict:
    """One packed row through the 35B-A3B layers with packscore's MoE block, then with Hugging
    Face's block in its place (its experts as ``grouped_mm``, then ``eager``): time and hidden-state
    differences. Keys ``grouped_mm`` and ``eager`` are Hugging Face's; ``packscore`` is ours."""
    from bench.hf_reference import build_twin, set_moe_implementation
    from bench.workload import WorkloadSpec, grpo_workload
    from model_runtime.model.packing import PackedBatch
    from model_runtime.scoring.rows import plan_row

    preset = "qwen3.5-35b-a3b" if H.DEVICE == "cuda" else "tiny-moe"
    twin = build_twin(preset, num_layers=num_layers, moe_implementation="grouped_mm", device=H.DEVICE,
                      dtype=torch.bfloat16 if H.DEVICE == "cuda" else torch.float32)
    model = twin.loaded.model
    sequences, total = [], 0
    for s in grpo_workload(twin.loaded.vocab_size, spec or WorkloadSpec()):
        if total + s.length > row_tokens:
            continue
        sequences.append(s)
        total += s.length
    plan = plan_row(sequences)
    ids = torch.from_numpy(plan.ids_T).to(H.DEVICE)
    hf_blocks = [(layer, hf_block) for layer, attr, hf_block in twin._originals if attr == "mlp"]
    ours_blocks = [(layer, layer.mlp) for layer, _ in hf_blocks]
    out, hidden = {"layers": len(model.layers), "row_tokens": total}, {}
    for impl, repeats in (("packscore", 3), ("grouped_mm", 3), ("eager", 2)):
        if impl != "packscore":
            set_moe_implementation(model, impl)
            experts = next(m for m in model.modules() if type(m).__name__.endswith("Experts"))
            assert experts.config._experts_implementation == impl, "the experts did not see the switch"
        for layer, block in (ours_blocks if impl == "packscore" else hf_blocks):
            layer.mlp = block
        times = []
        with torch.inference_mode():
            for r in range(repeats + 1):
                packed = PackedBatch.from_lengths(plan.lengths, device=H.DEVICE)
                sync()
                t0 = time.perf_counter()
                h = model(ids, packed)
                sync()
                if r:
                    times.append(time.perf_counter() - t0)
        hidden[impl] = h.float()
        out[impl] = {"forward_s": float(np.median(times)), "tokens_per_s": total / float(np.median(times))}
        log(f"35B-A3B MoE {impl}: {out[impl]}")
    for layer, block in ours_blocks:
        layer.mlp = block
    out["grouped_over_eager_speedup"] = out["eager"]["forward_s"] / out["grouped_mm"]["forward_s"]
    out["packscore_over_hf_grouped_speedup"] = out["grouped_mm"]["forward_s"] / out["packscore"]["forward_s"]
    out["hidden_max_abs_diff"] = float((hidden["grouped_mm"] - hidden["eager"]).abs().max())
    out["hidden_rel_diff"] = float((hidden["grouped_mm"] - hidden["eager"]).norm() / hidden["eager"].norm())
    out["packscore_vs_hf_grouped_hidden_max_abs_diff"] = float((hidden["packscore"] - hidden["grouped_mm"]).abs().max())
    set_moe_implementation(model, "grouped_mm")
    log(f"35B-A3B experts: {out}")
    return out


def run_tests(suite: Suite, smoke: bool, select: str | None = None) -> dict:
    report = Path("/tmp/packscore-gpu-tests.jsonl")
    report.unlink(missing_ok=True)
    env = dict(os.environ, PACKSCORE_GPU_REPORT=str(report), PACKSCORE_GPU_SMOKE="1" if smoke else "0")
    timeout = max(60, int(suite.remaining() - 15))
    cmd = [sys.executable, "-m", "pytest", "-q", "-rA", "tests/gpu", "-p", "no:cacheprovider", "--timeout", str(timeout)]
    if select:
        cmd += ["-k", select]
    log(" ".join(cmd))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout + 10)
    print(proc.stdout[-20000:], proc.stderr[-5000:], flush=True)
    suite.texts["gpu-tests.txt"] = proc.stdout[-200000:] + "\n" + proc.stderr[-20000:]
    records = [json.loads(line) for line in report.read_text().splitlines()] if report.exists() else []
    summary = [line for line in proc.stdout.splitlines() if " passed" in line or " failed" in line]
    return {"returncode": proc.returncode, "summary": summary[-1] if summary else "", "records": records}
