"""Client-level DP: clipping, noise, adaptive clipping and the RDP accountant.

Reference values come from published sources, cited next to each number."""
from __future__ import annotations

import math

import numpy as np
import pytest

from federated.privacy import (
    DEFAULT_ORDERS,
    AdaptiveClip,
    DPConfig,
    PrivacyError,
    RDPAccountant,
    adjusted_noise_multiplier,
    clip_update,
    compute_rdp,
    gaussian_noise,
    global_norm,
    noised_mean,
    privatize_update,
    rdp_to_epsilon,
)

# --------------------------------------------------------------------------- clipping and noise


def test_clip_update_global_l2_norm() -> None:
    rng = np.random.default_rng(0)
    delta = [rng.standard_normal((3, 4)), rng.standard_normal(5).astype(np.float32)]
    norm = math.sqrt(sum(float((a.astype(np.float64) ** 2).sum()) for a in delta))
    clipped, got = clip_update(delta, norm / 4)
    assert got == pytest.approx(norm, rel=1e-12)
    assert global_norm(clipped) == pytest.approx(norm / 4, rel=1e-6)
    for c, a in zip(clipped, delta):
        assert c.dtype == a.dtype
        np.testing.assert_allclose(c, a / 4, rtol=1e-6)  # same direction, scaled by C/||delta||
    same, _ = clip_update(delta, norm * 2)  # inside the ball: unchanged
    for c, a in zip(same, delta):
        np.testing.assert_array_equal(c, a)
    zero, n0 = clip_update([np.zeros(3)], 1.0)
    assert n0 == 0.0 and not zero[0].any()


def test_clip_update_rejects_bad_input() -> None:
    with pytest.raises(PrivacyError, match="max_norm"):
        clip_update([np.ones(2)], 0.0)
    with pytest.raises(PrivacyError, match=r"delta\[1\] holds non-finite"):
        clip_update([np.ones(2), np.array([np.nan])], 1.0)


def test_gaussian_noise_std_and_determinism() -> None:
    a = gaussian_noise([(200, 100), (50,)], 0.5, np.random.default_rng(7))
    b = gaussian_noise([(200, 100), (50,)], 0.5, np.random.default_rng(7))
    np.testing.assert_array_equal(a[0], b[0])
    assert a[0].shape == (200, 100) and a[1].shape == (50,)
    assert abs(a[0].std() - 0.5) < 0.01 and abs(a[0].mean()) < 0.01  # 20k samples: se ~0.0025


def test_dp_config_validation() -> None:
    DPConfig(clip_norm=1.0, noise_multiplier=1.0)
    for kw, match in [({"clip_norm": 0.0}, "clip_norm"), ({"noise_multiplier": -1.0}, "noise_multiplier"),
                      ({"mode": "global"}, "mode"), ({"delta": 1.0}, "delta"),
                      ({"target_quantile": 1.5}, "target_quantile"), ({"clip_lr": 0.0}, "clip_lr"),
                      ({"adaptive": True, "count_stddev": 0.2}, "count_stddev")]:
        base = {"clip_norm": 1.0, "noise_multiplier": 1.0}
        base.update(kw)
        with pytest.raises(PrivacyError, match=match):
            DPConfig(**base)  # type: ignore[arg-type]


