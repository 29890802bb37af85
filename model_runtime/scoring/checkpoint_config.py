"""What a checkpoint's ``config.json`` describes, read before any weight is.

``read_config`` reads it (a multimodal config's head tie as its top level says); ``text_config``,
``context_length`` and ``fp8_block_size`` read the language model's part of it, which
``refuse_odd_text_config`` requires to be an object where the model_type has one, and no object
where it has none; ``refuse_top_level_rope`` names a multimodal top level's rope setting that
transformers cannot build from. ``hf_config`` and ``build_meta_model`` give transformers' config object and the
causal LM it builds on the meta device, whose tensor names and shapes (``model_tensors``, kept per
config) are what ``checkpoint.check_checkpoint`` matches the files against. Settings packscore's forward would not
compute as Hugging Face's are refused (``refuse_other_forward_settings``), and so is a weight
update whose config would compute otherwise than the served model's (``refuse_other_forward``).
Every refusal is a ``CheckpointError``.
"""

from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path

from model_runtime.model.architectures import LAYER_KINDS, MODEL_TYPES
from model_runtime.scoring.checkpoint_error import CheckpointError, quoted_names


def read_config(path: Path) -> dict:
    if not path.is_dir():
        raise CheckpointError("unsupported", f"{path} is not a directory; expected a Hugging Face checkpoint directory")
    config_file = path / "config.json"
    try:
        if not config_file.is_file():
            raise CheckpointError("unsupported", f"{path} has no config.json; expected a Hugging Face checkpoint directory")
        raw = config_file.read_bytes()
    except OSError as exc:  # no permission to read it, or to search the directory
        raise CheckpointError("unreadable", f"{config_file} cannot be read: {exc.strerror or exc}") from None
    try:
        config = json.loads(raw.decode("utf-8"))  # as Hugging Face reads it
    except ValueError as exc:
        # a config cut short is often one still being written: the retryable kind
        raise CheckpointError("unreadable", f"{config_file} is not readable JSON: {exc}") from None
    if not isinstance(config, dict):
        raise CheckpointError("unsupported", f"{config_file} must hold a JSON object, got {type(config).__name__}")
    return _tie_as_multimodal(config)


def _tie_as_multimodal(config: dict) -> dict:
    """A multimodal config with ``text_config`` ties the language model's head to its embedding as
    its top level says (false when absent), whatever ``text_config`` says: Hugging Face's
    multimodal class reads the top level, and its ``save_pretrained`` writes the tie only there."""
    inner = config.get("text_config")
    if not isinstance(inner, dict):
        return config
    tie = config.get("tie_word_embeddings", False) is True
    if inner.get("tie_word_embeddings", False) is tie:
        return config
    return {**config, "text_config": {**inner, "tie_word_embeddings": tie}}


def text_config(config: dict) -> dict:
    """The language model's part of a (possibly multimodal) config."""
    inner = config.get("text_config")
    return inner if isinstance(inner, dict) else config


def refuse_odd_text_config(path: Path, config: dict) -> None:
    """Refuses (``incompatible``), naming what it holds, a ``text_config`` that is no object, a
    null, absent or empty one where the model_type keeps its language model there (transformers would
    build its default language model instead of this checkpoint's), and an object one where the
    model_type is text-only (transformers fails to build that model)."""
    model_type = config.get("model_type")
    text_type = _text_model_type(model_type)
    inner = config.get("text_config")
    if isinstance(inner, dict):
        if text_type is not None and inner:
            return
        if text_type is not None:  # transformers fills an empty one with its default language model
            raise CheckpointError("incompatible", f"{path}: config.json text_config is an empty object; a {model_type} "
                                  "config holds its language model's settings there (without them transformers builds "
                                  f"its default language model, not this checkpoint's; a text-only config is model_type "
                                  f"{text_type})")
        holders = [t for t in MODEL_TYPES if _text_model_type(t) == model_type]
        instead = f", or set model_type {holders[0]} for a multimodal config" if holders else ""
        raise CheckpointError("incompatible", f"{path}: config.json has a text_config object, but a {model_type} config "
                              "is text-only, its language model's settings at its top level (transformers fails to "
                              f"build a model from it); remove text_config{instead}")
    if inner is not None:
        raise CheckpointError("incompatible", f"{path}: config.json text_config holds {_shown(inner)}; it must be an "
                              "object, the language model's config")
    if text_type is None:
        return
    said = "text_config is null;" if "text_config" in config else "has no text_config;"
    raise CheckpointError("incompatible", f"{path}: config.json {said} a {model_type} config holds its language "
                          "model's settings there (without them transformers builds its default language model, "
                          f"not this checkpoint's; a text-only config is model_type {text_type})")


