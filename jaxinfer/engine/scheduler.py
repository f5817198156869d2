"""The engine's scheduler: which rows each step runs, under a token budget and the page pool.

vLLM's model: a request has tokens computed (K/V in its pages) and tokens wanted, and each step
hands out a budget of tokens so the first catch up with the second. Decode rows come first (one
row of `steps` tokens per running request), then prefill chunks of the requests still filling
their prompts, oldest first, then new requests from the waiting queue while a request slot,
pages and budget are left. When a decode row needs a page and none is left (after evicting
unreferenced cached pages), the youngest running request is preempted: its pages go back
(its full pages stay in the prefix cache) and it waits to be recomputed from its prompt and
the tokens it already produced, which reproduces its stream exactly (the sampling keys depend
on (request, position) only).

A request with a grammar (structured output) gets a decode row only when none of its tokens is
in flight, one token per row: its next token mask needs the token before it. The engine
dispatches step n + 1 before reading step n, so such a request advances every other step
while the others keep the pipeline.

Host-side only: it decides rows and pages; jaxinfer/engine/engine.py turns them into arrays.
"""

from __future__ import annotations

import collections
import dataclasses
import enum

from jaxinfer.engine.pages import OutOfPages, PagePool, page_keys
from jaxinfer.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Request:
    """One request's host-side state."""

    request_id: str
    index: int  # arrival number: the key id of a request without its own seed
    prompt: list[int]
    sampling: SamplingParams
    max_tokens: int
    stop_ids: frozenset[int]
    stop_strings: tuple[str, ...]
    seed: int
    arrival: float
    status: Status = Status.WAITING
    output: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    pages: list[int] = dataclasses.field(default_factory=list)
    slot: int | None = None
    target: int = 0  # tokens to prefill: prompt + output at (re)admission
    computed: int = 0  # tokens whose K/V is (or is being) written to its pages
    scheduled: int = 0  # output tokens sampled or in flight
    inflight: int = 0  # dispatches whose tokens are not read yet
    cached_tokens: int = 0  # prompt tokens the prefix cache served at the last admission
    preemptions: int = 0
    finish_reason: str | None = None
    first_token_time: float | None = None
    matcher: object | None = None  # structured output: its jaxinfer.structured.Matcher
    # the drafter's accepted drafts per verification, recent ones weighted (None: none yet;
    # speculative.MIN_GAIN)
    draft_gain: float | None = None
    top_logprobs: list = dataclasses.field(default_factory=list)  # per output token, if asked

    @property
    def prefilling(self) -> bool:
        return self.computed < self.target

    def tokens(self) -> list[int]:
        return self.prompt + self.output


@dataclasses.dataclass
class DecodeRow:
    request: Request
    position: int  # of its input token (the newest sampled one)


@dataclasses.dataclass
class PrefillRow:
    request: Request
    start: int  # first position of the chunk
    tokens: list[int]  # the chunk
    final: bool  # the chunk ends the prompt: the token after it is the next output


@dataclasses.dataclass
class Schedule:
    decode: list[DecodeRow]
    prefill: list[PrefillRow]
    preempted: list[Request]


