"""Hardware presets and user clusters: datasheet figures, TOML/YAML files, one-line errors."""

from __future__ import annotations

import pytest

from simulator.hardware import HardwareError, available_presets, load_cluster


def test_presets_carry_datasheet_figures():
    h100 = load_cluster("h100", 16)
    assert h100.gpu.peak_flops == pytest.approx(989e12)
    # memory: what torch reports as the device's capacity (85,017,493,504 bytes on the H100 80GB HBM3
    # of results/gpu/2026-11-27-h100), not the datasheet's "80 GB": the fits check compares with it
    assert h100.gpu.memory_bytes == pytest.approx(85_017_493_504, rel=1e-4)
    assert h100.gpu.memory_bandwidth == pytest.approx(3.35e12)
    assert h100.intra.bandwidth_gbs == 450 and h100.inter.bandwidth_gbs == 50
    assert h100.inter.topology == "rail-optimised" and h100.num_nodes == 2
    h200 = load_cluster("h200")
    assert h200.gpu.memory_gib == pytest.approx(139.80) and h200.gpu.memory_bandwidth_gbs == 4800
    a100 = load_cluster("a100-80g")
    assert a100.gpu.peak_tflops == 312 and a100.inter.bandwidth_gbs == 25
    assert {"h100", "h200", "a100-80g", "cpu-gloo"} <= set(available_presets())


def test_every_gpu_preset_holds_less_than_its_nominal_memory_as_torch_reports_it():
    nominal = {"h100": 80, "h800": 80, "h200": 141, "a100-80g": 80, "a100-40g": 40, "v100-32g": 32, "h100-500w": 96,
               "b200": 180, "gb200": 186}
    for name, gb in nominal.items():
        got = load_cluster(name).gpu.memory_gib
        assert 0.98 * gb < got < gb, name  # 79.18 of "80": HBM less ECC and the driver's reserve


def test_user_cluster_from_toml_and_yaml(tmp_path):
    body = {
        "name": "mine", "gpus_per_node": 4,
        "gpu": {"peak_tflops": 100.0, "memory_gib": 24.0, "memory_bandwidth_gbs": 900.0},
        "intra": {"bandwidth_gbs": 64.0, "latency_us": 5.0},
        "inter": {"bandwidth_gbs": 12.5, "latency_us": 20.0, "nics_per_node": 1, "topology": "fat-tree",
                  "oversubscription": 2.0},
    }
    import yaml

    y = tmp_path / "mine.yaml"
    y.write_text(yaml.safe_dump(body))
    c = load_cluster(str(y), 8)
    assert c.gpus_per_node == 4 and c.num_nodes == 2 and c.inter.topology == "fat-tree"
    t = tmp_path / "mine.toml"
    t.write_text(
        'name = "mine"\ngpus_per_node = 4\n[gpu]\npeak_tflops = 100.0\nmemory_gib = 24.0\nmemory_bandwidth_gbs = 900.0\n'
        '[intra]\nbandwidth_gbs = 64.0\nlatency_us = 5.0\n[inter]\nbandwidth_gbs = 12.5\nlatency_us = 20.0\n'
        'nics_per_node = 1\n'
    )
    assert load_cluster(str(t)).gpu.peak_tflops == 100.0


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda d: d["gpu"].update(peak_tflop=1.0), "gpu.peak_tflop"),
        (lambda d: d["intra"].update(bandwidth_gbs=-1.0), "intra.bandwidth_gbs"),
        (lambda d: d["inter"].update(topology="torus"), "inter.topology"),
        (lambda d: d.update(gpus_per_node=0), "gpus_per_node"),
        (lambda d: d["gpu"].pop("memory_gib"), "gpu.memory_gib"),
        (lambda d: d.update(colour="blue"), "colour"),
    ],
)
def test_bad_cluster_field_gives_one_line_error_naming_it(tmp_path, edit, needle):
    import yaml

    body = {
        "gpus_per_node": 8,
        "gpu": {"peak_tflops": 100.0, "memory_gib": 24.0, "memory_bandwidth_gbs": 900.0},
        "intra": {"bandwidth_gbs": 64.0, "latency_us": 5.0},
        "inter": {"bandwidth_gbs": 12.5, "latency_us": 20.0, "nics_per_node": 8},
    }
    edit(body)
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(body))
    with pytest.raises(HardwareError) as e:
        load_cluster(str(p))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_unknown_preset_lists_the_allowed_ones():
    with pytest.raises(HardwareError, match="hardware must be one of .*h100"):
        load_cluster("tpu-v9")
