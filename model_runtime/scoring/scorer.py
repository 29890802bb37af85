"""In-process scorer: sequences plus options in, per-sequence numpy arrays out.

The HTTP service and the offline CLI call ``Scorer.score_row`` (in one process, through
``LocalBackend``: one row their scheduler packed at a time); ``Scorer.score`` (the benchmarks)
packs its sequences into rows of at most ``max_batch_tokens`` tokens (first-fit decreasing) and
runs one packed forward per row. A sequence's numbers never depend on which others share its row.

With ``prefix_min_tokens`` > 0, sequences of a row that share at least that many leading tokens
(a GRPO group's prompt) run them once (``model_runtime.scoring.prefix``), and ``score`` keeps a
group in one row where the budget allows.

Legend: T = tokens in the packed row, D = hidden size, N = scored positions (the head's rows).
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

import numpy as np
import torch

from model_runtime.model.packing import pack_first_fit_decreasing, upload
from model_runtime.scoring.head import (
    BYTES_PER_LOGIT,
    HeadOutput,
    ROW_MULTIPLE,
    chunk_tokens_for_budget,
    fused_chunk_tokens,
    min_row_tokens,
    score_positions,
)
from model_runtime.scoring.loading import LoadedModel
from model_runtime.scoring.prefix import pack_groups_first_fit
from model_runtime.scoring.rows import plan_row, split_results, validate_sequence
from model_runtime.types import MAX_TOP_K, SequenceInput, SequenceScores


class Scorer:
    """Scores sequences with a loaded packed model on its device.

    Example:
        >>> scorer = Scorer(load_model("tiny"))
        >>> out = scorer.score([SequenceInput(np.array([1, 2, 3, 4]), score_from=2)])
        >>> out[0].logprobs.shape
        (2,)
    """

    # The head's memory cap on CUDA (docs/kernels.md, Head): one chunk of bf16 logits plus its hidden
    # rows; the head's budget is 1 GiB at 64k tokens, and 768 MiB leaves room for allocator rounding.
    CUDA_HEAD_CAP_BYTES = 768 << 20

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        max_batch_tokens: int = 16384,
        head_budget_bytes: int | None = None,
        prefix_min_tokens: int = 0,
    ):
        self.loaded = loaded
        self.max_batch_tokens = int(max_batch_tokens)
        self.prefix_min_tokens = int(prefix_min_tokens)  # 0: every sequence runs whole
        # Which members of a group may share their prompt without a number moving: on the GPU
        # measured before the first shared row (``rounding_in_use``); None on the CPU shares among
        # all members (set ``RowRounding.exact`` to do that on the GPU).
        self.prefix_rounding = None
        # Rows a narrow product may span with the ``runs`` backend (``narrow_runs_in_use``).
        self.narrow_runs: dict[str, int] | None = None
        # score() queues a row before reading the last back; False reads each back first (the
        # benchmark times both).
        self.queue_ahead = True
        self.logprob_fn = loaded.backends.fn("head")
        self._fixed_head_budget = head_budget_bytes
        if head_budget_bytes is None:
            head_budget_bytes = self.CUDA_HEAD_CAP_BYTES if loaded.device.type == "cuda" else 256 << 20
        self.set_head_budget(head_budget_bytes)
        self.warm_up_seconds: float | None = None
        self.warm_up_steps: dict[str, float] = {}

    def set_head_budget(self, budget_bytes: int) -> None:
        """Sizes the head's chunks: ``head_chunk_tokens`` positions per vocabulary product (every
        row, top-k or not, so a position's logits never depend on its neighbours' options) and
        ``head_chunk_tokens_top_k`` positions per ranking pass (those hold float32 copies). With
        the fused kernel, ranking gets a quarter of the budget beside the chunk's logits."""
        vocab = self.loaded.vocab_size
        self.head_budget_bytes = int(budget_bytes)
        if self.loaded.backends.head == "torch":
            self.head_chunk_tokens = chunk_tokens_for_budget(vocab, budget_bytes, BYTES_PER_LOGIT)
            self.head_chunk_tokens_top_k = self.head_chunk_tokens
        else:
            hidden = self.loaded.model.lm_head.weight.shape[1]
            itemsize = self.loaded.model.lm_head.weight.element_size()
            self.head_chunk_tokens = fused_chunk_tokens(vocab, hidden, budget_bytes, itemsize)
            self.head_chunk_tokens_top_k = chunk_tokens_for_budget(vocab, budget_bytes // 4, BYTES_PER_LOGIT)

    def head(self, hidden_TD, weight_VD, targets_N, temperature_N, *, top_k: int, rows_N) -> HeadOutput:
        """``score_positions`` with this scorer's chunks and head kernel."""
        return score_positions(
            hidden_TD,
            weight_VD,
            targets_N,
            temperature_N,
            top_k=top_k,
            chunk_tokens=self.head_chunk_tokens,
            top_k_rows=self.head_chunk_tokens_top_k,
            rows_N=rows_N,
            logprob_fn=self.logprob_fn,
        )

    def size_head_from_free_memory(self, fraction: float = 0.25) -> None:
        """On CUDA, shrinks the head's budget to ``fraction`` of the memory still free (measured
        after a full-budget forward), never above ``CUDA_HEAD_CAP_BYTES``. A budget given to the
        constructor is kept as it is."""
        if self.loaded.device.type != "cuda" or self._fixed_head_budget is not None:
            return
        free, _ = torch.cuda.mem_get_info(self.loaded.device)
        reserved_idle = torch.cuda.memory_reserved(self.loaded.device) - torch.cuda.memory_allocated(self.loaded.device)
        self.set_head_budget(min(self.CUDA_HEAD_CAP_BYTES, int(fraction * (free + reserved_idle))))

    def warm_up(self) -> None:
        """Runs the shapes the service will see so kernels compile and autotune before readiness.

        On CUDA: one sequence filling the token budget (the largest activations: sizes the head
        from the memory left), a row of many short sequences (fla's varlen index paths, many
        segments in attention), a top-k pass, and one-sequence rows of 1, 17 and 300 tokens (the
        shapes of idle requests; small sizes are their own compiled variants).
        With prefix sharing, also where the narrow products round by row count
        (``measure_prefix_rounding``) and a row of one group (the kernels' variants with initial
        states).
        On CPU: one short pass (nothing to compile).
        """
        import time

        started = time.perf_counter()
        rng = np.random.default_rng(0)
        vocab = self.loaded.vocab_size
        if self.loaded.device.type != "cuda":
            self.score_row([SequenceInput(rng.integers(0, vocab, 16), top_k=1)])
            self.warm_up_seconds = time.perf_counter() - started
            return
        budget = self.max_batch_tokens
        steps: dict[str, float] = {}

        def step(name: str, fn) -> None:
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize(self.loaded.device)
            steps[name] = time.perf_counter() - t0

        step("the narrow products' runs", self.narrow_runs_in_use)  # before the first row, which would measure it
        step("one sequence of the budget", lambda: self.score_row([SequenceInput(rng.integers(0, vocab, budget), score_from=1)]))
        self.size_head_from_free_memory()
        short = [SequenceInput(rng.integers(0, vocab, 64), score_from=8) for _ in range(max(1, budget // 64))]
        step("many short sequences", lambda: self.score_row(short))
        step("top-k", lambda: self.score_row([SequenceInput(rng.integers(0, vocab, 512), top_k=MAX_TOP_K) for _ in range(2)]))
        for n in (1, 17, 300):
            step(f"{n} tokens", lambda n=n: self.score_row([SequenceInput(rng.integers(0, vocab, n), score_from=1)]))
        step("attention plans", self.warm_attention_plans)
        if self.prefix_min_tokens:
            step("the narrow products' rounding by row count", self.rounding_in_use)  # unless measured already
            step("a shared prefix", lambda: self.score_row(shared_prefix_row(rng, vocab, self.prefix_min_tokens)))
        # Where start-up time goes (compilation and autotuning are in the first step that needs them).
        self.warm_up_steps = steps
        self.warm_up_seconds = time.perf_counter() - started

    def rounding_in_use(self):
        """The ``RowRounding`` groups are cut by: on CUDA with sharing on, measured first if no
        one has (``measure_prefix_rounding``), so that a scorer never shares a prompt among members
        whose lengths compute it differently; None on the CPU."""
        if self.prefix_rounding is None and self.prefix_min_tokens and self.loaded.device.type == "cuda":
            self.measure_prefix_rounding()
        return self.prefix_rounding

    def narrow_runs_in_use(self) -> dict[str, int]:
        """With the ``runs`` gate-projection backend on CUDA, how many rows one narrow product may
        span, by module (``rounding.prepare_runs``, measured before the first row); empty
        elsewhere, where every narrow product runs per segment."""
        if self.narrow_runs is None:
            from model_runtime.scoring.rounding import runs_in_use

            self.narrow_runs = runs_in_use(self.loaded, self.max_batch_tokens)
        return self.narrow_runs

    def measure_prefix_rounding(self) -> None:
        """On CUDA, where the narrow products round a prompt's rows by the sequence's length
        (``model_runtime.scoring.rounding``): groups are then cut there, and a shared prompt gives
        every member the numbers it gets alone, bit for bit."""
        from model_runtime.scoring.rounding import measure

        if self.loaded.device.type == "cuda":
            self.prefix_rounding = measure(self.loaded.model, self.max_batch_tokens)

    def warm_attention_plans(self) -> None:
        """Builds SDPA's plan for every attention bucket of the budget (some eighty, ~60 ms each
        on the H200), so no request pays for one (``kernels.attention.sdpa_causal``). cuDNN keeps
        plans per thread: call it on the thread that runs the forwards (the server runs the
        whole warm-up there)."""
        from model_runtime.kernels.attention import (
            attention_buckets,
            causal_attention_sdpa,
            causal_attention_sdpa_fused,
            sdpa_causal,
        )

        device, dtype = self.loaded.device, self.loaded.model.lm_head.weight.dtype
        shapes = {(m.num_heads, m.num_kv_heads, m.head_dim, m.scaling) for m in self.loaded.model.modules()
                  if getattr(m, "attention_fn", None) in (causal_attention_sdpa, causal_attention_sdpa_fused)}
        for heads, kv_heads, head_dim, scale in shapes:
            for length in attention_buckets(self.max_batch_tokens):
                q = torch.zeros(1, heads, length, head_dim, device=device, dtype=dtype)
                kv = torch.zeros(1, kv_heads, length, head_dim, device=device, dtype=dtype)
                sdpa_causal(q, kv, kv, scale, heads // kv_heads)

    def score(self, sequences: Sequence[SequenceInput]) -> list[SequenceScores]:
        """Scores any number of sequences; results come back in input order.

        Each row is queued on the device before the previous row's results are read back, so the
        host's work between rows (planning, uploads, splitting results) overlaps the GPU's."""
        for i, seq in enumerate(sequences):
            validate_sequence(seq, self.loaded.vocab_size, i)
        results: list[SequenceScores | None] = [None] * len(sequences)
        if self.prefix_min_tokens:
            rows = pack_groups_first_fit(sequences, self.max_batch_tokens, self.prefix_min_tokens, self.rounding_in_use())
        else:
            rows = pack_first_fit_decreasing([s.length for s in sequences], self.max_batch_tokens)
        # Rows queued on the device and not yet read back: one behind the row being read (none
        # without queue_ahead).
        queued: deque[tuple[list[int], PendingRow]] = deque()
        for row in rows:
            queued.append((row, self.queue_row([sequences[i] for i in row], validated=True)))
            while len(queued) > (1 if self.queue_ahead else 0):
                self._collect(*queued.popleft(), results)
        while queued:
            self._collect(*queued.popleft(), results)
        return results  # type: ignore[return-value]

    @staticmethod
    def _collect(row: list[int], pending: "PendingRow", results: list) -> None:
        for i, scores in zip(row, pending.results()):
            results[i] = scores

    def score_row(self, sequences: Sequence[SequenceInput], *, validated: bool = False) -> list[SequenceScores]:
        """Scores ``sequences`` in exactly one packed forward, whatever their total length."""
        return self.queue_row(sequences, validated=validated).results()

    @torch.inference_mode()
    def queue_row(self, sequences: Sequence[SequenceInput], *, validated: bool = False) -> "PendingRow":
        """Queues one packed forward of ``sequences`` and the copy of its results to the host;
        ``.results()`` on the returned row waits for them. On a GPU nothing here waits for the
        device, so the next row can be queued behind this one."""
        if not validated:
            for i, seq in enumerate(sequences):
                validate_sequence(seq, self.loaded.vocab_size, i)
        self.narrow_runs_in_use()
        plan = plan_row(sequences, self.prefix_min_tokens, self.rounding_in_use())
        device = self.loaded.device
        # A padding segment (never scored) makes T a multiple of ROW_MULTIPLE: every matrix
        # product then computes a token's row the same way whatever its neighbours (on CPU), and
        # T >= 2 keeps torch.compile from specialising a one-token row mid-request (on CUDA).
        # On CUDA rows are also at least CUDA_MIN_ROW_TOKENS long (see there).
        packed, ids_T = plan.padded_row(ROW_MULTIPLE, device, minimum=min_row_tokens(device))
        targets_N = upload(torch.from_numpy(plan.targets_N), device)
        temperature_N = upload(torch.from_numpy(plan.temperature_N), device)
        rows_N = upload(torch.from_numpy(plan.positions_N), device)
        hidden_TD = self.loaded.model(upload(torch.from_numpy(ids_T), device), packed)
        head = self.head(hidden_TD, self.loaded.model.lm_head.weight, targets_N, temperature_N, top_k=plan.top_k,
                         rows_N=rows_N)
        return PendingRow(list(sequences), plan.top_k, plan.expand(head))


class PendingRow:
    """A queued row's results on their way to the host: on a GPU, copied into pinned memory
    behind the row's own kernels; ``results()`` waits for that copy alone, not for rows queued
    after it."""

    def __init__(self, sequences: list[SequenceInput], top_k: int, head: HeadOutput):
        self.sequences, self.top_k = sequences, top_k
        self._done = None
        if head.logprobs_N.is_cuda:
            ids = None if head.top_k_ids_NK is None else head.top_k_ids_NK.to(torch.int32)  # half the bytes to copy
            head = HeadOutput(*(None if t is None else _to_pinned(t)
                                for t in (head.logprobs_N, head.entropy_N, ids, head.top_k_logprobs_NK)))
            self._done = torch.cuda.Event()
            self._done.record()
        self._head = head

    def results(self) -> list[SequenceScores]:
        if self._done is not None:
            self._done.synchronize()
        return split_results(self.sequences, self._head, self.top_k)


def _to_pinned(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def shared_prefix_row(rng: np.random.Generator, vocab: int, min_tokens: int, members: int = 4) -> list[SequenceInput]:
    """A warm-up row: ``members`` sequences sharing a prompt long enough to be shared."""
    prompt = rng.integers(0, vocab, max(min_tokens, 64) + 200)
    return [
        SequenceInput(np.concatenate([prompt, rng.integers(0, vocab, 100 + 37 * i)]), score_from=prompt.size)
        for i in range(members)
    ]
