"""The benchmark's workload: GRPO groups that share a prompt, realistic RL lengths, fixed seed.

256 sequences in groups of 8. Prompt lengths are log-normal with median 600 and sigma 1.0
(natural log) clipped to 64..4096, one per group; response lengths are log-normal with
median 1500 and sigma 1.0 clipped to 16..16384, one per sequence. Scoring starts at the
response (``score_from`` = prompt length) and entropy is on. Token ids are uniform random.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from model_runtime.types import SequenceInput


@dataclass(frozen=True)
class WorkloadSpec:
    num_sequences: int = 256
    group_size: int = 8
    prompt_median: float = 600.0
    prompt_clip: tuple[int, int] = (64, 4096)
    response_median: float = 1500.0
    response_clip: tuple[int, int] = (16, 16384)
    sigma: float = 1.0
    seed: int = 0


def _lognormal(rng: np.random.Generator, median: float, sigma: float, clip: tuple[int, int], n: int) -> np.ndarray:
    values = np.exp(np.log(median) + sigma * rng.standard_normal(n))
    return np.clip(np.rint(values), clip[0], clip[1]).astype(np.int64)


def grpo_workload(vocab_size: int, spec: WorkloadSpec = WorkloadSpec()) -> list[SequenceInput]:
    """The sequences, group by group (the 8 members of a group share their prompt tokens)."""
    if spec.num_sequences % spec.group_size:
        raise ValueError(f"num_sequences ({spec.num_sequences}) must be a multiple of group_size ({spec.group_size})")
    rng = np.random.default_rng(spec.seed)
    groups = spec.num_sequences // spec.group_size
    prompt_lengths = _lognormal(rng, spec.prompt_median, spec.sigma, spec.prompt_clip, groups)
    response_lengths = _lognormal(rng, spec.response_median, spec.sigma, spec.response_clip, spec.num_sequences)
    sequences = []
    for g in range(groups):
        prompt = rng.integers(0, vocab_size, prompt_lengths[g])
        for j in range(spec.group_size):
            response = rng.integers(0, vocab_size, response_lengths[g * spec.group_size + j])
            ids = np.concatenate([prompt, response])
            sequences.append(SequenceInput(ids, score_from=int(prompt_lengths[g]), return_entropy=True))
    return sequences


def describe(sequences: list[SequenceInput]) -> dict:
    lengths = np.array([s.length for s in sequences])
    scored = np.array([s.num_scored for s in sequences])
    # a group's members follow each other and start scoring at the prompt's end (grpo_workload)
    prompts = np.array([s.score_from for s in sequences])
    firsts = np.ones(len(sequences), bool)
    firsts[1:] = [a.input_ids[: a.score_from].tobytes() != b.input_ids[: b.score_from].tobytes()
                  for a, b in zip(sequences, sequences[1:])]
    return {
        "sequences": int(len(sequences)),
        # prompt tokens a group's later members repeat: what sharing whole prompts would not run
        "repeated_prompt_fraction": float(prompts[~firsts].sum() / lengths.sum()),
        "tokens": int(lengths.sum()),
        "scored_tokens": int(scored.sum()),
        "mean_length": float(lengths.mean()),
        "median_length": float(np.median(lengths)),
        "max_length": int(lengths.max()),
        "min_length": int(lengths.min()),
    }
