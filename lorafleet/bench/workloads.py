"""Benchmark workloads as data: how many requests, how long their prompts and outputs are, when
they arrive, and which adapters they ask for (how many, how popular, what ranks and targets, and
whether they start loaded or on disk).

A workload and its seed fix the requests exactly (private `random.Random`s, never the global
RNG), so every system under test gets the same token ids, lengths, adapters and arrival times.
Each aspect draws from a stream of its own, so that adding adapters or arrivals to a workload
never changes its prompts.

Mixes: a request may mix several adapters, each with a scale (`BenchRequest.mix`,
what `lorafleet.adapters.mix.Mix.of` takes). A mix workload's companion (`mix_single`) draws the
same mixes and serves each distinct one by an adapter of its own whose rank is the sum of the
mix's ranks: the same requests reading the same LoRA bytes per step, one adapter each, so their
throughputs' ratio is the price of mixing alone.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import TypedDict

from lorafleet.errors import ConfigError
from lorafleet.adapters.mix import MAX_ADAPTERS, MAX_SCALE, Mix
from lorafleet.adapters.peft_config import MODULES

ARRIVALS = ("all-at-once", "poisson")
POPULARITIES = ("uniform", "zipf", "round-robin")
RESIDENCIES = ("loaded", "registered")
ALL_MODULES = MODULES
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
FIRST_ORDINARY_ID = 3  # ids 0-2 are pad/bos/eos in the random bench models


def adapter_name(index: int) -> str:
    """The name of the index-th adapter of a workload (the folder `build_adapters` writes)."""
    return f"lora-{index:04d}"


@dataclass(frozen=True)
class Workload:
    """Lengths are drawn uniformly from the inclusive ranges (lo, hi).

    Adapters: `num_adapters` of them (0: base model only), the i-th of rank
    `ranks[i % len(ranks)]` on `targets`; a request takes adapter i with probability in
    proportion to 1 (`uniform`) or 1 / (i + 1) ** zipf_alpha (`zipf`), or none with probability
    `base_fraction`; `round-robin`: the j-th request takes adapter j % num_adapters (no draw).
    `residency`: `loaded` = every adapter is in the pool before the clock starts; `registered` =
    they start on disk and load when first asked for (the clock runs).
    `pool_fraction`: the pool has room, beyond the KV cache, for that fraction of the adapters'
    bytes (so the rest are evicted and reloaded: the tiers at work); None: for all of them.
    `kv_fraction` (with a `pool_fraction`): KV room for that share of the requests at full
    length, not all of them (pages are short: cached KV and idle adapters compete).
    Arrivals: `all-at-once` at time 0, or `poisson` at `rate` requests per second, the first at 0.
    `concurrency` (with `all-at-once`): a closed loop, at most that many requests in flight; each
    of the others is sent, in order, when one finishes (its arrival is when it is sent). Only the
    systems that replay over HTTP run it (`System.closed_loop`).
    Shared prefixes: with `tenants` > 0, each tenant has a system prompt of `system_len` tokens,
    and a request's prompt is its tenant's system prompt followed by a question of `prompt_len`
    tokens; adapter i belongs to tenant i % tenants (a base request to a random tenant).
    Mixes: with `mix_size` >= 2, each request mixes that many distinct adapters of the
    `num_adapters`, drawn uniformly, each at a scale drawn uniformly from `mix_scales` (no base
    requests, no other popularity: a mix is a draw without replacement). `mix_single`: the same
    draw, but each distinct mix is served by one adapter of its own, of the summed rank of its
    adapters (`adapter_ranks`): adapter k stands for the k-th distinct mix in request order.
    DoRA: with `dora_every` = k > 0, adapters 0, k, 2k... are DoRA adapters (the same A and B as
    otherwise, and a magnitude per module), the others plain. Saved LM heads: with `saves_every`
    = k > 0, adapters 0, k, 2k... also hold their own LM head (`modules_to_save`: the base's
    head moved by noise), the others not.
    """

    name: str
    num_requests: int
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    seed: int = 0
    arrival: str = "all-at-once"
    rate: float = 0.0
    num_adapters: int = 0
    popularity: str = "uniform"
    zipf_alpha: float = 1.0
    ranks: tuple[int, ...] = (8, 16, 32, 64)
    targets: tuple[str, ...] = ALL_MODULES
    base_fraction: float = 0.0
    residency: str = "loaded"
    pool_fraction: float | None = None
    kv_fraction: float | None = None
    tenants: int = 0
    system_len: int = 0
    concurrency: int | None = None
    mix_size: int = 0
    mix_scales: tuple[float, ...] = (1.0,)
    mix_single: bool = False
    dora_every: int = 0
    saves_every: int = 0
    description: str = ""

    def __post_init__(self):
        def bad(msg):
            raise ConfigError(f"workload {self.name}: {msg}")
        if self.num_requests < 1:
            bad("num_requests must be >= 1")
        for field, (lo, hi) in (("prompt_len", self.prompt_len), ("output_len", self.output_len)):
            if not 1 <= lo <= hi:
                bad(f"{field} needs 1 <= lo <= hi, got {(lo, hi)}")
        if self.arrival not in ARRIVALS:
            bad(f"arrival {self.arrival!r} is not one of {ARRIVALS}")
        if self.arrival == "poisson" and not self.rate > 0:
            bad(f"poisson arrivals need a rate > 0 requests/s, got {self.rate!r}")
        if self.num_adapters < 0:
            bad(f"num_adapters must be >= 0, got {self.num_adapters}")
        if self.popularity not in POPULARITIES:
            bad(f"popularity {self.popularity!r} is not one of {POPULARITIES}")
        if not self.zipf_alpha > 0:
            bad(f"zipf_alpha must be > 0, got {self.zipf_alpha!r}")
        if not self.ranks or any(r < 1 for r in self.ranks):
            bad(f"ranks must be positive integers, got {self.ranks!r}")
        unknown = [t for t in self.targets if t not in ALL_MODULES]
        if unknown or not self.targets:
            bad(f"targets must be some of {', '.join(ALL_MODULES)}, got {self.targets!r}")
        if not 0 <= self.base_fraction <= 1:
            bad(f"base_fraction must be in [0, 1], got {self.base_fraction!r}")
        if self.popularity == "round-robin" and self.base_fraction:
            bad(f"round-robin popularity gives every request an adapter: base_fraction must be 0, "
                f"got {self.base_fraction!r}")
        if self.residency not in RESIDENCIES:
            bad(f"residency {self.residency!r} is not one of {RESIDENCIES}")
        if self.kv_fraction is not None and not (0 < self.kv_fraction <= 1 and self.pool_fraction is not None):
            bad(f"kv_fraction must be in (0, 1] with a pool_fraction, got {self.kv_fraction!r}")
        if self.tenants < 0 or self.system_len < 0 or (self.tenants > 0) != (self.system_len > 0):
            bad(f"tenants and system_len go together (both > 0, or both 0), got {self.tenants}, {self.system_len}")
        if self.pool_fraction is not None and not (0 < self.pool_fraction <= 1 and self.residency == "registered"):
            bad(f"pool_fraction must be in (0, 1] with registered residency, got {self.pool_fraction!r}")
        if self.concurrency is not None and not (self.concurrency >= 1 and self.arrival == "all-at-once"):
            bad(f"concurrency must be >= 1 with all-at-once arrivals, got {self.concurrency!r} with {self.arrival}")
        if self.mix_size:
            if not 2 <= self.mix_size <= min(self.num_adapters, MAX_ADAPTERS):
                bad(f"mix_size must be 0, or 2 to min(num_adapters, {MAX_ADAPTERS}) = "
                    f"{min(self.num_adapters, MAX_ADAPTERS)}, got {self.mix_size}")
            if self.popularity != "uniform" or self.base_fraction or self.tenants:
                bad("mixes are drawn uniformly, every request on one: popularity must be uniform, base_fraction "
                    "and tenants 0")
            if not self.mix_scales or any(not -MAX_SCALE <= s <= MAX_SCALE for s in self.mix_scales):
                bad(f"mix_scales must be numbers in [-{MAX_SCALE:g}, {MAX_SCALE:g}], got {self.mix_scales!r}")
        elif self.mix_single:
            bad("mix_single stands in for mixes: it needs a mix_size")
        if self.dora_every < 0 or (self.dora_every and (self.mix_size or self.mix_single)):
            bad(f"dora_every must be >= 0, and 0 with mixes (DoRA adapters are not mixed), got {self.dora_every}")
        if self.saves_every < 0 or (self.saves_every and (self.mix_size or self.mix_single)):
            bad(f"saves_every must be >= 0, and 0 with mixes (adapters with their own LM head are not mixed), "
                f"got {self.saves_every}")

    def with_adapters(self, n: int) -> Workload:
        """The same requests over n adapters (the adapter sweep)."""
        return dataclasses.replace(self, name=f"{self.name}@{n}", num_adapters=n)

    def with_concurrency(self, n: int) -> Workload:
        """The same requests, n in flight (the llama.cpp comparison runs each at 1 and 8)."""
        return dataclasses.replace(self, name=f"{self.name}-{n}-in-flight", concurrency=n)


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload: `arrival_s` after the start of the run. On one adapter
    (`adapter`), the base (neither), or a mix: `mix`, (name, scale) pairs sorted by name as
    `Mix` keeps them (lists, as read back from JSON, become tuples)."""

    prompt: list[int]
    max_tokens: int
    adapter: str | None = None
    arrival_s: float = 0.0
    mix: tuple[tuple[str, float], ...] = ()

    def __post_init__(self):
        if self.mix and self.adapter is not None:
            raise ConfigError(f"a request names an adapter ({self.adapter!r}) or a mix, not both")
        object.__setattr__(self, "mix", tuple((str(n), float(s)) for n, s in self.mix))

    @property
    def names(self) -> tuple[str, ...]:
        """The adapters it uses: its mix's, its adapter, or none."""
        return tuple(n for n, _ in self.mix) if self.mix else (self.adapter,) if self.adapter is not None else ()

    @property
    def label(self) -> str | None:
        """What serves it, as the engine names it: the adapter, the mix (`a+b*0.5`), or None."""
        return Mix.of(self.mix).label if self.mix else self.adapter


