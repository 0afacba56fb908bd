"""`nestling server install-service`: a systemd unit that keeps the coordinator up and resumes after a crash."""

from __future__ import annotations

import sys
from pathlib import Path

from nestling.server.fleet import server_main
from nestling.server.service import SERVER_SERVICE, UNIT_NAME
from nestling.systemd import unit_text

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fleet.toml"


def test_the_unit_resumes_the_server_after_a_crash_once_the_network_is_up() -> None:
    lines = unit_text(SERVER_SERVICE, EXAMPLE, user="nestling").splitlines()
    assert "After=network-online.target" in lines and "Restart=on-failure" in lines
    assert "User=nestling" in lines and "Environment=OMP_NUM_THREADS=1" in lines
    assert f"ExecStart={sys.executable} -m nestling.server.fleet --resume --config {EXAMPLE}" in lines
    assert "KillSignal=SIGTERM" in lines and "WantedBy=multi-user.target" in lines


def test_install_service_writes_the_unit_for_a_valid_config(tmp_path: Path, capsys) -> None:
    assert (
        server_main(["install-service", "--config", str(EXAMPLE), "--out", str(tmp_path), "--user", "fl"])
        == 0
    )
    assert (tmp_path / UNIT_NAME).read_text() == unit_text(SERVER_SERVICE, EXAMPLE, user="fl")
    assert "systemctl enable --now nestling-server.service" in capsys.readouterr().out


def test_install_service_refuses_a_config_that_would_fail_at_boot(tmp_path: Path, capsys) -> None:
    broken = tmp_path / "fleet.toml"
    broken.write_text("[nonsense]\nx = 1\n")
    assert server_main(["install-service", "--config", str(broken), "--out", str(tmp_path)]) == 2
    assert "Error" in capsys.readouterr().err and not (tmp_path / UNIT_NAME).exists()