def refuse_top_level_rope(path: Path, config: dict) -> None:
    """Refuses (``incompatible``), in one line of its own, a multimodal config whose top-level rope
    setting transformers cannot build from (a yarn, llama3 or longrope one, whose checks read fields
    that top level lacks), where transformers' own words name no rope; runs after
    ``refuse_odd_text_config``. One it builds (linear, dynamic) scales nothing and passes."""
    model_type = config.get("model_type")
    fields = [field for field in ("rope_scaling", "rope_parameters") if config.get(field)]
    if not fields or _text_model_type(model_type) is None or _builds(config):
        return
    if not _builds({k: v for k, v in config.items() if k not in fields}):
        return  # something else fails too: model_tensors names it in transformers' words
    rope = config[fields[0]]
    rope_type = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    raise CheckpointError("incompatible", f"{path}: config.json has {fields[0]} ({rope_type} rope) at its top level; "
                          f"a {model_type} checkpoint's rope settings belong in text_config, its language model's "
                          "config, where transformers reads them (text_config.rope_parameters): move them there")


def _builds(config: dict) -> bool:
    """Whether transformers makes a config object of ``config`` (its checks pass)."""
    try:
        hf_config(config)
    except Exception:  # transformers' checks raise KeyError, AttributeError, ValueError...
        return False
    return True


def _text_model_type(model_type: str) -> str | None:
    """The model_type of the language model a multimodal model_type keeps in ``text_config``; None for a text-only one."""
    from transformers import CONFIG_MAPPING

    text_class = getattr(CONFIG_MAPPING[model_type], "sub_configs", {}).get("text_config")
    return None if text_class is None else text_class.model_type


def context_length(config: dict, default_positions: int = 0, path: Path | None = None) -> int:
    """Longest sequence the config's positions allow: ``max_position_embeddings`` of the language
    model's config (``default_positions`` where it has none, whatever a multimodal top level says), or
    with its yarn rope scaling ``factor * original_max_position_embeddings`` when that is larger. A field that bounds nothing (0, negative, not a number) is refused
    (``incompatible``, naming it and its value), never read as its default or as no bound at all;
    a ``max_position_embeddings`` of 0 or less only where yarn's two fields bound the context. So
    is a rope scaling ``factor`` that is no number above 0 (``SCALED_ROPE``)."""
    where = f"{path}: " if path is not None else ""
    text = text_config(config)
    prefix = "text_config." if text is not config else ""
    if "max_position_embeddings" in text:
        base, base_field = text["max_position_embeddings"], prefix + "max_position_embeddings"
    else:  # transformers builds the language model from text_config alone: a multimodal top level's bounds nothing
        base, base_field = default_positions, None
    if base_field is not None and not _is_int(base):
        raise CheckpointError("incompatible", f"{where}config.json {base_field} is {_shown(base)}; it must be a "
                              "positive integer, the longest sequence the model's positions allow")
    rope, rope_field = {}, ""
    for field in ("rope_scaling", "rope_parameters"):  # a multimodal top level's scales nothing transformers builds
        if text.get(field):
            rope, rope_field = text[field], prefix + field
            break
    rope_type = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    if rope_type in SCALED_ROPE:
        factor = rope.get("factor")
        if (factor is not None or rope_type != "yarn") and not (_is_number(factor) and 0 < factor < math.inf):
            raise CheckpointError("incompatible", f"{where}config.json {rope_field}.factor is {_shown(factor)}; it "
                                  f"must be a number above 0 ({rope_type} rope's scaling of the positions)")
    yarn = rope_type == "yarn"
    if yarn:
        original, factor = rope.get("original_max_position_embeddings"), rope.get("factor")
        if original is not None and not (_is_int(original) and original > 0):
            raise CheckpointError("incompatible", f"{where}config.json {rope_field}.original_max_position_embeddings "
                                  f"is {_shown(original)}; it must be a positive integer (yarn's pre-scaling context)")
        if original is not None and factor is not None:  # the two bound the context whatever the base says
            return max(base, int(factor * original))
    if base_field is not None and base <= 0:
        raise CheckpointError("incompatible", f"{where}config.json {base_field} is {_shown(base)}; it must be a "
                              "positive integer, the longest sequence the model's positions allow (0 or less would "
                              "bound no sequence)")
    if not yarn:
        return base
    original = rope.get("original_max_position_embeddings") or base
    factor = rope.get("factor") or (base / original if original else 1.0)
    return max(base, int(factor * original))


