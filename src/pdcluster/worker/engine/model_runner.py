"""Turns a scheduled batch into tensors, runs the model over the paged cache, and returns logits.

Everything per step is built as a handful of tensors up front (token ids, positions, slot mapping, one
padded block table), so the forward itself never loops over blocks or tokens in Python.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pdcluster.kernels import native
from pdcluster.worker.engine.attention import AttnMetadata, PrefillSeq, window_slots
from pdcluster.worker.engine.config import ModelConfig
from pdcluster.worker.engine.kv_cache import PagedKVCache
from pdcluster.worker.engine.loader import load_model, resolve_dtype
from pdcluster.worker.engine.scheduler import Batch
from pdcluster.worker.engine.sequence import Sequence


class ModelRunner:
    def __init__(
        self,
        cfg: ModelConfig,
        *,
        dtype: str,
        device: str,
        block_size: int,
        kv_cache_dtype: str,
        full_precision_layers: tuple[int, ...] = (),
        num_blocks: int | None,
        kv_cache_memory: int | None,
        gpu_memory_utilization: float,
        max_model_len: int,
        max_batch_size: int,
        swap_space_bytes: int,
        compile_decode: bool = False,
    ) -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype, cfg, self.device)
        self.block_size = block_size
        self.kv_cache_dtype = kv_cache_dtype
        self.full_precision_layers = full_precision_layers
        self.model = load_model(cfg, self.dtype, self.device, max_len=max_model_len)
        self.model.build_greedy_head()
        native.enabled("decoder")  # a bad PDCLUSTER_NATIVE_KERNELS fails at start, not at the first decode step
        # Summed layer by layer: full-precision layers of a mixed cache cost more than the quantized ones,
        # so the block count from a byte budget must use the real per-block total.
        self.block_bytes = PagedKVCache.bytes_per_block(
            cfg.num_layers,
            block_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            kv_cache_dtype,
            self.dtype,
            full_precision_layers,
        )
        if num_blocks is None:
            num_blocks = self._blocks_from_budget(
                kv_cache_memory, gpu_memory_utilization, max_model_len * max_batch_size
            )
        self.cache = self._new_cache(num_blocks, self.device)
        # CPU + any float layer: those layers' decode attention gathers through per-step slot indices
        # (AttnMetadata); quantized layers use the kernel
        # The kernel cannot soft-cap: such layers (Gemma 2) gather every position by slot on any device.
        self.gather_decode = (self.device.type == "cpu" and self.cache.has_float_layers) or (
            self.model.needs_full_gather
        )
        # Swap space never needs more blocks than the device has; allocated on the first swap-out.
        self.num_host_blocks = min(swap_space_bytes // self.block_bytes, num_blocks)
        self._host_cache: PagedKVCache | None = None
        # Decode steps through inductor (fused elementwise ops, fewer dispatches); dynamic shapes so batch
        # sizes and lengths share one graph. Prefill and mixed steps stay eager: their per-chunk loop would
        # recompile for every chunk count. Off by default: see docs/benchmarks/engine.md at 5f904a5 for the compile cost.
        self._decode_forward: Callable[..., torch.Tensor] = (
            torch.compile(self.model, dynamic=True) if compile_decode else self.model
        )

    def _new_cache(self, num_blocks: int, device: torch.device) -> PagedKVCache:
        c = self.cfg
        return PagedKVCache(
            c.num_layers,
            num_blocks,
            self.block_size,
            c.num_kv_heads,
            c.head_dim,
            self.kv_cache_dtype,
            self.dtype,
            device,
            self.full_precision_layers,
        )

    def _blocks_from_budget(self, budget: int | None, utilization: float, useful_tokens: int) -> int:
        if budget is None and self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            # what is left of utilization * total once the weights (already loaded) are accounted for
            budget = int(total * utilization) - (total - free)
        if budget is None:
            # CPU default: room for every batch slot at full length, capped at 1 GiB
            budget = min(1 << 30, (-(-useful_tokens // self.block_size) + 1) * self.block_bytes)
        blocks = budget // self.block_bytes
        if blocks < 1:
            raise ValueError(
                f"KV cache budget of {budget} bytes holds no block of {self.block_bytes} bytes; "
                "raise --kv-cache-memory / --gpu-memory-utilization"
            )
        return blocks

    @property
    def host_cache(self) -> PagedKVCache:
        if self._host_cache is None:
            self._host_cache = self._new_cache(self.num_host_blocks, torch.device("cpu"))
        return self._host_cache

    # -- per step ---------------------------------------------------------------------------------------

    def run_copies(self, copies: list[tuple[str, list[int], list[int]]]) -> None:
        for kind, src, dst in copies:
            src_t, dst_t = torch.tensor(src), torch.tensor(dst)
            if kind == "out":
                self.cache.copy_blocks_to(self.host_cache, src_t, dst_t)
            else:
                self.host_cache.copy_blocks_to(self.cache, src_t, dst_t)

    def slots(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        table = torch.tensor(seq.block_table)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    @torch.inference_mode()
    def execute(self, batch: Batch, layer_hook: Callable[[int], None] | None = None) -> torch.Tensor:
        """Logits (float32) for the sequences that sample a token this step, in batch order."""
        hidden = self._hidden(batch, layer_hook)
        return torch.empty(0, self.cfg.vocab_size) if hidden is None else self.model.compute_logits(hidden)

    @torch.inference_mode()
    def execute_greedy(self, batch: Batch, layer_hook: Callable[[int], None] | None = None) -> torch.Tensor:
        """The greedy token (int64) of each sequence that samples this step, in batch order: what argmax of
        ``execute``'s logits gives, without the whole head where the screen runs (greedy_head.py)."""
        hidden = self._hidden(batch, layer_hook)
        return torch.empty(0, dtype=torch.long) if hidden is None else self.model.greedy_tokens(hidden)

    def _hidden(self, batch: Batch, layer_hook: Callable[[int], None] | None) -> torch.Tensor | None:
        """The step's block copies, then the final hidden states of the rows that sample (None: no sequences)."""
        self.run_copies(batch.copies)
        if not batch.seqs:
            return None
        sample_idx: torch.Tensor | None  # None: every row samples
        if batch.num_decode:
            md, input_ids, sample_idx = self._prepare_mixed(batch)
        elif batch.is_prefill:
            md, input_ids, sample_idx = self._prepare_prefill(batch)
        else:
            md, input_ids, sample_idx = self._prepare_decode(batch.seqs)
        md.layer_hook = layer_hook if batch.is_prefill else None
        hidden = (self.model if batch.is_prefill else self._decode_forward)(input_ids, md, self.cache)
        return hidden if sample_idx is None else hidden[sample_idx]

    def _prepare_mixed(self, batch: Batch) -> tuple[AttnMetadata, torch.Tensor, torch.Tensor]:
        """The decode rows first (every one samples), then the prefill chunks: one token axis, the decode
        part's attention metadata plus the chunks (attention splits the rows at ``md.num_decode``)."""
        nd = batch.num_decode
        dec, dec_ids, _ = self._prepare_decode(batch.seqs[:nd])
        pre, pre_ids, pre_sample = self._prepare_prefill(batch, nd)
        dec.is_prefill, dec.num_decode, dec.prefill = True, nd, pre.prefill
        dec.positions = torch.cat((dec.positions, pre.positions))
        dec.slot_mapping = torch.cat((dec.slot_mapping, pre.slot_mapping))
        sample_idx = torch.cat((torch.arange(nd, device=self.device), pre_sample + nd))
        return dec, torch.cat((dec_ids, pre_ids)), sample_idx

    def _prepare_prefill(self, batch: Batch, first: int = 0) -> tuple[AttnMetadata, torch.Tensor, torch.Tensor]:
        """The prefill chunks of ``batch.seqs[first:]``."""
        ids: list[int] = []
        positions, slots = [], []
        chunks: list[PrefillSeq] = []
        sample_idx: list[int] = []
        for seq, n in zip(batch.seqs[first:], batch.num_new_tokens[first:], strict=True):
            start = seq.num_computed_tokens
            ids.extend(seq.token_ids[start : start + n])
            positions.append(torch.arange(start, start + n))
            slots.append(self.slots(seq, start, start + n))
            table = torch.tensor(seq.block_table, device=self.device) if start else None
            chunks.append(PrefillSeq(start, n, table))
            if start + n == len(seq):  # the chunk reaches the end: its last position samples a token
                sample_idx.append(len(ids) - 1)
        dev = self.device
        md = AttnMetadata(
            is_prefill=True,
            positions=torch.cat(positions).to(dev),
            slot_mapping=torch.cat(slots).to(dev),
            prefill=chunks,
        )
        return md, torch.tensor(ids, device=dev), torch.tensor(sample_idx, device=dev, dtype=torch.long)

    def _prepare_decode(self, seqs: list[Sequence]) -> tuple[AttnMetadata, torch.Tensor, None]:
        bs = self.block_size
        lens = [len(s) for s in seqs]
        width = max(len(s.block_table) for s in seqs)
        tables = [s.block_table + [0] * (width - len(s.block_table)) for s in seqs]
        slots = [s.block_table[(n - 1) // bs] * bs + (n - 1) % bs for s, n in zip(seqs, lens, strict=True)]
        dev = self.device
        md = AttnMetadata(
            is_prefill=False,
            positions=torch.tensor([n - 1 for n in lens], device=dev),
            slot_mapping=torch.tensor(slots, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
        )
        gathers = self.model.decode_gathers(self.cache)
        if self.gather_decode and gathers:
            assert md.block_tables is not None and md.seq_lens is not None
            pos = torch.arange(max(lens), device=dev)
            md.gather_slots = md.block_tables.long()[:, pos // bs] * bs + pos % bs  # padding -> block 0
            md.gather_mask = (pos[None, :] < md.seq_lens[:, None])[:, None, None, :]
            if min(lens) < max(lens):  # else every position is real: SDPA needs no mask
                bias = torch.zeros(md.gather_mask.shape, dtype=self.dtype, device=dev)
                md.gather_bias = bias.masked_fill_(~md.gather_mask, float("-inf"))
        if self.cfg.sliding_window is not None and gathers:
            # the paged (Triton / torch) kernel has no window argument: sliding-window layers gather their last
            # `window` slots
            assert md.block_tables is not None and md.seq_lens is not None
            md.window_slots, md.window_mask = window_slots(
                md.block_tables, md.seq_lens, self.cfg.sliding_window, bs
            )
        return md, torch.tensor([s.last_token_id for s in seqs], device=dev), None