class _Preset(TypedDict, total=False):
    """Fields that several workloads share (typed, so a misspelt or mistyped field is caught)."""

    num_requests: int
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    ranks: tuple[int, ...]
    targets: tuple[str, ...]
    concurrency: int
    mix_size: int
    mix_scales: tuple[float, ...]


class _FleetPreset(_Preset):
    """A preset that fixes the number of adapters too."""

    num_adapters: int


# the comparison with llama.cpp: 64 x 64+64 tokens, a closed loop of 8 in flight (`bench llama-cpp`
# runs each at 1 and 8), adapters of rank 64 on all seven projections
_PEER: _Preset
_PEER = dict(num_requests=64, prompt_len=(64, 64), output_len=(64, 64), ranks=(64,), concurrency=8)
# S-LoRA's scaling setting (ranks 8 and 16 on q/k/v/o, uniform popularity): 1000 against 8
# adapters differs in nothing else
_SLORA: _Preset
_SLORA = dict(num_requests=256, prompt_len=(64, 64), output_len=(64, 64), ranks=(8, 16), targets=ATTENTION_MODULES)
# mixes: 64 requests x 64+64 tokens at once, each a mix of 2 of 8 adapters (ranks 16-64 on all seven
# projections, two of each), each adapter at scale 1 or 0.5; mix-single differs only in serving each mix by one adapter
_MIX: _FleetPreset
_MIX = dict(num_requests=64, prompt_len=(64, 64), output_len=(64, 64), num_adapters=8, ranks=(16, 32, 48, 64),
            mix_size=2, mix_scales=(1.0, 0.5))
