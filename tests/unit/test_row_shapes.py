"""Shapes the GPU path runs at: attention buckets (bounded SDPA plans) and the row minimum
(no short-row GEMM kernels). Their numerical exactness is checked on the GPU
(tests/gpu/test_kernels.py, tests/gpu/test_isolation.py); here, the arithmetic of the shapes."""

import pytest
import torch

from model_runtime.kernels.attention import ATTENTION_MIN_BUCKET, attention_bucket, attention_buckets
from model_runtime.model.packing import PackedBatch
from model_runtime.scoring.head import CUDA_MIN_ROW_TOKENS, min_row_tokens


@pytest.mark.parametrize("length", [1, 2, 255, 256, 257, 300, 1000, 2047, 2048, 2049, 3000, 17237, 65535, 65536])
def test_attention_bucket_covers_the_length_with_little_waste(length):
    bucket = attention_bucket(length)
    assert bucket >= length
    if length > ATTENTION_MIN_BUCKET:
        assert bucket - length < max(ATTENTION_MIN_BUCKET, length // 16 + 1), (length, bucket)
    assert attention_bucket(bucket) == bucket  # a bucket is its own bucket


def test_attention_buckets_are_few_and_cover_every_length():
    buckets = attention_buckets(65536)
    assert len(buckets) <= 96
    assert buckets == sorted(set(buckets))
    assert all(attention_bucket(n) in buckets for n in range(1, 65537, 97))


def test_row_minimum_pads_short_rows_on_cuda_only():
    assert min_row_tokens("cpu") == 0
    assert min_row_tokens("cuda") == CUDA_MIN_ROW_TOKENS
    assert min_row_tokens(torch.device("cuda"), shards=4) == 4 * CUDA_MIN_ROW_TOKENS
    for lengths in [(5,), (3, 7), (600,), (512,), (100, 411)]:
        packed, pad = PackedBatch.from_lengths_padded(lengths, 16, minimum=512)
        total = sum(lengths)
        assert packed.total_tokens == max(512, total + (-total) % 16)
        assert pad == packed.total_tokens - total
        assert len(packed.segment_bounds) == len(lengths) + (pad > 0)  # the padding is a segment of its own
