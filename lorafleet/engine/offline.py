"""`Engine.generate`: prompts run to completion together, the engine's loop driven until each
has its final output (the offline form of what the daemon's worker does)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence, cast

from lorafleet.adapters.mix import Mix
from lorafleet.engine.request import RequestOutput, SamplingParams
from lorafleet.errors import InvalidRequestError

if TYPE_CHECKING:
    from lorafleet.engine.engine import Engine, Prompt


def generate(engine: Engine, prompts: Prompt | Sequence[Prompt],
             params: SamplingParams | list[SamplingParams] | tuple[SamplingParams, ...] | None = None,
             adapters: Sequence[str | Mix | None] | None = None) -> list[RequestOutput]:
    """Add every prompt (one refused: those added are aborted, and the refusal raised), then step
    until each has finished; final outputs in prompt order."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [cast("Prompt", prompts)]
    prompts = cast("Sequence[Prompt]", prompts)  # one prompt is wrapped above
    n = len(prompts)
    plist = list(params) if isinstance(params, (list, tuple)) else [params] * n
    alist = list(adapters) if adapters is not None else [None] * n
    if len(plist) != n or len(alist) != n:
        raise InvalidRequestError(f"{n} prompts but {len(plist)} params and {len(alist)} adapters")
    ids: list[str] = []
    try:
        for prompt, p, a in zip(prompts, plist, alist):
            ids.append(engine.add_request(prompt, p, a))
    except Exception:
        for rid in ids:
            engine.abort(rid)
        raise
    done: dict[str, RequestOutput]
    wanted, done = set(ids), {}
    while wanted - done.keys():
        for out in engine.step():
            if out.finished and out.request_id in wanted:
                done[out.request_id] = out
    return [done[i] for i in ids]