# the DoRA figure: 64 requests x 64+64 tokens at once over 8 adapters (ranks 16-64 on all seven projections),
# half of them DoRA; dora-plain differs only in every adapter being plain LoRA
_DORA: _FleetPreset
_DORA = dict(num_requests=64, prompt_len=(64, 64), output_len=(64, 64), num_adapters=8, ranks=(16, 32, 48, 64))
WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload("uniform-8", num_adapters=8, **_SLORA,
             description="256 requests x 64+64 tokens at once over 8 adapters (ranks 8/16 on q/k/v/o)"),
    Workload("uniform-1000", num_adapters=1000, **_SLORA, description="uniform-8's requests over 1000 adapters"),
    Workload("uniform-1000-tiered", num_adapters=1000, residency="registered", pool_fraction=0.05, **_SLORA,
             description="uniform-1000 from disk, with a pool that holds about 5% of the adapters"),
    Workload("zipf-1000", num_adapters=1000, popularity="zipf", zipf_alpha=1.0, arrival="poisson", rate=4.0,
             residency="registered", pool_fraction=0.05, **_SLORA,
             description="Zipf(1.0) popularity, Poisson arrivals at 4 req/s, a pool for ~5% of 1000 adapters"),
    Workload("mixed-lengths", 64, (16, 512), (16, 256), num_adapters=8,
             description="prompts 16-512, outputs 16-256, 8 adapters ranks 8-64 on all 7 projections"),
    Workload("cold-start", 128, (64, 64), (32, 32), num_adapters=32, ranks=(8, 16), arrival="poisson",
             rate=4.0, residency="registered",
             description="32 adapters on disk, loaded on first use; Poisson arrivals at 4 req/s"),
    Workload("shared-prefix", 200, (64, 64), (32, 32), num_adapters=100, popularity="zipf", zipf_alpha=1.0,
             arrival="poisson", rate=0.5, ranks=(8, 16), targets=ATTENTION_MODULES, tenants=10, system_len=512,
             description="10 tenants' 512-token system prompts + a 64-token question, 100 adapters (Zipf), "
                         "Poisson 0.5 req/s"),
    Workload("shared-prefix-pressure", 200, (64, 64), (32, 32), num_adapters=100, popularity="zipf",
             zipf_alpha=1.0, arrival="poisson", rate=0.5, ranks=(8, 16), targets=ATTENTION_MODULES, tenants=10,
             system_len=512, residency="registered", pool_fraction=0.1, kv_fraction=0.1,
             description="shared-prefix with adapters on disk, a pool for ~10% of them and KV room for 10% of "
                         "the requests: cached KV and idle adapters compete for pages"),
    Workload("base-only", 64, (16, 256), (16, 256),
             description="base model only, 64 requests arriving at once"),
    Workload("peer-base", **_PEER, description="64 requests x 64+64 tokens, 8 in flight, base model only"),
    Workload("peer-one-adapter", num_adapters=1, **_PEER,
             description="peer-base's requests, every one on the same rank-64 adapter"),
    Workload("peer-round-robin", num_adapters=8, popularity="round-robin", **_PEER,
             description="peer-base's requests over 8 rank-64 adapters in turn"),
    Workload("mix", **_MIX, description="64 requests x 64+64 tokens at once, each a mix of 2 of 8 adapters "
                                        "(ranks 16-64 on all 7 projections) at scales 1 or 0.5"),
    Workload("mix-single", **_MIX, mix_single=True,
             description="mix's requests, each mix served by one adapter of the summed rank (the same LoRA bytes)"),
    Workload("dora-mixed", **_DORA, dora_every=2,
             description="64 requests x 64+64 tokens at once over 8 adapters (ranks 16-64 on all 7 projections), "
                         "half of them DoRA"),
    Workload("dora-plain", **_DORA, description="dora-mixed's requests with every adapter plain LoRA"),
    Workload("saved-head-mixed", **_DORA, saves_every=2,
             description="dora-plain's requests, half of the adapters with their own LM head (modules_to_save)"),
    Workload("quick", 8, (8, 32), (8, 32), num_adapters=4, ranks=(8, 16), base_fraction=0.25,
             description="a smoke run: 8 requests, 4 adapters and some base requests"),
)}


