"""`nestling agent install-service`: a systemd unit that restarts the agent and runs it with one torch thread."""

from __future__ import annotations

import sys
from pathlib import Path

from nestling.edge.agent_cli import agent_main
from nestling.edge.service import UNIT_NAME, unit_text

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "agent.toml"


def test_the_unit_restarts_the_agent_after_the_network_is_up():
    text = unit_text(EXAMPLE, user="pi")
    lines = text.splitlines()
    assert "After=network-online.target" in lines and "Restart=on-failure" in lines
    assert "User=pi" in lines and "Environment=OMP_NUM_THREADS=1" in lines
    assert f"ExecStart={sys.executable} -m nestling.edge.agent_cli --config {EXAMPLE}" in lines
    assert "WantedBy=multi-user.target" in lines


def test_install_service_writes_the_unit_for_a_valid_config(tmp_path, capsys):
    assert (
        agent_main(["install-service", "--config", str(EXAMPLE), "--out", str(tmp_path), "--user", "pi"]) == 0
    )
    assert (tmp_path / UNIT_NAME).read_text() == unit_text(EXAMPLE, user="pi")
    assert "systemctl enable --now" in capsys.readouterr().out


def test_install_service_refuses_a_config_that_would_fail_at_boot(tmp_path, capsys):
    broken = tmp_path / "agent.toml"
    broken.write_text('[device]\nid = "a b"\n')
    assert agent_main(["install-service", "--config", str(broken), "--out", str(tmp_path)]) == 2
    assert "ConfigError" in capsys.readouterr().err and not (tmp_path / UNIT_NAME).exists()
