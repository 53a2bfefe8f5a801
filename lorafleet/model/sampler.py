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
- Logprobs are those of the model's raw distribution (before temperature and filters), as vLLM
  reports them by default.
"""

from __future__ import annotations

import torch

from lorafleet.kernels import reference

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


def _rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t's rows `rows` (ascending, without repeats): t itself when they are all of them (an
    index from a list costs more than the small ops around it)."""
    return t if len(rows) == len(t) else t[rows]


def _draw(x: torch.Tensor, params: list, generator: torch.Generator | None, whole: bool = False
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each row of x [R, V] (logits / temperature, finite but for -inf; overwritten
    where no row filters, in place of a copy: on the CPU a fresh tensor of the vocabulary's width
    costs its page faults every step): the filtered distribution's draw from `generator`; and which
    rows' filters were complete among their candidates (the others are drawn again over their
    whole row: `sample`)."""
    dev, V = x.device, x.shape[1]
    out = torch.empty(len(params), dtype=torch.long, device=dev)
    complete = torch.ones(len(params), dtype=torch.bool, device=dev)
    plain = [i for i, q in enumerate(params) if not 0 < q.top_k < V and q.top_p >= 1.0]
    if plain:  # no top-k nor top-p: the whole row, unsorted
        e = _rows(x, plain)
        e = e.sub_(e.amax(-1, keepdim=True)).exp_()  # unnormalized, the largest at 1
        if any(params[i].min_p > 0 for i in plain):
            m = torch.tensor([params[i].min_p for i in plain], device=dev, dtype=x.dtype)
            e = e.masked_fill_(e < m[:, None], 0.0)
        out[plain if len(plain) < len(params) else slice(None)] = _pick(e, generator)
    rest = sorted(set(range(len(params))) - set(plain))
    if rest:
        q = [params[i] for i in rest]
        k_on = [r.top_k for r in q if 0 < r.top_k < V]
        k = torch.tensor([r.top_k if 0 < r.top_k < V else 0 for r in q], device=dev)
        p = torch.tensor([r.top_p if r.top_p < 1.0 else float("inf") for r in q], device=dev, dtype=x.dtype)
        m = torch.tensor([r.min_p for r in q], device=dev, dtype=x.dtype)
        wide = CANDIDATES if any(r.top_p < 1.0 for r in q) else 0  # top-k alone: its k and one more
        K = V if whole else min(V, max(wide, max(k_on) + 1 if k_on else 0))
        probs, ids, done = _filtered(_rows(x, rest), k, p, m, K)
        if len(rest) < len(params):
            complete[rest] = done
        else:
            complete = done
        out[rest] = ids.gather(1, _pick(probs, generator)[:, None])[:, 0]
    return out, complete


def sample(logits: torch.Tensor, params: list, generators: list, greedy=reference.greedy,
           shared: torch.Generator | None = None
           ) -> tuple[list[int | None], list[dict | None], dict[int, str]]:
    """logits: [S, V] float32; params[i]: SamplingParams; generators[i]: the row's own
    torch.Generator (a seeded request) or None (it draws from `shared`); `greedy`: the model's
    kernel for `reference.greedy` (every row's argmax and finiteness).
    Returns the chosen token ids, for rows that asked their logprob dicts, and {row: why} for
    rows that could not be sampled (their token is None; every other row is unaffected)."""
    S, V = logits.shape
    dev = logits.device
    tokens_dev, finite = greedy(logits)  # one batched call covers greedy rows
    hot = [i for i, p in enumerate(params) if not p.greedy]
    want_lp = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not hot and not want_lp:  # every row greedy: the argmax alone
        got, finite = torch.stack([tokens_dev, finite.long()]).tolist()
        return ([t if ok else None for t, ok in zip(got, finite)], [None] * S,
                {i: NON_FINITE for i, ok in enumerate(finite) if not ok})
    complete = torch.ones(S, dtype=torch.bool, device=dev)
    if hot:
        inv = torch.tensor([1.0 / params[i].temperature for i in hot], device=dev, dtype=logits.dtype)
        argmax, hot_logits = _rows(tokens_dev, hot), _rows(logits, hot)
        top = hot_logits.gather(1, argmax.clamp(0, V - 1)[:, None])[:, 0]  # each row's largest
        ok = _rows(finite, hot) & torch.isfinite(top * inv)  # a temperature can overflow the largest logit
        # a failed row draws harmlessly from zeros (no device op sees a NaN); its token is dropped
        x = torch.nan_to_num_(hot_logits * torch.where(ok, inv, 0.0)[:, None], 0.0, 0.0, NEG_INF)
        finite, tokens_dev = finite.clone(), tokens_dev.clone()
        finite[hot] = ok
        together = [j for j, i in enumerate(hot) if generators[i] is None]
        groups = [(together, shared)] if together else []
        groups += [([j], generators[i]) for j, i in enumerate(hot) if generators[i] is not None]
        for sel, gen in groups:
            at = [hot[j] for j in sel]
            tokens_dev[at], complete[at] = _draw(_rows(x, sel), [params[i] for i in at], gen)
    if want_lp:
        lp = logits[want_lp].log_softmax(-1)
        n = min(max(params[i].logprobs for i in want_lp), V)
        top_v, top_i = torch.topk(lp, n, dim=-1)
        chosen = lp.gather(1, tokens_dev[want_lp].clamp(0, V - 1)[:, None])[:, 0]
    got, finite, complete = torch.stack([tokens_dev, finite.long(), complete.long()]).tolist()  # the one read
    redo = [j for j, i in enumerate(hot) if finite[i] and not complete[i]]
    if redo:  # a nucleus wider than its candidates (rare but for flat distributions): whole rows, sorted
        groups = [([j for j in redo if generators[hot[j]] is None], shared)]
        groups += [([j], generators[hot[j]]) for j in redo if generators[hot[j]] is not None]
        for sel, gen in groups:
            if sel:
                again = _draw(x[sel], [params[hot[j]] for j in sel], gen, whole=True)[0].tolist()
                for j, t in zip(sel, again):
                    got[hot[j]] = t
        if want_lp:
            chosen = lp.gather(1, torch.tensor([got[i] for i in want_lp], device=dev)[:, None])[:, 0]
    tokens: list[int | None] = [t if ok else None for t, ok in zip(got, finite)]
    errors = {i: NON_FINITE for i, ok in enumerate(finite) if not ok}
    lps: list[dict | None] = [None] * len(params)
    if want_lp:
        chosen, top_v, top_i = chosen.tolist(), top_v.tolist(), top_i.tolist()
        for j, i in enumerate(want_lp):
            if tokens[i] is not None:
                n = params[i].logprobs
                lps[i] = {tokens[i]: chosen[j], **dict(zip(top_i[j][:n], top_v[j][:n]))}
    return tokens, lps, errors