def get_workload(name: str) -> Workload:
    if name not in WORKLOADS:
        raise ConfigError(f"unknown workload {name!r} (choose from {', '.join(WORKLOADS)})")
    return WORKLOADS[name]


def zipf_weights(n: int, alpha: float) -> list[float]:
    """Popularity of adapters 0..n-1 under Zipf(alpha), normalised to sum to 1."""
    raw = [1.0 / (k + 1) ** alpha for k in range(n)]
    total = sum(raw)
    return [w / total for w in raw]


def make_requests(workload: Workload, vocab_size: int) -> list[BenchRequest]:
    """The workload's requests in arrival order; the same for the same workload and vocabulary
    size, and the same lengths, adapters and arrivals for any vocabulary size."""
    if vocab_size <= FIRST_ORDINARY_ID:
        raise ConfigError(f"vocab_size must be > {FIRST_ORDINARY_ID}, got {vocab_size}")
    n = workload.num_requests
    rng = random.Random(workload.seed)
    # lengths first, so that they do not depend on the vocabulary: every shape gets the same
    lengths = [(rng.randint(*workload.prompt_len), rng.randint(*workload.output_len)) for _ in range(n)]
    prompts = [[rng.randrange(FIRST_ORDINARY_ID, vocab_size) for _ in range(p)] for p, _ in lengths]
    arrivals = _draw_arrivals(workload, random.Random(f"{workload.seed}/arrivals"))
    if workload.mix_size:
        mixes = _draw_mixes(workload)
        if workload.mix_single:
            ids = {m: k for k, m in enumerate(dict.fromkeys(mixes))}
            return [BenchRequest(prompt, out, adapter_name(ids[m]), arrival)
                    for prompt, (_, out), m, arrival in zip(prompts, lengths, mixes, arrivals)]
        return [BenchRequest(prompt, out, None, arrival, tuple((adapter_name(i), s) for i, s in m))
                for prompt, (_, out), m, arrival in zip(prompts, lengths, mixes, arrivals)]
    adapters = _draw_adapters(workload, random.Random(f"{workload.seed}/adapters"))
    if workload.tenants:
        prompts = _with_system_prompts(workload, prompts, adapters, vocab_size)
    return [BenchRequest(prompt, out, adapter, arrival)
            for prompt, (_, out), adapter, arrival in zip(prompts, lengths, adapters, arrivals)]


