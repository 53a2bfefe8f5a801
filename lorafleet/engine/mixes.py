"""What the engine checks of a request that mixes adapters (`lorafleet.adapters.mix`), beyond the mix's
own bounds: that the pool can hold its adapters and prompt at once, and that each adapter may be
mixed. Read only: the registry (`memory.residency`) stays the owner of the adapters' state.

DoRA and lora_bias adapters serve alone: DoRA's magnitude rescales its module's whole output,
which has no meaning beside another adapter's delta (nor at another scale), and both are read
only on a lone segment (`kernels/reference.py`). So does an adapter with its own embedding,
LM head or norms (a copy: `adapters/heads.py`): it replaces the base's, beside which another's delta
has no meaning (LoRA on them mixes as any LoRA does, and so does an adapter whose copies equal the
base's: dropped at load, as PEFT's default `save_embedding_layers` writes them; its mix waits for
its load to know, like its kind). At scale 0 any adapter contributes nothing and
the LoRA op never reads it (`ModelRunner.lora_batch`), so one may be named there. An adapter's
kind is known once it was loaded: a mix naming one that was not is watched, and refused once
every kind is known, before it can be admitted (a mix is admitted only once all its adapters are
ready, and ready adapters have their kind).

An activated LoRA (aLoRA, `adapters/alora.py`: known at registration) serves alone too: its
activation is its own prompt's, beside which another adapter's delta over the whole request has no
single meaning. `check` also finds where a request's aLoRA takes over (`Request.activation`), for
a lone adapter as for a mix of it alone.
"""

from __future__ import annotations

from lorafleet.engine.request import Request, Status
from lorafleet.errors import InvalidRequestError
from lorafleet.adapters.alora import FIELD, request_activation
from lorafleet.adapters.mix import Mix

ALONE = {"dora": "DoRA", "lora_bias": "lora_bias"}  # the variants that serve alone, as messages name them


class MixChecks:
    def __init__(self, adapters, pool, kv):
        """`adapters`: the engine's `AdapterResidency`; `pool`, `kv`: its page pool and KV manager."""
        self.adapters, self.pool, self.kv = adapters, pool, kv
        self.watched: dict[Request, None] = {}  # mixes naming an adapter whose kind is not known yet

    def check(self, req: Request) -> int | None:
        """A new request's adapters; returns where its aLoRA takes over (None: from its first
        token). A mix: InvalidRequestError when the pool cannot hold its adapters and prompt at
        once (it would wait forever; sizes from the files' headers, known at registration), or it
        mixes an adapter known to serve alone. An aLoRA whose sequence the prompt lacks:
        InvalidRequestError. AdapterNotFoundError for an unregistered adapter."""
        mix, prompt_len = req.mix, len(req.prompt_token_ids)
        if mix is None:
            return request_activation([(self.adapters.get(req.adapter), 1.0)] if req.adapter else [],
                                      req.prompt_token_ids)
        entries = {name: self.adapters.get(name) for name in mix.names}
        pages = {name: self.adapters.pages_needed(e) for name, e in entries.items()}
        kv = self.kv.blocks_needed(prompt_len + 1)
        if sum(pages.values()) + kv > self.pool.num_pages:
            mib = self.pool.page_bytes / 2**20
            sizes = ", ".join(f"{n} {p * mib:.1f} MiB" for n, p in pages.items())
            raise InvalidRequestError(
                f"the adapters of mix {mix.label!r} need {sum(pages.values())} pages together ({sizes}) and its "
                f"prompt {kv}; the pool holds {self.pool.num_pages} pages ({self.pool.num_pages * mib:.1f} MiB): "
                "mix fewer adapters or raise pool_bytes")
        for name, scale in mix.members:
            mixable(entries[name], scale, mix)
        return request_activation([(entries[name], scale) for name, scale in mix.members], req.prompt_token_ids)

    def watch(self, req: Request) -> None:
        """`req` (a mix, its adapters held) is refused later if an adapter's kind is unknown now."""
        if any(e.variant is None for e in req.loras):
            self.watched[req] = None

    def refused(self) -> list[tuple[Request, str]]:
        """The watched mixes whose adapters' kinds are all known now and that may not run, each
        with why; those that may, and those that ended, are no longer watched."""
        out = []
        for req in list(self.watched):
            if req.status is not Status.FINISHED and any(e.variant is None for e in req.loras):
                continue
            del self.watched[req]
            if req.status is Status.FINISHED:
                continue
            assert req.mix is not None  # only mixes are watched
            try:
                for entry, scale in zip(req.loras, req.scales):
                    mixable(entry, scale, req.mix)
            except InvalidRequestError as e:
                out.append((req, str(e)))
        return out


def mixable(entry, scale: float, mix: Mix) -> None:
    """InvalidRequestError (on `adapters`) when `entry` at `scale` may not be in `mix`: a variant
    that serves alone, or one with copies it serves, beside another adapter of nonzero scale or
    itself at a scale other than 0 or 1 (nothing while that is unknown)."""
    others = sum(s != 0.0 for s in mix.scales) - 1
    copies = alone_copies(entry)
    alone = ALONE.get(entry.variant) or (f"aLoRA ({FIELD})" if entry.invocation else None)
    alone = alone or (f"its own {' and '.join(copies)} (saved whole: modules_to_save, or "
                      "an embedding LoRA's base_layer unlike the base's)" if copies else None)
    if alone and scale != 0.0 and (others or scale != 1.0):
        e = InvalidRequestError(f"adapters: adapter {entry.name!r} uses {alone}, which serves "
                                "alone (as `model`, or a mix of it alone at scale 1): it cannot be mixed or scaled")
        e.param = "adapters"
        raise e


def alone_copies(entry) -> tuple[str, ...]:
    """The copies that make `entry` serve alone, as far as known: once loaded, those it serves;
    before, those its files declare unless each may yet be dropped (an embedding / LM head of the
    base's vocabulary: `adapters/finish.py` drops one equal to the base's), then none until its load
    lands (the mix is watched: `MixChecks.watch`). Why: PEFT saves both layers whole beside any
    embedding LoRA, usually unchanged, and such an adapter mixes as any LoRA."""
    if entry.copies is not None:
        return entry.copies
    if entry.vocab_size is None and set(entry.saved) <= {"embed_tokens", "lm_head"}:
        return ()
    return entry.saved
