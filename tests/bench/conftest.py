from __future__ import annotations

import pytest

from lorafleet.bench.fixtures import build_base


@pytest.fixture(scope="session")
def micro_dir(tmp_path_factory):
    """The micro bench model, built once for the session in a cache of its own."""
    return build_base("micro", root=tmp_path_factory.mktemp("bench-cache"))
