"""LLMEngine: requests in, tokens out, one `step()` at a time (synchronous; AsyncEngine drives it).

It wires the scheduler (what runs), the model runner (the forward) and the sampler, and owns request
life cycles: validation, stop conditions, streaming detokenization, abort, and the disaggregation hooks
(prefill-only requests that keep their KV for export; requests whose KV is imported from elsewhere).
"""

from __future__ import annotations

import logging
import time
from typing import Literal

import torch

from pdcluster.worker.engine.block_manager import BlockManager
from pdcluster.worker.engine.config import ModelConfig
from pdcluster.worker.engine.engine_config import EngineConfig
from pdcluster.worker.engine.kv_cache import layer_kv_dtypes
from pdcluster.worker.engine.kv_connector import KVConnectorBase, KVLayout
from pdcluster.worker.engine.kv_io import EngineKVIO
from pdcluster.worker.engine.model_runner import ModelRunner
from pdcluster.worker.engine.outputs import FinishReason, RequestOutput
from pdcluster.worker.engine.parallel.runner import TPModelRunner
from pdcluster.worker.engine.sampler import History, logprobs_of, sample
from pdcluster.worker.engine.sampling_params import SamplingParams
from pdcluster.worker.engine.scheduler import Batch, Scheduler
from pdcluster.worker.engine.sequence import Sequence, SequenceStatus
from pdcluster.worker.engine.stop_text import StopText
from pdcluster.worker.engine.structured import GrammarBackend, GrammarState
from pdcluster.worker.engine.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger(__name__)