def adapter_ranks(workload: Workload) -> tuple[int, ...]:
    """The rank of each adapter the requests may name, the i-th `adapter_name(i)`'s: ranks[i %
    len(ranks)] of `num_adapters`; for `mix_single`, one per distinct mix, in request order, the
    sum of its adapters' ranks."""
    own = tuple(workload.ranks[i % len(workload.ranks)] for i in range(workload.num_adapters))
    if not workload.mix_single:
        return own
    return tuple(sum(own[i] for i, _ in m) for m in dict.fromkeys(_draw_mixes(workload)))


def _draw_mixes(workload: Workload) -> list[tuple[tuple[int, float], ...]]:
    """Per request, its mix as (adapter index, scale) pairs sorted by name (`Mix`'s order:
    `adapter_name` pads, so by index); `mix_single` draws the same."""
    rng = random.Random(f"{workload.seed}/mixes")
    out = []
    for _ in range(workload.num_requests):
        picks = sorted(rng.sample(range(workload.num_adapters), workload.mix_size))
        out.append(tuple((i, rng.choice(workload.mix_scales)) for i in picks))
    return out


def _with_system_prompts(workload: Workload, questions: list[list[int]], adapters: list[str | None],
                         vocab_size: int) -> list[list[int]]:
    rng = random.Random(f"{workload.seed}/tenants")
    systems = [[rng.randrange(FIRST_ORDINARY_ID, vocab_size) for _ in range(workload.system_len)]
               for _ in range(workload.tenants)]
    names = {adapter_name(i): i % workload.tenants for i in range(workload.num_adapters)}
    return [systems[names[a] if a is not None else rng.randrange(workload.tenants)] + q
            for q, a in zip(questions, adapters)]


def _draw_adapters(workload: Workload, rng: random.Random) -> list[str | None]:
    n = workload.num_adapters
    if n == 0:
        return [None] * workload.num_requests
    if workload.popularity == "round-robin":
        return [adapter_name(j % n) for j in range(workload.num_requests)]
    weights = zipf_weights(n, workload.zipf_alpha) if workload.popularity == "zipf" else None
    picks = rng.choices(range(n), weights=weights, k=workload.num_requests)
    base = [rng.random() < workload.base_fraction for _ in picks]
    return [None if b else adapter_name(i) for i, b in zip(picks, base)]


def _draw_arrivals(workload: Workload, rng: random.Random) -> list[float]:
    if workload.arrival == "all-at-once":
        return [0.0] * workload.num_requests
    times, t = [], 0.0
    for _ in range(workload.num_requests):
        times.append(t)
        t += rng.expovariate(workload.rate)
    return times
