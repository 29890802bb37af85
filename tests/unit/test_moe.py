"""Packscore's sparse-MoE block: every block switched, Hugging Face's numbers, and a token's output
independent of the tokens packed with it."""

import pytest
import torch

from model_runtime.kernels.moe_experts import experts_tiled
from model_runtime.kernels.registry import select_backends
from model_runtime.model.architectures import ARCHITECTURES
from model_runtime.model.causal_lm import PatchError, patch_for_packing
from model_runtime.model.moe import PackedSparseMoe
from model_runtime.model.packing import PackedBatch
from tests.checkpoints import build_hf_model

MOE_KINDS = ("qwen3_5_moe", "qwen3_next")
LENGTHS = (1, 2, 3, 5, 17, 33, 64)


def report(what, got, ref, tol):
    diff = (got.float() - ref.float()).abs().max().item()
    assert diff <= tol, f"{what}: max |diff| {diff:.3e} > tolerance {tol:.1e}"
    return diff


def hf_block(kind: str, dtype=torch.float32, seed: int = 0, **shape):
    """One Hugging Face sparse-MoE block of ``kind`` with fresh random weights (std 0.05, router 0.5)."""
    import transformers as tf

    from tests.checkpoints import _COMMON, _MOE

    cfg = {k: v for k, v in _COMMON.items() if k != "intermediate_size"} | _MOE | shape
    config = tf.Qwen3_5MoeTextConfig(**cfg) if kind == "qwen3_5_moe" else tf.Qwen3NextConfig(**cfg)
    module = tf.models.qwen3_5_moe.modeling_qwen3_5_moe if kind == "qwen3_5_moe" else tf.models.qwen3_next.modeling_qwen3_next
    block_cls = getattr(module, "Qwen3_5MoeSparseMoeBlock" if kind == "qwen3_5_moe" else "Qwen3NextSparseMoeBlock")
    gen = torch.Generator().manual_seed(seed)
    block = block_cls(config)
    for name, p in block.named_parameters():
        std = 0.5 if name == "gate.weight" else 0.05
        p.data = (torch.randn(p.shape, generator=gen) * std).to(dtype)
    return block.eval().requires_grad_(False)


def set_experts(block, implementation: str):
    block.experts.config._experts_implementation = implementation
    if hasattr(block.experts.config, "_experts_implementation_internal"):
        block.experts.config._experts_implementation_internal = implementation


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_every_sparse_moe_block_is_switched_and_keeps_its_names(kind):
    hf = build_hf_model(kind)
    names = set(dict(hf.named_parameters()))
    model, report_ = patch_for_packing(hf, ARCHITECTURES[kind], select_backends("cpu"))
    assert report_.sparse_moe == len(model.layers) == 8
    assert all(isinstance(layer.mlp, PackedSparseMoe) for layer in model.layers)
    assert not any(type(m).__name__.endswith("SparseMoeBlock") for m in model.modules())
    # Parameters keep Hugging Face's names (FSDP wraps, the FLOP count and weight loads read them).
    assert {"model." + n for n, _ in model.layers.named_parameters(prefix="layers")} <= names


def test_an_unknown_sparse_moe_block_fails_the_patch():
    hf = build_hf_model("qwen3_5_moe")
    block = hf.model.layers[3].mlp
    block.__class__ = type("Qwen3_5MoeNewSparseMoeBlock", (type(block),), {})
    with pytest.raises(PatchError, match=r"layers\.3\.mlp \(Qwen3_5MoeNewSparseMoeBlock\)"):
        patch_for_packing(hf, ARCHITECTURES["qwen3_5_moe"], select_backends("cpu"))