# Rope types whose frequencies ``factor`` scales (yarn's may be left out): 0 divides by zero, a negative
# one or no number is no scaling.
SCALED_ROPE = ("linear", "dynamic", "yarn", "llama3")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is no length


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _shown(value) -> str:
    """``value`` as config.json writes it (null, true, "text"), with its JSON type."""
    kind = {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}.get(type(value))
    text = json.dumps(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    return f"{text} ({kind})" if kind else text


def config_default_positions(config: dict) -> int:
    """The ``max_position_embeddings`` transformers gives a language model config without one (the model is built with it)."""
    if "max_position_embeddings" in text_config(config):
        return 0
    return int(getattr(hf_config(config).get_text_config(), "max_position_embeddings", 0) or 0)


def quantization_method(path: Path, config: dict) -> str | None:
    quant = config.get("quantization_config") or text_config(config).get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method != "fp8":
        raise CheckpointError(
            "unsupported",
            f"{path}: quantization_config.quant_method {method!r} is not supported; packscore loads unquantized "
            "checkpoints and FP8 block-scaled ones (quant_method 'fp8', dequantized at load)",
        )
    block = quant.get("weight_block_size")
    if block is not None and (not isinstance(block, list) or len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block)):
        raise CheckpointError("unsupported", f"{path}: FP8 weight_block_size must be two positive integers, got {block!r}")
    return "fp8"


def fp8_block_size(config: dict) -> tuple[int, int] | None:
    """The FP8 scaling block ``(rows, cols)`` of the config, or None for one scale per tensor."""
    quant = config.get("quantization_config") or text_config(config).get("quantization_config") or {}
    block = quant.get("weight_block_size")
    return (int(block[0]), int(block[1])) if block else None


# The model the config builds.


def hf_config(config: dict):
    """transformers' config object for a config.json dict, its quantization left out (FP8 weights
    are dequantized at load: the model is the unquantized one)."""
    from transformers import AutoConfig

    plain = {k: v for k, v in config.items() if k != "quantization_config"}
    if isinstance(plain.get("text_config"), dict):
        plain["text_config"] = {k: v for k, v in plain["text_config"].items() if k != "quantization_config"}
    return AutoConfig.for_model(plain.pop("model_type"), **plain)


def build_meta_model(config: dict):
    """The Hugging Face causal LM the config describes, on the meta device (no memory, no data).

    Built in the default dtype: given the config's, transformers would set torch's default dtype
    for the whole process meanwhile, under a model serving in another thread (a weight update
    checks its checkpoint with this), whose new tensors and compiled functions would see it.
    """
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config(config), dtype=None)


def model_tensors(path: Path, config: dict) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """The model's tensor names -> shapes, one name per tensor, and its tied aliases -> that name."""
    try:
        needed, aliases = _tensors_of_config(json.dumps(_without(config, _BUILD_NEUTRAL_FIELDS), sort_keys=True))
    except Exception as exc:  # a config transformers cannot build a model from
        reason = " ".join(str(exc).split())  # transformers' validation errors span lines: the CLI prints one
        raise CheckpointError("incompatible", f"{path}: config.json does not describe a buildable model: {reason}") from None
    return dict(needed), dict(aliases)


# Fields that never change the model built (it is built in the default dtype): left out of the key.
_BUILD_NEUTRAL_FIELDS = frozenset({"dtype", "torch_dtype", "transformers_version", "_name_or_path"})


def _without(config: dict, fields: frozenset) -> dict:
    """``config`` without ``fields``, at its top level and in its sub-models' configs (``text_config``...)."""
    return {k: _without(v, fields) if isinstance(v, dict) and k.endswith("_config") and k != "quantization_config" else v
            for k, v in config.items() if k not in fields}