def test_central_and_local_noise() -> None:
    cfg_c = DPConfig(clip_norm=2.0, noise_multiplier=0.5, mode="central")
    cfg_l = DPConfig(clip_norm=2.0, noise_multiplier=0.5, mode="local")
    delta = [np.full(10_000, 1.0)]  # norm 100 -> clipped to 2
    up_c, norm = privatize_update(delta, cfg_c, np.random.default_rng(1))
    assert norm == pytest.approx(100.0) and global_norm(up_c) == pytest.approx(2.0)
    up_l, _ = privatize_update(delta, cfg_l, np.random.default_rng(1))
    resid = up_l[0] - up_c[0]
    assert abs(resid.std() - 0.5 * 2.0) < 0.03  # local noise std z*C
    # server: central adds N(0, (zC)^2) to the sum then divides by m; local only divides
    s = [np.zeros(10_000)]
    m = noised_mean(s, 4, cfg_c, np.random.default_rng(2))
    assert abs(m[0].std() - 0.5 * 2.0 / 4) < 0.01
    assert not noised_mean(s, 4, cfg_l, np.random.default_rng(2))[0].any()
    with pytest.raises(PrivacyError, match="num_clients"):
        noised_mean(s, 0, cfg_c, np.random.default_rng(2))


# --------------------------------------------------------------------------- adaptive clipping

def test_adaptive_clip_geometric_update() -> None:
    """Andrew et al. 2021: C <- C * exp(-eta_C (b_frac - gamma))."""
    ac = AdaptiveClip(initial_clip=1.0, target_quantile=0.5, lr=0.2)
    c1 = ac.update([0.1, 0.2, 0.3, 5.0])  # 3 of 4 unclipped
    assert c1 == pytest.approx(math.exp(-0.2 * (0.75 - 0.5)), rel=1e-12)
    c2 = ac.update([10.0, 10.0])  # none unclipped: grows
    assert c2 == pytest.approx(c1 * math.exp(-0.2 * (0.0 - 0.5)), rel=1e-12)
    # converges towards the target quantile of a fixed norm distribution
    rng = np.random.default_rng(3)
    ac = AdaptiveClip(initial_clip=0.01, target_quantile=0.5, lr=0.2)
    for _ in range(400):
        ac.update(list(rng.lognormal(0.0, 0.5, size=50)))
    assert abs(ac.clip_norm - 1.0) < 0.15  # the median of lognormal(0, .5) is 1
    # noised count: deterministic given the rng
    a = AdaptiveClip(1.0, count_stddev=2.0, rng=np.random.default_rng(5))
    b = AdaptiveClip(1.0, count_stddev=2.0, rng=np.random.default_rng(5))
    assert a.update_from_count(3, 10) == b.update_from_count(3, 10)


def test_adjusted_noise_multiplier() -> None:
    """Andrew et al. 2021, Thm. 1: z_delta = (z^-2 - (2 sigma_b)^-2)^(-1/2)."""
    z, sb = 1.0, 5.0
    assert adjusted_noise_multiplier(z, sb) == pytest.approx((1 - 1 / 100) ** -0.5, rel=1e-12)
    assert adjusted_noise_multiplier(z, 0.0) == z
    with pytest.raises(PrivacyError, match="count_stddev"):
        adjusted_noise_multiplier(1.0, 0.4)


# --------------------------------------------------------------------------- RDP accountant

def test_rdp_no_sampling_is_closed_form() -> None:
    """q = 1: the Gaussian mechanism's RDP is alpha / (2 z^2) per step (Mironov 2017, Prop. 7)."""
    orders = [1.5, 2.0, 3.0, 7.5, 32.0, 63.0]
    for z in (0.5, 1.0, 3.7):
        np.testing.assert_allclose(compute_rdp(1.0, z, 5, orders), [5 * a / (2 * z * z) for a in orders],
                                   rtol=1e-14)
    # TF-Privacy rdp_accountant_test.py test_compute_rdp_no_sampling: compute_rdp(1, 10, 1, 20) == 0.1
    assert compute_rdp(1.0, 10.0, 1, 20)[0] == pytest.approx(0.1, rel=1e-14)
    assert compute_rdp(0.0, 10.0, 1, 20)[0] == 0.0  # test_compute_rdp_no_data


