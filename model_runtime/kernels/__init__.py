"""Kernels: one boundary per family, each fast backend beside its exact PyTorch reference.

- ``registry``: the backends of every family and ``select_backends`` (``KernelBackends``).
- ``overrides``: the ``--kernels`` syntax and the family names (no torch import).
- one module per family or fast path: ``attention``, ``conv``, ``conv_triton``,
  ``linear_attention``, ``logprob_head``, ``elementwise``, ``norm_triton``,
  ``pointwise_triton``, ``triton_math``, ``gate_projection``, ``moe_experts``, ``moe_triton``,
  ``moe_router``; ``cache`` sets the compile caches.
- ``expert_gemm``: the MoE experts' products in packscore's CUTLASS kernel (``csrc/``), loaded
  from a library built ahead of time.
"""
