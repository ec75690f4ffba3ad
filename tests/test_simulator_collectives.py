"""NCCL-like collective costs: algorithm choice, placement, bandwidth laws."""

from __future__ import annotations

from dataclasses import replace

import pytest

from simulator.collectives import CollectiveModel
from simulator.hardware import load_cluster


@pytest.fixture
def h100():
    return CollectiveModel(load_cluster("h100", 2048))


def test_large_all_reduce_in_a_node_uses_the_ring_at_nvlink_bus_bandwidth(h100):
    ranks = tuple(range(8))
    size = 4 * 2**30
    t, algo = h100.all_reduce(size, ranks)
    assert algo == "ring"
    bus = 2 * 7 / 8 * size / t
    assert 0.95 * 360e9 < bus <= 360e9  # 450 GB/s x 0.8 link efficiency, nearly reached


def test_small_all_reduce_across_many_nodes_prefers_the_tree_for_its_log_latency(h100):
    ranks = tuple(range(0, 2048, 8))  # one GPU per node, 256 nodes
    t_small, algo_small = h100.all_reduce(64 * 1024, ranks)
    assert algo_small == "tree"
    ring = h100._ring(2 * 255, 2 * 255 / 256 * 64 * 1024, h100._bus_link(h100.placement(ranks)))
    assert t_small < ring


def test_group_inside_a_node_is_faster_than_the_same_group_across_nodes(h100):
    inside = tuple(range(8))
    across = tuple(range(0, 64, 8))
    for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        assert h100.cost(op, 256 * 2**20, inside) < h100.cost(op, 256 * 2**20, across)
    assert h100.send_recv(2**26, 0, 1) < h100.send_recv(2**26, 0, 8)


def test_hierarchical_all_reduce_wins_for_large_multi_node_groups(h100):
    t, algo = h100.all_reduce(2 * 2**30, tuple(range(64)))
    assert algo in ("hierarchical", "ring", "tree") and t > 0
    t_h, algo_h = h100.all_reduce(2 * 2**30, tuple(range(512)))
    assert algo_h == "hierarchical"


@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"])
@pytest.mark.parametrize("ranks", [tuple(range(8)), tuple(range(0, 128, 8)), tuple(range(64))])
def test_more_bandwidth_never_makes_a_collective_slower(op, ranks):
    base = load_cluster("h100", 128)
    fast = replace(base, intra=replace(base.intra, bandwidth_gbs=900.0), inter=replace(base.inter, bandwidth_gbs=100.0))
    for size in (1024, 2**20, 2**30):
        assert CollectiveModel(fast).cost(op, size, ranks) <= CollectiveModel(base).cost(op, size, ranks)


def test_cost_is_monotone_in_size_and_zero_for_one_rank(h100):
    ranks = tuple(range(0, 256, 8))
    sizes = [2**k for k in range(10, 32, 2)]
    times = [h100.all_reduce(s, ranks)[0] for s in sizes]
    assert times == sorted(times)
    assert h100.all_reduce(2**30, (3,))[0] == 0.0


def test_calibrated_alpha_beta_replace_the_datasheet():
    c = load_cluster("cpu-gloo", 4)
    m = CollectiveModel(c, fitted={"intra": (1e-3, 1e9)})
    t = m.send_recv(1e9, 0, 1)
    assert t == pytest.approx(1e-3 + 1e9 / (1e9 * m._eff(1e9)))


def test_oversubscribed_fat_tree_slows_cross_node_collectives_only():
    base = load_cluster("h100", 128)
    tree = replace(base, inter=replace(base.inter, topology="fat-tree", oversubscription=4.0))
    across, inside = tuple(range(0, 128, 8)), tuple(range(8))
    assert CollectiveModel(tree).cost("all_gather", 2**30, across) > CollectiveModel(base).cost("all_gather", 2**30, across)
    assert CollectiveModel(tree).cost("all_gather", 2**30, inside) == CollectiveModel(base).cost("all_gather", 2**30, inside)


def test_cross_rail_traffic_pays_an_extra_hop_on_a_rail_optimised_fabric(h100):
    assert h100.send_recv(1024, 0, 9) > h100.send_recv(1024, 0, 8)