def test_rdp_matches_tf_privacy_unit_test_values() -> None:
    # tensorflow/privacy tensorflow_privacy/privacy/analysis/rdp_accountant_test.py:
    # test_compute_rdp_scalar: compute_rdp(0.1, 2, 10, 5) ~= 0.07737 (places=5)
    assert compute_rdp(0.1, 2.0, 10, 5)[0] == pytest.approx(0.07737, abs=1e-5)
    # test_compute_rdp_sequence: compute_rdp(0.01, 2.5, 50, [1.5, 2.5, 5, 50, 100]) (delta=1e-5)
    got = compute_rdp(0.01, 2.5, 50, [1.5, 2.5, 5, 50, 100])
    np.testing.assert_allclose(got, [0.00065, 0.001085, 0.00218075, 0.023846, 167.416307], atol=1e-5)


def _log_a_by_quadrature(q: float, sigma: float, alpha: float) -> float:
    """A_alpha = E_{x ~ N(0, sigma^2)} [((1-q) + q exp((2x-1)/(2 sigma^2)))^alpha], by the
    trapezoid rule on a fine grid (an independent check of both series)."""
    x = np.linspace(-40 * sigma, 40 * sigma + 2 * alpha, 400_001)
    log_mu0 = -x ** 2 / (2 * sigma ** 2) - math.log(sigma * math.sqrt(2 * math.pi))
    log_ratio = np.logaddexp(math.log1p(-q), math.log(q) + (2 * x - 1) / (2 * sigma ** 2))
    log_f = log_mu0 + alpha * log_ratio
    m = log_f.max()
    return float(m + math.log(np.trapezoid(np.exp(log_f - m), x)))


@pytest.mark.parametrize("q, sigma, alpha", [(0.01, 1.0, 1.5), (0.05, 0.8, 2.7), (0.2, 2.0, 12.0),
                                             (0.001, 0.6, 7.3), (0.1, 1.1, 30.0)])
