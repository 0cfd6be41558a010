"""The synchronous engine: ``add_request`` / ``step`` / ``abort``. One thread owns it (see
``async_engine``), so the cache and allocator need no locks, like TGI's single allocator task."""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cache.kv_pool import KVPool, KVShape, bytes_per_token, num_blocks_for, pool_problem
from cache.radix import HotWalk
from engine import attention
from engine.config import ConfigError, EngineConfig
from engine.cpu_linear import use_skinny_linear
from engine.cuda_graphs import StepGraphs, graphs_blocker
from engine.detokenizer import find_stop, flush_text, take_delta, update_text
from engine.guided import GuideError, Guides
from engine.kv_manager import KVManager
from engine.kv_scales import KVScaleError, read_kv_scales
from engine.latency import E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS, Histogram
from engine.layer_probe import layer_problem
from engine.model_loader import LoadedModel, load_model, weight_files
from engine.model_runner import ModelRunner
from engine.model_support import UnsupportedModel, serving_limits
from engine.sampler import NoTokenLeft, Sampled, finite_logprob, make_generator, sample, top_alternatives
from engine.scheduler import Scheduler
from engine.sequence import SamplingError, SamplingParams, Sequence, Status, TokenEvent

log = logging.getLogger(__name__)


class BooksBroken(RuntimeError):
    """The KV pool's or the scheduler's bookkeeping failed in a step: not one request's trouble, so not
    failed alone (``LLMEngine._fail``); the engine loop ends and the replica is replaced."""


@contextlib.contextmanager
def _books():
    try:
        yield
    except Exception as e:
        raise BooksBroken(f"{type(e).__name__}: {e}") from e


HOT_WALK_NODES_PER_STEP = 2048  # about a millisecond of Python per engine step


class RequestError(ValueError):
    """A request that cannot be served as asked (too long, bad ids, bad sampling values)."""


