"""A fast path made wrong on purpose, for the self-check's and `lorafleet verify`'s tests: every
kernel set but the torch reference gets a `linear` that adds NOISE to what it computes. Used in
this process (`break_fast_path(monkeypatch)`) or at the start of a daemon's (`HOOK`, run by
`python -c` from the checkout's root before the CLI)."""

from __future__ import annotations

import dataclasses

NOISE = 0.5
HOOK = ("from tests.engine.broken_kernels import break_fast_path; break_fast_path(); "
        "from lorafleet.cli.main import main; main()")


def break_fast_path(monkeypatch=None) -> None:
    from lorafleet.kernels import backend

    select = backend.select

    def broken(device, dtype, want=None):
        kernels = select(device, dtype, want)
        if want == "torch":
            return kernels
        exact = kernels.linear

        def linear(x, w, bias=None, scales=None, offsets=None):
            return exact(x, w, bias, scales, offsets) + NOISE
        return dataclasses.replace(kernels, linear=linear)

    if monkeypatch is None:
        backend.select = broken
    else:
        monkeypatch.setattr(backend, "select", broken)