class LLMEngine(EngineKVIO):
    """The disaggregation side (KV export and import) is `EngineKVIO` (kv_io.py)."""

    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.model_config = ModelConfig.from_folder(config.model)
        # The upper bound needs the model: check it before loading weights (fail fast, name the field).
        layer_kv_dtypes(self.model_config.num_layers, config.kv_cache_dtype, config.full_precision_layers)
        self.tokenizer = Tokenizer.from_folder(config.model)
        self.max_model_len = min(config.max_model_len or 1 << 62, self.model_config.max_position_embeddings)
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        self.grammar = GrammarBackend(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        self._grammars: dict[str, GrammarState] = {}  # structured-output requests' matchers
        self.runner: ModelRunner | TPModelRunner
        if config.tensor_parallel_size > 1:  # rank 0 of N processes (parallel/runner.py)
            self.runner = TPModelRunner(self.model_config, config, self.max_model_len)
        else:
            self.runner = ModelRunner(self.model_config, **config.runner_kwargs(self.max_model_len))
        num_blocks = self.runner.cache.num_blocks
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        host = self.runner.num_host_blocks
        self.host_block_manager = BlockManager(host, config.block_size, False) if host else None
        self.scheduler = Scheduler(
            self.block_manager,
            self.host_block_manager,
            max_batch_size=config.max_batch_size,
            max_batch_tokens=config.max_batch_tokens,
            watermark=config.watermark,
            preemption_mode=config.preemption_mode,
            choose_mode=self._cheaper_preemption,
            mixed=config.mixed_steps,
        )
        self.seqs: dict[str, Sequence] = {}  # every request that holds state here
        self.kv_connector: KVConnectorBase | None = None  # where prefill-only requests send their KV
        self.idle = False
        self._pending: list[RequestOutput] = []  # outputs produced between steps (imports)
        self._detok: dict[str, StopText] = {}
        self._prefill_tps = 2000.0  # running estimate of prefill tokens/s, for "auto" preemption
        # Measured prefill throughput for the router (/internal/load): decayed sums of prefill tokens and step
        # seconds, so long steps weigh more than short ones and nothing is reported before the first step.
        self._prefill_tokens_decayed = 0.0
        self._prefill_seconds_decayed = 0.0
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "requests": 0, "steps": 0}

    # -- requests ---------------------------------------------------------------------------------------

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        params.validate()
        if not prompt_token_ids:
            raise ValueError("prompt is empty")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad!r} is outside the vocabulary [0, {vocab})")
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_token_ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds "
                f"the model length ({self.max_model_len})"
            )
        if self.block_manager.blocks_for(total) > self.block_manager.num_blocks:
            raise ValueError(f"request needs {total} tokens of KV cache; the whole cache holds fewer")
        if params.structured_kind and self.tokenizer is None:
            raise ValueError("structured output needs the model's tokenizer (this model has no tokenizer.json)")

    def compile_grammar(self, params: SamplingParams) -> None:
        """Compile (and cache) a structured-output request's grammar; any thread. ValueError: a bad spec."""
        if params.structured_kind:
            self.grammar.compile(params.structured_kind, params.structured_spec)

    def _new_grammar(self, prompt_token_ids: list[int], params: SamplingParams) -> GrammarState | None:
        """The request's matcher, advanced over the output tokens its prompt ends with (a resume's)."""
        if not params.structured_kind:
            return None
        n = params.first_output_index
        replay = prompt_token_ids[len(prompt_token_ids) - n:] if n else []
        return self.grammar.state(params.structured_kind, params.structured_spec, replay)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prefill_only: bool = False,
    ) -> None:
        """Queue a request; raises ValueError for invalid input. With ``prefill_only`` the request finishes
        after its first token but keeps its KV blocks (for export) until ``release``, and its KV leaves
        layer by layer through the attached KV connector, if any (see kv_connector.py)."""
        if request_id in self.seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.validate_request(prompt_token_ids, params)
        grammar = self._new_grammar(prompt_token_ids, params)
        seq = Sequence(request_id, prompt_token_ids, params, prefill_only=prefill_only)
        self.seqs[request_id] = seq
        if grammar is not None:
            self._grammars[request_id] = grammar
        if self.tokenizer is not None:
            self._detok[request_id] = StopText(IncrementalDetokenizer(self.tokenizer, prompt_token_ids))
        self.counters["requests"] += 1
        self.counters["prompt_tokens"] += len(prompt_token_ids)  # once, even if preemption recomputes it
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its blocks. False if unknown (already finished)."""
        seq = self.seqs.get(request_id)
        if seq is None:
            return False
        self._finish(seq, "abort")
        return True

    def release(self, request_id: str) -> None:
        """Free the blocks a finished prefill-only request kept for export (no-op if unknown)."""
        seq = self.seqs.get(request_id)
        if seq is not None:
            self._finish(seq, seq.finish_reason)

    def set_kv_connector(self, connector: KVConnectorBase | None) -> None:
        """Attach the transfer backend that prefill-only requests export their KV through (None detaches)."""
        self.kv_connector = connector

    @property
    def kv_layout(self) -> KVLayout:
        mc = self.model_config
        return KVLayout(mc.num_layers, mc.num_kv_heads, mc.head_dim, self.config.block_size)

    @property
    def fault(self) -> str | None:
        """Why this engine can no longer run a step (a tensor-parallel rank died), else None."""
        return self.runner.fault if isinstance(self.runner, TPModelRunner) else None

    def close(self) -> None:
        """Stop the tensor-parallel follower processes, if any (idempotent)."""
        if isinstance(self.runner, TPModelRunner):
            self.runner.close()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending)

    # -- the step ---------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        batch = self.scheduler.schedule()
        self.idle = batch is None  # work exists but none can run now (e.g. blocks held for export)
        if batch is None:
            return outputs
        self.counters["steps"] += 1
        if batch.is_prefill:  # when each request first got compute: its queue time ends here (metrics)
            now = time.monotonic()
            for s in batch.seqs:
                s.first_scheduled_at = s.first_scheduled_at or now
        exports = self._exports(batch)
        hook = (lambda layer: self._save_layer(layer, exports)) if exports else None  # noqa: E731
        t0 = time.perf_counter()
        greedy = self._greedy_runner(batch)
        logits_or_ids = greedy.execute_greedy(batch, hook) if greedy is not None else self.runner.execute(batch, hook)
        for seq, _, end in exports:
            seq.num_exported_tokens = end
        nd = batch.num_decode if batch.is_prefill else len(batch.seqs)  # decoding seqs lead a mixed step
        done = batch.seqs[:nd]
        for s in done:
            s.num_computed_tokens += 1
            self.block_manager.commit(s)
        if batch.is_prefill:
            n_tokens = sum(batch.num_new_tokens[nd:])
            took = max(time.perf_counter() - t0, 1e-6)
            self._prefill_tps = 0.8 * self._prefill_tps + 0.2 * n_tokens / took
            self._prefill_tokens_decayed = 0.9 * self._prefill_tokens_decayed + n_tokens
            self._prefill_seconds_decayed = 0.9 * self._prefill_seconds_decayed + took
            done = done + [
                s
                for s, n in zip(batch.seqs[nd:], batch.num_new_tokens[nd:], strict=True)
                if self.scheduler.finish_prefill_chunk(s, n)
            ]
        if not done:
            return outputs
        if greedy is not None:
            ids: list[int | None] = logits_or_ids.tolist()
            tokens, logits = ids, None
        else:
            logits = logits_or_ids
            tokens = self._sample(logits, done)
        for i, (seq, token) in enumerate(zip(done, tokens, strict=True)):
            if token is None:  # its sampling raised: that request failed alone (see _sample)
                outputs.append(self._fail(seq, "sampling failed"))
                continue
            try:
                out = self._append_token(seq, token)
            except Exception as e:  # one request's data (e.g. its stop list) must not fail the others
                outputs.append(self._fail(seq, f"{type(e).__name__}: {e}"))
                continue
            if logits is not None and seq.params.logprobs is not None:
                out.logprobs = self._logprobs(seq, logits[i], token)
            if logits is not None and self.config.debug_logits:
                out.extra["logits"] = logits[i].clone()
            first = batch.is_prefill and i >= nd  # its prompt's last chunk ran in this step
            if first:  # the first token: where its TTFT went, and how much came from the cache
                out.extra["scheduled_at"], out.extra["cached_tokens"] = seq.first_scheduled_at, seq.num_cached_tokens
            if first and not seq.is_finished:
                if seq.prefill_only:
                    seq.status = SequenceStatus.PREFILLED  # holds its blocks until release()
                    out.finished, out.extra["kv_held"] = True, True
                else:
                    self.scheduler.start_decoding(seq)
            outputs.append(out)
        return outputs

    def _greedy_runner(self, batch: Batch) -> ModelRunner | None:
        """The runner, when every row of the step takes its plain argmax and nothing reads the logits: it may
        answer with token ids alone (greedy_head.py), never with a different token. None: sample the logits."""
        runner = self.runner
        if (isinstance(runner, ModelRunner) and not self.config.debug_logits
                and all(s.params.greedy and not s.params.shapes_logits and s.params.logprobs is None
                        for s in batch.seqs)):
            return runner
        return None

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int | None]:
        """One token per sequence; a sequence whose sampling raises gets None (the others still sample).
        The batch is sampled at once; only when that raises is it redone row by row to find the culprit."""
        index = [s.num_output_tokens + s.params.first_output_index for s in seqs]
        hist = [self._history(s) if s.params.shapes_logits else None for s in seqs]
        try:
            return list(sample(logits, [s.params for s in seqs], index, hist))
        except Exception:
            log.exception("sampling the batch failed; retrying row by row")
        out: list[int | None] = []
        for i, s in enumerate(seqs):
            try:
                out.append(sample(logits[i : i + 1], [s.params], [index[i]], [hist[i]])[0])
            except Exception:
                log.exception("request %s: sampling failed", s.request_id)
                out.append(None)
        return out

    def _history(self, seq: Sequence) -> History:
        # A resumed request's prompt ends with the output tokens already delivered (first_output_index of them).
        start = seq.num_prompt_tokens - seq.params.first_output_index
        p = seq.params
        stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)
        grammar = self._grammars.get(seq.request_id)
        allowed = grammar.allowed() if grammar is not None else None
        return History(seq.token_ids[:start], seq.token_ids[start:], stop_ids, allowed)

    def _logprobs(self, seq: Sequence, row: torch.Tensor, token: int) -> list[dict]:
        """The OpenAI logprobs entry of one sampled token (token strings from the tokenizer, if any)."""
        lp, top = logprobs_of(row, token, seq.params.logprobs or 0)

        def entry(t: int, v: float) -> dict:
            text = self.tokenizer.decode([t], skip_special_tokens=False) if self.tokenizer is not None else ""
            return {"token_id": t, "token": text or f"token_id:{t}", "logprob": v, "bytes": list(text.encode())}

        return [{**entry(token, lp), "top": [entry(t, v) for t, v in top]}]

    def _fail(self, seq: Sequence, message: str) -> RequestOutput:
        """End one request with an error (its blocks come back); the rest of the step goes on."""
        log.warning("request %s failed: %s", seq.request_id, message)
        if not seq.is_finished:
            self._finish(seq, "error")
        return RequestOutput(seq.request_id, [], finished=True, finish_reason="error", error=message,
                             prompt_tokens=seq.num_prompt_tokens, completion_tokens=seq.num_output_tokens)

    def _append_token(self, seq: Sequence, token: int) -> RequestOutput:
        seq.token_ids.append(token)
        self.counters["generation_tokens"] += 1
        p = seq.params
        reason: Literal["stop", "length"] | None = None
        # Below min_tokens nothing stops the request but its length (vLLM: EOS / stop ids are masked in the
        # sampler too; stop strings are not looked for). Counted over the whole output, resumes included.
        may_stop = seq.num_output_tokens + p.first_output_index >= p.min_tokens
        if may_stop and (token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids)):
            reason = "stop"
        elif seq.num_output_tokens >= p.max_tokens or len(seq) >= self.max_model_len:
            reason = "length"
        grammar = self._grammars.get(seq.request_id)
        if grammar is not None:
            grammar.accept(token)  # raises for a token the mask let through by mistake: that request fails
            if grammar.terminated:  # the grammar ended (its stop token): done, whatever ignore_eos says
                reason = "stop"
        text = ""
        state = self._detok.get(seq.request_id)
        if state is not None:
            text, hit_stop = state.add(token, p.stop if may_stop else [], final=reason is not None)
            if hit_stop:
                reason = "stop"
        out = RequestOutput(
            seq.request_id,
            [token],
            text,
            prompt_tokens=seq.num_prompt_tokens,
            completion_tokens=seq.num_output_tokens,
        )
        if reason is not None:
            self._finish(seq, reason)
            out.finished, out.finish_reason = True, reason
        return out

    def _finish(self, seq: Sequence, reason: FinishReason | None) -> None:
        self.scheduler.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.seqs.pop(seq.request_id, None)
        self._detok.pop(seq.request_id, None)
        self._grammars.pop(seq.request_id, None)

    def _cheaper_preemption(self, seq: Sequence) -> Literal["swap", "recompute"]:
        swap_s = 2 * len(seq.block_table) * self.runner.block_bytes / self.config.host_bandwidth
        recompute_s = len(seq) / self._prefill_tps
        return "swap" if swap_s < recompute_s else "recompute"

    # -- convenience ------------------------------------------------------------------------------------

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[list[int]]:
        """Run prompts to completion in one continuous batch; the generated ids of each, in order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{id(self)}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, plist, strict=True):
            self.add_request(rid, prompt, p)
        result: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_unfinished():
            for out in self.step():
                result[out.request_id].extend(out.new_token_ids)
        return [result[rid] for rid in ids]

    def stats(self) -> dict[str, float | int]:
        bm = self.block_manager
        return {
            "requests_waiting": len(self.scheduler.waiting),
            "requests_running": len(self.scheduler.running),
            "requests_swapped": len(self.scheduler.swapped),
            "kv_cache_total_blocks": bm.num_blocks,
            "kv_cache_block_size": bm.block_size,
            "kv_cache_used_blocks": bm.num_used_blocks,
            "kv_cache_usage_ratio": bm.num_used_blocks / bm.num_blocks,
            "preemptions_total": self.scheduler.num_preemptions,
            "prefix_cache_hit_blocks": bm.prefix_hits,
            "prefix_cache_hit_tokens": bm.prefix_hits * bm.block_size,
            "prefix_cache_query_tokens": bm.prefix_query_tokens,
            "prompt_tokens_total": self.counters["prompt_tokens"],
            "generation_tokens_total": self.counters["generation_tokens"],
            "requests_total": self.counters["requests"],
            # 0.0 until a prefill step ran: the router then has no estimate of this worker's prefill speed
            "prefill_tokens_per_s": (self._prefill_tokens_decayed / self._prefill_seconds_decayed
                                     if self._prefill_seconds_decayed > 0 else 0.0),
            "max_batch_size": self.config.max_batch_size,
        }
