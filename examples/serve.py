"""An inference engine in miniature: one KDA layer served from a slot-indexed state pool with kdagen.

The loop does with the layer's recurrent state what a serving engine (vLLM, SGLang) does:

- a pool of state slots with a free list; a running request holds S slots (its state, and during a
  speculative verify the state after each of its S tokens);
- requests arrive over time with prompts of different lengths, some sharing a prefix;
- chunked prefill: every step prefills the next piece (at most `chunk` tokens) of every unfinished prompt,
  all pieces packed into one call with cu_seqlens, each continuing from its request's slot; on the way, the
  state after every multiple of C = 64 prompt tokens goes into a free slot (a prefix-cache checkpoint);
- a new request whose prompt starts with a cached prefix copies that checkpoint into its own slot and
  prefills only the rest;
- decode steps (S = 1) for every running request, captured once in a CUDA graph on CUDA and replayed;
- speculative verify steps: S = 4 tokens a request with one slot per token; a random number of them is
  accepted, and the next step continues from the last accepted token's slot through num_accepted_tokens
  (the rollback copies nothing).

The same engine runs on two backends: `KdagenBackend` (the kernels: ``kernel(...)`` on the pool and
``kernel.decode(...)``) and `ReferenceBackend` (kdagen.reference's fp64 token recurrence on the CPU, which
defines the semantics). At the end, the o of every token the engine computed, every finished request's final
state and every cached checkpoint are compared, position by position, with an fp64 reference run of each
request's whole token stream (relative RMSE <= 0.005, kda-math.md §4); the script prints a report and exits
with status 1 on a mismatch.

    python examples/serve.py --device cuda --spec specs/sm90.yaml:k128
    python examples/serve.py --device cpu --spec specs/sm90.yaml:k64
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from kdagen.reference import (
    kda_pool_decode_reference,
    kda_pool_prefill_reference,
    kda_recurrent_reference,
    make_inputs,
    rel_rmse,
)
from kdagen.spec import KernelSpec, resolve_spec

Tensor = torch.Tensor
REPO = Path(__file__).resolve().parents[1]
TOL = 0.005  # relative RMSE of o and of the fp32 states against the fp64 reference (kda-math.md §4.2)
GRID = 16  # tokens a recurrence step: a prefill piece places checkpoints only if it starts on this grid
PAD = -1  # a padding slot: the kernels read and write no state for it and give its tokens o = 0
TOKEN_INPUTS = ("q", "k", "v", "g", "beta")


# ------------------------------------------------------------------------------------------------------
# The layer: token ids -> KDA inputs
# ------------------------------------------------------------------------------------------------------


@dataclass
class Layer:
    """One KDA layer. Each token id maps to fixed q, k, v, g, beta rows in the spec's dtypes, a stand-in for
    a model's projections (equal prefixes then give equal states, which is what a prefix cache relies on);
    A_log and dt_bias are the layer's gate parameters (None for a precomputed gate)."""

    spec: KernelSpec
    table: dict[str, Tensor]  # name -> [vocab, ...]
    A_log: Tensor | None
    dt_bias: Tensor | None

    @classmethod
    def random(cls, spec: KernelSpec, heads: int, vocab: int, seed: int, device: torch.device) -> Layer:
        hv = heads * spec.gva_ratio
        x = make_inputs(1, vocab, heads, hv, spec.head_dim_k, spec.head_dim_v, dtype=spec.dtype,
                        beta_dtype=spec.beta_dtype, g_dtype=spec.g_dtype, gate=spec.gate,
                        safe_gate=spec.safe_gate, lower_bound=spec.lower_bound, seed=seed, device=device,
                        l2norm_qk=spec.l2norm_qk, state_layout=spec.state_layout,
                        gate_logit_normalizer=10.0 if spec.gate == "precomputed" else 1.0)
        A_log, dt_bias = x["A_log"], x["dt_bias"]
        if dt_bias is not None:
            # Slow decays, as in the long-memory channels of a trained model: with A_log = 0 and dt_bias near
            # -5 the log-decay is about -5 sigmoid(-5) = -0.03 a token (lower_bound gate) or -softplus(-5) =
            # -0.007 (softplus), so a state carries its tokens over tens of steps and a wrong state shows in
            # the outputs. (make_inputs' gate parameters forget most of a state within a few tokens.)
            A_log = torch.zeros_like(A_log)
            dt_bias = dt_bias * 0.5 - 5.0
        return cls(spec, {name: x[name][0] for name in TOKEN_INPUTS}, A_log, dt_bias)

    def to(self, device: torch.device | str) -> Layer:
        def move(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.to(device)

        return Layer(self.spec, {n: t.to(device) for n, t in self.table.items()}, move(self.A_log),
                     move(self.dt_bias))

    @property
    def device(self) -> torch.device:
        return self.table["q"].device

    @property
    def slot_shape(self) -> tuple[int, int, int]:
        """One request's state: [HV, K, V] (state_layout kv) or [HV, V, K] (vk)."""
        hv, k, v = self.table["v"].shape[1], self.spec.head_dim_k, self.spec.head_dim_v
        return (hv, k, v) if self.spec.state_layout == "kv" else (hv, v, k)

    def inputs(self, tokens: Sequence[int], rows: int = 1) -> dict[str, Tensor]:
        """q, k, v, g, beta of `tokens` as [rows, len(tokens) // rows, ...]: rows = 1 packs them for
        cu_seqlens, rows = N gives decode's [N, S, ...]."""
        ids = torch.tensor(list(tokens), dtype=torch.long).to(self.device)
        per_row = len(tokens) // rows
        return {n: t.index_select(0, ids).view(rows, per_row, *t.shape[1:]) for n, t in self.table.items()}

    def reference_options(self) -> dict[str, Any]:
        """The keywords of kdagen.reference's functions that make them compute this layer."""
        s = self.spec
        return {"gate": s.gate, "lower_bound": s.lower_bound, "l2norm_qk": s.l2norm_qk,
                "state_layout": s.state_layout, "A_log": self.A_log, "dt_bias": self.dt_bias}


# ------------------------------------------------------------------------------------------------------
# Backends: the operations an engine needs from the layer, all in place on the pool
# ------------------------------------------------------------------------------------------------------


class Backend(Protocol):
    name: str
    capturable: bool  # whether its decode can be captured in a CUDA graph (no host reads of device data)

    def prefill(self, x: dict[str, Tensor], *, cu_seqlens: Tensor, state_pool: Tensor, state_indices: Tensor,
                has_initial_state: Tensor, checkpoint_interval: int, start_positions: Tensor,
                checkpoint_indices: Tensor) -> Tensor:
        """Prefill pieces packed as [1, T, ...] with cu_seqlens, each from its slot, with prefix-cache
        checkpoints; returns o [1, T, HV, V]."""
        ...

    def decode(self, x: dict[str, Tensor], *, state_pool: Tensor, state_indices: Tensor,
               num_accepted_tokens: Tensor | None = None, out: Tensor | None = None) -> Tensor:
        """Decode (x [N, 1, ...], state_indices [N]) or verify (x [N, S, ...], state_indices [N, S], FLA's
        semantics); returns o [N, S, HV, V] (`out` when given)."""
        ...


class KdagenBackend:
    """The kdagen kernels: ``kernel(...)`` with a state pool for prefill, ``kernel.decode(...)`` for decode
    and verify."""

    name = "kdagen"
    capturable = True

    def __init__(self, layer: Layer) -> None:
        import kdagen  # builds the variant into the cache on a miss, or loads it

        self.kernel = kdagen.get_kernel(layer.spec)
        self.params = {"A_log": layer.A_log, "dt_bias": layer.dt_bias}

    def prefill(self, x: dict[str, Tensor], **pool: Any) -> Tensor:
        o, _ = self.kernel(*(x[n] for n in TOKEN_INPUTS), **self.params, **pool)
        return o

    def decode(self, x: dict[str, Tensor], **pool: Any) -> Tensor:
        return self.kernel.decode(*(x[n] for n in TOKEN_INPUTS), **self.params, **pool)


class ReferenceBackend:
    """The same operations on kdagen.reference's fp64 token recurrence (kda_pool_prefill_reference,
    kda_pool_decode_reference). It reads the index tensors on the host, so it runs eagerly (CPU) and is never
    captured; o comes back in the layer's dtype, as from the kernels."""

    name = "reference"
    capturable = False

    def __init__(self, layer: Layer) -> None:
        self.options = layer.reference_options()

    def prefill(self, x: dict[str, Tensor], **pool: Any) -> Tensor:
        return kda_pool_prefill_reference(**x, **pool, **self.options).to(x["q"].dtype)

    def decode(self, x: dict[str, Tensor], *, out: Tensor | None = None, **pool: Any) -> Tensor:
        o = kda_pool_decode_reference(**x, **pool, **self.options).to(x["q"].dtype)
        return o if out is None else out.copy_(o)


# ------------------------------------------------------------------------------------------------------
# The engine's state: pool, prefix cache, requests
# ------------------------------------------------------------------------------------------------------


class StatePool:
    """The layer's recurrent states, one request (or checkpoint) a slot, and the free list."""

    def __init__(self, layer: Layer, slots: int) -> None:
        # An engine allocates the pool uninitialised (torch.empty); NaN here makes a read of a slot that
        # nothing has written show up in the checks.
        self.states = torch.full((slots, *layer.slot_shape), float("nan"), dtype=torch.float32,
                                 device=layer.device)
        self.free: list[int] = list(range(slots - 1, -1, -1))

    def take(self) -> int:
        return self.free.pop()

    def give(self, slots: Sequence[int]) -> None:
        self.free.extend(slots)


class PrefixCache:
    """Prompt prefixes of a multiple of C tokens whose state sits in a pool slot, least recently used first.
    Keys are the prefix tokens themselves (an engine would hash its blocks)."""

    def __init__(self, interval: int, capacity: int) -> None:
        self.interval = interval
        self.capacity = capacity
        self.entries: OrderedDict[tuple[int, ...], int] = OrderedDict()

    def __contains__(self, key: tuple[int, ...]) -> bool:
        return key in self.entries

    def lookup(self, prompt: Sequence[int]) -> tuple[int, int] | None:
        """(p, slot) of the longest cached prefix that leaves at least one prompt token to compute (the last
        prompt token's o is what the engine samples from), or None."""
        c = self.interval
        for p in range((len(prompt) - 1) // c * c, 0, -c):
            key = tuple(prompt[:p])
            if key in self.entries:
                self.entries.move_to_end(key)
                return p, self.entries[key]
        return None

    def add(self, key: tuple[int, ...], slot: int) -> list[int]:
        """Cache `slot` under `key`; returns the slots of the entries evicted to stay within capacity."""
        self.entries[key] = slot
        return [self.entries.popitem(last=False)[1] for _ in range(len(self.entries) - self.capacity)]

    def evict(self) -> int | None:
        return self.entries.popitem(last=False)[1] if self.entries else None


@dataclass
class Request:
    rid: int
    prompt: list[int]
    arrival: int  # the engine step it arrives at
    max_new: int  # tokens to generate
    slots: list[int] = field(default_factory=list)  # S slots: prefill and decode use slots[cur], verify all
    cur: int = 0  # the column of `slots` that holds the request's state
    tokens: list[int] = field(default_factory=list)  # the prompt, then the accepted tokens
    in_state: int = 0  # tokens of `tokens` in the state
    restored: int = 0  # prompt tokens restored from the prefix cache
    pending: int | None = None  # the sampled token the next decode or verify step feeds
    prefilled: list[tuple[int, Tensor]] = field(default_factory=list)  # (position, o rows) of prompt tokens
    decoded: list[tuple[int, Tensor]] = field(default_factory=list)  # the same of accepted tokens
    rejected: list[tuple[int, list[int], Tensor]] = field(default_factory=list)  # (position, fed, o)
    final_state: Tensor | None = None

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt)

    @property
    def generated(self) -> int:
        return len(self.tokens) - len(self.prompt)


@dataclass(frozen=True)
class Config:
    """The engine's sizes and policies."""

    slots: int = 64  # pool slots: request states, their speculative slots and checkpoints
    chunk: int = 48  # prefill tokens a request a step; a multiple of GRID, so every piece starts on the grid
    checkpoint_interval: int = 64  # C, the prefix cache's block
    cache_entries: int = 16
    draft: int = 4  # S: tokens a verify step feeds a request (its sampled token and S - 1 draft tokens)
    verify_every: int = 3  # every third generation step is a speculative verify
    graph_rows: int = 8  # requests a decode step holds (the captured batch)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.chunk <= 0 or self.chunk % GRID or self.checkpoint_interval % GRID:
            raise ValueError(f"chunk and checkpoint_interval must be positive multiples of {GRID}")
        if not 2 <= self.draft <= 8:
            raise ValueError("draft: a verify step feeds 2 to 8 tokens a request")
        if self.slots < self.draft or self.graph_rows < 1 or self.verify_every < 1:
            raise ValueError("slots >= draft, graph_rows >= 1 and verify_every >= 1 are needed")


@dataclass
class Stats:
    steps: int = 0
    prefill_calls: int = 0
    prefill_pieces: int = 0
    prefill_tokens: int = 0
    prefix_hits: int = 0
    restored_tokens: int = 0
    checkpoints: int = 0
    evictions: int = 0
    decode_steps: int = 0
    decode_tokens: int = 0
    padding_rows: int = 0
    padding_nonzero: int = 0  # elements of o in padding rows that are not zero (must stay 0)
    verify_steps: int = 0
    verify_tokens: int = 0
    accepted: Counter = field(default_factory=Counter)  # accepted tokens -> verify rows


# ------------------------------------------------------------------------------------------------------
# Decode in a CUDA graph
# ------------------------------------------------------------------------------------------------------


class DecodeGraph:
    """The decode step (S = 1) of up to `rows` requests on static buffers: captured once in a CUDA graph and
    replayed every step when `capture`, called as is otherwise.

    A graph replays fixed shapes and addresses, so the batch is padded to `rows` with slot PAD: the kernel
    reads and writes no state for a padding row and gives it o = 0, so one graph serves any number of
    requests up to `rows`, and whatever the padding rows' inputs hold is harmless. A negative index is the
    padding convention (vLLM's PAD_SLOT_ID = -1) because every non-negative index is a real slot."""

    def __init__(self, backend: Backend, layer: Layer, pool: Tensor, rows: int, capture: bool) -> None:
        self.backend, self.layer, self.pool, self.rows = backend, layer, pool, rows
        self.x = layer.inputs([0] * rows, rows=rows)  # [rows, 1, ...], overwritten in place each step
        self.idx = torch.full((rows,), PAD, dtype=torch.int32, device=pool.device)
        hv, v = layer.table["v"].shape[1:]
        self.out = torch.full((rows, 1, hv, v), float("nan"), dtype=self.x["q"].dtype, device=pool.device)
        self.graph: torch.cuda.CUDAGraph | None = None
        if capture:
            # Warm up on a side stream first: the first call checks the arguments and makes the kernel's
            # helper tensors, host work and allocations that must stay out of the graph. Every row is
            # padding here, so neither call touches the pool.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._step()
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self._step()

    def _step(self) -> None:
        self.backend.decode(self.x, state_pool=self.pool, state_indices=self.idx, out=self.out)

    def __call__(self, tokens: list[int], slots: list[int]) -> tuple[Tensor, Tensor]:
        """o [n, 1, HV, V] of the n live rows (a copy: the next step overwrites the buffer) and of the
        padding rows."""
        pad = self.rows - len(tokens)
        fresh = self.layer.inputs(tokens + [0] * pad, rows=self.rows)
        for name, t in self.x.items():
            t.copy_(fresh[name])
        self.idx.copy_(torch.tensor(slots + [PAD] * pad, dtype=torch.int32))
        if self.graph is not None:
            self.graph.replay()
        else:
            self._step()
        n = len(tokens)
        return self.out[:n].clone(), self.out[n:]


# ------------------------------------------------------------------------------------------------------
# The engine
# ------------------------------------------------------------------------------------------------------


class Engine:
    """One step: admit arrived requests (restoring cached prefixes), a decode or verify step for the requests
    past their prompt, then one chunked-prefill call for the others."""

    def __init__(self, layer: Layer, backend: Backend, config: Config, vocab: int) -> None:
        self.layer, self.backend, self.config, self.vocab = layer, backend, config, vocab
        self.pool = StatePool(layer, config.slots)
        self.cache = PrefixCache(config.checkpoint_interval, config.cache_entries)
        capture = backend.capturable and layer.device.type == "cuda"
        self.graph = DecodeGraph(backend, layer, self.pool.states, config.graph_rows, capture)
        self.captured = capture
        self.rng = random.Random(config.seed)  # sampling, drafts and acceptance: the same on every backend
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.stats = Stats()

    def run(self, requests: Sequence[Request], max_steps: int = 10_000) -> list[Request]:
        self.waiting.extend(sorted(requests, key=lambda r: r.arrival))
        while self.waiting or self.running:
            if self.stats.steps >= max_steps:
                raise RuntimeError(f"requests still unfinished after {max_steps} steps")
            self.step()
        return self.finished

    def step(self) -> None:
        self._admit()
        self._generate()
        self._prefill()
        self.stats.steps += 1

    def _device(self, values: Any, dtype: torch.dtype) -> Tensor:
        return torch.tensor(values, dtype=dtype).to(self.pool.states.device)

    def _sample(self) -> int:
        return self.rng.randrange(self.vocab)

    def _alloc(self, n: int) -> list[int] | None:
        # Free slots first; then the least recently used checkpoints give theirs up.
        while len(self.pool.free) < n:
            slot = self.cache.evict()
            if slot is None:
                return None
            self.pool.give([slot])
            self.stats.evictions += 1
        return [self.pool.take() for _ in range(n)]

    def _admit(self) -> None:
        # First come, first served: a request waits for its arrival step and for S free slots.
        while self.waiting and self.waiting[0].arrival <= self.stats.steps:
            slots = self._alloc(self.config.draft)
            if slots is None:
                return
            req = self.waiting.popleft()
            req.slots = slots
            self.running.append(req)
            hit = self.cache.lookup(req.prompt)
            if hit is not None:
                # A prefix-cache hit: the checkpoint's state is copied into the request's own slot, which the
                # next piece updates in place (the checkpoint stays intact for the next hit), and prefill
                # goes on from position p.
                p, src = hit
                self.pool.states[slots[0]].copy_(self.pool.states[src])
                req.in_state = req.restored = p
                self.stats.prefix_hits += 1
                self.stats.restored_tokens += p

    def _prefill(self) -> None:
        batch = [r for r in self.running if r.in_state < len(r.prompt)]
        if not batch:
            return
        c = self.config.checkpoint_interval
        tokens: list[int] = []
        cu, starts, has_state, ck_rows = [0], [], [], []
        claimed: dict[tuple[int, ...], int] = {}
        for r in batch:
            lo, hi = r.in_state, min(r.in_state + self.config.chunk, len(r.prompt))
            tokens += r.prompt[lo:hi]
            cu.append(len(tokens))
            # The piece does not know where it sits in its request: start_positions tells the kernel how many
            # tokens the state already holds, so that checkpoints land on multiples of C counted from the
            # request's first token (the prefix cache's block boundaries), not from the piece's.
            starts.append(lo)
            # A fresh request's slot still holds a finished request's state (or garbage); has_initial_state
            # False starts it from zero without a clearing pass over the slot.
            has_state.append(lo > 0)
            row = []
            for p in range((lo // c + 1) * c, hi + 1, c):
                key = tuple(r.prompt[:p])
                slot = PAD  # negative: no checkpoint wanted here (already cached, or no slot to spare)
                if key not in self.cache and key not in claimed:
                    got = self._alloc(1)
                    if got is not None:
                        slot = claimed[key] = got[0]
                row.append(slot)
            ck_rows.append(row)
        width = max(1, *(len(row) for row in ck_rows))
        ck = [row + [PAD] * (width - len(row)) for row in ck_rows]
        o = self.backend.prefill(
            self.layer.inputs(tokens),
            cu_seqlens=self._device(cu, torch.int32),
            state_pool=self.pool.states,
            state_indices=self._device([r.slots[r.cur] for r in batch], torch.int32),
            has_initial_state=self._device(has_state, torch.bool),
            checkpoint_interval=c,
            start_positions=self._device(starts, torch.int32),
            checkpoint_indices=self._device(ck, torch.int32),
        )
        # The checkpoints are in their slots once the call has run (stream order): later calls may use them.
        for key, slot in claimed.items():
            freed = self.cache.add(key, slot)
            self.pool.give(freed)
            self.stats.evictions += len(freed)
        for n, r in enumerate(batch):
            r.prefilled.append((r.in_state, o[0, cu[n]:cu[n + 1]]))
            r.in_state += cu[n + 1] - cu[n]
            if r.in_state == len(r.prompt):
                r.pending = self._sample()  # the first generated token, fed by the next step
        s = self.stats
        s.prefill_calls += 1
        s.prefill_pieces += len(batch)
        s.prefill_tokens += len(tokens)
        s.checkpoints += len(claimed)

    def _generate(self) -> None:
        batch = [r for r in self.running if r.pending is not None]
        if not batch:
            return
        every = self.config.verify_every
        if self.stats.steps % every == every - 1:
            self._verify(batch)
        else:
            for i in range(0, len(batch), self.graph.rows):
                self._decode(batch[i:i + self.graph.rows])
        for r in batch:
            if r.generated >= r.max_new:
                self._finish(r)

    def _decode(self, batch: list[Request]) -> None:
        o, padding = self.graph([r.pending for r in batch], [r.slots[r.cur] for r in batch])
        for r, o_r in zip(batch, o):
            r.decoded.append((len(r.tokens), o_r))
            r.tokens.append(r.pending)
            r.in_state += 1
            r.pending = self._sample()
        s = self.stats
        s.decode_steps += 1
        s.decode_tokens += len(batch)
        s.padding_rows += padding.shape[0]
        s.padding_nonzero += int(torch.count_nonzero(padding))

    def _verify(self, batch: list[Request]) -> None:
        S = self.config.draft
        fed = [[r.pending] + [self._sample() for _ in range(S - 1)] for r in batch]  # sampled + drafts
        o = self.backend.decode(
            self.layer.inputs(list(itertools.chain(*fed)), rows=len(batch)),
            state_pool=self.pool.states,
            # One slot a token: the state after token t goes to slots[t] ...
            state_indices=self._device([r.slots for r in batch], torch.int32),
            # ... and the state is read from slots[accepted - 1], the column the last step left it in.
            num_accepted_tokens=self._device([r.cur + 1 for r in batch], torch.int32),
        )
        for r, toks, o_r in zip(batch, fed, o):
            a = self.rng.randint(1, S)  # the target model agrees with the first a tokens (the first always)
            r.decoded.append((len(r.tokens), o_r[:a]))
            if a < S:
                r.rejected.append((len(r.tokens), toks, o_r[a:]))
            r.tokens += toks[:a]
            r.in_state += a
            # The rollback: the state after the last accepted token already sits in slots[a - 1]; the next
            # step reads it there (num_accepted_tokens = a, or state_indices = slots[a - 1] for S = 1).
            r.cur = a - 1
            r.pending = self._sample()
            self.stats.accepted[a] += 1
        self.stats.verify_steps += 1
        self.stats.verify_tokens += S * len(batch)

    def _finish(self, r: Request) -> None:
        r.final_state = self.pool.states[r.slots[r.cur]].clone()
        self.pool.give(r.slots)  # the slots keep the stale state: the next owner starts from zero anyway
        self.running.remove(r)
        self.finished.append(r)


# ------------------------------------------------------------------------------------------------------
# Workload and checks
# ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """The layer's sizes and the requests (make_requests)."""

    requests: int = 8
    heads: int = 2  # q/k heads (value heads: heads * the spec's gva_ratio)
    vocab: int = 256
    system: int = 150  # tokens of a system prompt that some requests share
    tail: tuple[int, int] = (8, 90)  # (min, max) tokens of each request's own part of the prompt
    new_tokens: tuple[int, int] = (6, 16)  # (min, max) tokens to generate
    spacing: int = 2  # engine steps between arrivals
    seed: int = 0


def make_requests(w: Workload) -> list[Request]:
    """Prompts of four kinds in turn: the shared system prompt and a question; a prompt of its own; a
    follow-up (the prompt of the request two before and more, as in a chat's next turn); part of the system
    prompt and a question. Requests of the first, third and fourth kind find prefixes in the cache."""
    rng = random.Random(w.seed)

    def words(n: int) -> list[int]:
        return [rng.randrange(w.vocab) for _ in range(n)]

    system = words(w.system)
    requests: list[Request] = []
    for i in range(w.requests):
        tail = words(rng.randint(*w.tail))
        kind = i % 4
        if kind == 0:
            prompt = system + tail
        elif kind == 1:
            prompt = tail
        elif kind == 2:
            prompt = requests[i - 2].prompt + tail
        else:
            prompt = system[:rng.randint(GRID, w.system)] + tail
        requests.append(Request(i, prompt, arrival=i * w.spacing, max_new=rng.randint(*w.new_tokens)))
    return requests


@dataclass
class Check:
    """One category of the comparison: its worst error (relative RMSE, or a count) and where it is."""

    what: str
    count: str  # what was compared, in words
    error: float
    where: str
    tol: float = TOL

    @property
    def ok(self) -> bool:
        return self.error <= self.tol  # NaN fails

    def line(self) -> str:
        worst = f"worst {self.error:.2e} ({self.where})" if self.where else f"{self.error:g}"
        return f"{'ok  ' if self.ok else 'FAIL'} {self.what}: {self.count}, {worst}"


def _worst(what: str, unit: str, pairs: list[tuple[str, Tensor, Tensor]]) -> Check:
    # One line for a category: the largest error, or the first failing one (a NaN has no order) and how
    # many others fail.
    errors = [(rel_rmse(ref, out), name) for name, ref, out in pairs]
    bad = [e for e in errors if not e[0] <= TOL]
    err, where = bad[0] if bad else max(errors, default=(0.0, "-"))
    if len(bad) > 1:
        where += f"; {len(bad) - 1} more fail"
    return Check(what, f"{len(pairs)} {unit}", err, where)


def check(layer: Layer, engine: Engine) -> list[Check]:
    """Compare with one fp64 reference run (kda_recurrent_reference from a zero state, on the CPU) of: each
    finished request's whole token stream, each rejected verify step's stream (the tokens before it, then the
    tokens it fed) and each cached checkpoint's prefix."""
    requests = engine.finished
    streams = [r.tokens for r in requests]
    streams += [r.tokens[:pos] + fed for r in requests for pos, fed, _ in r.rejected]
    streams += [list(key) for key in engine.cache.entries]
    cu = [0, *itertools.accumulate(len(s) for s in streams)]
    ref = layer.to("cpu")
    o_ref, h_ref = kda_recurrent_reference(**ref.inputs(list(itertools.chain(*streams))), cu_seqlens=cu,
                                           output_final_state=True, **ref.reference_options())

    def rows(m: int, lo: int, hi: int) -> Tensor:
        return o_ref[0, cu[m] + lo:cu[m] + hi]

    def aligned(into: list, n: int, outputs: list[tuple[int, Tensor]]) -> None:
        # (name, reference, engine) o of the positions the engine computed, in order
        if outputs:
            into.append((f"request {requests[n].rid}",
                         torch.cat([rows(n, pos, pos + o.shape[0]) for pos, o in outputs]),
                         torch.cat([o.cpu() for _, o in outputs])))

    prefilled: list = []
    generated: list = []
    drafts, finals = [], []
    m = len(requests)
    for n, r in enumerate(requests):
        aligned(prefilled, n, r.prefilled)
        aligned(generated, n, r.decoded)
        finals.append((f"request {r.rid}", h_ref[n], r.final_state))
        for pos, fed, o in r.rejected:
            end = pos + len(fed)
            drafts.append((f"request {r.rid} at {pos}", rows(m, end - o.shape[0], end), o))
            m += 1
    cached = [(f"slot {slot} ({len(key)} tokens)", h_ref[m + i], engine.pool.states[slot])
              for i, (key, slot) in enumerate(engine.cache.entries.items())]
    s = engine.stats
    return [
        _worst("o of the prompt tokens prefilled", f"requests, {s.prefill_tokens} tokens", prefilled),
        _worst("o of the tokens decoded and accepted", "requests", generated),
        _worst("o of the rejected draft tokens", "verify rows", drafts),
        _worst("final states", "requests", finals),
        _worst("checkpoints in the cache", "slots", cached),
        Check("non-zero o in decode padding rows", f"{s.padding_rows} rows", s.padding_nonzero, "", 0),
    ]


@dataclass
class Result:
    """What a run did (stats) and how its outputs compare with the reference (checks)."""

    backend: str
    device: str
    spec: KernelSpec
    stats: Stats
    checks: list[Check]
    seconds: float
    captured: bool

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def report(self) -> str:
        s, sp = self.stats, self.spec
        acc = ", ".join(f"{a}: {n}" for a, n in sorted(s.accepted.items()))
        lines = [
            f"backend {self.backend} on {self.device}; K={sp.head_dim_k} V={sp.head_dim_v} "
            f"gva={sp.gva_ratio} gate={sp.gate} layout={sp.state_layout}",
            f"  {s.steps} steps, {self.seconds:.2f} s",
            f"  prefill: {s.prefill_calls} calls, {s.prefill_pieces} pieces, {s.prefill_tokens} tokens "
            f"computed; {s.prefix_hits} prefix-cache hits restored {s.restored_tokens} tokens; "
            f"{s.checkpoints} checkpoints written, {s.evictions} evicted",
            f"  decode: {s.decode_steps} steps{' (CUDA graph replays)' if self.captured else ''}, "
            f"{s.decode_tokens} tokens, {s.padding_rows} padding rows",
            f"  verify: {s.verify_steps} steps, {s.verify_tokens} tokens fed, accepted per row {{{acc}}}",
            f"checks against the fp64 reference (relative RMSE <= {TOL}):",
        ]
        lines += [f"  {c.line()}" for c in self.checks]
        lines.append("PASS" if self.ok else "FAIL")
        return "\n".join(lines)


def serve(spec: KernelSpec, device: torch.device | str, workload: Workload = Workload(),
          config: Config = Config(), make_backend: Callable[[Layer], Backend] | None = None) -> Result:
    """Run the workload through the engine on `device` (the kernels on CUDA, the reference elsewhere, unless
    `make_backend` says) and check the results."""
    device = torch.device(device)
    layer = Layer.random(spec, workload.heads, workload.vocab, workload.seed, device)
    if make_backend is None:
        make_backend = KdagenBackend if device.type == "cuda" else ReferenceBackend
    with torch.inference_mode():
        backend = make_backend(layer)
        engine = Engine(layer, backend, config, workload.vocab)
        start = time.perf_counter()
        engine.run(make_requests(workload))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        checks = check(layer, engine)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    return Result(backend.name, where, spec, engine.stats, checks, seconds, engine.captured)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda: the kdagen kernels; cpu: the fp64 reference backend")
    parser.add_argument("--spec", default=f"{REPO / 'specs' / 'sm90.yaml'}:k128", help="path.yaml:variant")
    parser.add_argument("--requests", type=int, default=Workload.requests)
    parser.add_argument("--heads", type=int, default=Workload.heads)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slots", type=int, default=Config.slots)
    parser.add_argument("--chunk", type=int, default=Config.chunk)
    parser.add_argument("--interval", type=int, default=Config.checkpoint_interval)
    parser.add_argument("--draft", type=int, default=Config.draft)
    args = parser.parse_args(argv)
    _, spec = resolve_spec(args.spec)
    workload = Workload(requests=args.requests, heads=args.heads, seed=args.seed)
    config = Config(slots=args.slots, chunk=args.chunk, checkpoint_interval=args.interval, draft=args.draft,
                    seed=args.seed)
    result = serve(spec, args.device, workload, config)
    print(result.report())
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