@pytest.mark.parametrize("kind", MOE_KINDS)
@pytest.mark.parametrize("implementation", ["grouped_mm", "eager"])
def test_block_matches_hugging_face_float32(kind, implementation):
    """Fresh random weights and inputs; float32, where only summation orders differ."""
    block = hf_block(kind)
    set_experts(block, implementation)
    x_TD = torch.randn(sum(LENGTHS), block.gate.hidden_dim)
    ours = PackedSparseMoe(block, select_backends("cpu"))
    packed = PackedBatch.from_lengths(list(LENGTHS), device="cpu")
    with torch.no_grad():
        report(f"{kind} vs HF {implementation}", ours(x_TD, packed), block(x_TD[None])[0], 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("kind", MOE_KINDS)
def test_a_token_does_not_depend_on_its_neighbours(kind, dtype):
    """Each sequence alone equals its rows inside the packed row, bit for bit, for every length."""
    block = hf_block(kind, dtype, seed=1)
    ours = PackedSparseMoe(block, select_backends("cpu"))
    x_TD = torch.randn(sum(LENGTHS), block.gate.hidden_dim).to(dtype)
    with torch.no_grad():
        whole = ours(x_TD, PackedBatch.from_lengths(list(LENGTHS), device="cpu"))
        start = 0
        for n in LENGTHS:
            alone = ours(x_TD[start : start + n], PackedBatch.from_lengths([n], device="cpu"))
            report(f"{kind} {dtype} length {n} alone vs packed", alone, whole[start : start + n], 0.0)
            start += n


def test_tiles_do_not_depend_on_the_count():
    """The experts alone: one token routed with 0..40 others to the same experts gives the same row."""
    gen = torch.Generator().manual_seed(2)
    E, D, I, K = 3, 24, 16, 2
    gate_up, down = torch.randn(E, 2 * I, D, generator=gen), torch.randn(E, D, I, generator=gen)
    x = torch.randn(41, D, generator=gen)
    top_i = torch.tensor([[0, 2]]).expand(41, K)
    top_w = torch.rand(41, K, generator=gen)
    first = experts_tiled(x[:1], top_i[:1], top_w[:1], gate_up, down)
    for n in (2, 3, 4, 31, 32, 33, 41):
        report(f"first token among {n}", experts_tiled(x[:n], top_i[:n], top_w[:n], gate_up, down)[:1], first, 0.0)



# The name each grouped backend's refusal gives (the scattered one names its fused family).
REFUSED_AS = {"grouped_mm": "grouped_mm", "grouped_mm_fused": "grouped_mm_fused",
              "grouped_mm_fused_scatter": "grouped_mm_fused_scatter", "expert_tiles": "expert_tiles",
              "expert_tiles_silu": "expert_tiles_silu"}


@pytest.mark.parametrize("backend", sorted(REFUSED_AS))
def test_a_grouped_backend_refuses_float32_on_the_cpu_naming_the_way_out(backend):
    from model_runtime.kernels.registry import REGISTRY

    x, top_i, top_w = torch.zeros(2, 8), torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1)
    want = f"the {REFUSED_AS[backend]} experts need bfloat16 on CUDA, got torch.float32 on cpu; use --kernels moe_experts=tiled"
    with pytest.raises(ValueError) as refused:
        REGISTRY["moe_experts"][backend](x, top_i, top_w, torch.zeros(1, 8, 8), torch.zeros(1, 8, 4))
    assert str(refused.value) == want

@pytest.mark.parametrize("kind", MOE_KINDS)
def test_block_follows_hugging_face_bf16_per_token(kind):
    """bf16 on the CPU, 8 of 16 experts per token: packscore's row against Hugging Face per sequence.

    Against HF's grouped_mm experts (its default) only float32 summation orders differ (the
    products' blocking, the top-k renormalisation, the top-k sum), each rounded once to bf16 at the
    same step as HF: at most one bf16 step (2^-8 relative) at the output. HF's eager experts add the
    8 weighted rows into a bf16 accumulator one expert at a time (8 roundings instead of one), so
    against them up to 4 steps of the output's magnitude are allowed.
    """
    block = hf_block(kind, torch.bfloat16, seed=3, num_experts=16, num_experts_per_tok=8)
    ours = PackedSparseMoe(block, select_backends("cpu"))
    x_TD = torch.randn(sum(LENGTHS), block.gate.hidden_dim).bfloat16()
    packed = PackedBatch.from_lengths(list(LENGTHS), device="cpu")
    with torch.no_grad():
        got = ours(x_TD, packed)
        for implementation, steps in (("grouped_mm", 1), ("eager", 4)):
            set_experts(block, implementation)
            ref = torch.cat([block(x_TD[s:e][None])[0] for s, e in packed.segment_bounds])
            scale = ref.float().abs().max().item()
            diff = report(f"{kind} bf16 vs HF {implementation} per sequence", got, ref, steps * 2.0**-8 * scale)
            print(f"{kind} bf16 vs HF {implementation}: max |diff| {diff:.3e}, output max {scale:.3e}")


