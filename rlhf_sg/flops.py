"""Each phase of a step against what the machine can do: model FLOPs, bytes read, and the ceilings they are held to.

Counts (per step, from the packed layout the step ran; only real tokens, never padding):

* A *segment* is what one packed sequence computes: a prompt of ``P`` tokens and the responses that attend to it,
  ``(P, [r_1, ..., r_k])``. Without shared prompts every row is its own segment ``(P, [r])``; with shared prompts
  the rows of one prompt in one micro-batch form segments as :func:`rlhf_sg.packing.shared_prompt_segments` cuts
  them, so a prompt counts once per segment.
* Tokens of a segment: ``T = P + sum r_j``. Attention context pairs (key positions each query attends to, causal):
  ``C = P (P + 1) / 2 + sum_j (P r_j + r_j (r_j + 1) / 2)``.
* Forward FLOPs (a multiply-add is 2 FLOPs): ``2 N_body T + 2 N_head H + 4 n_layers d_q C`` where ``N_body`` is
  the matmul weights of the decoder layers (q, k, v, o and the MLP's three projections; not embeddings, norms,
  biases), ``d_q = n_heads x head_dim`` (``Q K^T`` and ``A V``: 2 x 2 d_q FLOPs per pair per layer), ``N_head`` the
  output head's weights (lm_head ``vocab x hidden``, or a value head's ``hidden``) and ``H`` the tokens it is
  applied to: the log-prob forwards apply the lm_head only at the response tokens' predictors (``H = sum r``).
* Training: 3 x forward (backward = 2 x forward), whatever gradient checkpointing recomputes (the convention of
  model-FLOPs utilisation: recomputation is not useful work).
* Generation (bytes read): each decoded token reads the KV of every token before it, ``kv_bytes_per_token`` of
  :mod:`rlhf_sg.memory` each (``P + j`` tokens for response token ``j``), and each decode step reads the
  weights once per engine: ``engines x max r x weight bytes + kv_bytes_per_token x sum_rows (r P + r (r - 1) / 2)``.
  A lower bound: activations, logits and the prefill's compute are not counted.

Ceilings (:class:`Ceiling`): on CUDA the device's dense peak for the model dtype and its memory bandwidth from
:data:`GPU_PEAKS` (the vendors' datasheets, no sparsity), overridable with ``--perf.peak_tflops`` /
``--perf.peak_bandwidth_gbs``; on CPU measured once (:func:`measure_cpu_ceiling`): a GEMM at the model's MLP shape
and dtype with the ranks' threads, and a large tensor copy (bytes read + written over the time). A phase that
runs on several ranks or devices is held to that many ceilings.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlhf_sg.memory import ModelShape, kv_bytes_per_token, weight_bytes

#: dense peak TFLOP/s per dtype and memory bandwidth (GB/s) of common devices, by a piece of the name
#: ``torch.cuda.get_device_name()`` returns (the first match wins: specific names first). float32 is the
#: non-tensor-core rate (torch's default matmul precision); bfloat16 / float16 the dense tensor-core rate.
GPU_PEAKS: tuple[tuple[str, dict[str, float], float], ...] = (
    ("H100 PCIe", {"bfloat16": 756.0, "float16": 756.0, "float32": 51.0}, 2000.0),
    ("H100 NVL", {"bfloat16": 835.0, "float16": 835.0, "float32": 60.0}, 3900.0),
    ("H100", {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0}, 3350.0),  # SXM5 80GB HBM3
    ("H200", {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0}, 4800.0),
    ("A100-SXM4-40GB", {"bfloat16": 312.0, "float16": 312.0, "float32": 19.5}, 1555.0),
    ("A100-PCIE-40GB", {"bfloat16": 312.0, "float16": 312.0, "float32": 19.5}, 1555.0),
    ("A100 80GB PCIe", {"bfloat16": 312.0, "float16": 312.0, "float32": 19.5}, 1935.0),
    ("A100", {"bfloat16": 312.0, "float16": 312.0, "float32": 19.5}, 2039.0),  # SXM4 80GB
    ("L40S", {"bfloat16": 362.0, "float16": 362.0, "float32": 91.6}, 864.0),
    ("B200", {"bfloat16": 2250.0, "float16": 2250.0, "float32": 75.0}, 8000.0),
)


@dataclass(frozen=True)
class Ceiling:
    """What one rank's device can do: ``tflops`` (dense matmul, TFLOP/s, at the model's dtype) and ``gbs`` (memory
    bandwidth, GB/s); ``source`` says where the figures come from."""

    tflops: float
    gbs: float
    source: str

    def describe(self) -> str:
        return f"{self.tflops:.3g} TFLOP/s, {self.gbs:.4g} GB/s ({self.source})"


def gpu_ceiling(device_name: str, dtype: str, peak_tflops: float | None = None,
                peak_bandwidth_gbs: float | None = None) -> Ceiling | None:
    """The table's peaks for ``device_name`` at ``dtype``; a flag given wins. None when the device is not in the
    table and no flag gives the missing figure."""
    flops, gbs, source = peak_tflops, peak_bandwidth_gbs, "--perf flags"
    for piece, peaks, bandwidth in GPU_PEAKS:
        if piece.lower() in device_name.lower():
            flops = flops if flops is not None else peaks.get(dtype)
            gbs = gbs if gbs is not None else bandwidth
            source = f"{device_name}: datasheet peak for {dtype}" + (
                "" if peak_tflops is None and peak_bandwidth_gbs is None else ", --perf flags over it")
            break
    if flops is None or gbs is None:
        return None
    return Ceiling(float(flops), float(gbs), source)


def _best_seconds(fn, min_total_s: float, repeats: int) -> float:
    """The fastest of ``repeats`` timings of ``fn`` (each repeated until it lasts ``min_total_s / repeats``)."""
    fn()  # warm up (allocation, thread pool)
    best = math.inf
    for _ in range(repeats):
        n, start = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_total_s / repeats:
                break
        best = min(best, elapsed / n)
    return best


@functools.lru_cache(maxsize=8)
def measure_cpu_ceiling(shape: ModelShape, dtype: str, threads: int, tokens: int = 1024, copy_bytes: int = 1 << 28,
                        min_total_s: float = 0.5, repeats: int = 5) -> Ceiling:
    """Measure this CPU: a ``[tokens, hidden] x [hidden, intermediate]`` GEMM in ``dtype`` (the model's MLP
    projection, its largest matmul) with ``threads`` torch threads, and a copy of ``copy_bytes`` (read + written).
    Fastest of ``repeats`` timings each, so a moment of load elsewhere does not lower it. Measured once per process
    for the same arguments (about a second), by the trainer before its cluster starts."""
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        a = torch.randn(tokens, shape.hidden_size, dtype=torch_dtype)
        b = torch.randn(shape.hidden_size, shape.intermediate_size, dtype=torch_dtype)
        gemm_s = _best_seconds(lambda: torch.mm(a, b), min_total_s, repeats)
        src = torch.empty(copy_bytes // 4, dtype=torch.float32).fill_(1.0)
        dst = torch.empty_like(src)
        copy_s = _best_seconds(lambda: dst.copy_(src), min_total_s, repeats)
    finally:
        torch.set_num_threads(before)
    tflops = 2 * tokens * shape.hidden_size * shape.intermediate_size / gemm_s / 1e12
    gbs = 2 * src.nbytes / copy_s / 1e9
    return Ceiling(tflops, gbs, f"measured: {dtype} GEMM {tokens}x{shape.hidden_size}x{shape.intermediate_size} "
                                f"with {threads} thread(s), {copy_bytes >> 20} MiB copy")


# ---- counts ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Segment:
    """A prompt of ``prompt`` tokens and the responses (their token counts) computed after it in one sequence."""

    prompt: int
    responses: tuple[int, ...]

    @property
    def tokens(self) -> int:
        return self.prompt + sum(self.responses)

    @property
    def context_pairs(self) -> int:
        """Query-key pairs causal attention computes: every token with itself and the tokens it sees before it."""
        p = self.prompt
        return p * (p + 1) // 2 + sum(p * r + r * (r + 1) // 2 for r in self.responses)


def matmul_params(shape: ModelShape) -> int:
    """``N_body``: the matmul weights of the decoder layers (attention projections and the MLP)."""
    h, q, kv = shape.hidden_size, shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    return shape.num_layers * (h * q + 2 * h * kv + q * h + 3 * h * shape.intermediate_size)


def forward_flops(shape: ModelShape, segments: Iterable[Segment], head: str = "lm") -> float:
    """Model FLOPs of one forward over ``segments``. ``head``: "lm" (the lm_head at each response token's
    predictor: log-probs), "value" (a scalar head at each response token: values), "score" (a scalar head at the
    last token: a reward model)."""
    if head not in ("lm", "value", "score"):
        raise ValueError(f"forward_flops: head must be 'lm', 'value' or 'score', got {head!r}")
    body, h = matmul_params(shape), shape.hidden_size
    d_q = shape.num_heads * shape.head_dim
    total = 0.0
    for s in segments:
        head_tokens = len(s.responses) if head == "score" else sum(s.responses)
        head_params = shape.vocab_size * h if head == "lm" else h
        total += 2 * body * s.tokens + 2 * head_params * head_tokens + 4 * shape.num_layers * d_q * s.context_pairs
    return total


def train_flops(shape: ModelShape, segments: Iterable[Segment], head: str = "lm") -> float:
    """Model FLOPs of a forward and backward over ``segments``: 3 x the forward."""
    return 3 * forward_flops(shape, segments, head)


def row_lengths(attention_mask: torch.Tensor, response_width: int) -> tuple[list[int], list[int]]:
    """Real prompt and response tokens of each row of a rollout batch ([B, P + response_width], left-padded
    prompts, right-padded responses)."""
    mask = attention_mask.bool()
    prompt_width = mask.shape[1] - response_width
    return mask[:, :prompt_width].sum(dim=1).tolist(), mask[:, prompt_width:].sum(dim=1).tolist()


def microbatch_segments(sequences: torch.Tensor, attention_mask: torch.Tensor, response_width: int,
                        plan: Sequence[Sequence[int]], share_prompts: bool, segment_tokens: int,
                        images: Sequence | None = None) -> list[Segment]:
    """The segments the micro-batches of ``plan`` (lists of row indices) compute: each row alone, or with
    ``share_prompts`` the rows of one prompt (and, ``images`` given per row, of the same images: what the forward
    shares) within a micro-batch cut as the shared-prompt packing cuts them
    (``segment_tokens``: its segment size, as :func:`rlhf_sg.packing.default_segment_tokens` gives it: the hidden
    size on the tree mask, :data:`rlhf_sg.packing.UNCAPPED_SEGMENT_TOKENS` on the blocks)."""
    from rlhf_sg.packing import prompt_groups, shared_prompt_segments

    prompt_len, response_len = row_lengths(attention_mask, response_width)
    segments = []
    for micro in plan:
        micro = list(micro)
        if not share_prompts:
            segments += [Segment(prompt_len[b], (response_len[b],)) for b in micro]
            continue
        local = prompt_groups(sequences[micro], attention_mask[micro], response_width,
                              None if images is None else [images[b] for b in micro])
        groups = [[micro[i] for i in g] for g in local]
        capacity = max([segment_tokens] + [prompt_len[b] + response_len[b] for b in micro])
        for seg in shared_prompt_segments(groups, prompt_len, response_len, capacity):
            segments.append(Segment(prompt_len[seg[0]], tuple(response_len[b] for b in seg)))
    return segments


def decode_bytes(shape: ModelShape, prompt_len: Sequence[int], response_len: Sequence[int], engines: int = 1) -> float:
    """Bytes generation reads at least: the language model's weights once per decode step on each engine (``max r``
    steps; a vision tower runs on the prompt's images, not per decoded token) and, for each decoded token, the KV
    of every token before it."""
    if not response_len:
        return 0.0
    kv = kv_bytes_per_token(shape) * sum(r * p + r * (r - 1) // 2 for p, r in zip(prompt_len, response_len))
    return float(engines * max(response_len) * weight_bytes(dataclasses.replace(shape, vision_params=0)) + kv)


def decode_flops(shape: ModelShape, prompt_len: Sequence[int], response_len: Sequence[int]) -> float:
    """Model FLOPs generation does at least: each decoded token's forward (the decoder's matmuls, the lm_head, and
    attention over the ``p + i`` tokens before it). The prompts' prefill is not counted (an engine's prefix cache
    shares it across a group's samples), so this is a floor, as :func:`decode_bytes` is."""
    body, d_q = matmul_params(shape), shape.num_heads * shape.head_dim
    tokens = sum(response_len)
    pairs = sum(r * p + r * (r - 1) // 2 for p, r in zip(prompt_len, response_len))
    return float(2 * (body + shape.vocab_size * shape.hidden_size) * tokens + 4 * shape.num_layers * d_q * pairs)


# ---- a step's report --------------------------------------------------------------------------------------


def phase_metrics(ceiling: Ceiling | None, seconds: dict[str, float], flops: dict[str, tuple[float, int]],
                  generated_tokens: int = 0, generate_bytes: float = 0.0, engines: int = 1,
                  sync_bytes: float = 0.0, sync_s: float = 0.0, engine_load_s: float = 0.0,
                  generate_flops: float = 0.0) -> dict[str, float]:
    """``perf/*`` metrics of one step. ``seconds``: the step's phase times (:class:`rlhf_sg.timing.StepTimer`);
    ``flops``: per FLOP phase (train, reference, critic, actor_logprob) its model FLOPs and the ranks (devices) it
    ran on. Per FLOP phase: ``perf/{phase}_TFLOP`` done, ``perf/{phase}_TFLOPs`` achieved, ``perf/{phase}_of_peak``
    (achieved over ranks x the ceiling). Generation: ``perf/generate_tokens_per_s``, ``perf/generate_bytes_per_token``,
    ``perf/generate_GBps``, ``perf/generate_of_peak_bw`` (over engines x the bandwidth), ``perf/generate_TFLOPs``
    and ``perf/generate_of_roofline``: the roofline's time over the phase's, where a decode is bound by the larger
    of its bytes over the engines' bandwidth and its FLOPs (``generate_flops``) over their matmul rate. Weight sync:
    ``perf/weight_sync_GB``, ``perf/weight_sync_GBps``, ``perf/weight_sync_over_engine_load`` (the sync's seconds
    over the seconds the engines took to receive and load the same bytes, their floor; 1 is the floor)."""
    out: dict[str, float] = {}
    for phase, (done, ranks) in flops.items():
        s = seconds.get(phase, 0.0)
        if done <= 0 or s <= 0:
            continue
        achieved = done / s / 1e12
        out[f"perf/{phase}_TFLOP"] = done / 1e12
        out[f"perf/{phase}_TFLOPs"] = achieved
        if ceiling is not None:
            out[f"perf/{phase}_of_peak"] = achieved / (max(ranks, 1) * ceiling.tflops)
    gen_s = seconds.get("generate", 0.0)
    if generated_tokens and gen_s > 0:
        out["perf/generate_tokens_per_s"] = generated_tokens / gen_s
        out["perf/generate_bytes_per_token"] = generate_bytes / generated_tokens
        out["perf/generate_GBps"] = generate_bytes / gen_s / 1e9
        if ceiling is not None:
            out["perf/generate_of_peak_bw"] = generate_bytes / gen_s / 1e9 / (max(engines, 1) * ceiling.gbs)
        if generate_flops:
            out["perf/generate_TFLOPs"] = generate_flops / gen_s / 1e12
            if ceiling is not None:
                bound_s = max(generate_bytes / (ceiling.gbs * 1e9), generate_flops / (ceiling.tflops * 1e12))
                out["perf/generate_of_roofline"] = bound_s / max(engines, 1) / gen_s
    if sync_bytes and sync_s > 0:
        out["perf/weight_sync_GB"] = sync_bytes / 1e9
        out["perf/weight_sync_GBps"] = sync_bytes / sync_s / 1e9
        if engine_load_s > 0:
            out["perf/weight_sync_over_engine_load"] = sync_s / engine_load_s
    return out


#: the per-phase fractions a table or plot shows, in step order: (metric, label)
FRACTIONS = (("perf/generate_of_roofline", "generate (roofline)"), ("perf/reference_of_peak", "reference"),
             ("perf/critic_of_peak", "critic"), ("perf/actor_logprob_of_peak", "actor_logprob"),
             ("perf/train_of_peak", "train"))


def _device_name(_actor_instance) -> str:
    """Run inside a model-worker actor through ``__ray_call__``: the name of its CUDA device."""
    return torch.cuda.get_device_name(torch.cuda.current_device())


def _segment_tokens(worker) -> int:
    """Run inside a model-worker actor through ``__ray_call__``: the shared-prompt segment size its forwards use."""
    from rlhf_sg.packing import default_segment_tokens

    return default_segment_tokens(worker.module)


class StepAccounting:
    """A run's per-phase accounting: the controller counts each phase's model FLOPs from the micro-batch plans it
    hands the ranks (:meth:`count`), and :meth:`report` turns a finished step's counts and times into ``perf/*``
    metrics (:func:`phase_metrics`)."""

    def __init__(self, shapes: dict[str, ModelShape], ceiling: Ceiling | None, engines: int):
        self.shapes = shapes
        self.ceiling = ceiling
        self.engines = engines
        #: phase -> role -> (model FLOPs, ranks) of the step in progress
        self.flops: dict[str, dict[str, tuple[float, int]]] = {}
        #: role -> the shared-prompt segment size its ranks use (:meth:`ask_segments`); else its hidden size
        self.segment_tokens: dict[str, int] = {}

    @classmethod
    def for_run(cls, cfg, layout, actor_group=None) -> StepAccounting:
        """Shapes of the run's models in ``--model.dtype`` and the ceiling: on CUDA the device table (the device
        named by ``actor_group``'s rank 0) or the ``--perf`` flags; on CPU measured here with an actor rank's
        threads (no group needed)."""
        import dataclasses

        from rlhf_sg.memory import load_shape

        dtype = cfg.model.dtype
        roles = ["actor"] + [r for r, used in (("ref", layout.uses_ref), ("teacher", layout.uses_teacher),
                                               ("critic", layout.uses_critic)) if used]
        shapes = {r: dataclasses.replace(load_shape(layout.model_path(r)), dtype=dtype) for r in roles}
        p = cfg.perf
        if cfg.train.device == "cuda":
            import ray

            name = ray.get(actor_group.workers[0].__ray_call__.remote(_device_name), timeout=cfg.train.timeout_s)
            ceiling = gpu_ceiling(name, dtype, p.peak_tflops, p.peak_bandwidth_gbs)
        else:
            ceiling = measure_cpu_ceiling(shapes["actor"], dtype, layout.worker_threads("actor"))
            if p.peak_tflops is not None or p.peak_bandwidth_gbs is not None:
                ceiling = Ceiling(p.peak_tflops or ceiling.tflops, p.peak_bandwidth_gbs or ceiling.gbs,
                                  ceiling.source + ", --perf flags over it")
        return cls(shapes, ceiling, cfg.rollout.num_engines)

    def ask_segments(self, groups: dict[str, Any], timeout_s: float) -> None:
        """Ask rank 0 of each role's group (``role -> group``) for the shared-prompt segment size its forwards use,
        which its attention decides (:func:`rlhf_sg.packing.default_segment_tokens`), so :meth:`count` cuts the
        segments the ranks compute."""
        import ray

        refs = {role: group.workers[0].__ray_call__.remote(_segment_tokens) for role, group in groups.items()}
        self.segment_tokens = {role: int(size) for role, size in zip(refs, ray.get(list(refs.values()),
                                                                                  timeout=timeout_s))}

    def start_step(self) -> None:
        self.flops = {}

    def count(self, phase: str, role: str, experience, plans: list[list[list[int]]], share_prompts: bool,
              train: bool = False, sequence_parallel: int = 1) -> None:
        """Add the model FLOPs of ``role``'s forwards (``train``: forward and backward) over ``plans`` (per
        data-parallel rank, micro-batches of row indices) to ``phase``; each plan ran on ``sequence_parallel`` ranks
        (an SP group, which shares its FLOPs). A phase runs on the ranks of every role counted in it (the actor's and
        the critic's updates run side by side)."""
        from rlhf_sg.packing import MAX_DEFAULT_SEGMENT_TOKENS

        shape = self.shapes[role]
        segment_tokens = self.segment_tokens.get(role) or min(shape.hidden_size, MAX_DEFAULT_SEGMENT_TOKENS)
        segments = [seg for plan in plans for seg in microbatch_segments(
            experience.sequences, experience.attention_mask, experience.response_width, plan, share_prompts,
            segment_tokens, getattr(experience, "images", None))]
        head = "value" if role == "critic" else "lm"
        done = (train_flops if train else forward_flops)(shape, segments, head)
        total, ranks = self.flops.setdefault(phase, {}).get(role, (0.0, 0))
        self.flops[phase][role] = (total + done, max(ranks, len(plans) * sequence_parallel))

    def report(self, times: dict[str, float], experience, sync_stats: list[dict] | None) -> dict[str, float]:
        """The ``perf/*`` metrics of the step: the counted phases, generation from the experience's real tokens, and
        the weight sync from the first sending rank's stats (:meth:`rlhf_sg.sync.WeightSyncer.sync`)."""
        prompt_len, response_len = row_lengths(experience.attention_mask, experience.response_width)
        stats = sync_stats[0] if sync_stats else {}
        return phase_metrics(
            self.ceiling, times, {phase: (sum(f for f, _ in roles.values()), sum(r for _, r in roles.values()))
                                  for phase, roles in self.flops.items()},
            generated_tokens=sum(response_len),
            generate_bytes=decode_bytes(self.shapes["actor"], prompt_len, response_len, self.engines),
            engines=self.engines, sync_bytes=float(stats.get("bytes", 0.0)), sync_s=float(stats.get("seconds", 0.0)),
            engine_load_s=float(stats.get("engine_seconds", 0.0)),
            generate_flops=decode_flops(self.shapes["actor"], prompt_len, response_len))
