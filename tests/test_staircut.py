"""StairCut: the price curve, the expected-tokens-per-ms cut and the acceptance estimates."""

from __future__ import annotations

from tandem.speculative.acceptance import AcceptanceStats
from tandem.speculative.staircut import PriceCurve, expected_distinct, stair_cut
from tandem.speculative.tree import DraftTree


def test_price_curve_interpolates_and_rescales() -> None:
    curve = PriceCurve([(1, 10.0), (4, 13.0), (8, 30.0)], max_nodes=16)
    assert curve.price(1) == 10.0 and curve.price(2) == 11.0 and curve.price(6) == 21.5
    assert curve.price(12) > curve.price(8)  # extrapolated from the last two points
    curve.observe(1, 20.0)  # the first observation sets the level: twice as slow everywhere
    assert curve.price(4) == 26.0
    curve.observe(4, 52.0)  # verifies cost 4x the profile's: their own scale, plain steps keep theirs
    assert curve.price(4) == 52.0 and curve.price(8) == 120.0 and curve.price(1) == 20.0
    curve.observe(1, 10.0)  # an EMA (decay 0.8) after the first observation
    assert abs(curve.price(1) - 18.0) < 1e-9 and curve.price(4) == 52.0
    assert PriceCurve([], 8).price(3) > PriceCurve([], 8).price(1)


def test_stair_cut_picks_the_best_rate() -> None:
    flat = PriceCurve([(1, 10.0), (8, 10.5), (9, 20.0), (16, 21.0)], max_nodes=16)  # a GPU-like staircase
    assert stair_cut([0.9] * 15, flat, 0.0, 0.0) == 8  # fill the first stair, do not pay for the second
    line = PriceCurve([(1, 10.0), (2, 17.0)], max_nodes=16)  # a CPU-like line: each node costs 0.7 of a step
    assert stair_cut([0.2] * 15, line, 0.0, 0.0) == 1  # unlikely guesses: plain step
    assert stair_cut([0.99] * 15, line, 0.0, 0.0) > 8
    assert stair_cut([], line, 0.0, 0.0) == 1


def test_acceptance_estimates_follow_observations() -> None:
    acc = AcceptanceStats(2, max_depth=4, prior=0.5)
    for _ in range(50):
        acc.observe(0, 1, 1.0, True)
        acc.observe(1, 1, 0.8, False)
    assert acc.edge_prob(0, 1, 1.0) > 0.95 and acc.edge_prob(1, 1, 0.8) < 0.05
    assert acc.edge_prob(0, 3, 1.0) > 0.95 and acc.edge_prob(1, 4, 0.8) < 0.05  # untested depths borrow depth 1's
    fresh = AcceptanceStats(2, max_depth=4, prior=0.5)
    assert fresh.edge_prob(0, 3, 1.0) == 0.5  # nothing tested: the prior
    fresh.observe(0, 1, 1.0, True)
    fresh.observe(0, 3, 1.0, False)  # depth 3 starts from depth 1's averages (0.55), then its own miss
    assert abs(fresh.acc[0][2] - 0.9 * 0.55) < 1e-12 and fresh.edge_prob(0, 4, 1.0) == fresh.edge_prob(0, 3, 1.0)
    assert fresh.edge_prob(0, 2, 1.0) == fresh.edge_prob(0, 1, 1.0)  # depth 2 still borrows depth 1's
    tree = DraftTree(0)
    a = tree.add(0, 1, 0.5, 0)
    tree.add(a, 2, 0.25, 0)
    tree.add(0, 3, 0.5, 1)
    acc.observe_round(tree, [0, 1])  # all three tested (their parents are on the path); only node 1 accepted
    assert (acc.num_tested, acc.num_accepted) == (103, 51)


