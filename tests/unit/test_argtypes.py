"""``tessera.argtypes``: the one address parser every command uses (issue 31 item 8): a malformed
address is refused at once, naming the flag, never retried until a timeout."""
from __future__ import annotations

import argparse

import pytest

from tessera.argtypes import AddressError, address_arg, parse_address, parse_shard_list, shard_list_arg


@pytest.mark.parametrize("text, want", [
    ("127.0.0.1:5000", ("127.0.0.1", 5000)), ("localhost:1", ("localhost", 1)), ("ps-0.example:65535", ("ps-0.example", 65535)),
    ("[::1]:7000", ("::1", 7000)), (" host:80 ", ("host", 80)),
])
def test_good_addresses(text: str, want: tuple[str, int]) -> None:
    assert parse_address(text, "--server") == want


@pytest.mark.parametrize("text, needle", [
    ("localhost5999", "is not HOST:PORT"), ("host:", "port must be a number"), (":5000", "no valid host"),
    ("host:0", "1..65535"), ("host:65536", "1..65535"), ("host:http", "port must be a number"),
    ("::1:5000", "brackets"), ("[::1:5000", "brackets"), ("a b:5", "no valid host"),
])
def test_bad_addresses_name_the_flag(text: str, needle: str) -> None:
    with pytest.raises(AddressError, match="^--server: ") as e:
        parse_address(text, "--server")
    assert needle in str(e.value) and repr(text) in str(e.value), str(e.value)


def test_shard_lists() -> None:
    assert parse_shard_list("a:1|b:2, c:3") == [["a:1", "b:2"], ["c:3"]]
    for bad, needle in [("a:1,,c:3", "shard 1 is empty"), ("a:1|", "empty replica"), ("a:1,c3", "shard 1: 'c3'"), ("", "no address")]:
        with pytest.raises(AddressError, match=needle):
            parse_shard_list(bad)


def test_argparse_types_refuse_with_one_usage_error_and_keep_the_text() -> None:
    p = argparse.ArgumentParser(exit_on_error=False)
    p.add_argument("--ps", type=shard_list_arg())
    p.add_argument("--backup-of", default="", type=address_arg("--backup-of", allow_empty=True))
    args = p.parse_args(["--ps", "a:1|b:2,c:3"])
    assert args.ps == "a:1|b:2,c:3" and args.backup_of == ""  # callers go on splitting the text
    with pytest.raises(argparse.ArgumentError, match="shard 0: 'localhost5999' is not HOST:PORT"):
        p.parse_args(["--ps", "localhost5999"])