# Kept per config: a weight update's checkpoint usually has the served one's config, and building
# a model holds the GIL for the whole build, in which the forwards beside it stop.
@lru_cache(maxsize=16)
def _tensors_of_config(config_json: str) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    model = build_meta_model(json.loads(config_json))
    needed: dict[str, tuple[int, ...]] = {}
    aliases: dict[str, str] = {}
    first_name: dict[int, str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        owner = first_name.setdefault(id(tensor), name)
        if owner == name:
            needed[name] = tuple(tensor.shape)
        else:
            aliases[name] = owner  # a tied weight (lm_head.weight tied to the embedding)
    return needed, aliases


# Settings packscore's forward does not compute as Hugging Face's: refused, never scored otherwise.

SILU_ACTIVATIONS = ("silu", "swish")  # what the packed delta-rule conv and the MoE experts compute
PER_SEQUENCE_ROPE = ("longrope",)  # Hugging Face picks their frequencies by each sequence's own length


def refuse_other_forward_settings(path: Path, config: dict, kind: str = "unsupported") -> None:
    """Refuses (``kind``), naming the field, a config whose forward packscore would not
    compute as Hugging Face's does; runs on a config that ``model_tensors`` has built a model from."""
    text = hf_config(config)
    text = text.get_text_config() if hasattr(text, "get_text_config") else text
    kinds = list(text.layer_types or ())
    unknown = sorted({str(k) for k in kinds if k not in LAYER_KINDS})
    if unknown:
        raise CheckpointError(kind, f"{path}: layer_types holds {quoted_names(repr(k) for k in unknown)}; "
                              f"packscore runs {' and '.join(LAYER_KINDS)} layers only")
    act = getattr(text, "hidden_act", "silu")
    # A dense MLP runs Hugging Face's own module, any activation; the delta-rule conv and the experts are SiLU only.
    if act not in SILU_ACTIVATIONS and ("linear_attention" in kinds or (getattr(text, "num_experts", 0) or 0) > 0):
        raise CheckpointError(kind, f"{path}: hidden_act {act!r} is not supported: packscore's linear-attention "
                              f"convolution and MoE experts compute SiLU, as Hugging Face does for hidden_act 'silu'")
    rope = text.rope_parameters if isinstance(getattr(text, "rope_parameters", None), dict) else {}
    per_kind = [v for v in rope.values() if isinstance(v, dict)] or [rope]  # rope_parameters may be keyed by layer type
    for params in per_kind:
        if params.get("rope_type") in PER_SEQUENCE_ROPE:
            raise CheckpointError(kind, f"{path}: rope_parameters rope_type {params['rope_type']!r} is not "
                                  "supported: Hugging Face picks its frequencies by each sequence's length, which a "
                                  "packed row or a shared prefix does not have")


# Config fields that never change a scored number: names, token ids, output switches, storage
# dtype, training-only settings, and the context length (which only bounds what is admitted).
_FORWARD_NEUTRAL_FIELDS = frozenset({
    "_name_or_path", "architectures", "model_type", "transformers_version", "dtype", "torch_dtype",
    "bos_token_id", "eos_token_id", "pad_token_id", "id2label", "label2id", "problem_type", "return_dict",
    "output_attentions", "output_hidden_states", "output_router_logits", "use_cache", "is_encoder_decoder",
    "chunk_size_feed_forward", "initializer_range", "router_aux_loss_coef", "max_position_embeddings",
    "quantization_config", "transformers_weights",  # which files hold the weights: packscore names them itself
})


def forward_settings(config) -> dict:
    """The text model's settings that shape its forward (a Hugging Face config object or a
    config.json dict), normalised by transformers' own config class so that defaults compare."""
    if isinstance(config, dict):
        config = hf_config(config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return {k: v for k, v in text.to_dict().items() if k not in _FORWARD_NEUTRAL_FIELDS}


def refuse_other_forward(path: Path, served_config, new_config: dict) -> None:
    """A weight update keeps the served model's code and config: refuses (``incompatible``) a
    checkpoint whose config.json would compute otherwise (a norm's epsilon, rope, activation,
    routing), whose weights would then be scored under the old settings. ``new_config`` has
    passed ``check_checkpoint``, which built a model from it."""
    if served_config is None:
        return
    new = forward_settings(new_config)
    served = forward_settings(served_config)
    differ = [f"{k} {served.get(k)!r} -> {new.get(k)!r}" for k in sorted(served.keys() | new.keys()) if served.get(k) != new.get(k)]
    if differ:
        raise CheckpointError("incompatible", f"{path}: config.json computes otherwise than the served model's ({quoted_names(differ)}); "
                              "an update swaps weights only: serve a changed config by restarting with it")
