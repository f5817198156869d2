"""`Engine`: requests that come and go, served from one paged KV cache (continuous batching).

    engine = jaxinfer.Engine(model)
    rid = engine.add_request("Hello", max_tokens=32)      # at any time
    while engine.has_unfinished():
        for out in engine.step():                          # RequestOutput per request that got tokens
            print(out.request_id, out.new_token_ids, out.finished)

Each `step()` schedules (jaxinfer/engine/scheduler.py: decode rows, then prefill chunks under a
token budget, admission by free pages, preemption by recompute), dispatches the jitted prefill
chunk and decode steps (jaxinfer/engine/step.py), and only then reads the tokens of the
previous step: the device runs step n + 1 while the host turns step n's tokens into outputs,
so a step returns the tokens of the step before it. Shapes are bucketed (rows and chunk
lengths to powers of two, the block table to the longest row's pages, or to the table's full
width where the Pallas kernels read only valid pages), so a running engine compiles a few
executables and then none.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import memory, sampling
from jaxinfer import prompts as prompts_lib
from jaxinfer.cache import PagedKVCache, check_kv_dtype
from jaxinfer.engine import step as step_lib
from jaxinfer.engine.pages import PagePool
from jaxinfer.engine.scheduler import Request, Scheduler, Status
from jaxinfer.ops.dispatch import kernels_on
from jaxinfer.sampling import SamplingParams, SamplingTensors

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """The tokens one request got in one step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float] | None  # when its SamplingParams asked for logprobs
    finished: bool
    finish_reason: str | None  # "stop" (EOS, stop token or string), "length", or None
    # Per new token, its SamplingParams.top_logprobs most likely tokens: [(id, logprob), ...]
    new_top_logprobs: list[list[tuple[int, float]]] | None = None
    # Speculative engines: drafts proposed to the request and accepted, in this output.
    draft_tokens: int = 0
    accepted_tokens: int = 0


def _pow2(n: int, lo: int = 1) -> int:
    return max(lo, 1 << max(n - 1, 0).bit_length())


# The references' narrowest block table (pages; 512 tokens in CPU's pages of 16): a gather of
# that many slots costs little beside a step's matmuls, and each width is one more program.
MIN_WIDTH = 32


