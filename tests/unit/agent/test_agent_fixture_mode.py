"""Production code has no fixture mode (finding 11).

On b6733c0 any `--root` other than / silently made the agent read sysfs through a
simulated netlink and ignore `--require-pyverbs`, while tc, dcb, rdma and modprobe still
ran on the real machine. Now the agent and doctor accept only / and say why, `Host`
refuses any other root, and the fixture doubles (the tree's netlink, the sysfs-only
discovery) belong to the tests' own `FixtureHost`."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import make_config
from fakes import FixtureHost, no_rdma_node

from metaroce_agent.cli import doctor_main, run_main
from metaroce_agent.discover import verbs_backend
from metaroce_agent.host import Host


def _config(tmp_path: Path) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(make_config(nics={"drivers": ["igb"]}).to_yaml())
    return str(path)


def test_a_root_other_than_slash_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tree, _ = no_rdma_node(tmp_path / "root")
    rc = run_main(
        ["--config", _config(tmp_path), "--root", str(tree.root), "--no-report", "--once"]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "no fixture mode" in err, err
    assert doctor_main(["--root", str(tree.root)]) == 2
    assert "no fixture mode" in capsys.readouterr().err


def test_require_pyverbs_cannot_be_bypassed_with_a_root(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tree, _ = no_rdma_node(tmp_path / "root")
    argv = ["--config", _config(tmp_path), "--root", str(tree.root), "--require-pyverbs"]
    assert run_main([*argv, "--no-report", "--once"]) == 2
    assert "--root" in capsys.readouterr().err


def test_host_over_a_tree_is_the_tests_fixture_host(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="FixtureHost"):
        Host(tmp_path)
    backend, warnings = verbs_backend(FixtureHost(tmp_path))
    assert backend.source == "sysfs" and warnings == []
