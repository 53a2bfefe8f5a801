"""Sampling as pure functions of (logits, params, generators).

Each row is processed on its own: a request with a seed draws only from its own generator, so
its tokens do not depend on what else shares the batch, and a row that cannot be sampled (its
logits are not finite: an adapter whose weights overflow) fails that row only. Logprobs are
those of the model's raw distribution (before temperature and filters), as vLLM reports them by
default. Temperatures below `MIN_TEMPERATURE` are greedy (`SamplingParams.greedy`).
"""

from __future__ import annotations

import torch

from lorafleet.kernels import reference

NEG_INF = float("-inf")


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """logits: [V] (already divided by temperature). Tokens outside the top-k, or outside the
    smallest set whose probability reaches top_p, or (then) less likely than min_p times the most
    likely one, get -inf (vLLM's order). The most likely token always stays."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, NEG_INF)
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = (cum - sorted_logits.softmax(-1)) >= top_p  # mass before this token already enough
        drop[0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), NEG_INF)
    if min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), NEG_INF)
    return logits


def sample_row(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
               generator: torch.Generator | None, min_p: float = 0.0) -> int:
    """One token from one row of logits [V] (temperature > 0)."""
    probs = filter_top_k_top_p(logits / temperature, top_k, top_p, min_p).softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def top_logprobs(logprobs: torch.Tensor, token: int, n: int) -> dict[int, float]:
    """The chosen token's logprob plus the n most likely: {token_id: logprob}. logprobs: [V]."""
    out = {token: float(logprobs[token])}
    n = min(n, logprobs.shape[-1])
    if n:
        values, ids = torch.topk(logprobs, n)
        out.update({int(i): float(v) for i, v in zip(ids.tolist(), values.tolist())})
    return out


def sample(logits: torch.Tensor, params: list, generators: list, greedy=reference.greedy
           ) -> tuple[list[int | None], list[dict | None], dict[int, str]]:
    """logits: [S, V] float32; params[i]: SamplingParams; generators[i]: torch.Generator or None;
    `greedy`: the model's kernel for `reference.greedy` (every row's argmax and finiteness).
    Returns the chosen token ids, for rows that asked their logprob dicts, and {row: why} for
    rows that could not be sampled (their token is None; every other row is unaffected)."""
    greedy_tokens, finite = greedy(logits)  # one batched call covers greedy rows
    greedy_tokens, finite = greedy_tokens.tolist(), finite.tolist()
    want_lp = [i for i, p in enumerate(params) if p.logprobs is not None]
    logprobs = logits[want_lp].log_softmax(-1) if want_lp else None
    tokens: list[int | None] = [None] * len(params)
    lps: list[dict | None] = [None] * len(params)
    errors: dict[int, str] = {}
    for i, p in enumerate(params):
        if not finite[i]:
            errors[i] = "the model produced non-finite logits for this request (NaN or Inf)"
            continue
        try:
            tokens[i] = greedy_tokens[i] if p.greedy else sample_row(logits[i], p.temperature, p.top_k,
                                                                   p.top_p, generators[i], p.min_p)
        except RuntimeError as e:  # torch refuses the distribution: this row's problem only
            errors[i] = f"sampling failed: {e}"
    for j, i in enumerate(want_lp):
        if tokens[i] is not None:
            lps[i] = top_logprobs(logprobs[j], tokens[i], params[i].logprobs)
    return tokens, lps, errors
