"""Every config knob of transformers' qwen3_5 / qwen3_5_moe / qwen3_next classes a checkpoint can
be saved with: packscore scores it as Hugging Face's forward does, or refuses it at start naming
the field (docs/checkpoints.md, "Config fields"). Never scored silently otherwise."""

import numpy as np
import pytest
import torch

from model_runtime.scoring.checkpoint import check_checkpoint
from model_runtime.scoring.checkpoint_error import CheckpointError
from model_runtime.scoring.loading import load_model
from model_runtime.scoring.scorer import Scorer
from model_runtime.types import SequenceInput
from tests.checkpoints import build_hf_model, hf_scores

TOL = 1e-4  # float32 CPU parity target (tests/unit/test_packed_parity.py)
LENGTHS = (3, 40, 70)  # 70 crosses Hugging Face's 64-token delta-rule chunk
ALL_FULL = ["full_attention"] * 8
LAYOUT = ["full_attention", "linear_attention", "full_attention", "full_attention"] + ["linear_attention"] * 4
LONGROPE = dict(rope_type="longrope", short_factor=[1.0, 1.1, 1.2, 1.3], long_factor=[2.0, 3.0, 4.0, 5.0],
                original_max_position_embeddings=32)

# (kind, text config overrides, multimodal top-level overrides, dtype saved in)
HONOURED = {
    "tie_word_embeddings": ("qwen3_5", {"tie_word_embeddings": True}, None, None),
    "next_tie_word_embeddings": ("qwen3_next", {"tie_word_embeddings": True}, None, None),
    "norm_topk_prob_false": ("qwen3_next", {"norm_topk_prob": False}, None, None),
    "decoder_sparse_step_mlp_only_layers": ("qwen3_next", {"decoder_sparse_step": 2, "mlp_only_layers": [3],
                                                           "intermediate_size": 40}, None, None),
    "no_experts": ("qwen3_next", {"num_experts": 0}, None, None),
    "attention_bias": ("qwen3_5", {"attention_bias": True}, None, None),
    "next_attention_bias": ("qwen3_next", {"attention_bias": True}, None, None),
    "partial_rotary_factor_half": ("qwen3_5", {"rope_parameters": {"partial_rotary_factor": 0.5}}, None, None),
    "partial_rotary_factor_full": ("qwen3_5", {"rope_parameters": {"partial_rotary_factor": 1.0}}, None, None),
    "partial_rotary_factor_odd": ("qwen3_next", {"rope_parameters": {"partial_rotary_factor": 0.3}}, None, None),
    "rope_theta": ("qwen3_5", {"rope_parameters": {"rope_theta": 100.0}}, None, None),
    "rope_linear": ("qwen3_5", {"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, None, None),
    "rope_dynamic": ("qwen3_5", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, None, None),
    "rope_yarn": ("qwen3_next", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                                     "original_max_position_embeddings": 32}}, None, None),
    "rope_llama3": ("qwen3_5_moe", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}},
                    None, None),
    "head_dim": ("qwen3_5", {"head_dim": 16}, None, None),
    "mha_kv_heads": ("qwen3_5", {"num_key_value_heads": 4}, None, None),
    "mqa_kv_heads": ("qwen3_5", {"num_key_value_heads": 1}, None, None),
    "layer_types": ("qwen3_5", {"layer_types": LAYOUT}, None, None),
    "layer_types_no_full_attention": ("qwen3_next", {"layer_types": ["linear_attention"] * 8}, None, None),
    "full_attention_interval": ("qwen3_5_moe", {"full_attention_interval": 2}, None, None),
    "linear_heads_equal": ("qwen3_5", {"linear_num_key_heads": 4, "linear_num_value_heads": 4}, None, None),
    "linear_heads_one_to_four": ("qwen3_next", {"linear_num_key_heads": 1, "linear_num_value_heads": 4}, None, None),
    "linear_head_dims": ("qwen3_5", {"linear_key_head_dim": 8, "linear_value_head_dim": 24}, None, None),
    "next_linear_head_dims": ("qwen3_next", {"linear_key_head_dim": 24, "linear_value_head_dim": 8}, None, None),
    "linear_conv_kernel_dim": ("qwen3_5", {"linear_conv_kernel_dim": 2}, None, None),
    "hidden_act_swish": ("qwen3_5", {"hidden_act": "swish"}, None, None),
    "hidden_act_gelu_dense_full_attention": ("qwen3_5", {"hidden_act": "gelu", "layer_types": ALL_FULL}, None, None),
    "rms_norm_eps": ("qwen3_5", {"rms_norm_eps": 1e-3}, None, None),
    "no_shared_expert": ("qwen3_next", {"shared_expert_intermediate_size": 0}, None, None),
    "experts_shapes": ("qwen3_5_moe", {"num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 16,
                                       "shared_expert_intermediate_size": 48}, None, None),
    "one_expert_per_token": ("qwen3_5_moe", {"num_experts_per_tok": 1, "output_router_logits": True}, None, None),
    "odd_sizes": ("qwen3_5", {"vocab_size": 131, "hidden_size": 48}, None, None),
    "multimodal_text_config": ("qwen3_5_moe_vl", {"attention_bias": True, "head_dim": 16}, {"tie_word_embeddings": True},
                               None),
    "float16_checkpoint": ("qwen3_5", {}, None, torch.float16),
    "bfloat16_checkpoint": ("qwen3_5_vl", {}, None, torch.bfloat16),
}

