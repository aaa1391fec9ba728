"""README (Federated mode): the `tessera fed server` flags reach the server they build (helper Y's
README audit, /work/notes/Y-audit.md). The features behind them are tested through ServerConfig
(tests/integration/test_fed_*.py); this checks the command line's part: each flag lands in the
config or strategy, and the setups the README says are refused at start are refused."""
from __future__ import annotations

import pytest

from federated.cli import _build_server
from federated.errors import ConfigError
from federated.server_task import load_server_task
from tessera.cli import build_parser


@pytest.fixture(scope="module")
def digits():  # type: ignore[no-untyped-def]
    return load_server_task("digits", seed=0)


def _server(digits, *flags: str):  # type: ignore[no-untyped-def]
    args = build_parser().parse_args(["fed", "server", "--task", "digits", "--port", "0", *flags])
    return _build_server(args, digits, None)


def test_strategy_dp_secagg_sampling_and_wait_flags_reach_the_server(digits) -> None:
    server, strategy = _server(
        digits, "--strategy", "fedadam", "--strategy-param", "eta=0.05", "--dp-clip", "1.5", "--dp-noise", "0.7",
        "--dp-mode", "local", "--dp-adaptive", "--secagg", "--fraction", "0.5", "--wait-timeout", "7",
        "--min-available", "3", "--round-timeout", "9")
    c = server.config
    assert strategy.name == "fedadam" and strategy.params()["eta"] == 0.05
    assert (c.dp.clip_norm, c.dp.noise_multiplier, c.dp.mode, c.dp.adaptive) == (1.5, 0.7, "local", True)
    assert c.secagg.enabled  # DP composes with --secagg
    assert (c.fraction, c.wait_timeout, c.min_available, c.round_timeout) == (0.5, 7.0, 3, 9.0)


@pytest.mark.parametrize("spec", ["fp16", "int8", "topk:0.1"])
def test_compress_flag(digits, spec: str) -> None:
    server, _ = _server(digits, "--compress", spec)
    assert server.config.compress == spec and server.config.dp is None


@pytest.mark.parametrize("strategy", ["krum", "median", "trimmed_mean", "scaffold", "fedbuff"])
def test_secagg_refuses_strategies_that_need_individual_updates(digits, strategy: str) -> None:
    params = ["--strategy-param", "num_clients=2"] if strategy == "scaffold" else []
    with pytest.raises(ConfigError, match="secure aggregation"):
        _server(digits, "--strategy", strategy, *params, "--secagg")


def test_dp_noise_without_a_clip_is_refused(digits) -> None:
    with pytest.raises(ConfigError, match="--dp-noise needs --dp-clip"):
        _server(digits, "--dp-noise", "1.0")


def test_retry_straggler_and_per_identity_defaults(digits) -> None:
    """README (Federated mode): a round that gathers too few answers "is retried up to `--max-retries`
    times (default 20), waiting `--retry-backoff` s (default 1) doubling to 30 s between attempts";
    a straggler is a client silent "(1 + straggler_factor) * t" after its task went out,
    "`ServerConfig.straggler_factor`, default 1 ... never less than `(1 + straggler_factor) *
    straggler_min_s`, default 0.2 s"; each identity "may hold `max_clients_per_identity` client ids
    (default 10,000) and have `max_calls_per_identity` calls open (default 64". A server built by
    `tessera fed server` with none of these flags has them: its orchestrator waits 1, 2, 4, ... s,
    capped at 30 s, between its 20 retries, the straggler floor is 0.2 s, and the registry and the
    kernel's admission hold the per-identity limits. Reference: the README's figures."""
    server, _ = _server(digits)
    c = server.config
    assert c.max_retries == 20
    assert [server.orchestrator.retry_delay(a) for a in range(8)] == [1, 2, 4, 8, 16, 30, 30, 30]
    assert c.straggler_factor == 1.0
    assert (1 + c.straggler_factor) * c.straggler_min_s == pytest.approx(0.2)
    assert (c.max_clients_per_identity, c.max_calls_per_identity) == (10_000, 64)
    assert server.registry.max_clients_per_identity == 10_000
    assert (server.security.max_concurrent, server.security.max_waiting) == (64, 64)
