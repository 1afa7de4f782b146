"""`from engine import ...`: every name the package advertises resolves (some load lazily)."""

from __future__ import annotations

import engine


def test_every_advertised_name_and_the_lazy_outputs_resolve():
    for name in [*engine.__all__, "CompletionOutput"]:
        assert getattr(engine, name).__name__ == name