@dataclass
class EngineStats:
    """Counters and latency histograms for metrics (read by the serving layer)."""

    requests_finished: int = 0
    requests_failed: int = 0  # of them, ended by an engine error in their own step work (engine._fail)
    requests_aborted: int = 0  # cancelled before they finished (client gone, shutdown)
    warmups_finished: int = 0  # prefill-only requests (warm-up), kept out of the request counters
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_tokens_computed: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))  # arrival to end, finished
    # the latest samples only, for a look at single requests (tests); the metrics read the histograms
    ttft_s: deque = field(default_factory=lambda: deque(maxlen=4096))
    itl_s: deque = field(default_factory=lambda: deque(maxlen=4096))
    e2e_s: deque = field(default_factory=lambda: deque(maxlen=4096))
    steps: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        self.config = config.validate()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        name = attention.register()
        self.loaded = loaded or load_model(config.model_id, config.device, config.dtype)
        m = self.loaded
        m.model.set_attn_implementation(name)
        if problem := layer_problem(m.model, m.device, m.layer_windows):
            raise UnsupportedModel(f"{m.model_id}: {problem}")
        self.tokenizer = m.tokenizer
        self.vocab_size = m.config.vocab_size
        self.eos_ids = self._eos_ids()
        self.guides = Guides(self.tokenizer, self.vocab_size, self.eos_ids)

        self.window = config.window_size or m.sliding_window
        # a model whose layers differ (Gemma 3): no window frees blocks, its sliding layers mask theirs
        self.sliding_layers = frozenset() if self.window is not None else frozenset(
            i for i, w in enumerate(m.layer_windows) if w is not None)
        if config.window_size and config.window_size != m.sliding_window:  # a choice that changes the answers
            log.warning("window_size %d: attention sees the last %d tokens only (the model's own window: %s)",
                        config.window_size, config.window_size, m.sliding_window or next(
                            (f"{w} on some layers" for w in m.layer_windows if w), "none, it attends to all"))
        token_bytes = bytes_per_token(m.num_layers, m.num_kv_heads, m.head_dim, config.kv_cache_dtype, m.dtype)
        num_blocks = num_blocks_for(config.block_size, token_bytes, config.max_batch_total_tokens,
                                    config.kv_memory_fraction, m.device)
        if config.max_batch_total_tokens:  # a pool sized from the free memory fits it by construction
            problem = pool_problem(num_blocks, config.block_size, token_bytes, m.device)
            if problem:
                raise ConfigError(problem)
        self.max_input_tokens, self.max_total_tokens = serving_limits(
            m.config, config.max_input_tokens, config.max_total_tokens, num_blocks * config.block_size)
        self.pool = KVPool(KVShape(m.num_layers, num_blocks, config.block_size, m.num_kv_heads, m.head_dim),
                           config.kv_cache_dtype, m.dtype, m.device)
        self.kv_scales = "1.0"  # where the fp8 scales came from, for the log and /info
        if self.pool.fp8_dtype is not None and Path(m.model_id).is_dir():  # before CUDA graphs keep them
            try:
                scales = read_kv_scales(weight_files(Path(m.model_id)), m.num_layers)
            except KVScaleError as e:
                raise ConfigError(f"{m.model_id}: {e}") from None
            if scales is not None:
                self.pool.set_scales(*scales)
                self.kv_scales = "checkpoint"
        self.kv = KVManager(num_blocks, config.block_size, config.prefix_caching,
                            config.cache_namespace or m.model_id, self.window)
        self.scheduler = Scheduler(self.kv, config.max_batch_prefill_tokens, config.max_num_seqs,
                                   config.max_prefill_chunk_tokens, config.scheduling_policy)
        use_flash = (config.attention_backend in ("auto", "flash") and attention.flash_available(m.device)
                     and self.pool.fp8_dtype is None and m.dtype in (torch.float16, torch.bfloat16)
                     and self.pool.storage_dtype == m.dtype and attention.flash_fits(config.block_size, m.head_dim))
        if config.attention_backend == "flash" and not use_flash:
            raise ConfigError("attention_backend=flash needs CUDA, vllm_flash_attn, an fp16/bf16 model, a KV "
                              "cache of the same dtype, a block_size that is a multiple of 16 and a head size "
                              f"of 32-256 in steps of 32 (this model's: {m.head_dim})")
        self.attention_backend = "flash" if use_flash else "sdpa"
        head = m.model.get_output_embeddings()
        if head is not None and m.device.type == "cpu" and m.dtype == torch.float32:
            use_skinny_linear(head)  # a faster decode lm_head (engine.cpu_linear)
        self.runner = ModelRunner(m.model, self.pool, config.block_size, self.window, use_flash,
                                  self._step_graphs(use_flash), m.layer_windows if self.sliding_layers else ())
        self.requests: dict[str, Sequence] = {}
        self.stats = EngineStats()
        self.capture_logits: dict[str, list[torch.Tensor]] | None = None  # tests: raw logits per step
        self._pending_finished: list[Sequence] = []  # finished before reaching the scheduler
        self._hot: int | None = None  # working set (blocks) at the last complete count
        self._hot_sketch: list[int] = []  # the smallest of its hashes (``cache.hot_sketch``), same count
        self._hot_walk: HotWalk | None = None  # the count in progress, a slice per step while serving
        log.info("engine ready: %s on %s/%s, %d blocks x %d tokens (%.1f MiB KV, %s), backend %s",
                 m.model_id, m.device, m.dtype, num_blocks, config.block_size, self.pool.nbytes / 2**20,
                 self.pool.storage_dtype if self.pool.fp8_dtype is None
                 else f"{self.pool.fp8_dtype}, scales {self.kv_scales}", self.attention_backend)

    def _step_graphs(self, use_flash: bool) -> StepGraphs | None:
        """CUDA graphs for small steps, where they can run (a CUDA device, the SDPA backend, a model whose
        forward never waits on the host)."""
        m = self.loaded
        if m.device.type != "cuda" or not self.config.cuda_graphs:
            return None
        blocker = "the flash backend" if use_flash else graphs_blocker(m.config)
        if blocker:
            log.info("CUDA graphs off: %s", blocker)
            return None
        context = self.max_total_tokens  # a windowed prefill chunk's rows see up to window + chunk - 1 tokens
        if self.window is not None:
            context = min(self.window + max(self.config.cuda_graphs) - 1, context)
        return StepGraphs(m.model, self.pool, self.config.cuda_graphs, context, sliding_layers=self.sliding_layers)

    def capture_graphs(self) -> int:
        """Capture the CUDA graphs of every (rows, context) bucket now rather than on first use, so that
        no request waits for a capture; a replica does this before it takes traffic. Returns how
        many it captured (0 where graphs are off)."""
        g = self.runner.graphs
        if g is None:
            return 0
        t0 = time.perf_counter()
        n = g.capture_all()
        log.info("captured %d CUDA graphs (step sizes %s, contexts up to %d tokens) in %.1f s%s", n, g.sizes,
                 g.max_context, time.perf_counter() - t0, f"; {g.stats.disabled}" if g.stats.disabled else "")
        return n

    def _eos_ids(self) -> set[int]:
        """Every id that ends a sequence: the model config's, ``generation_config.json``'s (where chat
        models list their end-of-turn tokens, e.g. Llama 3's ``<|eot_id|>``) and the tokenizer's."""
        gen = getattr(self.loaded.model, "generation_config", None)
        out: set[int] = set()
        for eos in (getattr(self.loaded.config, "eos_token_id", None), getattr(gen, "eos_token_id", None),
                    getattr(self.tokenizer, "eos_token_id", None)):
            if eos is not None:
                out |= {int(e) for e in eos} if isinstance(eos, (list, tuple)) else {int(eos)}
        outside = {e for e in out if not 0 <= e < self.vocab_size}
        if outside:  # a tokenizer that does not match the model: such an id indexes past the logits
            log.warning("end-of-sequence id(s) %s are outside the model's vocabulary (%d): ignored",
                        sorted(outside), self.vocab_size)
        return out - outside

    # ------------------------------------------------------------------ requests
    def validate(self, prompt_ids: list[int], params: SamplingParams, prefill_only: bool = False,
                 guide_start=None):
        """Raise ``RequestError`` for a request this engine cannot serve (no state changes). Returns its
        guide's compiled start state (``Guides.check``), if it has a guide; ``guide_start``: that state,
        from a validation before (not compiled again)."""
        try:
            params.validate()
        except SamplingError as e:
            raise RequestError(str(e)) from e
        if params.priority and self.config.scheduling_policy != "priority":
            raise RequestError("priority: this server schedules first come, first served (start it with "
                               "--scheduling-policy priority to order requests by priority)")
        if params.guide is not None:
            # what would leave a step no token the guide allows (the sampler would then draw token 0)
            if params.min_tokens:
                raise RequestError("min_tokens cannot be combined with a structured output (its guide decides the end)")
            if params.allowed_token_ids:
                raise RequestError("allowed_token_ids cannot be combined with a structured output")
            try:  # (a bad one is refused before it is queued)
                guide_start = guide_start or self.guides.check(*params.guide)
            except GuideError as e:
                raise RequestError(str(e)) from None
        if params.allowed_token_ids:  # (with none left the sampler would draw token 0, allowed or not)
            left = set(params.allowed_token_ids) - {w[0] for w in params.bad_words_ids if len(w) == 1}
            if params.min_tokens:  # the ending tokens wait for min_tokens
                left -= set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_ids)
            if not left:
                raise RequestError("allowed_token_ids leave no token to generate once one-token bad_words"
                                   + (" and, before min_tokens, the ending tokens" if params.min_tokens else "")
                                   + " are taken out")
        if params.guide_opener is not None and (params.guide_opener >= self.vocab_size
                                                or not self.tokenizer.decode([params.guide_opener],
                                                                             skip_special_tokens=True)):
            raise RequestError(f"guide_opener {params.guide_opener} is not a token with text")
        bad_bias = next((t for t in params.logit_bias if type(t) is not int or not 0 <= t < self.vocab_size), None)
        if bad_bias is not None:
            raise RequestError(f"logit_bias token id {bad_bias!r} is outside the vocabulary (0..{self.vocab_size - 1})")
        for name, ids in (("stop token", params.stop_token_ids), ("allowed_token_ids", params.allowed_token_ids),
                          ("bad_words", [t for w in params.bad_words_ids for t in w])):
            bad_id = next((t for t in ids if t >= self.vocab_size), None)
            if bad_id is not None:
                raise RequestError(f"{name} id {bad_id} is outside the vocabulary (0..{self.vocab_size - 1})")
        n = len(prompt_ids)
        what = "prefix" if prefill_only else "prompt"  # a warm-up prefills a prefix
        if n == 0:
            raise RequestError(f"the {what} is empty")
        if n > self.max_input_tokens:
            raise RequestError(f"the {what} has {n} tokens, more than max_input_tokens ({self.max_input_tokens})")
        bad = next((t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestError(f"token id {bad!r} is outside the vocabulary (0..{self.vocab_size - 1})")
        total = n if prefill_only else n + params.max_new_tokens
        if total > self.max_total_tokens:
            raise RequestError(f"prompt ({n}) + max_new_tokens ({params.max_new_tokens}) = {total} tokens, more "
                               f"than max_total_tokens ({self.max_total_tokens})")
        if total > self.kv.capacity_tokens:
            raise RequestError(f"{total} tokens do not fit the KV pool ({self.kv.capacity_tokens} tokens)")
        return guide_start if params.guide is not None else None

    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, prefill_only: bool = False,
                    arrival: float | None = None, sibling: bool = False, guide_start=None) -> str:
        """Queue a request. ``arrival`` (``time.monotonic()``): when it reached this replica, if earlier
        than now (the async wrapper hands requests over between steps); TTFT counts from it. ``sibling``:
        another choice of a prompt an earlier request of the same client call computed (``n``,
        ``best_of``): the cached prompt it finds is not a second use of it (no reuse protection, not the
        working set). ``guide_start``: what ``validate`` returned for it on another thread (the guide
        is not compiled again here, on the engine's thread, if it left the guides' cache meanwhile)."""
        params = params or SamplingParams()
        guide_start = self.validate(prompt_ids, params, prefill_only, guide_start)
        rid = request_id or uuid.uuid4().hex
        if rid in self.requests:
            raise RequestError(f"request id {rid!r} is already in use")
        ids = list(prompt_ids)
        if prefill_only:  # only whole blocks can be cached; the tail would be wasted work
            ids = ids[: len(ids) // self.config.block_size * self.config.block_size] or ids[:0]
        seq = Sequence(rid, ids, params, prefill_only=prefill_only, sibling=sibling)
        if params.guide is not None:
            try:
                seq.matcher = self.guides.matcher(*params.guide, start=guide_start)
            except GuideError as e:
                raise RequestError(str(e)) from None
            if params.guide_after:
                # a guide that writes a tag itself holds the thinking block too, from the first token
                tags = [params.guide_after] + ([] if params.guide_opener is None
                                               else [self.tokenizer.decode([params.guide_opener])])
                if not any(self.guides.allows_text(seq.matcher, t) for t in tags):
                    seq.guide_wait = "marker" if params.guide_opener is None else "opener"
        if arrival is not None:
            seq.arrival = arrival
        if not params.greedy:
            seq.generator = make_generator(params.seed)
        if params.min_tokens or seq.guide_wait is not None:  # (a guided answer cannot end before its thinking does)
            seq.ends = tuple(sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_ids)))
        self.requests[rid] = seq
        self.stats.prompt_tokens += len(ids)
        if not ids:  # warm-up shorter than a block: nothing to cache
            seq.status = Status.FINISHED
            seq.finish_reason = "warmup"
            self._pending_finished.append(seq)
        else:
            self.scheduler.add(seq)
        return rid

    def abort(self, request_id: str) -> bool:
        """Stop a request at once and give back its blocks; False if it is unknown or done."""
        seq = self.requests.pop(request_id, None)
        if seq is not None and seq in self._pending_finished:  # (a warm-up with nothing to cache: not sent yet)
            self._pending_finished.remove(seq)
            seq.finish_reason = "abort"
            return True
        if seq is None or seq.status is Status.FINISHED:
            return False
        self.scheduler.remove(seq)
        seq.finish_reason = "abort"
        if not seq.prefill_only:
            self.stats.requests_aborted += 1
        return True

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending_finished)

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[TokenEvent]:
        """Run one batch; returns the events it produced (tokens, finishes)."""
        events = [self._finish(seq, seq.finish_reason or "warmup") for seq in self._pending_finished]
        self._pending_finished = []
        plan = self.scheduler.schedule()
        for seq in plan.finished_at_admission:
            events.append(self._finish(seq, "warmup"))
        if not plan.chunks:
            return events
        self.stats.steps += 1
        if self._hot_walk is not None and self._hot_walk.advance(HOT_WALK_NODES_PER_STEP):
            self._took_hot_count(self._hot_walk)
        sample_mask = [c.seq.num_computed + c.num_tokens == c.seq.num_tokens and not c.seq.prefill_only
                       for c in plan.chunks]
        all_rows = [c.seq.wants_prompt_logprobs for c in plan.chunks]
        logits = self.runner.forward(plan.chunks, sample_mask, all_rows if any(all_rows) else None)
        if any(all_rows):
            logits = self._prompt_logprobs(plan.chunks, sample_mask, all_rows, logits)
        now = time.monotonic()
        to_sample: list[Sequence] = []
        for c, wants in zip(plan.chunks, sample_mask, strict=True):
            seq = c.seq
            if seq.num_computed < len(seq.prompt_ids):
                self.stats.prefill_tokens_computed += min(c.num_tokens, len(seq.prompt_ids) - seq.num_computed)
            seq.num_computed += c.num_tokens
            self.kv.publish(seq)  # KV is written now: publish full blocks
            if wants:
                to_sample.append(seq)
            elif seq.prefill_only and seq.num_computed == seq.num_tokens:
                events.append(self._finish(seq, "warmup"))
        if to_sample:
            if self.capture_logits is not None:
                for row, seq in zip(logits, to_sample, strict=True):
                    self.capture_logits.setdefault(seq.request_id, []).append(row.clone())
            try:
                sampled: list[Sampled | Exception] = list(sample(logits, to_sample))
            except Exception:  # noqa: BLE001 - one request's adjustments (its guide, ...): find whose
                sampled = self._sample_each(logits, to_sample)
            for seq, s in zip(to_sample, sampled, strict=True):
                try:
                    if isinstance(s, Exception):
                        raise s
                    events.append(self._append_token(seq, s, now))
                except BooksBroken:
                    raise  # (the pool's or the scheduler's books: every request's, the engine loop ends)
                except Exception as e:  # noqa: BLE001 - fails that request alone; the batch goes on
                    events.append(self._fail(seq, e))
        return events

    @staticmethod
    def _sample_each(logits: torch.Tensor, seqs: list[Sequence]) -> list[Sampled | Exception]:
        """Each row on its own (the batch's sampling failed): its token, or what failed it. ``sample``
        adjusts copies of the rows, so a row is sampled here as it would have been in the batch."""
        out: list[Sampled | Exception] = []
        for i, seq in enumerate(seqs):
            try:
                out.append(sample(logits[i:i + 1], [seq])[0])
            except Exception as e:  # noqa: BLE001
                out.append(e)
        return out

    def _fail(self, seq: Sequence, e: Exception) -> TokenEvent:
        """End a request whose own step work (its sampling, text, guide) raised: it gets the error, its
        blocks go back, and the other requests of the step go on (a replica restart would lose them all)."""
        ev = self._finish(seq, "error")
        if isinstance(e, (GuideError, NoTokenLeft)):  # its own guide or constraints: its fault, not the engine's
            # (not counted as failed: an alert on engine failures must not fire on clients' input)
            log.warning("request %s: %s", seq.request_id, e)
            ev.error, ev.error_kind = str(e), "validation"
            return ev
        self.stats.requests_failed += 1
        log.error("request %s failed in a step, the others go on", seq.request_id, exc_info=e)
        ev.error, ev.error_kind = f"engine failure: {type(e).__name__}: {e}", "engine"
        return ev

    def _prompt_logprobs(self, chunks: list, sample_mask: list[bool], all_rows: list[bool],
                         logits: torch.Tensor) -> torch.Tensor:
        """Record the prompt log-probabilities the rows of ``all_rows`` chunks give (row p: the
        distribution of token p + 1); returns the rows to sample from."""
        sampled, r = [], 0
        for c, wants, every in zip(chunks, sample_mask, all_rows, strict=True):
            n = c.num_tokens if every else int(wants)
            seq, rows = c.seq, logits[r:r + n]
            r += n
            if wants:
                sampled.append(rows[-1:])
            if not every:
                continue
            start = seq.num_computed
            if start == 0 or seq.prompt_logprobs is None:  # (again from the start after a preemption)
                seq.prompt_logprobs = [None]
            m = min(c.num_tokens, len(seq.prompt_ids) - 1 - start)
            if m <= 0:
                continue
            lp = torch.log_softmax(rows[:m], dim=-1)
            targets = torch.tensor(seq.prompt_ids[start + 1:start + 1 + m], device=lp.device)
            picked = lp.gather(1, targets.unsqueeze(1))
            ranks = (lp > picked).sum(dim=1).add(1).tolist()
            seq.prompt_logprobs.extend(
                (finite_logprob(p), rank, top) for p, rank, top in
                zip(picked.squeeze(1).tolist(), ranks, top_alternatives(lp, seq.params.prompt_logprobs), strict=True))
        return torch.cat(sampled) if sampled else logits[:0]

    def _append_token(self, seq: Sequence, s: Sampled, now: float) -> TokenEvent:
        tok = s.token
        if seq.first_token_time is None:
            seq.first_token_time = now
            self.stats.ttft.observe(now - seq.arrival)
            self.stats.ttft_s.append(now - seq.arrival)
        else:
            self.stats.itl.observe(now - seq.last_token_time)
            self.stats.itl_s.append(now - seq.last_token_time)
        seq.last_token_time = now
        seq.output_ids.append(tok)
        self.stats.generated_tokens += 1
        p = seq.params
        # a guided request ends where its guide is complete (the token that completes it is text)
        if seq.guide_wait == "opener":  # the first token: the opener starts the thinking, any other the guide
            seq.guide_wait = "marker" if tok == p.guide_opener else None
        guide_done = seq.matcher is not None and seq.guide_wait is None and self.guides.step(seq.matcher, tok)
        reason = None
        stop_reason: str | int | None = None  # which stop string or stop token ended it (vLLM's field)
        if tok in self.eos_ids and (not p.ignore_eos or guide_done):  # (an EOS its guide ended on ends it,
            reason = "eos"  # ignore_eos or not: no text, as any ending token)
        elif tok in p.stop_token_ids:
            reason, stop_reason = "stop", tok
        before = start = len(seq.text)  # this token's text starts here (a held-back byte: where it completes)
        by_string = False
        if reason is None:  # the token that ends a request (EOS, a stop token) is not text
            own = update_text(self.tokenizer, seq)
            start = start if own is None else own
            if seq.guide_wait == "marker" and (at := seq.text.find(p.guide_after, max(0, before - len(p.guide_after)))) >= 0:
                seq.guide_wait = None  # the thinking is over: the guide holds the rest, and any text this
                tail = seq.text[at + len(p.guide_after):].lstrip()  # token wrote after the tag already
                if tail:
                    if not self.guides.consume_text(seq.matcher, tail):
                        # (a tag of several tokens, whose last one wrote more than the guide starts with: the
                        # answer cannot be what was asked for, and ends as a guide that broke off, not "stop")
                        raise GuideError(f"the guide cannot go on: the text after {p.guide_after!r} is not "
                                         f"what it allows: {tail[:40]!r}")
                    guide_done = seq.matcher.is_stopped() or seq.matcher.is_error()
            # stop strings count past min_tokens (as in vLLM: the token after the min_tokens-th may complete one
            # that began before, as an ending token may come there at the earliest), and only ones this
            # token completes
            if len(seq.output_ids) > p.min_tokens and (stop_reason := find_stop(seq, before)):
                reason, by_string = "stop", True
        by_guide = reason is None and guide_done  # (an EOS or stop token that ended the guide is no text)
        if by_guide:
            reason = "stop"
        elif reason is None and len(seq.output_ids) >= p.max_new_tokens:
            reason = "length"
        if reason is not None and not by_string:
            # the end: bytes held back for a character that never completed are text too, and so is
            # the ending token when the client asked for it (include_stop_str_in_output, as vLLM)
            before = len(seq.text)
            keep_end = reason == "length" or by_guide or p.include_stop_str_in_output
            own = flush_text(self.tokenizer, seq, len(seq.output_ids) - (not keep_end))
            if keep_end and own is not None:
                start = own
            if found := find_stop(seq, before):
                reason, stop_reason = "stop", found
        if reason is None:
            with _books():
                self.kv.trim_window(seq)
            ev = TokenEvent(seq.request_id, tok, take_delta(seq, final=False), s.logprob, False,
                            num_prompt_tokens=len(seq.prompt_ids), num_cached_tokens=seq.num_cached_prompt_tokens,
                            num_output_tokens=len(seq.output_ids), top_logprobs=s.top, text_offset=start)
        else:
            with _books():
                ev = self._finish(seq, reason)
            ev.token_id, ev.logprob, ev.top_logprobs, ev.stop_reason = tok, s.logprob, s.top, stop_reason
            ev.text_offset = min(start, len(seq.text))  # a stop string left out of the text took its place
        if len(seq.output_ids) == 1 and seq.params.prompt_logprobs is not None:
            ev.prompt_logprobs = seq.prompt_logprobs
        return ev

    def _finish(self, seq: Sequence, reason: str) -> TokenEvent:
        if seq.status is not Status.FINISHED:  # still queued or running: give its blocks back
            self.scheduler.remove(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        self.requests.pop(seq.request_id, None)
        if seq.prefill_only:
            self.stats.warmups_finished += 1
        else:
            self.stats.requests_finished += 1
            e2e = time.monotonic() - seq.arrival
            self.stats.e2e.observe(e2e)
            self.stats.e2e_s.append(e2e)
        return TokenEvent(seq.request_id, None, take_delta(seq, final=True), None, True, reason,
                          num_prompt_tokens=len(seq.prompt_ids), num_cached_tokens=seq.num_cached_prompt_tokens,
                          num_output_tokens=len(seq.output_ids))

    # ------------------------------------------------------------------ conveniences
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[Sequence]:
        """Run ``prompts`` to completion (offline use and tests); returns finished sequences in order."""
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        seqs: list[Sequence] = []
        try:
            for ids, p in zip(prompts, plist, strict=True):
                rid = self.add_request(ids, p)
                seqs.append(self.requests[rid])
        except BaseException:  # one refused: none of the batch runs (the next call would run them unasked)
            for seq in seqs:
                self.abort(seq.request_id)
            raise
        while self.has_work():
            self.step()
        return seqs

    def check_invariants(self) -> None:
        """Assert every KV block is accounted for (free, cached or held by a live request)."""
        live = list(self.scheduler.running) + [s for s in self.scheduler.waiting if s.block_table]
        self.kv.check(live)

    def hot_blocks(self, window_s: float) -> int:
        """Cached blocks that served a hit in the last ``window_s`` seconds (the working set). Idle (or
        the first time), counted now; while serving, the last complete count, and a new one starts that
        the next steps carry on a slice at a time (a whole walk would stall the running requests)."""
        c = self.kv.cache
        if c is None:
            return 0
        if self._hot is None or not self.scheduler.has_work():
            self._took_hot_count(c.hot_walk(c.wall_clock() - window_s, whole=True))
        elif self._hot_walk is None:
            self._hot_walk = c.hot_walk(c.wall_clock() - window_s)
        return self._hot

    def hot_sketch(self) -> list[int]:
        """The smallest hashes of the working set ``hot_blocks`` last counted (``cache.hot_sketch``): the
        fleet's merge into a count of its distinct hot blocks, a prefix every replica holds counted once."""
        return self._hot_sketch

    def _took_hot_count(self, walk: HotWalk) -> None:
        self._hot, self._hot_sketch, self._hot_walk = walk.blocks, walk.sketch.values(), None

    def kv_stats(self) -> dict:
        a = self.kv.allocator
        c = self.kv.cache
        counters = c.counters if c is not None else None
        return {
            "blocks_total": a.num_blocks,
            "blocks_free": a.num_free,
            "blocks_cached": c.cached_blocks if c is not None else 0,
            "blocks_evictable": a.num_evictable,
            "blocks_in_use": a.num_in_use,
            "block_size": self.config.block_size,
            "prefix_queries_tokens": counters.query_tokens if counters else 0,
            "prefix_hit_tokens": counters.hit_tokens if counters else 0,
            "evicted_blocks": counters.evicted_blocks if counters else 0,
            "recomputed_blocks": counters.recomputed_blocks if counters else 0,
            "preemptions": self.scheduler.num_preemptions,
            "running": len(self.scheduler.running),
            "waiting": self.scheduler.num_waiting,
        }
