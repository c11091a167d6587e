"""ModelRunner: loads the model and sizes the KV and SSM pools from EngineConfig; runs one mixed batch."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from pathlib import Path

import torch
from headroom.engine.cache.kv_slots import KVAllocator
from headroom.engine.config import EngineConfig
from headroom.engine.models.causal_lm import CausalLM
from headroom.engine.plan import kv_bytes_per_token, load_geometry, ssm_slot_bytes
from headroom.engine.plan.engines.builtin import decode_graph_batch
from headroom.engine.runtime.decode_graphs import CaptureReport, DecodeGraphs
from headroom.engine.runtime.forward_batch import BatchItem, ForwardBatch
from headroom.engine.runtime.kv_pool import KVPool
from headroom.engine.runtime.loader import load_config, load_weights
from headroom.engine.runtime.parallel import TensorParallel, shard_config
from headroom.engine.runtime.sharded_loader import load_sharded_weights
from headroom.engine.runtime.ssm_pool import SSMPool
from headroom.engine.sequence import Sequence
from headroom.kernels.compile_ahead import (
    CompileAhead,
    CompileAheadReport,
    compile_threads,
    create_triton_driver,
    triton_compiles_ahead,
)
from headroom.kernels.gdn_fla import fla_available, import_in_background, use_tuned_fla_configs

logger = logging.getLogger(__name__)

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# Layers the host may run ahead of the GPU in an interruptible pass: enough to keep the GPU fed (a layer of an 8K
# chunk is ~3.6 ms of GPU work against ~1.3 ms to launch it on the H200), few enough that an interjected pass
# is not queued behind the rest of the long one.
INTERJECTION_LAG = 2
# The last chunk of a KIVI warm-up prompt (kivi_warm_up_lengths): under the dense path's DENSE_MIN_ROWS, and at
# least the block path's BLOCKWISE_MIN_ROWS query rows (512) at any GQA group.
KIVI_BLOCK_PATH_CHUNK = 1000


def bounded_lag(hook: Callable[[], None], device: torch.device, lag: int = INTERJECTION_LAG) -> Callable[[], None]:
    """hook, preceded on a GPU by a wait until the device has finished all but the last `lag` layers."""
    if device.type != "cuda":
        return hook
    recorded: deque[torch.cuda.Event] = deque()

    def between_layers() -> None:
        event = torch.cuda.Event()
        event.record()
        recorded.append(event)
        if len(recorded) > lag:
            recorded.popleft().synchronize()
        hook()

    return between_layers


class CapacityError(RuntimeError):
    """The pools the config asks for do not fit; the message says the numbers."""


class ModelRunner:
    def __init__(self, config: EngineConfig, tp: TensorParallel | None = None):
        """tp: this process's rank of a tensor-parallel group (engine/runtime/leader.py starts one); the
        runner then holds the rank's share and model_config is the rank's (shard_config)."""
        if config.tensor_parallel_size != (tp.size if tp is not None else 1):
            raise ValueError(
                f"tensor_parallel_size {config.tensor_parallel_size} needs one process per rank: build the runner "
                "with engine/runtime/leader.py's build_runner"
            )
        self.config = config
        self.tp = tp
        self.device = torch.device(config.device)
        model_dir = Path(config.model_path)
        full_config = load_config(model_dir)
        self.vocab_size = full_config.vocab_size
        self.model_config = shard_config(full_config, tp.size) if tp is not None else full_config
        dtype_name = self.model_config.torch_dtype if config.dtype == "auto" else config.dtype
        if dtype_name not in _TORCH_DTYPES:
            raise ValueError(f"model dtype {dtype_name!r} (config.json) is not one of {', '.join(_TORCH_DTYPES)}")
        self.dtype = _TORCH_DTYPES[dtype_name]
        mc = self.model_config
        if mc.is_hybrid and config.ssm_slots < config.max_running_requests:
            raise CapacityError(
                f"ssm_slots={config.ssm_slots} < max_running_requests={config.max_running_requests}: "
                "every running request of a hybrid model needs its own SSM slot"
            )
        self._precheck(model_dir)
        if mc.is_hybrid and self.device.type == "cuda":
            # Before fla's first import: the Gated DeltaNet kernels' configs tuned on this GPU, if shipped.
            tuned = use_tuned_fla_configs(self.device)
            logger.info("fla kernel configs: %s", f"shipped ones for this GPU ({tuned})" if tuned else "autotuned")
        if tp is None:
            weights = load_weights(model_dir, self.dtype, self.device, mc.weight_quant)
        else:
            weights = load_sharded_weights(model_dir, full_config, self.dtype, self.device, tp.rank, tp.size)
        weight_bytes = sum(t.numel() * t.element_size() for t in weights.values())
        self.model = CausalLM(mc, weights, tp)
        self.kv_pool = KVPool(
            config.max_total_tokens, len(mc.full_attention_layers), mc.num_kv_heads, mc.head_dim,
            config.kv_dtype, self.dtype, self.device, residual_rows=config.max_running_requests,
        )
        self.ssm_pool: SSMPool | None = None
        if mc.is_hybrid:
            self.ssm_pool = SSMPool(
                config.ssm_slots, len(mc.linear_attention_layers), mc.linear_conv_channels,
                mc.linear_conv_kernel_dim, mc.linear_num_value_heads, mc.linear_key_head_dim,
                mc.linear_value_head_dim, self.dtype, self.device, config.ssm_dtype,
            )
        self.kv_allocator = KVAllocator(config.max_total_tokens, self.kv_pool.page_tokens)
        self.weight_bytes = weight_bytes
        self._check_budget()
        if mc.is_hybrid and self.device.type == "cuda" and fla_available():
            # fla's import (7-10 s on an H100's GPU machine) out of the first prefill pass, on a thread of its own. It
            # holds the GIL most of its time: started before the weights' load (session 25) it slowed that load 1.5
            # -> 5.4 s; started here, once the pools fit the budget, it runs beside cuDNN's plans and the capture's
            # compiles instead (session 26 on an H100: cold start 29.2 s against 32.9 s, bench/results/session26).
            create_triton_driver()
            import_in_background()
        graph_batch = config.cuda_graph_max_batch
        if graph_batch is None:
            graph_batch = decode_graph_batch(bool(mc.moe_layers), config.max_running_requests) \
                if self.device.type == "cuda" else 0
        self.decode_graphs = DecodeGraphs(self, graph_batch) if graph_batch else None
        # Layers the host may run ahead of the GPU in an interruptible pass (`headroom serve --interjection-lag`).
        self.interjection_lag = INTERJECTION_LAG
        # Set during the warm-up only (start_compile_ahead): each eager pass runs dry first, its kernels compiled
        # on every core, then for real.
        self.compile_ahead: CompileAhead | None = None

    def capture_decode_graphs(self) -> CaptureReport:
        """Capture the decode graphs (before the first request: capture overwrites slots 0..max_batch-1)."""
        if self.decode_graphs is None:
            return CaptureReport((), 0.0, 0)
        return self.decode_graphs.capture()

    def synchronize(self) -> None:
        """Wait for this device's queued work (every rank's, for a tensor-parallel leader)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        """Stop what the runner started besides its tensors (a tensor-parallel leader's other ranks)."""

    def release(self, seq: Sequence) -> None:
        """Forget seq's per-request state here (KIVI residual window, decode-graph table row)."""
        self.kv_pool.release(seq)
        if self.decode_graphs is not None:
            self.decode_graphs.release(seq)

    @property
    def static_bytes(self) -> int:
        ssm = self.ssm_pool.nbytes() if self.ssm_pool else 0
        return self.weight_bytes + self.kv_pool.nbytes() + ssm

    def _precheck(self, model_dir: Path) -> None:
        """Refuse before allocating anything: pools and weights priced with the planner's formulas."""
        config = self.config
        geometry = load_geometry(model_dir)
        element = torch.tensor([], dtype=self.dtype).element_size()
        # Per device: a tensor-parallel rank holds 1/tp of the weights and pools (the plan's ledger).
        tp = config.tensor_parallel_size
        if config.kv_dtype == "auto":
            kv_token = kv_bytes_per_token(geometry, "bf16", tp) * element // 2
        else:
            kv_token = kv_bytes_per_token(geometry, config.kv_dtype, tp)
        ssm = ssm_slot_bytes(geometry, tp, config.ssm_dtype) * config.ssm_slots if geometry.is_hybrid else 0
        weights = -(-geometry.total_weight_bytes() * element // geometry.dtype_bytes // tp)
        expected = weights + kv_token * config.max_total_tokens + ssm
        budget = config.static_budget_bytes
        if budget is not None and expected > budget:
            raise CapacityError(
                f"weights {weights} + KV pool {kv_token} x {config.max_total_tokens} tokens + SSM pool {ssm} = "
                f"{expected} bytes exceed the plan's static budget of {budget} bytes"
            )
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            if config.gpu_memory_bytes is not None and total < config.gpu_memory_bytes:
                raise CapacityError(
                    f"the plan assumed {config.gpu_memory_bytes} bytes of GPU memory; {self.device} has {total}"
                )
            if expected > free:
                raise CapacityError(f"weights and pools need {expected} bytes; {self.device} has {free} free")

    def _check_budget(self) -> None:
        ssm = self.ssm_pool.nbytes() if self.ssm_pool else 0
        budget = self.config.static_budget_bytes
        if budget is not None and self.static_bytes > budget:
            raise CapacityError(
                f"weights {self.weight_bytes} + KV pool {self.kv_pool.nbytes()} + SSM pool {ssm} = "
                f"{self.static_bytes} bytes exceed the plan's static budget of {budget} bytes"
            )
        assumed = self.config.gpu_memory_bytes
        if assumed is not None and self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
            if total < assumed:
                raise CapacityError(f"the plan assumed {assumed} bytes of GPU memory; {self.device} has {total}")

    @property
    def supports_interjection(self) -> bool:
        """Whether forward() may run another pass from between_layers. Not with tensor parallelism: the other
        ranks run the pass they were sent in lockstep (its collectives), and a pass sent mid-pass would wedge them."""
        return self.tp is None

    def warm_attention_plans(self, max_rows: int) -> int:
        """Build the cuDNN attention plans that prefill passes of up to max_rows rows can meet (the dense path
        of long spans, engine/layers/paged_attention.py); 0 where that path is not taken (CPU, fp8 pools, KIVI
        pages the block dequantizer cannot tile, no cuDNN, no full-attention layer). A plan built inside a request
        cost it tens of milliseconds."""
        from headroom.engine.layers import paged_attention

        mc, pool = self.model_config, self.kv_pool
        if not paged_attention.DENSE_ATTENTION or self.device.type != "cuda" or not mc.full_attention_layers:
            return 0
        from headroom.kernels import dense_attention
        from headroom.kernels.paged_kv import blockwise_supported

        if not (pool.stores_rows_as_is or pool.is_kivi and blockwise_supported(mc.head_dim, pool.page_tokens,
                                                                              pool.value_group)):
            return 0
        # (A KIVI pool's pages are packed integers; its dense path reads them dequantized into the model's dtype.)
        dtype = pool.model_dtype if pool.is_kivi else pool.layers[0]["k"].dtype
        return dense_attention.warm_up(self.device, dtype, mc.num_heads, mc.num_kv_heads, mc.head_dim, max_rows)

    def start_compile_ahead(self) -> int:
        """From now until stop_compile_ahead, every eager pass with prefill (and each decode graph's warm pass)
        first runs dry and has its Triton kernels compiled on a thread pool (kernels/compile_ahead.py): for the
        warm-up alone, whose passes may then compute garbage. Returns the pool's threads, 0 where it stays off:
        no GPU, tensor parallelism (a dry pass on this rank alone would leave the others' collectives unmatched),
        a Triton without the hooks it uses, HEADROOM_COMPILE_AHEAD=0, or one CPU."""
        if self.device.type != "cuda" or self.tp is not None or not triton_compiles_ahead():
            return 0
        threads = compile_threads()
        self.compile_ahead = CompileAhead(threads) if threads else None
        return threads

    def stop_compile_ahead(self) -> CompileAheadReport | None:
        """Passes run once again; what compiling ahead did, or None where it was not on."""
        ahead, self.compile_ahead = self.compile_ahead, None
        return ahead.report if ahead is not None else None

    def gemv_warm_up_lengths(self, already: tuple[int, ...]) -> tuple[int, ...]:
        """Prompt lengths (1-16 tokens) whose passes, alone, with lone prompts of the lengths `already` and the
        captured decode graphs, launch every GEMV variant that serving's passes of up to 16 tokens can take with
        this GPU's tuned table (kernels/gemv.py warm_up_rows), the LM head's aside (a prompt's runs on its last
        row: gemv_warm_up_batches); none off a GPU."""
        from headroom.kernels.gemv import warm_up_rows

        head = self._lm_head_shape()
        return warm_up_rows(self.device, tuple(already) + self._graphed_sizes(), keep=lambda n, k: (n, k) != head)

    def gemv_warm_up_batches(self, already: tuple[int, ...]) -> tuple[int, ...]:
        """Numbers of sequences (2 up to max_running_requests, at most 16) that passes holding them together, with
        passes of `already` sequences and the captured decode graphs, give the LM head every GEMV variant that
        serving's can take: it runs on one row a sequence, so where decode steps of more sequences than the graphs
        hold run eagerly, only such passes compile its variants. None off a GPU or where the graphs hold every
        count."""
        from headroom.kernels.gemv import MAX_ROWS, warm_up_rows

        head = self._lm_head_shape()
        if head is None:
            return ()
        most = min(MAX_ROWS, self.config.max_running_requests)
        return warm_up_rows(self.device, (1, *already, *self._graphed_sizes()), keep=lambda n, k: (n, k) == head,
                            most=most)

    def _lm_head_shape(self) -> tuple[int, int] | None:
        head = self.model.lm_head
        return (head.shape[0], head.shape[1]) if isinstance(head, torch.Tensor) and head.dim() == 2 else None

    def _graphed_sizes(self) -> tuple[int, ...]:
        return self.decode_graphs.captured_sizes if self.decode_graphs is not None else ()

    def kivi_warm_up_lengths(self, chunk: int) -> tuple[int, int | None]:
        """Warm-up prompt lengths whose passes meet every path of a KIVI pool's long prefills
        (engine/layers/paged_attention.py), so that all their kernels are compiled before /ready: whole chunks past
        the block path's workspace (the dense path where it is on, else the block path), then a last chunk too short for the dense path that reads its
        prefix in two workspace blocks (the block path's continuing pass); and, where chunks are long enough for
        the dense path (when it is on: paged_attention.DENSE_ATTENTION), a prompt whose last chunk ends mid-page
        after a whole cuDNN block (its paged rest), else None."""
        from headroom.engine.layers import paged_attention
        from headroom.kernels.dense_attention import PREFIX_BLOCK
        from headroom.kernels.paged_kv import BLOCKWISE_WORKSPACE_TOKENS

        longest = (BLOCKWISE_WORKSPACE_TOKENS // chunk + 1) * chunk + min(KIVI_BLOCK_PATH_CHUNK, chunk)
        dense = paged_attention.DENSE_ATTENTION and chunk > paged_attention.DENSE_MIN_ROWS
        mid_page = -(-PREFIX_BLOCK // chunk) * chunk + chunk - 1 if dense else None
        return longest, mid_page

    @property
    def overlaps_decode(self) -> bool:
        """Whether a graphed decode step may be launched on tokens the previous one left on the device
        (forward's tokens_on_device; engine/loop/step.py's overlapped decode). On a GPU only, where the host's
        work then runs while the device computes; not with tensor parallelism, whose other ranks are sent each
        pass's tokens from the host."""
        return self.tp is None and self.decode_graphs is not None and self.device.type == "cuda"

    def prepare_thread(self) -> None:
        """Called by a thread that will run this runner's forwards (the engine loop's). On a CPU device: torch's
        intra-op threads for it, config.cpu_threads (OpenMP teams started from a thread other than the main
        one were 2-3x slower than one thread on a 2-core machine; EngineConfig)."""
        if self.device.type == "cpu":
            torch.set_num_threads(self.config.cpu_threads)

    def forward(self, items: list[BatchItem], all_positions: bool = False,
                between_layers: Callable[[], None] | None = None,
                tokens_on_device: tuple[torch.Tensor, list[int]] | None = None) -> torch.Tensor:
        """Run one mixed batch -> logits [num_items, vocab] at each item's last token
        ([num_tokens, vocab] over the flattened items if all_positions, for tests and scoring).

        Each item's sequence must hold kv_slots for all its positions and (hybrid) an SSM slot; a sequence
        starting at position 0 gets a zeroed SSM state. Advances each seq.num_computed_tokens.
        between_layers: called after each layer but the last of an eager pass (loop/step.py runs interjected
        passes from it); on a GPU the host is then kept at most interjection_lag layers ahead of the device, so
        that what it interjects waits for about that many layers, not for everything queued before it.
        tokens_on_device (tokens, rows): a decode step whose input tokens the previous step sampled on the device
        and the host has not read yet (item i's is tokens[rows[i]]; its item.token_ids hold PENDING_TOKEN). Only
        through the decode graphs, which gather them on the device (DecodeGraphs.run).
        """
        if tokens_on_device is not None and (all_positions or self.decode_graphs is None
                                             or not self.decode_graphs.can_run(items)):
            raise ValueError("a decode step with its tokens on the device runs only through the decode graphs")
        for item in items:
            seq = item.seq
            end = seq.num_computed_tokens + len(item.token_ids)
            # A step on device tokens computes the one token the host has not appended yet.
            if end > seq.num_tokens + (tokens_on_device is not None):
                raise ValueError(f"request {seq.request_id!r}: item reaches position {end} past its {seq.num_tokens} tokens")
            if tokens_on_device is None and item.token_ids != seq.tokens_between(seq.num_computed_tokens, end):
                raise ValueError(f"request {seq.request_id!r}: item tokens are not its next uncomputed tokens")
            if len(seq.kv_slots) < end:
                raise ValueError(f"request {seq.request_id!r} holds {len(seq.kv_slots)} kv slots, needs {end}")
            if self.ssm_pool is not None and seq.ssm_slot is None:
                raise ValueError(f"request {seq.request_id!r} has no SSM slot")
        graphs = self.decode_graphs if not all_positions and self.decode_graphs is not None \
            and self.decode_graphs.can_run(items) else None
        if self.compile_ahead is not None and graphs is None and any(item.seq.is_prefilling for item in items):
            # Passes with prefill only: the warm-up fits its fixed pass cost on decode-only passes, which a dry pass
            # would double where decode steps run eagerly (no graphs: MoE models). Before the SSM resets below, so
            # that a new sequence's real pass starts from a zeroed state whatever the dry one wrote; a batch of its
            # own (ForwardBatch caches what the layers build from it).
            self.compile_ahead.prepare(lambda: self.model(ForwardBatch.build(items, self.device), self.kv_pool,
                                                          self.ssm_pool, all_positions))
        if self.ssm_pool is not None:
            for item in items:
                if item.seq.num_computed_tokens == 0:
                    self.ssm_pool.reset(item.seq.ssm_slot)
        if graphs is not None:
            logits = graphs.run(items, tokens_on_device)
        else:
            batch = ForwardBatch.build(items, self.device)
            hook = None if between_layers is None else bounded_lag(between_layers, self.device, self.interjection_lag)
            logits = self.model(batch, self.kv_pool, self.ssm_pool, all_positions, hook)
        if self.tp is not None:
            logits = self.tp.gather_vocab(logits, self.vocab_size)
        for item in items:
            item.seq.num_computed_tokens += len(item.token_ids)
        return logits