class Scheduler:
    """Requests waiting and running, and the pages and slots they hold."""

    def __init__(self, pool: PagePool, *, max_num_seqs: int, max_pages: int,
                 max_num_batched_tokens: int, chunk_size: int, decode_steps: int,
                 max_prefill_rows: int, cache_extra: bytes):
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_pages = max_pages  # per request (the block table's width)
        self.budget = max_num_batched_tokens
        self.chunk_size = chunk_size
        self.steps = decode_steps
        self.max_prefill_rows = max_prefill_rows
        self.extra = cache_extra
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # in admission order
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))

    # -- pages -----------------------------------------------------------------------------

    def _grow(self, req: Request, tokens: int) -> None:
        """Pages for positions [0, tokens) (capped at the table's width); OutOfPages if not."""
        want = min(-(-tokens // self.pool.page_size), self.max_pages)
        if want > len(req.pages):
            req.pages += self.pool.allocate(want - len(req.pages))

    def _register(self, req: Request, tokens: list[int], upto: int) -> None:
        """Make the request's full pages below position `upto` findable by later requests."""
        full = upto // self.pool.page_size
        if full:
            self.pool.register(req.pages[:full], page_keys(tokens[:full * self.pool.page_size],
                                                           self.pool.page_size, self.extra))

    def release(self, req: Request) -> None:
        """Give back a request's pages (its full ones stay cached) and its slot."""
        fed = len(req.prompt) + max(len(req.output) - 1, 0)  # positions fed with known tokens
        if req.status is Status.RUNNING:
            self._register(req, req.tokens(), req.computed if req.prefilling else fed)
        self.pool.release(req.pages)
        req.pages = []
        if req.slot is not None:
            self.free_slots.append(req.slot)
            req.slot = None

    # -- admission and preemption ---------------------------------------------------------

    def _admit(self, req: Request) -> bool:
        """Waiting -> running if a slot and the pages of its first chunk are to be had."""
        if not self.free_slots:
            return False
        tokens = req.tokens()
        keys = page_keys(tokens, self.pool.page_size, self.extra)
        # At least one token is computed, for the logits of the next one.
        hit = self.pool.match(keys[:(len(tokens) - 1) // self.pool.page_size])
        first = min(len(tokens), len(hit) * self.pool.page_size + self.chunk_size)
        need = min(-(-first // self.pool.page_size), self.max_pages) - len(hit)
        if need > self.pool.available:
            self.pool.release(hit)
            return False
        req.pages = hit
        req.slot = self.free_slots.pop()
        req.status = Status.RUNNING
        req.target = len(tokens)
        req.computed = req.cached_tokens = len(hit) * self.pool.page_size
        req.scheduled = len(req.output)
        self.pool.queries += len(req.prompt) if not req.preemptions else 0
        self.pool.hits += req.cached_tokens if not req.preemptions else 0
        self.running.append(req)
        return True

    def _preempt(self, spare: Request | None) -> Request | None:
        """Preempt the youngest running request other than `spare` (recompute later)."""
        for req in reversed(self.running):
            if req is not spare:
                self.running.remove(req)
                self.release(req)
                req.status = Status.WAITING
                req.computed = req.target = 0
                req.preemptions += 1
                self.waiting.appendleft(req)
                return req
        return None

    def _pages_for(self, req: Request, tokens: int, preempted: list[Request]) -> bool:
        """Grow req to `tokens` positions, preempting younger requests while pages lack.
        False: req itself had to go (it was the only one left)."""
        while True:
            try:
                self._grow(req, tokens)
                return True
            except OutOfPages:
                victim = self._preempt(spare=req)
                if victim is None:
                    self._preempt(spare=None)
                    preempted.append(req)
                    return False
                preempted.append(victim)

    # -- one step -----------------------------------------------------------------------------

    def schedule(self, idle: bool = False) -> Schedule:
        """This step's rows. idle: nothing is in flight, so if no row can be scheduled every
        running request is stuck on pages: the youngest gives its pages back and it retries."""
        sched = self._schedule()
        if idle and not sched.decode and not sched.prefill and len(self.running) > 1:
            sched.preempted.append(self._preempt(spare=self.running[0]))
            again = self._schedule()
            sched = Schedule(again.decode, again.prefill, sched.preempted + again.preempted)
        return sched

    def _schedule(self) -> Schedule:
        preempted: list[Request] = []
        decode: list[DecodeRow] = []
        for req in list(self.running):
            if req not in self.running or req.prefilling or req.finish_reason:
                continue
            if req.scheduled >= req.max_tokens:
                continue  # its last tokens are in flight
            if req.matcher is not None and req.inflight:
                continue  # its grammar's next mask needs the token in flight
            position = len(req.prompt) + req.scheduled - 1
            if not self._pages_for(req, position + self.steps, preempted):
                continue
            decode.append(DecodeRow(req, position))
            req.scheduled += 1 if req.matcher is not None else self.steps
        decode = [row for row in decode if row.request.status is Status.RUNNING]
        budget = self.budget - len(decode) * self.steps
        prefill: list[PrefillRow] = []

        def add_chunk(req: Request) -> bool:
            nonlocal budget
            n = min(self.chunk_size, req.target - req.computed, budget)
            if n <= 0 or len(prefill) >= self.max_prefill_rows:
                return False
            try:
                self._grow(req, req.computed + n)
            except OutOfPages:
                return False
            tokens = req.tokens()
            start = req.computed
            final = start + n == req.target
            prefill.append(PrefillRow(req, start, tokens[start:start + n], final))
            req.computed += n
            budget -= n
            self._register(req, tokens[:req.target], req.computed)
            if final:
                req.scheduled += 1
            return True

        for req in self.running:
            if req.prefilling and not any(r.request is req for r in prefill):
                add_chunk(req)
        while self.waiting and budget > 0 and len(prefill) < self.max_prefill_rows:
            req = self.waiting[0]
            if req.inflight or not self._admit(req):
                break
            self.waiting.popleft()
            if not add_chunk(req):
                break
        return Schedule(decode, prefill, preempted)

    def finish(self, req: Request, reason: str) -> None:
        """A running or waiting request is done: its pages and slot go back at once."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
            self.release(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