def test_rdp_against_numerical_integration(q: float, sigma: float, alpha: float) -> None:
    expected = _log_a_by_quadrature(q, sigma, alpha) / (alpha - 1)
    assert compute_rdp(q, sigma, 1, alpha)[0] == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("z, epochs, published", [
    # tensorflow/privacy tutorials/README.md "Select Parameters" table (MNIST, N=60000,
    # batch 256 -> q = 256/60000, steps = epochs * (60000 // 256), delta = 1e-5,
    # orders [1.1, ..., 10.9] + [12, ..., 63] as in tutorials/mnist_dpsgd_tutorial.py,
    # classic RDP -> (eps, delta) conversion of that time):
    (1.12, 60, 2.92),
    (0.6, 30, 9.74),
    (1.2, 10, 1.20),
    # same README, "Expected Output": eps after 1 and 2 epochs of the default run (z=1.12)
    (1.12, 1, 1.00),
    (1.12, 2, 1.04),
])
def test_tf_privacy_mnist_tutorial_epsilons(z: float, epochs: int, published: float) -> None:
    acc = RDPAccountant(noise_multiplier=z, sample_rate=256 / 60000)
    acc.step(epochs * (60000 // 256))
    eps = acc.epsilon(1e-5, conversion="classic")
    assert eps == pytest.approx(published, rel=0.01)
    # the improved conversion is never worse
    assert acc.epsilon(1e-5) <= eps


def test_opacus_rdp_accountant_value() -> None:
    # pytorch/opacus opacus/tests/accountants_test.py test_rdp_accountant: z=1.5,
    # q=0.04, steps=int(90/0.04), delta=1e-5 -> 7.32911117143 (default alphas, the
    # Balle et al. 2020 conversion)
    acc = RDPAccountant(noise_multiplier=1.5, sample_rate=0.04)
    for _ in range(int(90 / 0.04)):
        acc.step()
    eps, order = acc.epsilon_and_order(1e-5)
    assert eps == pytest.approx(7.32911117143, rel=1e-6)
    assert order in DEFAULT_ORDERS
    # same file, test_get_noise_multiplier_rdp_steps: z=1.3562 is the smallest
    # multiplier reaching eps=8 for q=0.04, 2000 steps
    acc2 = RDPAccountant(noise_multiplier=1.3562, sample_rate=0.04)
    acc2.step(2000)
    assert acc2.epsilon(1e-5) == pytest.approx(8.0, rel=0.01) and acc2.epsilon(1e-5) <= 8.0


def test_abadi_moments_accountant_example() -> None:
    # Abadi et al., "Deep Learning with Differential Privacy", CCS 2016, Sec. 3.1:
    # q = 0.01, sigma = 4, delta = 1e-5, T = 10000 -> eps ~= 1.26 with the moments
    # accountant (integer moments lambda <= 32, i.e. RDP orders 2..33, classic conversion)
    acc = RDPAccountant(noise_multiplier=4.0, sample_rate=0.01, orders=range(2, 34))
    acc.step(10_000)
    assert acc.epsilon(1e-5, conversion="classic") == pytest.approx(1.26, rel=0.01)


def test_composition_and_conversions_tf_privacy() -> None:
    # TF-Privacy rdp_accountant_test.py test_check_composition: 40000 steps of
    # (q=1e-4, z=0.4) then 100 of (q=0.1, z=2), delta=1e-5 -> eps 8.509656 at order 2.5
    # with the old (classic) conversion
    orders = (1.25, 1.5, 1.75, 2., 2.5, 3., 4., 5., 6., 7., 8., 10., 12., 14., 16., 20., 24., 28., 32.,
              64., 256.)
    acc = RDPAccountant(noise_multiplier=0.4, sample_rate=1e-4, orders=orders)
    acc.step(40_000)
    acc.step(100, noise_multiplier=2.0, sample_rate=0.1)
    eps, order = acc.epsilon_and_order(1e-5, conversion="classic")
    assert eps == pytest.approx(8.509656, rel=1e-5) and order == 2.5
    assert acc.epsilon(1e-5) <= 8.509656
    # test_get_privacy_spent_check_target_delta: Gaussian, z = 4.530877117 gives exactly
    # (1, 1e-6)-DP under the improved conversion with a fine grid of orders
    fine = [0.001 * i for i in range(1001, 100_000)]
    eps2, _ = rdp_to_epsilon(fine, compute_rdp(1.0, 4.530877117, 1, fine), 1e-6)
    assert eps2 == pytest.approx(1.0, rel=1e-6)
    # and constant RDP 1.1 at orders 2..32 (pure DP): eps = 1.32783806176 at order 32
    e3, o3 = rdp_to_epsilon(range(2, 33), [1.1] * 31, 1e-5)
    assert e3 == pytest.approx(1.32783806176, rel=1e-9) and o3 == 32


def test_accountant_state_and_errors() -> None:
    acc = RDPAccountant(noise_multiplier=1.0, sample_rate=0.1)
    assert acc.epsilon(1e-5) == 0.0
    acc.step(3)
    st = acc.state_dict()
    other = RDPAccountant(noise_multiplier=9.0, sample_rate=0.5)
    other.load_state_dict(st)
    assert other.steps == 3 and other.epsilon(1e-5) == acc.epsilon(1e-5)
    other.step()
    acc.step()
    assert other.epsilon(1e-5) == acc.epsilon(1e-5)
    with pytest.raises(PrivacyError, match="sample_rate"):
        RDPAccountant(1.0, 1.5)
    with pytest.raises(PrivacyError, match="orders"):
        RDPAccountant(1.0, 0.1, orders=[0.5, 2])
    with pytest.raises(PrivacyError, match="delta"):
        acc.epsilon(0.0)
    with pytest.raises(PrivacyError, match="conversion"):
        acc.epsilon(1e-5, conversion="other")  # type: ignore[arg-type]
    zero_noise = RDPAccountant(0.0, 0.1)
    zero_noise.step()
    assert zero_noise.epsilon(1e-5) == math.inf
