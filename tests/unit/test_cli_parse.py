"""``tessera.argtypes.parse_key_values`` (also ``tessera.cli.parse_key_values``): the ``KEY=VALUE`` parser of
``--task-opt`` (worker, peer, fed server) and ``--strategy-param``."""
from __future__ import annotations

import pytest

from tessera.cli import parse_key_values


def test_values_parse_as_json_else_stay_strings() -> None:
    got = parse_key_values(["vocab=1000", "lr=0.5", "tied=true", "sizes=[1, 2]", "name=ctr", "path=a=b", "empty="])
    assert got == {"vocab": 1000, "lr": 0.5, "tied": True, "sizes": [1, 2], "name": "ctr", "path": "a=b", "empty": ""}


@pytest.mark.parametrize("item", ["vocab", "=3"])
def test_an_item_without_key_and_value_names_the_flag(item: str) -> None:
    with pytest.raises(ValueError, match=f"--task-opt expects KEY=VALUE, got '{item}'"):
        parse_key_values([item])