def test_shipped_gpu_profile_prices_trees_as_measured() -> None:
    """profiles/cuda-nvidia-h200.json (tools/profile_from_bench.py from bench/results/cuda_decode_h200.json): a model
    without its own curve takes the first one (the 27B-shape NVFP4 prior); every curve starts at the decode step and
    never falls with N; with a well-predicting drafter it verifies far more nodes than the built-in CPU-shaped line;
    another GPU without a profile starts from it."""
    import json

    from tandem.models.qwen3_5.cuda_model import profile_key_for
    from tandem.speculative.speculator import PROFILES, load_curve

    data = json.loads((PROFILES / "cuda-nvidia-h200.json").read_text())
    bench = json.loads((PROFILES.parent / "bench" / "results" / "cuda_decode_h200.json").read_text())
    assert data["device"] == "cuda-nvidia-h200" == profile_key_for(bench["device"])
    assert next(iter(data["curves"])) == "synthetic-qwen3.5-27b-nvfp4"
    for name, curve in data["curves"].items():
        points = curve["verify_ms"]
        assert points[0][0] == 1 and all(b[1] >= a[1] and b[0] > a[0] for a, b in zip(points, points[1:])), name
        if name.startswith("synthetic-qwen3.5-"):
            shape, fmt = name.removeprefix("synthetic-qwen3.5-").split("-")
            assert points[0][1] == bench["shapes"][shape]["formats"][fmt]["ms_per_token_engine"], name
    gpu = load_curve("some-checkpoint", 32, "cuda-nvidia-h200")
    first = data["curves"]["synthetic-qwen3.5-27b-nvfp4"]["verify_ms"]
    assert gpu.price(1) == first[0][1] and gpu.price(32) == first[-1][1]
    probs = [0.8 ** (i // 3 + 1) for i in range(31)]  # a tree of 3-wide levels, each 0.8 as likely as the last
    cpu_like = load_curve("some-checkpoint", 32, "no-such-device")
    assert stair_cut(probs, gpu, 0.3, 0.2) >= 8 > stair_cut(probs, cpu_like, 0.003, 0.002)
    other_gpu = load_curve("some-checkpoint", 32, "cuda-nvidia-gb10")  # no profile: the H200's shape
    assert [other_gpu.price(n) for n in range(1, 33)] == [gpu.price(n) for n in range(1, 33)]


def test_a_verify_dearer_than_the_profile_says_turns_speculation_off() -> None:
    """The embedded model on an H200: a 0.26 ms step, a 6-node verify 1.5 ms; the profile (27B) says 1.4x."""
    curve = PriceCurve([(1, 5.6), (2, 6.5), (4, 7.6), (8, 10.4)], max_nodes=16)
    good = [0.8 ** d for d in range(1, 16)]  # a chain's path probabilities
    curve.observe(1, 0.26)
    assert stair_cut(good, curve, 0.05, 0.15) > 1  # the profile's ratio: speculate
    curve.observe(6, 1.5)
    assert stair_cut(good, curve, 0.05, 0.15) == 1  # the observed ratio: plain steps win


def test_routed_experts_price_a_verify_by_its_distinct_experts() -> None:
    """A MoE model (Capabilities.expert_routing): each extra node costs what the experts it brings cost, so wide
    trees get dearer than on the dense curve and StairCut verifies fewer nodes; N = 1 keeps the step's price."""
    assert expected_distinct(256, 8, 1) == 8.0
    assert 8 * 2 > expected_distinct(256, 8, 2) > 15.7 and expected_distinct(4, 4, 3) == 4.0
    points = [(1, 1.0), (4, 1.1), (8, 1.2), (16, 1.6)]
    dense, routed = PriceCurve(points, max_nodes=16), PriceCurve(points, max_nodes=16).with_routing(256, 8, 0.5)
    assert routed.price(1) == dense.price(1)
    for n in (2, 8, 16):  # + 0.5 of a step for every k experts beyond the first k
        extra = 0.5 * (expected_distinct(256, 8, n) / 8 - 1)
        assert abs(routed.price(n) - dense.price(n) - extra) < 1e-12
    assert PriceCurve(points, max_nodes=16).with_routing(8, 8, 0.5).ms == dense.ms  # every row reads every expert
    probs = [0.8 ** d for d in range(1, 16)]  # a chain's path probabilities
    assert stair_cut(probs, routed, 0.05, 0.02) < stair_cut(probs, dense, 0.05, 0.02)