def test_lane_tree_sum_is_the_warp_reduction_order():
    """The CUDA order of the router's renormalisation sum: for K = 8 one value per lane folded at
    offsets 4, 2, 1; for K = 10 lanes 0 and 1 first add their second value. Symbols instead of
    numbers, so the test reads the order itself rather than a rounding it causes."""
    from model_runtime.model.moe import lane_tree_sum

    class Expr:  # records how the values are added
        def __init__(self, text):
            self.text = text

        def __add__(self, other):
            return Expr(f"({self.text}+{other.text})")

    eight = lane_tree_sum([Expr(f"w{i}") for i in range(8)]).text
    assert eight == "(((w0+w4)+(w2+w6))+((w1+w5)+(w3+w7)))", eight
    ten = lane_tree_sum([Expr(f"w{i}") for i in range(10)]).text
    assert ten == "((((w0+w8)+w4)+(w2+w6))+(((w1+w9)+w5)+(w3+w7)))", ten
    assert lane_tree_sum([Expr("w0")]).text == "w0"


@pytest.mark.parametrize("k", [1, 2, 3, 4, 8, 10])
def test_combine_in_cuda_order_is_four_accumulators_from_zero(k):
    """``combine_top_k``'s CUDA order (the one PyTorch's strided sum uses, measured on an H200):
    row k into accumulator k % 4, each from +0.0, then the four in turn; bit for bit, -0.0 rows
    included, whatever K."""
    from model_runtime.kernels.moe_experts import combine_top_k

    g = torch.Generator().manual_seed(k)
    T, D = 50, 64
    w = (torch.randn(T * k, D, generator=g) * torch.exp2(torch.randint(-12, 12, (T * k, 1), generator=g).float())).bfloat16()
    w[:k] = -0.0  # token 0: every row -0.0
    v = w.view(T, k, D).float()
    acc = [torch.zeros(T, D) for _ in range(4)]
    for j in range(k):
        acc[j % 4] = acc[j % 4] + v[:, j]
    want = (((acc[0] + acc[1]) + acc[2]) + acc[3]).bfloat16()
    got = combine_top_k(w, T, torch.bfloat16, cuda_order=True)
    differing = int((got.view(torch.int16) != want.view(torch.int16)).sum())
    assert differing == 0, f"{differing} of {T * D} values differ from four accumulators (tolerance: bit for bit)"


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_linked_row_runs_router_and_shared_gate_from_one_gather(kind, monkeypatch):
    """On a row with prefix links the router's and the shared gate's products run in one
    ``narrow_products`` call (one gather of x to the whole sequences): the block's output equals
    the two calls it replaces, bit for bit, and the row gathers x once."""
    from model_runtime.kernels import gate_projection
    from model_runtime.model import moe
    from model_runtime.model.packing import PrefixLinks

    block = hf_block(kind, torch.bfloat16, seed=2)
    ours = PackedSparseMoe(block, select_backends("cpu"))
    ours.tiled = False  # the per-segment narrow products a GPU runs (tiled is the CPU's own form)
    lengths, parents = (64, 5, 30, 1, 90), (-1, -1, 0, 0, 0)
    packed = PackedBatch.from_lengths(lengths, links=PrefixLinks(parents, 2))
    x_TD = torch.randn(sum(lengths), block.gate.hidden_dim).to(torch.bfloat16)
    calls = []
    real = gate_projection.narrow_products
    monkeypatch.setattr(moe, "narrow_products", lambda fn, linears, *a, **k: calls.append(len(linears)) or real(fn, linears, *a, **k))
    with torch.no_grad():
        ours.merged_narrow = True
        merged = ours(x_TD, packed)
        assert calls == [2], f"narrow_products calls (linears each): {calls}, expected one call with both"
        ours.merged_narrow = False
        apart = ours(x_TD, packed)
    report(f"{kind} linked row, router and shared gate in one call vs two", merged, apart, 0.0)
