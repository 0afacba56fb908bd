"""The device section: machine facts, a sustained GFLOP/s figure, tegrastats parsing, graceful elsewhere."""

from __future__ import annotations

import json

from nestling.profiler.device import device_info, is_jetson, jetson_state, measure_gflops, parse_tegrastats

NANO_LINE = (
    "RAM 2448/3964MB (lfb 57x4MB) SWAP 0/1982MB (cached 0MB) CPU [8%@1479,3%@1479,off,off] EMC_FREQ 0% "
    "GR3D_FREQ 0% PLL@29.5C CPU@31.5C PMIC@50C GPU@30C AO@38.5C thermal@30.75C POM_5V_IN 1766/1766 "
    "POM_5V_GPU 0/0 POM_5V_CPU 199/199"
)
ORIN_LINE = (
    "RAM 5373/7620MB (lfb 2x4MB) SWAP 0/3810MB (cached 0MB) CPU [2%@729,1%@729,0%@729,0%@729,off,off] "
    "GR3D_FREQ 0% cpu@47.062C soc2@45.468C soc0@45.875C gpu@-256C VDD_IN 5021mW/5021mW "
    "VDD_CPU_GPU_CV 476mW/476mW VDD_SOC 1427mW/1427mW"
)


def test_tegrastats_lines_of_old_and_new_jetsons_parse() -> None:
    nano = parse_tegrastats(NANO_LINE)
    assert (nano["ram_used_mb"], nano["ram_total_mb"]) == (2448, 3964)
    assert nano["temperatures_c"]["CPU"] == 31.5 and nano["temperatures_c"]["thermal"] == 30.75
    assert nano["power_mw"]["POM_5V_IN"] == {"current": 1766, "average": 1766}
    assert "RAM" not in nano["power_mw"]
    orin = parse_tegrastats(ORIN_LINE)
    assert orin["power_mw"]["VDD_IN"] == {"current": 5021, "average": 5021}
    assert orin["temperatures_c"]["gpu"] == -256.0  # an idle Orin GPU reports this sentinel
    assert parse_tegrastats("") == {"power_mw": {}, "temperatures_c": {}}


def test_sustained_gflops_is_measured_over_repeated_products() -> None:
    result = measure_gflops("cpu", seconds=0.05, size=128)
    assert result["iterations"] >= 3 and result["gflops"] > 0


def test_device_info_is_plain_json_and_degrades_gracefully_off_jetson() -> None:
    info = device_info("cpu", gflops_seconds=0.05)
    json.dumps(info)
    assert (
        info["cpu"]["logical_cores"] >= 1
        and info["memory"]["total_bytes"] > info["memory"]["available_bytes"] > 0
    )
    assert info["compute"]["gflops"] > 0
    if not is_jetson():
        assert info["jetson"] is None and jetson_state() is None