def _bucket(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket >= n (buckets ascending; the last one is the most there is)."""
    return next((b for b in buckets if b >= n), buckets[-1])


def _kv_budget(kv_memory) -> int:
    """Bytes for the page pools: a fraction (0, 1] of the free device memory, or bytes (a
    number, or a string: "0.5" or "8GB")."""
    free, what = memory.budget()
    if isinstance(kv_memory, str):
        try:
            kv_memory = float(kv_memory)
        except ValueError:
            return memory.parse_bytes(kv_memory)
    if isinstance(kv_memory, bool) or not isinstance(kv_memory, (int, float)) or kv_memory <= 0:
        raise ValueError(f"kv_memory must be a fraction in (0, 1] of the free memory, a byte "
                         f"count or a string like '8GB', got {kv_memory!r}")
    if kv_memory <= 1:
        if free is None:
            raise ValueError(f"the free memory of {what} is unknown: give kv_memory in bytes")
        return int(free * kv_memory)
    return int(kv_memory)


class Engine:
    """Continuous batching over a paged KV cache with prefix caching and chunked prefill.

    model: a loaded `jaxinfer.Model` (MLA models page their latent: cache.PagedLatentCache).
    max_num_seqs: requests running at once (rows of a decode step). page_size: tokens per
    page (a power of two; default 64 on a GPU, the kernels' key tile, 16 on CPU).
    kv_memory: the page pools' size: a fraction of the free memory after the params (default
    0.8 on a GPU; on CPU 0.25, capped at what max_num_seqs full-length requests need) or
    bytes. max_model_len: the longest prompt + output a request may have (default the
    model's context, at most 32768 on a GPU and 4096 on CPU). max_num_batched_tokens: the
    token budget of a step (decode rows count `decode_steps` each); chunk_size: the most
    prompt tokens of one request per step (a power of two; default 512, or max_model_len's
    power of two where less). decode_steps: decode steps dispatched per engine step before
    the host reads them (fewer host round trips; a finished request wastes up to
    decode_steps - 1). max_prefill_rows: requests whose prompt chunks share a step (at most
    max_num_seqs).
    row_buckets: the batch sizes that get compiled programs, a step's rows padded up to the
    next (prefill rows capped at max_prefill_rows; max_num_seqs always one); default the
    powers of two (on a GPU 1, then 8 and up: a step reads the weights whatever its rows).
    Fewer sizes compile fewer programs; on CPU padding rows cost their compute.
    prefix_caching: share the K/V pages of equal prompt prefixes. kv_cache_dtype: None,
    "int8" or "fp8" (cache.py). policy: the kernel policy (default the model's). seed: the
    seed of requests that give none (their key id is their arrival number).
    speculative: None, "ngram" / a `speculative.NGram` (prompt lookup), a draft model with
    the same tokenizer (its K/V in page pools of its own, at the target's page indices), or a
    feature head: "head" (the EAGLE head saved beside the model), "mtp" (DeepSeek-V3's
    module from its checkpoint) or a `draft_head.FeatureHead` (its one layer's K/V or latent
    and the target's features in pages at the target's page indices, step.HeadPages, so
    prefix-cache hits and chunked prefills carry them): num_speculative_tokens drafts per
    decode row, verified in one step (the same tokens as without); a speculative step's
    tokens are read before the next is dispatched (the next positions depend on them).
    """

    def __init__(self, model, *, max_num_seqs: int | None = None, page_size: int | None = None,
                 kv_memory=None, max_model_len: int | None = None,
                 max_num_batched_tokens: int | None = None, chunk_size: int | None = None,
                 decode_steps: int = 1, max_prefill_rows: int = 4, prefix_caching: bool = True,
                 kv_cache_dtype: str | None = None, policy=None, seed: int = 0,
                 speculative=None, num_speculative_tokens: int = 4, row_buckets=None):
        from jaxinfer.generate import _plan, run_params

        config = model.config
        check_kv_dtype(kv_cache_dtype, "kv_cache_dtype")
        gpu = jax.default_backend() == "gpu"
        self.model = model
        self.plan = _plan(model, policy)
        if self.plan.sharded:
            raise ValueError("the engine runs on one device for now; load the model without "
                             "a mesh")
        self.params = run_params(model, self.plan)
        self.kernels = kernels_on(self.plan, config.dtype)

        def positive(name, value):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
            return int(value)

        self.max_num_seqs = positive("max_num_seqs", max_num_seqs or (64 if gpu else 16))
        page_size = positive("page_size", page_size or (64 if gpu else 16))
        if page_size & (page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {page_size}")
        context = config.max_position_embeddings
        self.max_model_len = positive("max_model_len",
                                      max_model_len or min(context, 32768 if gpu else 4096))
        if self.max_model_len > context:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's context "
                             f"of {context} tokens")
        # (default: 512, or the context's power of two where shorter: a chunk past it never
        # comes, and each chunk length is a program warmup compiles)
        chunk = positive("chunk_size", chunk_size or min(512, _pow2(self.max_model_len)))
        self.chunk_size = _pow2(chunk)
        if self.chunk_size != chunk:
            raise ValueError(f"chunk_size must be a power of two, got {chunk}")
        self.decode_steps = positive("decode_steps", decode_steps)
        # Speculative decoding: prompt lookup (ngram), a draft model (draft: its plan and
        # params; its page pools follow the target's block tables) or a feature head (head:
        # its params and HeadSpec; its pages too), K drafts per decode row.
        self.ngram, self.draft, self.head, self.num_speculative_tokens = self._speculative(
            speculative, num_speculative_tokens, policy)
        budget = positive("max_num_batched_tokens",
                          max_num_batched_tokens or max(2048, self.chunk_size))
        self.max_pages = -(-self.max_model_len // page_size)
        # (at most max_num_seqs: a prefill row is a running request's, so more rows never
        # come, and each prefill batch size is programs that warmup compiles)
        self.max_prefill_rows = min(positive("max_prefill_rows", max_prefill_rows),
                                    self.max_num_seqs)
        # Dispatch shapes, each compiled once: powers of two (a new shape compiled in ~3 s
        # for Llama-3-8B on the H200). On a GPU decode rows 2-4 run as 8 (a step reads the
        # weights whatever the rows) and chunks are >= 64 tokens; on CPU padded tokens cost
        # their full compute.
        def pow2s(lo: int, hi: int) -> tuple[int, ...]:
            return tuple(1 << i for i in range(hi.bit_length()) if lo <= 1 << i < hi) + (hi,)

        if row_buckets is None:
            self.decode_buckets = (1, *pow2s(8, self.max_num_seqs)) if gpu and \
                self.max_num_seqs > 8 else pow2s(1, self.max_num_seqs)
            self.prefill_rows = pow2s(1, self.max_prefill_rows)
        else:
            if isinstance(row_buckets, (str, bytes)) or not hasattr(row_buckets, "__iter__") \
                    or not list(row_buckets):
                raise ValueError(f"row_buckets must be a non-empty sequence of batch sizes, "
                                 f"got {row_buckets!r}")
            sizes = sorted({positive("row_buckets' sizes", n) for n in row_buckets})
            if sizes[-1] > self.max_num_seqs:
                raise ValueError(f"row_buckets {tuple(row_buckets)} has a size over "
                                 f"max_num_seqs {self.max_num_seqs}")
            self.decode_buckets = tuple(sorted({*sizes, self.max_num_seqs}))
            self.prefill_rows = tuple(sorted({n for n in sizes if n < self.max_prefill_rows}
                                             | {self.max_prefill_rows}))
        self.prefill_lengths = pow2s(64 if gpu else 16, self.chunk_size)
        self.kv_cache_dtype = kv_cache_dtype

        page_bytes = memory.kv_bytes_per_token(config, kv_cache_dtype) * page_size
        if self.draft is not None:  # a page index holds both models' K/V
            page_bytes += memory.kv_bytes_per_token(self.draft[0].config) * page_size
        if self.head is not None:  # ... or the head's K/V and the target's features
            head_config = self.head[1].plan.config
            page_bytes += (memory.kv_bytes_per_token(head_config) + config.hidden_size
                           * memory.itemsize(config.dtype)) * page_size
        full = self.max_num_seqs * self.max_pages + 1  # every row at max_model_len
        if kv_memory is None:
            num_pages = min(_kv_budget(0.8 if gpu else 0.25) // page_bytes, full if not gpu
                            else 1 << 62)
        else:
            num_pages = _kv_budget(kv_memory) // page_bytes
        if num_pages < self.max_pages + 1:
            raise memory.OutOfMemory(
                f"the KV page pool would hold {num_pages} pages of {page_size} tokens "
                f"({memory.gib(page_bytes)} each), fewer than one request of max_model_len "
                f"{self.max_model_len} needs ({self.max_pages}); raise kv_memory or lower "
                "max_model_len")
        pool = PagePool(num_pages, page_size, prefix_caching)
        extra = repr((config, str(config.dtype), kv_cache_dtype)).encode()
        self.scheduler = Scheduler(pool, max_num_seqs=self.max_num_seqs,
                                   max_pages=self.max_pages, max_num_batched_tokens=budget,
                                   chunk_size=self.chunk_size,
                                   # a verification's K + 1 slots, pages and budget
                                   decode_steps=self.decode_steps + self.num_speculative_tokens,
                                   max_prefill_rows=self.max_prefill_rows, cache_extra=extra)
        with memory.reporting_oom(f"allocating the KV page pool ({num_pages} pages)"):
            cache = PagedKVCache.init(config, num_pages, page_size, kv_dtype=kv_cache_dtype)
            self.draft_cache = None if self.draft is None else PagedKVCache.init(
                self.draft[0].config, num_pages, page_size)
            head = None if self.head is None else step_lib.HeadPages(
                cache=PagedKVCache.init(head_config, num_pages, page_size),
                feats=jnp.zeros((num_pages, page_size, config.hidden_size), config.dtype))
            self.state = step_lib.EngineState(
                cache=cache, last_token=jnp.zeros((self.max_num_seqs + 1,), jnp.int32),
                head=head)
        # The head's arguments of the prefill and verification steps (none without a head).
        self._head_args = {} if self.head is None else dict(
            head_params=self.head[0], head_spec=self.head[1])
        self._verify_args = {} if self.head is None else dict(self._head_args,
                                                                k=self.num_speculative_tokens)
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) \
                or not 0 <= seed < 2**32:
            raise ValueError(f"seed must be an integer in [0, 2**32), got {seed!r}")
        self.seed = int(seed)
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()  # key ids of requests without their own seed
        self._flags: sampling.SamplingFlags | None = None  # union of the dispatches' so far
        # The last dispatch's (params, flags, SamplingTensors): a steady decode batch reuses
        # its tensors instead of rebuilding and uploading 9 arrays per step.
        self._tensors: tuple | None = None
        self._inflight: list = []  # dispatches not read yet (_read says what they hold)
        self.stats = {"steps": 0, "prompt_tokens": 0, "generated_tokens": 0, "preemptions": 0,
                      "draft_tokens": 0, "accepted_tokens": 0, "plain_rounds": 0}
        self._idle = 0  # plain rounds in a row while the drafter's drafts are rejected
        self._patience = 0  # plain rounds before the next probe (speculative.PROBE ...)

    # -- public API ---------------------------------------------------------------------------

    @property
    def pool(self) -> PagePool:
        return self.scheduler.pool

    @property
    def total_pages(self) -> int:
        return self.pool.total

    @property
    def free_pages(self) -> int:
        """Pages a request can get now (free, or cached and held by nobody)."""
        return self.pool.available

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    def prefix_cache_hit_rate(self) -> float:
        """Prompt tokens served from the prefix cache / prompt tokens admitted."""
        return self.pool.hits / self.pool.queries if self.pool.queries else 0.0

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (pages nobody holds become free)."""
        self.pool.reset_prefix_cache()

    def add_request(self, prompt, *, sampling: SamplingParams | None = None,
                    max_tokens: int = 128, stop=None, request_id: str | None = None,
                    seed: int | None = None, chat: bool | None = None,
                    grammar=None, ignore_eos: bool = False) -> str:
        """Queue one request (anything `generate` takes for one prompt) -> its id. Every check
        runs here: a bad request raises ValueError and changes nothing. seed: its own seed
        (its draws then equal generate(..., seed=seed) for it alone); default the engine's
        seed and its arrival number. grammar: a `jaxinfer.structured.Grammar` its output must
        follow (structured output; it finishes with "stop" once the grammar is complete);
        such a request advances every other step (the scheduler's docstring says why).
        ignore_eos: EOS does not end it (vLLM's; max_tokens, stop and the grammar still do)."""
        from jaxinfer.generate import _stop_ids

        model = self.model
        if len(prompts_lib.as_batch(prompt)) != 1:
            raise ValueError("add_request takes one prompt (text, token ids or chat messages); "
                             "call it once per prompt")
        (ids,) = prompts_lib.encode(model.tokenizer, [prompt], chat, model.config.vocab_size)
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)) \
                or max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        sampling = SamplingParams(temperature=0.0) if sampling is None else sampling
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        sampling.check_vocabulary(model.config.vocab_size)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))
                                 or not 0 <= seed < 2**32):
            raise ValueError(f"seed must be an integer in [0, 2**32), got {seed!r}")
        need = len(ids) + int(max_tokens)
        if need > self.max_model_len:
            raise ValueError(f"prompt of {len(ids)} tokens + max_tokens {max_tokens} = {need} "
                             f"exceeds the engine's max_model_len of {self.max_model_len} "
                             "tokens; shorten the prompt or lower max_tokens")
        if -(-need // self.page_size) > self.pool.total:
            raise ValueError(f"{need} tokens need {-(-need // self.page_size)} pages, more "
                             f"than the whole pool's {self.pool.total}; raise kv_memory")
        stop_ids, stop_strings = _stop_ids(model, stop, ignore_eos)
        index = next(self._arrivals)
        if request_id is None:
            request_id = f"req-{index}"
        elif not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        matcher = None
        if grammar is not None:
            from jaxinfer.structured import Grammar

            if not isinstance(grammar, Grammar):
                raise ValueError(f"grammar must be a jaxinfer.structured.Grammar, got "
                                 f"{type(grammar).__name__}")
            if model.tokenizer is None or grammar.vocab_size != model.tokenizer.vocab_size:
                raise ValueError("grammar was compiled for another tokenizer than this model's")
            matcher = grammar.matcher()
        if sampling.seed is not None:
            seed, key_id = sampling.seed, 0
        elif seed is not None:
            key_id = 0
        else:
            seed, key_id = self.seed, index
        req = Request(request_id, key_id, list(ids), sampling, int(max_tokens),
                      frozenset(stop_ids), tuple(stop_strings), int(seed), time.perf_counter(),
                      matcher=matcher)
        self.requests[request_id] = req
        self.scheduler.waiting.append(req)
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request now; its pages and slot go back at once."""
        req = self.requests.get(request_id)
        if req is None:
            raise ValueError(f"no request {request_id!r} in the engine (finished requests are "
                             "forgotten once their last output is returned)")
        self.scheduler.finish(req, "abort")
        del self.requests[request_id]

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._inflight)

    def step(self) -> list[RequestOutput]:
        """Schedule and dispatch one step, then return the outputs of the one before it."""
        sched = self.scheduler.schedule(idle=not self._inflight)
        self.stats["preemptions"] += len(sched.preempted)
        dispatched = []
        with memory.reporting_oom("an engine step"):
            if sched.prefill:
                dispatched.append(self._dispatch_prefill(sched.prefill))
            if sched.decode:
                dispatched.extend(self._dispatch_decode(sched.decode))
        outputs = self._read(self._inflight)
        self._inflight = dispatched
        if self.num_speculative_tokens:  # the next rows' positions and drafts need these
            outputs, self._inflight = self._read(dispatched), []
        self.stats["steps"] += 1
        return outputs

    def warmup(self, sampling=None, progress: bool = False, structured: bool = False) -> int:
        """Compile every dispatch shape now (prefill rows x chunk lengths, decode rows), for
        requests with these SamplingParams (one or a list; default greedy), so a running
        engine compiles nothing: a shape first met while serving stalls every row for its
        compile (~3 s at 8B on the H200). Runs rows of padding only (they write nothing).
        Params asking for top_logprobs also warm the programs that search them (a dispatch
        has them when one of its rows asks); a speculative engine also warms its
        verifications (and a draft model's prefill and drafting steps); structured=True also
        the programs with a grammar's token bitmask (in a speculative engine: its plain
        rounds'). -> the number of executables dispatched. Call it before serving; idle
        engines only."""
        from tqdm.auto import tqdm

        if self.has_unfinished():
            raise ValueError("warmup() runs on an idle engine; call it before adding requests")
        params = sampling if isinstance(sampling, (list, tuple)) else \
            [sampling or SamplingParams(temperature=0.0)]
        for sp in params:
            if not isinstance(sp, SamplingParams):
                raise ValueError(f"sampling must be SamplingParams, got {type(sp).__name__}")
        tensors = SamplingTensors.from_params(params)
        self._flags = tensors.flags if self._flags is None else self._flags.union(tensors.flags)
        if self._flags.penalties:  # the programs that take the penalty statistics
            self._allocate_penalties()
        # As _rows: the flags of every request so far, the top-logprobs search the dispatch's.
        tops = sorted({SamplingTensors.from_params([sp]).flags.top_logprobs for sp in params})
        masks = [False, True] if structured else [False]
        # The references' block-table width grows with the longest row; the kernels' is fixed.
        widths = [self.max_pages] if self.kernels else sorted(
            {min(self.max_pages, _pow2(n, MIN_WIDTH)) for n in range(1, self.max_pages + 1)})
        shapes = [("prefill", b, c, w) for b in self.prefill_rows for c in self.prefill_lengths
                  for w in widths] + [("decode", b, 1, w) for b in self.decode_buckets
                                      for w in widths]
        if self.num_speculative_tokens:
            shapes += [("verify", b, self.num_speculative_tokens + 1, w)
                       for b in self.decode_buckets for w in widths]
        # Rows with a grammar verify nothing: a head's plain step takes their masks.
        variants = [(shape, top, mask) for shape in shapes for top in tops for mask in masks
                    if not (mask and shape[0] == "verify" and self.head is None)]
        r = self.max_num_seqs
        words = -(-self.model.config.vocab_size // 32)
        dispatched = 0
        for (kind, b, c, w), top, mask in tqdm(variants, desc="compiling",
                                               disable=not progress, leave=False):
            rows = step_lib.Rows(
                slot=jnp.full((b,), r, jnp.int32), position=jnp.full((b,), -1, jnp.int32),
                count=jnp.zeros((b,), jnp.int32), seed=jnp.zeros((b,), jnp.uint32),
                key_id=jnp.zeros((b,), jnp.int32), block_tables=jnp.zeros((b, w), jnp.int32),
                sampling=SamplingTensors.from_params([params[0]] * b).widen(
                    dataclasses.replace(self._flags, top_logprobs=top)),
                token_bitmask=jnp.full((b, words), -1, jnp.int32) if mask else None)
            if kind == "prefill":
                self.state, new, _, _ = step_lib.prefill_step(
                    self.params, self.state, jnp.zeros((b, c), jnp.int32), rows, self.plan,
                    **self._head_args)
                if self.draft is not None and not mask:  # the draft's pages take the chunks
                    _, plan, dparams = self.draft
                    self.draft_cache = step_lib.draft_prefill_step(
                        dparams, self.draft_cache, jnp.zeros((b, c), jnp.int32), rows, plan)
                    dispatched += 1
            elif kind == "decode":
                if self.draft is not None and mask:  # a constrained row's draft forward
                    _, plan, dparams = self.draft
                    self.draft_cache, _, _ = step_lib.draft_step(
                        dparams, self.draft_cache, jnp.zeros((b, 2), jnp.int32),
                        rows.replace(token_bitmask=None), plan, 1)
                    dispatched += 1
                self.state, new, _, _ = step_lib.decode_step(self.params, self.state, rows,
                                                             self.plan)
            elif mask:  # a head's plain step under a grammar's mask
                self.state, new, *_ = step_lib.verify_step(
                    self.params, self.state, None, rows, self.plan, **self._verify_args,
                    plain=True)
            else:  # a verification of c - 1 drafts
                tokens = jnp.zeros((b, c), jnp.int32)
                if self.draft is not None:
                    _, plan, dparams = self.draft
                    self.draft_cache, tokens, laws = step_lib.draft_step(
                        dparams, self.draft_cache, jnp.zeros((b, 2), jnp.int32), rows, plan,
                        c - 1, self._draft_laws)
                    dispatched += 1
                    if self._draft_adaptive:  # a plain round's (and a probe's)
                        self.draft_cache, _, _ = step_lib.draft_step(
                            dparams, self.draft_cache, jnp.zeros((b, 2), jnp.int32), rows,
                            plan, 1)
                        dispatched += 1
                if self.head is not None:  # the head drafts inside the verification
                    tokens = None
                    if self._draft_adaptive:  # and its plain step (and a probe's)
                        self.state, new, *_ = step_lib.verify_step(
                            self.params, self.state, tokens, rows, self.plan,
                            **self._verify_args, plain=True)
                        new.block_until_ready()
                        dispatched += 1
                self.state, new, *_ = step_lib.verify_step(
                    self.params, self.state, tokens, rows, self.plan, **self._head_k(c - 1),
                    **self._laws_arg(laws if self.draft is not None else None))
            new.block_until_ready()
            dispatched += 1
        return dispatched

    def run(self, prompts: Iterable, *, sampling=None, max_tokens: int = 128, stop=None,
            seed: int | None = None, chat: bool | None = None, progress: bool = False,
            ignore_eos: bool = False):
        """Serve a list of prompts to the end -> one `Completion` per prompt, in order.
        sampling: one SamplingParams or one per prompt; seed: request i's is seed + i (so
        each equals generate(prompt_i, seed=seed + i) alone), default the engine's. Requests
        added otherwise run on meanwhile, but their outputs are not returned here."""
        from tqdm.auto import tqdm

        from jaxinfer.generate import Completion

        prompts = list(prompts)
        params = sampling if isinstance(sampling, (list, tuple)) else [sampling] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        stops = [s for s in ([stop] if isinstance(stop, str) else stop or [])
                 if isinstance(s, str)]
        ids = [self.add_request(p, sampling=sp, max_tokens=max_tokens, stop=stop, chat=chat,
                                seed=None if seed is None else seed + i,
                                ignore_eos=ignore_eos)
               for i, (p, sp) in enumerate(zip(prompts, params))]
        prompt_tokens = {i: len(self.requests[i].prompt) for i in ids}
        got = {i: ([], []) for i in ids}
        spec = {i: [0, 0] for i in ids}  # drafts proposed, accepted
        reasons = {}
        with tqdm(total=len(ids), desc="requests", disable=not progress, leave=False) as bar:
            while len(reasons) < len(ids):
                for out in self.step():
                    if out.request_id not in got:
                        continue
                    toks, lps = got[out.request_id]
                    toks += out.new_token_ids
                    lps += out.new_logprobs or []
                    spec[out.request_id][0] += out.draft_tokens
                    spec[out.request_id][1] += out.accepted_tokens
                    if out.finished:
                        reasons[out.request_id] = out.finish_reason
                        bar.update(1)
        results = []
        for i, sp in zip(ids, params):
            toks, lps = got[i]
            text = self.model.tokenizer.decode(toks) if self.model.tokenizer is not None else ""
            cuts = [text.find(s) for s in stops if s in text]
            text = text[:min(cuts)] if cuts else text  # the stop string itself is left out
            drafted, accepted = spec[i] if self.num_speculative_tokens else (None, None)
            results.append(Completion(token_ids=toks, text=text, finish_reason=reasons[i],
                                      logprobs=lps if sp is not None and sp.logprobs else None,
                                      prompt_tokens=prompt_tokens[i], draft_tokens=drafted,
                                      accepted_tokens=accepted))
        return results

    def stream(self, prompt, *, sampling=None, max_tokens: int = 128, stop=None,
               seed: int | None = None, chat: bool | None = None):
        """One request's text piece by piece, as `jaxinfer.stream` gives it (a TextStream:
        iterate it; then `.completion`, `.time_to_first_token`). Its prompt's cached pages
        are reused, so a chat turn prefills only what the conversation added since the last
        one. Closing the stream (or an exception in the consumer's loop) aborts the request.
        Other requests in the engine run on meanwhile; their outputs are not returned here."""
        from jaxinfer.generate import Completion, StreamText, TextStream

        if self.model.tokenizer is None:
            raise ValueError("stream() needs a tokenizer to turn tokens into text")
        t0 = time.perf_counter()
        rid = self.add_request(prompt, sampling=sampling, max_tokens=max_tokens, stop=stop,
                               seed=seed, chat=chat)
        req = self.requests[rid]
        out = TextStream(iter(()))

        def pieces():
            shown = StreamText(self.model.tokenizer, req.stop_ids, req.stop_strings)
            ids, lps, reason = [], [], None
            try:
                while reason is None:
                    for o in self.step():
                        if o.request_id != rid:
                            continue
                        if out.time_to_first_token is None:
                            out.time_to_first_token = time.perf_counter() - t0
                        for i, token in enumerate(o.new_token_ids):
                            last = o.finished and i == len(o.new_token_ids) - 1
                            piece, stopped = shown.feed(token, last)
                            if piece:
                                yield piece
                            if stopped:
                                break
                        ids += o.new_token_ids
                        lps += o.new_logprobs or []
                        reason = o.finish_reason if o.finished else None
            finally:
                if reason is None and rid in self.requests:
                    self.abort(rid)
            text = shown.text
            cuts = [text.find(s) for s in req.stop_strings if s in text]
            out.completion = Completion(token_ids=ids, text=text[:min(cuts)] if cuts else text,
                                        finish_reason=reason,
                                        logprobs=lps if req.sampling.logprobs else None,
                                        prompt_tokens=len(req.prompt))

        out._pieces = pieces()
        return out

    # -- dispatch -----------------------------------------------------------------------------

    def _width(self, rows_pages: Iterable[int]) -> int:
        """Block-table width of a dispatch: the kernels read only valid pages, so the full
        width (one shape); the references gather every entry, so the longest row's, bucketed."""
        if self.kernels:
            return self.max_pages
        return min(self.max_pages, _pow2(max(rows_pages, default=1), MIN_WIDTH))

    def _rows(self, reqs: list[Request], positions, counts, b: int, width: int,
              sampled=None):
        """Rows for these requests padded to b rows (padding: slot R, position -1).
        sampled [n] bool: the rows whose token is kept (default all): those with a grammar
        get its mask of allowed tokens."""
        n = len(reqs)
        r = self.max_num_seqs
        slot = np.full((b,), r, np.int32)
        position = np.full((b,), -1, np.int32)
        count = np.zeros((b,), np.int32)
        seed = np.zeros((b,), np.uint32)
        key_id = np.zeros((b,), np.int32)
        tables = np.zeros((b, width), np.int32)
        for i, req in enumerate(reqs):
            slot[i], position[i], count[i] = req.slot, positions[i], counts[i]
            seed[i], key_id[i] = req.seed, req.index
            pages = req.pages[:width]
            tables[i, :len(pages)] = pages
        params = [req.sampling for req in reqs] + [reqs[0].sampling] * (b - n)
        last = self._tensors
        if (last is not None and last[1] == self._flags and len(last[0]) == b
                and all(p is q for p, q in zip(last[0], params))):
            tensors = last[2]  # (the params held there cannot be reused objects)
        else:
            tensors = sampling.SamplingTensors.from_params(params)
            # The flags of every request so far: a new mix of requests compiles nothing new.
            # The top-logprobs search alone is this dispatch's own (rows that ask are rare).
            self._flags = tensors.flags if self._flags is None else \
                self._flags.union(tensors.flags)
            tensors = tensors.widen(dataclasses.replace(
                self._flags, top_logprobs=tensors.flags.top_logprobs))
            self._tensors = (params, self._flags, tensors)
        sampled = [True] * n if sampled is None else sampled
        bitmask = None
        if any(req.matcher is not None and s for req, s in zip(reqs, sampled)):
            bitmask = np.full((b, -(-self.model.config.vocab_size // 32)), -1, np.int32)
            for i, (req, s) in enumerate(zip(reqs, sampled)):
                if req.matcher is not None and s:
                    req.matcher.fill_bitmask(bitmask[i])
            bitmask = jnp.asarray(bitmask)
        # One transfer call for the six arrays (each call is a GIL release and re-take, which
        # waits behind the server's event loop).
        slot, position, count, seed, key_id, tables = jax.device_put(
            (slot, position, count, seed, key_id, tables))
        return step_lib.Rows(slot=slot, position=position, count=count, seed=seed,
                             key_id=key_id, block_tables=tables, sampling=tensors,
                             token_bitmask=bitmask)

    def _allocate_penalties(self) -> None:
        """The penalty statistics [R + 1, V] per slot, zero, once (at the first request or
        warmup that uses penalties; engines without them never hold the two arrays)."""
        if self.state.token_counts is None:
            v = self.model.config.vocab_size
            self.state = self.state.replace(
                token_counts=jnp.zeros((self.max_num_seqs + 1, v), jnp.int32),
                seen_mask=jnp.zeros((self.max_num_seqs + 1, v), bool))

    def _ensure_penalties(self, reqs: list[Request]) -> None:
        """Penalty statistics on the device for requests that use penalties (allocated at the
        first such request), set for each newly admitted one."""
        fresh = [r for r in reqs if (r.sampling.repetition_penalty != 1
                                      or r.sampling.presence_penalty != 0
                                      or r.sampling.frequency_penalty != 0)]
        if not fresh:
            return
        v = self.model.config.vocab_size
        self._allocate_penalties()
        counts = np.zeros((len(fresh), v), np.int32)
        seen = np.zeros((len(fresh), v), bool)
        for i, req in enumerate(fresh):
            np.add.at(counts[i], np.asarray(req.output, np.int64), 1)
            seen[i, np.asarray(req.tokens(), np.int64)] = True
        slots = jnp.asarray([r.slot for r in fresh], jnp.int32)
        self.state = step_lib.set_penalty_rows(self.state, slots, jnp.asarray(counts),
                                               jnp.asarray(seen))

    def _dispatch_prefill(self, rows):
        reqs = [row.request for row in rows]
        starting = [row.request for row in rows if row.start == row.request.cached_tokens]
        self._ensure_penalties(starting)
        b = _bucket(len(rows), self.prefill_rows)
        c = _bucket(max(len(row.tokens) for row in rows), self.prefill_lengths)
        width = self._width(-(-(row.start + len(row.tokens)) // self.page_size) for row in rows)
        tokens = np.zeros((b, c), np.int32)
        for i, row in enumerate(rows):
            tokens[i, :len(row.tokens)] = row.tokens
        batch = self._rows(reqs, [row.start for row in rows], [len(row.tokens) for row in rows],
                           b, width, sampled=[row.final for row in rows])
        # Rows whose chunk does not end the prompt sample nothing kept: slot R.
        final = np.array([row.final for row in rows] + [False] * (b - len(rows)))
        batch = batch.replace(slot=jnp.where(jnp.asarray(final), batch.slot, self.max_num_seqs))
        self.state, new, logprobs, top = step_lib.prefill_step(
            self.params, self.state, jnp.asarray(tokens), batch, self.plan, **self._head_args)
        if self.draft is not None:  # the same chunks into the draft model's pages
            _, plan, params = self.draft
            self.draft_cache = step_lib.draft_prefill_step(
                params, self.draft_cache, jnp.asarray(tokens), batch.replace(token_bitmask=None),
                plan)
        for row in rows:
            if row.final:
                row.request.inflight += 1
        self.stats["prompt_tokens"] += sum(len(row.tokens) for row in rows)
        return ("prefill", [row.request if row.final else None for row in rows], [new],
                [logprobs], [top], None)

    def _dispatch_decode(self, rows) -> list:
        if not self.num_speculative_tokens:
            return [self._dispatch_plain(rows)]
        # Rows with a grammar take the drafter's plain round, under their masks (drafts are
        # not verified under a grammar): a dispatch of their own.
        free = [row for row in rows if row.request.matcher is None]
        bound = [row for row in rows if row.request.matcher is not None]
        return [self._dispatch_verify(part, plain=part is bound)
                for part in (free, bound) if part]

    def _dispatch_plain(self, rows):
        reqs = [row.request for row in rows]
        b = _bucket(len(rows), self.decode_buckets)
        width = self._width(len(r.pages) for r in reqs)
        positions = np.array([row.position for row in rows] + [-1] * (b - len(rows)), np.int32)
        batch = self._rows(reqs, positions, [1] * len(rows), b, width)
        news, lps, tops = [], [], []
        # Rows with a grammar take one step: their next mask needs this step's token.
        one = np.array([r.matcher is not None for r in reqs] + [False] * (b - len(rows)))
        # decode_steps dispatches of one step each before anything is read: each reads the
        # token the one before wrote to last_token (one step per executable: k steps inside
        # one jit copied the pools between them on the H200, 119 ms/token at k = 4).
        for i in range(self.decode_steps):
            if i:
                batch = batch.replace(
                    position=jnp.asarray(np.where((positions < 0) | one, -1, positions + i)))
                if one.any():  # idle as padding rows from here on
                    batch = batch.replace(slot=jnp.where(jnp.asarray(one), self.max_num_seqs,
                                                         batch.slot), token_bitmask=None)
            self.state, new, logprobs, top = step_lib.decode_step(self.params, self.state,
                                                                  batch, self.plan)
            news.append(new)
            lps.append(logprobs)
            tops.append(top)
        for req in reqs:
            req.inflight += 1
        return ("decode", reqs, news, lps, tops, None)

    def _speculative(self, speculative, k, policy):
        """(NGram or None, (draft model, its plan, its params) or None, (head params, its
        HeadSpec) or None, K or 0) from the constructor's arguments."""
        from jaxinfer import draft_head
        from jaxinfer.draft_head import FeatureHead
        from jaxinfer.generate import _plan, run_params
        from jaxinfer.model import Model
        from jaxinfer.speculative import (DraftModel, NGram, check_same_vocabulary, min_gain,
                                          resolve_drafter, start_gain)

        self._draft_adaptive = self._draft_laws = False
        self._min_gain = self._start_gain = 0.0
        if speculative is None:
            return None, None, None, 0
        head = None
        if isinstance(speculative, FeatureHead) or (isinstance(speculative, str)
                                                    and speculative in ("head", "mtp")):
            # The head's file and its target are checked here, before anything compiles.
            head = resolve_drafter(speculative, self.model)
        elif speculative == "ngram":
            speculative = NGram()
        if isinstance(speculative, Model):
            speculative = DraftModel(speculative)
        if head is None and not isinstance(speculative, NGram | DraftModel):
            raise ValueError(f"the engine's speculative must be None, 'ngram', 'head', 'mtp', "
                             f"an NGram, a loaded draft model, a DraftModel or a "
                             f"draft_head.FeatureHead, got {speculative!r}")
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {k!r}")
        if self.decode_steps != 1:
            raise ValueError("speculative decoding takes decode_steps=1 (a verification "
                             "already yields several tokens per step)")
        if head is not None:
            self._draft_adaptive = head.adaptive  # plain rounds while drafts are rejected
            self._min_gain, self._start_gain = min_gain(head), start_gain(head, k)
            head = draft_head.for_model(head, self.model)  # its layer in the model's dtype
            spec = dataclasses.replace(
                head.spec, plan=dataclasses.replace(self.plan, config=head.spec.plan.config),
                rejection=head.rejection)
            return None, None, (head.params, spec), int(k)
        if isinstance(speculative, NGram):
            return speculative, None, None, int(k)
        draft = speculative.model
        self._draft_adaptive = speculative.adaptive  # plain rounds while drafts are rejected
        self._min_gain, self._start_gain = min_gain(speculative), start_gain(speculative, k)
        self._draft_laws = speculative.rejection  # sampled rows: rejection sampling
        check_same_vocabulary(self.model, draft)
        plan = _plan(draft, policy)
        return None, (draft, plan, run_params(draft, plan)), None, int(k)

    def _dispatch_verify(self, rows, plain: bool = False):
        """Decode rows as verifications: each row's newest token and K drafts (prompt
        lookup over its tokens, on the host, where a step's tokens are read before the next;
        a draft model's steps; or the head's, inside the verification step). plain: the
        drafter's plain round (rows with a grammar), else when drafts are mostly rejected."""
        from jaxinfer.speculative import ngram_drafts_host

        reqs = [row.request for row in rows]
        # a draft model's or a head's round: plain, a probe (a plain step checking the
        # drafter's first draft) or a verification
        kind = "plain" if plain else (self._round(reqs) if self.ngram is None else "verify")
        k = self.num_speculative_tokens
        b = _bucket(len(rows), self.decode_buckets)
        width = self._width(len(r.pages) for r in reqs)
        positions = np.array([row.position for row in rows] + [-1] * (b - len(rows)), np.int32)
        batch = self._rows(reqs, positions, [k + 1] * len(rows), b, width)
        tokens = laws = None  # a head drafts on the device inside the verification step
        if self.draft is not None:  # drafted on the device by the draft model
            last_two = np.zeros((b, 2), np.int32)
            for i, req in enumerate(reqs):
                last_two[i] = req.tokens()[-2:]  # a decode row has >= 1 prompt + 1 output
            _, plan, params = self.draft
            if kind in ("plain", "probe"):
                # A plain step; the draft model's first forward only, so that its pages
                # hold this step's tokens (its draft [B, 2]: x, d_1, a probe's).
                self.draft_cache, drafted, _ = step_lib.draft_step(
                    params, self.draft_cache, jnp.asarray(last_two),
                    batch.replace(token_bitmask=None), plan, 1)
                step = self._dispatch_plain(rows)
                return step if kind == "plain" else ("probe", *step[1:5], drafted[:, 1])
            self.draft_cache, tokens, laws = step_lib.draft_step(
                params, self.draft_cache, jnp.asarray(last_two), batch, plan, k,
                self._draft_laws)
        elif self.ngram is not None:
            if plain:
                return self._dispatch_plain(rows)
            drafts = [ngram_drafts_host(req.tokens(), k, self.ngram) for req in reqs]
            if not any(found for _, found in drafts):
                return self._dispatch_plain(rows)  # one token per row: no guesses to verify
            tokens = np.zeros((b, k + 1), np.int32)
            for i, (req, (draft, _)) in enumerate(zip(reqs, drafts)):
                tokens[i] = [req.tokens()[-1]] + draft
            tokens = jnp.asarray(tokens)
        plain = self.head is not None and kind in ("plain", "probe")
        # (plain passed only when set: a jit keyed as warmup's calls)
        self.state, new, logprobs, top, drafts = step_lib.verify_step(
            self.params, self.state, tokens, batch, self.plan, **self._head_k(k),
            **({"plain": True} if plain else {}), **self._laws_arg(laws))
        for req in reqs:
            req.inflight += 1
        t = new.shape[1]
        tops = [None] * t if top is None else [(top[0][:, j], top[1][:, j]) for j in range(t)]
        # per column [B], as decode (a head's plain step: one column, a decode; a probe's
        # also its head's draft)
        return ("decode" if kind == "plain" else kind, reqs, list(new.T),
                list(logprobs.T), tops, drafts[:, 0] if kind == "probe" else None)

    def _head_k(self, k: int) -> dict:
        """verify_step's head arguments with k drafts (none without a head)."""
        return dict(self._verify_args, k=k) if self.head is not None else {}

    @staticmethod
    def _laws_arg(laws) -> dict:
        """verify_step's draft_laws, passed only when set (a jit keyed as warmup's calls)."""
        return {} if laws is None else {"draft_laws": laws}

    def _round(self, reqs) -> str:
        """This round of a draft model or a head, as generate's: "verify" while some row's
        recent drafts were accepted (the drafter's min_gain), else "plain", with a "probe"
        (a plain step checking the drafter's first draft) when due (a probe that finds them
        still rejected doubles the wait for the next, up to MAX_PROBE). Counts the round."""
        from jaxinfer.speculative import MAX_PROBE, PROBE

        if not self._draft_adaptive or any(
                (self._start_gain if r.draft_gain is None else r.draft_gain) >= self._min_gain
                for r in reqs):
            self._idle, self._patience = 0, PROBE
            return "verify"
        if self._idle >= self._patience:
            self._idle, self._patience = 0, min(2 * self._patience, MAX_PROBE)
            return "probe"
        self._idle += 1
        self.stats["plain_rounds"] += 1
        return "plain"

    # -- outputs ------------------------------------------------------------------------------

    def _read(self, dispatched) -> list[RequestOutput]:
        if not dispatched:
            return []
        # (kind, requests, tokens, logprobs, top logprobs, a probe's drafts [B] or None)
        values = jax.device_get([d[2:] for d in dispatched])
        now = time.perf_counter()
        outputs: dict[str, RequestOutput] = {}
        for (kind, reqs, *_), (new, lps, tops, probe) in zip(dispatched, values):
            # [B, steps]; a verification's [B, K + 1] has -1 after its kept tokens
            new, lps = np.stack(new, axis=1), np.stack(lps, axis=1)
            if tops[0] is not None:  # [B, steps, K]
                top_ids = np.stack([t[0] for t in tops], axis=1)
                top_lps = np.stack([t[1] for t in tops], axis=1)
            for row, req in enumerate(reqs):
                if req is None:
                    continue
                req.inflight -= 1
                if req.status is Status.FINISHED or req.finish_reason:
                    continue
                steps = 1 if req.matcher is not None else new.shape[1]  # see _dispatch_decode
                kept = new[row, :steps] >= 0
                k = req.sampling.top_logprobs
                top = [list(zip(top_ids[row, j, :k].tolist(), top_lps[row, j, :k].tolist()))
                       for j in np.flatnonzero(kept)] if k else None
                got, got_lp, got_top = self._accept(req, new[row, :steps][kept].tolist(),
                                                    lps[row, :steps][kept].tolist(), top)
                drafted = accepted = 0
                if self.num_speculative_tokens:
                    req.scheduled = len(req.output)  # the scheduler counted K + 1
                if kind in ("verify", "probe"):  # as generate: drafts cut by a stop or the
                    spec_k = self.num_speculative_tokens  # budget do not count (min(a, emitted))
                    gain = self._start_gain if req.draft_gain is None else req.draft_gain
                    if kind == "probe":  # a plain step checking one draft: a hit counts as
                        drafted = 1  # a round of K accepted drafts (generate's rule)
                        hits = spec_k * int(bool(kept[0]) and probe[row] == new[row, 0])
                    else:
                        drafted = new.shape[1] - 1  # the dispatch's K
                        hits = int(kept.sum()) - 1  # drafts the verification accepted
                        accepted = min(hits, len(got))
                    req.draft_gain = 0.5 * gain + 0.5 * hits
                    self.stats["draft_tokens"] += drafted
                    self.stats["accepted_tokens"] += accepted
                if req.first_token_time is None and got:
                    req.first_token_time = now
                prev = outputs.get(req.request_id)
                if prev is not None:
                    got = prev.new_token_ids + got
                    got_lp = (prev.new_logprobs or []) + got_lp
                    got_top = (prev.new_top_logprobs or []) + got_top if k else None
                    drafted += prev.draft_tokens
                    accepted += prev.accepted_tokens
                want_lp = got_lp if req.sampling.logprobs else None
                outputs[req.request_id] = RequestOutput(
                    req.request_id, got, want_lp, req.finish_reason is not None,
                    req.finish_reason, new_top_logprobs=got_top if k else None,
                    draft_tokens=drafted, accepted_tokens=accepted)
        for out in outputs.values():
            if out.finished:
                self.requests.pop(out.request_id, None)
        return list(outputs.values())

    def _accept(self, req: Request, tokens: list[int], lps: list[float], tops=None):
        """Append a row's new tokens to its request, up to its stop or its budget (or the
        end of its grammar)."""
        got, got_lp, got_top = [], [], []
        for j, (token, lp) in enumerate(zip(tokens, lps)):
            if len(req.output) >= req.max_tokens:
                break
            req.output.append(token)
            req.logprobs.append(lp)
            got.append(token)
            got_lp.append(lp)
            if tops is not None:
                req.top_logprobs.append(tops[j])
                got_top.append(tops[j])
            self.stats["generated_tokens"] += 1
            reason = None
            if token in req.stop_ids:
                reason = "stop"
            elif req.matcher is not None and not req.matcher.consume(token):
                # Only an empty mask (no EOS id to end on) lets a disallowed token through.
                log.warning("request %s: token %d is outside its grammar (%s); stopping it",
                            req.request_id, token, req.matcher.error)
                reason = "stop"
            elif req.stop_strings and self._stop_string(req, got, got_lp, got_top):
                reason = "stop"
            elif req.matcher is not None and req.matcher.done:
                reason = "stop"  # the grammar is complete: only EOS could follow
            elif len(req.output) >= req.max_tokens:
                reason = "length"
            if reason:
                self.scheduler.finish(req, reason)
                break
        return got, got_lp, got_top

    def _stop_string(self, req: Request, got: list[int], got_lp: list[float],
                     got_top: list) -> bool:
        """Whether the output's text now holds a stop string; if so the output is cut to the
        fewest tokens whose text reaches it (as generate's _finish)."""
        tok = self.model.tokenizer
        if tok is None:
            return False
        text = tok.decode(req.output)
        cuts = [text.find(s) for s in req.stop_strings if s in text]
        if not cuts:
            return False
        cut = min(cuts)
        for n in range(1, len(req.output) + 1):
            if len(tok.decode(req.output[:n])) > cut:
                drop = len(req.output) - n
                del req.output[n:], req.logprobs[n:], req.top_logprobs[n:]
                if drop:
                    del got[-drop:], got_lp[-drop:], got_top[-drop:]
                break
        return True
