"""NCCL-like collective costs: algorithm choice, placement, bandwidth laws."""

from __future__ import annotations

from dataclasses import replace

import pytest

from simulator.collectives import CollectiveModel
from simulator.hardware import load_cluster


@pytest.fixture
def h100():
    return CollectiveModel(load_cluster("h100", 2048))


def test_large_all_reduce_in_a_node_uses_nvls_and_other_collectives_the_nvlink_ring(h100):
    # NCCL on 8 H100s (NVIDIA/nccl-tests#212): NVLS all-reduce peaks near 480 GB/s bus bandwidth;
    # rings (and every collective but all-reduce) reach about 370 GB/s of NVLink's 450.
    ranks = tuple(range(8))
    size = 4 * 2**30
    t, algo = h100.all_reduce(size, ranks)
    assert algo == "nvls" and 0.95 * 480e9 < 2 * 7 / 8 * size / t <= 480e9
    t_ag, _ = h100.all_gather(size, ranks)
    assert 0.95 * 360e9 < 7 / 8 * size / t_ag <= 360e9
    no_nvls = CollectiveModel(replace(h100.cluster, intra=replace(h100.cluster.intra, nvls_busbw_gbs=0.0)))
    t, algo = no_nvls.all_reduce(size, ranks)
    assert algo == "ring" and 0.95 * 360e9 < 2 * 7 / 8 * size / t <= 360e9


def test_bus_bandwidth_grows_with_message_size_through_the_protocols(h100):
    # LL's latency wins small messages, Simple's bandwidth large ones: bus bandwidth rises with size
    ranks = tuple(range(16))
    bus = [2 * 15 / 16 * s / h100.all_reduce(s, ranks)[0] for s in (2**16, 2**20, 2**24, 2**30)]
    assert bus == sorted(bus) and bus[0] < 0.05 * bus[-1]


def test_small_all_reduce_across_many_nodes_prefers_the_tree_for_its_log_latency(h100):
    ranks = tuple(range(0, 2048, 8))  # one GPU per node, 256 nodes
    t_small, algo_small = h100.all_reduce(64 * 1024, ranks)
    assert algo_small == "tree"
    assert t_small < h100._nccl_ring("all_reduce", 64 * 1024, h100.placement(ranks))


def test_group_inside_a_node_is_faster_than_the_same_group_across_nodes(h100):
    inside = tuple(range(8))
    across = tuple(range(0, 64, 8))
    for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        assert h100.cost(op, 256 * 2**20, inside) < h100.cost(op, 256 * 2**20, across)
    assert h100.send_recv(2**26, 0, 1) < h100.send_recv(2**26, 0, 8)


def test_a_ring_over_whole_nodes_drives_every_nic_and_one_rank_per_node_only_its_own(h100):
    # a ring channel per NIC: 8 x 46 GB/s for whole nodes (NVLink caps it at 360); one rail: 46 GB/s
    size = 2 * 2**30
    whole, rail = tuple(range(64)), tuple(range(0, 512, 8))
    bus_whole = 2 * 63 / 64 * size / h100.all_reduce(size, whole)[0]
    bus_rail = 2 * 63 / 64 * size / h100.all_reduce(size, rail)[0]
    assert 250e9 < bus_whole <= 360e9
    assert 35e9 < bus_rail <= 46e9


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


def test_deepep_sends_a_token_to_each_remote_node_once_and_forwards_it_over_nvlink(h100):
    # Qwen3-235B's dispatch over EP 32 = 4 whole nodes, 128 experts, top-8 (MoE model zoo's cross-node
    # rows): the all-to-all dispatcher sends 8 * 24/32 = 6 copies of a token over the network, DeepEP
    # one per remote node the token reaches, 3 * (1 - C(96, 8)/C(128, 8)) = 2.72 of them.
    ranks = tuple(range(32))
    nbytes = 2048 * 8 * 4096 * 2  # 2,048 tokens x top-8 x hidden 4,096, bf16
    plain = h100.expert_all_to_all(nbytes, ranks, 128, 8, "alltoall")
    assert plain == h100.all_to_all(nbytes, ranks)[0]
    deepep = h100.expert_all_to_all(nbytes, ranks, 128, 8, "deepep")
    assert 0.42 < deepep / plain < 0.48
    # inside one node there is nothing to deduplicate
    node = tuple(range(8))
    assert h100.expert_all_to_all(nbytes, node, 128, 8, "deepep") == h100.expert_all_to_all(nbytes, node, 128, 8)
    # top-1 routing sends one copy per token either way: DeepEP saves nothing on the network
    one = h100.expert_all_to_all(nbytes / 8, ranks, 128, 1, "deepep")
    assert one == pytest.approx(h100.expert_all_to_all(nbytes / 8, ranks, 128, 1), rel=0.02)
