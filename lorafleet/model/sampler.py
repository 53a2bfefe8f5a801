"""Sampling as pure functions of (logits, params, generators), batched: one pass over the rows
that sample, whatever their settings, and one read of the chosen tokens (on a GPU, the step's
only synchronization).

- Temperatures below `MIN_TEMPERATURE` are greedy (`SamplingParams.greedy`): the kernels' argmax.
- The filters run in vLLM's order: top-k, then top-p over what top-k kept, then min-p; the most
  likely token always stays. Rows are filtered together among their `CANDIDATES` most likely
  tokens (a top-k one: its k and one more, to see a tie at the k-th); a row whose kept set may
  reach past its candidates (a nucleus wider than them, a tie at the k-th) is done again over its
  whole sorted row, so the result is always that of filtering the whole row.
- Rows without a generator of their own draw together from the `shared` one (the engine's,
  seeded by its config). A request with a seed has its own generator and is sampled alone, so
  its tokens do not depend on what else shares the batch.
- A row that cannot be sampled (its logits are not finite: an adapter whose weights overflow)
  fails that row only; it is replaced by zeros before any draw, so no device op sees a NaN.
- Logprobs are those of the model's raw distribution (before temperature, filters and a
  structured output's mask), as vLLM reports them by default.
- A row under a structured output's constraint draws among the tokens its mask allows (`constrain`).
"""

from __future__ import annotations

import torch

from lorafleet.kernels import reference
from lorafleet.model.upload import Upload

NEG_INF = float("-inf")
NON_FINITE = "the model produced non-finite logits for this request (NaN or Inf)"
CANDIDATES = 1024  # tokens a top-p row is first filtered among (why: a sort of the whole vocabulary
#                    per row cost more than the model's decode step at 64 rows; most nuclei are narrower)


def _filtered(x: torch.Tensor, k: torch.Tensor, p: torch.Tensor, m: torch.Tensor, K: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows x [R, V] (divided by their temperatures) with top-k k [R] (0: off), top-p p [R] (inf: off) and
    min-p m [R] among their K most likely tokens (all of them, sorted, when K is V). Returns the
    distribution over the candidates [R, K], their token ids [R, K], and which rows' kept tokens
    all lie among the candidates (always, when K is V)."""
    V = x.shape[1]
    if K >= V:
        vals, ids = torch.sort(x, dim=-1, descending=True, stable=True)
    else:
        vals, ids = torch.topk(x, K, dim=-1)
    K = vals.shape[1]
    kth = vals.gather(1, (k.clamp(1, K) - 1)[:, None])
    topk = (k > 0)[:, None]
    tied = topk[:, 0] & (vals[:, -1] >= kth[:, 0])  # the k-th value reaches the last candidate
    vals = vals.masked_fill(topk & (vals < kth), NEG_INF)
    # top-p over what top-k kept: a top-k row's kept tokens are all candidates (or it is redone),
    # any other row's mass is over the whole row
    logz = torch.where(topk[:, 0], vals.logsumexp(-1), x.logsumexp(-1))
    probs = (vals - logz[:, None]).exp()
    cum = probs.cumsum(-1)
    drop = (cum - probs) >= p[:, None]
    drop[:, 0] = False
    vals = vals.masked_fill(drop, NEG_INF)
    complete = torch.ones_like(topk[:, 0]) if K == V else (
        (topk[:, 0] & ~tied) | (~topk[:, 0] & (cum[:, -1] >= p)))
    probs = vals.softmax(-1)
    probs = probs.masked_fill(probs < m[:, None] * probs[:, :1], 0.0)
    return probs, ids, complete


def _pick(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One index per row of probs [R, K] (non-negative, any scale; overwritten), by inverting its
    cumulative sum at one uniform draw. Why not torch.multinomial: it draws a number per token,
    which cost more than the model's step on the CPU. A token of probability 0 is never picked."""
    cdf = probs.cumsum_(-1)
    total = cdf[:, -1:]
    u = torch.rand(total.shape, generator=generator, device=probs.device, dtype=probs.dtype)
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))  # below the total
    return torch.searchsorted(cdf, target, right=True)[:, 0]