# (kind, text config overrides, the field the refusal names)
REFUSED = {
    "hidden_act_gelu": ("qwen3_5", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    "hidden_act_moe_experts": ("qwen3_5_moe_vl", {"hidden_act": "gelu_pytorch_tanh", "layer_types": ALL_FULL},
                               "hidden_act 'gelu_pytorch_tanh'"),
    "hidden_act_next": ("qwen3_next", {"hidden_act": "relu"}, "hidden_act 'relu'"),
    "rope_longrope": ("qwen3_5", {"rope_parameters": LONGROPE}, "rope_type 'longrope'"),
    "next_rope_longrope": ("qwen3_next", {"rope_parameters": LONGROPE}, "rope_type 'longrope'"),
    "layer_types_unknown": ("qwen3_5", {"layer_types": ["sliding_attention"] + LAYOUT[1:]},
                            "layer_types holds 'sliding_attention'"),
}


def with_nonzero_norms_and_biases(model):
    """Hugging Face starts norm weights and biases at zero, where a knob on them would not show."""
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and ("norm" in name or "bias" in name) and "visual" not in name:
                p.add_(torch.randn(p.shape, generator=generator) * 0.1)
    return model


def saved(tmp_path, kind, text, top=None, dtype=None):
    model = with_nonzero_norms_and_biases(build_hf_model(kind, text=text, top=top))
    model.to(dtype or torch.float32).save_pretrained(tmp_path)
    return type(model), tmp_path


@pytest.mark.parametrize("case", sorted(HONOURED))
def test_a_knob_scores_as_hugging_face(case, tmp_path, capsys):
    kind, text, top, dtype = HONOURED[case]
    model_class, path = saved(tmp_path, kind, text, top, dtype)
    hf = model_class.from_pretrained(path, dtype=torch.float32).eval()  # the saved class, as the checkpoint reads
    loaded = load_model(str(path), device="cpu")
    rng = np.random.default_rng(2)
    seqs = [SequenceInput(rng.integers(0, loaded.vocab_size, n), score_from=1, top_k=3) for n in LENGTHS]
    worst = 0.0
    for seq, got in zip(seqs, Scorer(loaded).score_row(seqs)):
        logp, entropy, top_ids, _ = hf_scores(hf, seq, 3)
        worst = max(worst, float(np.abs(got.logprobs - logp).max()), float(np.abs(got.entropy - entropy).max()))
        np.testing.assert_array_equal(got.top_k_ids, top_ids, err_msg=f"{case}: top-k ids, length {seq.length}")
    with capsys.disabled():
        print(f"\n[knob {case}] max |diff| {worst:.2e} (tol {TOL:.0e})")
    assert worst <= TOL, f"{case} {text} {top or ''}: max |diff| {worst:.3e} against Hugging Face > tol {TOL:.0e}"


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_knob_packscore_cannot_follow_is_refused_at_start_by_name(case, tmp_path):
    kind, text, named = REFUSED[case]
    _, path = saved(tmp_path, kind, text)
    with pytest.raises(CheckpointError, match=named) as refused:
        check_checkpoint(path)  # before a byte of weights is read
    assert refused.value.kind == "unsupported"
    with pytest.raises(CheckpointError, match=named):
        load_model(str(path), device="cpu")