class _Draw:
    """Rows drawn together: their positions among the sampled rows, their generator, and whether
    they filter (top-k or top-p: among K candidates) or not (the whole row, unsorted)."""

    def __init__(self, up: Upload, pos: list[int], params: list, generator, V: int, whole: bool):
        self.generator, self.size = generator, len(pos)
        self.filters = any(_filters(p, V) for p in params)
        self.pos = up.add(pos)
        self.min_p = up.add([p.min_p for p in params], torch.float32) if any(p.min_p > 0 for p in params) else None
        if self.filters:
            k = [p.top_k if 0 < p.top_k < V else 0 for p in params]
            self.k = up.add(k)
            self.p = up.add([p.top_p if p.top_p < 1.0 else float("inf") for p in params], torch.float32)
            self.min_p = self.min_p if self.min_p is not None else up.add([0.0] * len(params), torch.float32)
            wide = CANDIDATES if any(p.top_p < 1.0 for p in params) else 0  # top-k alone: its k and one more
            self.K = V if whole else min(V, max(wide, max(k) + 1))

    def run(self, x: torch.Tensor, cols: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens [n] and whether each row's filter was complete among its candidates [n], for rows
        x [n, V] (logits / temperature, finite but for -inf; overwritten where the rows do not
        filter, in place of a copy: on the CPU a fresh tensor of the vocabulary's width costs its
        page faults every step)."""
        if not self.filters:
            e = x.sub_(x.amax(-1, keepdim=True)).exp_()  # unnormalized, the largest at 1
            if self.min_p is not None:
                e = e.masked_fill_(e < cols[self.min_p][:, None], 0.0)
            return _pick(e, self.generator), torch.ones(len(x), dtype=torch.bool, device=x.device)
        assert self.min_p is not None  # set with the filters
        probs, ids, complete = _filtered(x, cols[self.k], cols[self.p], cols[self.min_p], self.K)
        return ids.gather(1, _pick(probs, self.generator)[:, None])[:, 0], complete


def _filters(p, V: int) -> bool:
    """Whether SamplingParams `p` filter a vocabulary of V tokens: a top-k below V, or a top-p."""
    return 0 < p.top_k < V or p.top_p < 1.0


def _draws(up: Upload, pos: list[int], params: list, generators: list, shared, V: int, whole: bool) -> list[_Draw]:
    """The draws for sampled rows at positions `pos`: those without a generator of their own
    together from `shared` (those that filter apart from those that do not), a seeded one alone."""
    draws = []
    common = [j for j in pos if generators[j] is None]
    for filters in (False, True):
        sel = [j for j in common if _filters(params[j], V) == filters]
        if sel:
            draws.append(_Draw(up, sel, [params[j] for j in sel], shared, V, whole))
    draws += [_Draw(up, [j], [params[j]], generators[j], V, whole) for j in pos if generators[j] is not None]
    return draws


def _run(x: torch.Tensor, draws: list[_Draw], cols: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every draw over the rows of x [H, V]: tokens [H] and completeness [H]."""
    if len(draws) == 1 and draws[0].size == len(x):  # one draw over every row: no gather
        return draws[0].run(x, cols)
    tokens = torch.empty(len(x), dtype=torch.long, device=x.device)
    complete = torch.ones(len(x), dtype=torch.bool, device=x.device)
    for d in draws:
        at = cols[d.pos]
        t, c = d.run(x.index_select(0, at), cols)
        tokens.index_copy_(0, at, t)
        complete.index_copy_(0, at, c)
    return tokens, complete


class Drawn:
    """A step's draws, launched: `tokens` [S] on the device (what the next step's rows may read
    as their input before the host has them), read with `read()`. The results travel to the host
    in one non-blocking copy (pinned, on a GPU) that `read()` waits for."""

    def __init__(self, S: int, params: list, generators: list, shared, tokens: torch.Tensor,
                 finite: torch.Tensor, complete: torch.Tensor | None, hot: list[int], x, lp_parts):
        self.S, self.params, self.generators, self.shared = S, params, generators, shared
        self.tokens, self.hot, self.x, self.lp_parts = tokens, hot, x, lp_parts
        parts = [tokens, finite] + ([complete] if complete is not None else [])
        self._host: torch.Tensor | list[torch.Tensor]  # packed on the pinned host (CUDA), else the parts
        self._done: torch.cuda.Event | None
        if tokens.device.type == "cuda":
            packed = torch.stack([p.long() for p in parts])
            self._host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self._host.copy_(packed, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record()
        else:
            self._host, self._done = parts, None

    def read(self) -> tuple[list[int | None], list[dict | None], dict[int, str]]:
        """The chosen token ids, for rows that asked their logprob dicts, and {row: why} for rows
        that could not be sampled (their token is None; every other row is unaffected)."""
        if self._done is not None:
            self._done.synchronize()  # the step's one wait
        got, finite, *rest = [p.tolist() for p in self._host]
        complete = rest[0] if rest else None
        params, hot = self.params, self.hot
        redo = [j for j, i in enumerate(hot) if finite[i] and not complete[i]] if complete is not None else []
        if redo:  # a nucleus wider than its candidates (rare but for flat distributions): whole rows, sorted
            up = Upload()
            at = up.add(redo)
            again = _draws(up, list(range(len(redo))), [params[hot[j]] for j in redo],
                           [self.generators[hot[j]] for j in redo], self.shared, self.x.shape[1], whole=True)
            cols = up.send(self.x.device)
            for j, t in zip(redo, _run(self.x.index_select(0, cols[at]), again, cols)[0].tolist()):
                got[hot[j]] = t
        tokens: list[int | None] = [t if ok else None for t, ok in zip(got, finite)]
        errors = {i: NON_FINITE for i, ok in enumerate(finite) if not ok}
        lps: list[dict | None] = [None] * self.S
        if self.lp_parts is not None:
            want_lp, lp, chosen, top_v, top_i = self.lp_parts
            if redo:  # some tokens drawn again: their logprobs looked up again
                chosen = lp.gather(1, torch.tensor([got[i] for i in want_lp], device=lp.device)[:, None])[:, 0]
            chosen, top_v, top_i = chosen.tolist(), top_v.tolist(), top_i.tolist()
            for j, i in enumerate(want_lp):
                if tokens[i] is not None:
                    n = params[i].logprobs
                    lps[i] = {tokens[i]: chosen[j], **dict(zip(top_i[j][:n], top_v[j][:n]))}
        return tokens, lps, errors


class Plan:
    """A step's per-row sampler numbers (which rows draw or want logprobs, temperatures, the
    draws' filters), added to the step's one `Upload` before its forward pass, so that they cross
    to the device in the copy that carries the step's inputs (`ModelRunner.execute`); `launch`
    reads them from `up.sent`. params[i]: SamplingParams; generators[i]: the row's own
    torch.Generator (a seeded request) or None (it draws from `shared`); V: the vocabulary;
    `exact`: see `launch`; `held`: the rows under a structured output's constraint. The width is
    the base's vocabulary; a step whose logits are wider (an adapter with a vocabulary of its own)
    has its plan made again at `launch`."""

    def __init__(self, up: Upload, params: list, generators: list, shared: torch.Generator | None, V: int,
                 exact: bool = False, held: list[int] | None = None):
        self.up, self.params, self.generators, self.shared = up, params, generators, shared
        self.V, self.exact = V, exact
        self.hot = [i for i, p in enumerate(params) if not p.greedy]
        self.want_lp = [i for i, p in enumerate(params) if p.logprobs is not None]
        self.held = held
        self.held_at = up.add(held) if held else None
        self.draws: list[_Draw] = []
        if self.hot or self.want_lp:
            self.hot_at, self.lp_at = up.add(self.hot), up.add(self.want_lp)
            self.inv_at = up.add([1.0 / params[i].temperature for i in self.hot], torch.float32)
            self.draws = _draws(up, list(range(len(self.hot))), [params[i] for i in self.hot],
                                [generators[i] for i in self.hot], shared, V, whole=exact)

    @staticmethod
    def bound(rows: int) -> int:
        """The most bytes a plan over `rows` rows adds to an Upload: at most 8 columns that each
        hold a row at most once (the held rows, hot, logprobs, temperatures, and the draws' positions,
        min-p, k and p, split among the draws), each element at most 8 bytes with its padding."""
        return 8 * 8 * rows


def launch(logits: torch.Tensor, plan: Plan, greedy=reference.greedy, constrain=None) -> Drawn:
    """The draws of every row of logits [S, V] float32 as `plan` says, queued on the device
    (`plan.up` already sent); `greedy`: the model's kernel for `reference.greedy` (every row's
    argmax and finiteness). `plan.exact` (a next step may read `tokens` before the host does):
    filtering rows sort their whole rows at once, so a token is never drawn again once read, and a
    failed row's token is clamped into the vocabulary, a valid input. `constrain(logits)`: sets
    the tokens the held rows may not take to -inf in place (structured output); each row's
    finiteness is judged before, and logprobs read a copy taken before, where any row asks for
    them: both stay the model's own."""
    S, V = logits.shape
    assert S == len(plan.params), "the plan was made for another step"
    if V != plan.V:  # an adapter's own vocabulary widened the logits: its numbers for this width, sent alone
        up = Upload()
        plan = Plan(up, plan.params, plan.generators, plan.shared, V, plan.exact, plan.held)
        up.send(logits.device)
    params, exact, cols = plan.params, plan.exact, plan.up.sent
    raw = logits
    tokens_dev, finite = greedy(logits)  # one batched call covers greedy rows
    if constrain is not None:
        assert plan.held_at is not None  # a constraint's rows were planned
        if plan.want_lp:
            logits = logits.clone()
        constrain(logits)
        held = cols[plan.held_at]
        tokens_dev = tokens_dev.index_copy(0, held, logits.index_select(0, held).argmax(-1))
    hot, want_lp = plan.hot, plan.want_lp
    if not hot and not want_lp:  # every row greedy: the argmax alone
        return Drawn(S, params, plan.generators, plan.shared, tokens_dev.clamp(0, V - 1) if exact else tokens_dev,
                     finite, None, hot, None, None)
    complete, x = torch.ones(S, dtype=torch.bool, device=logits.device), None
    if hot:
        rows, inv = cols[plan.hot_at], cols[plan.inv_at]
        every = len(hot) == S
        hot_logits = logits if every else logits.index_select(0, rows)
        argmax = tokens_dev if every else tokens_dev.index_select(0, rows)
        top = hot_logits.gather(1, argmax.clamp(0, V - 1)[:, None])[:, 0]  # each row's largest
        ok = (finite if every else finite.index_select(0, rows)) & torch.isfinite(top * inv)  # a temperature
        # can overflow the largest logit; a failed row draws harmlessly from zeros (no device op sees a
        # NaN), its token dropped
        x = torch.nan_to_num_(hot_logits * torch.where(ok, inv, 0.0)[:, None], 0.0, 0.0, NEG_INF)
        drawn, done = _run(x, plan.draws, cols)  # x's filtering rows stay as they were, for a redo
        tokens_dev = tokens_dev.index_copy(0, rows, drawn)
        finite = finite.index_copy(0, rows, ok)
        complete = complete.index_copy(0, rows, done)
    lp_parts = None
    if want_lp:
        lp = raw.index_select(0, cols[plan.lp_at]).log_softmax(-1)
        top_v, top_i = torch.topk(lp, min(max(params[i].logprobs for i in want_lp), V), dim=-1)
        chosen = lp.gather(1, tokens_dev.index_select(0, cols[plan.lp_at]).clamp(0, V - 1)[:, None])[:, 0]
        lp_parts = (want_lp, lp, chosen, top_v, top_i)
    return Drawn(S, params, plan.generators, plan.shared, tokens_dev.clamp(0, V - 1) if exact else tokens_dev,
                 finite, complete, hot, x, lp_parts)


def sample(logits: torch.Tensor, params: list, generators: list, greedy=reference.greedy,
           shared: torch.Generator | None = None
           ) -> tuple[list[int | None], list[dict | None], dict[int, str]]:
    """A `Plan` sent alone, `launch`, then `Drawn.read`: the chosen token ids, for rows that asked
    their logprob dicts, and {row: why} for rows that could not be sampled."""
    up = Upload()
    plan = Plan(up, params, generators, shared, logits.shape[1])
    up.send(logits.device)
    return launch(logits, plan, greedy).read()
