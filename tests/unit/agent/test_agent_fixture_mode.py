"""A fixture tree is an explicit mode, never a silent switch (finding 11).

On b6733c0 any `--root` other than / silently made the agent read sysfs through a
simulated netlink and ignore `--require-pyverbs`, while tc, dcb, rdma and modprobe still
ran on the real machine. Now a root other than / must be asked for as a fixture
(`--fixture-root`, `Host(..., fixture=True)`), and a fixture with `--require-pyverbs`
is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import make_config
from fakes import no_rdma_node

from metaroce_agent.cli import doctor_main, run_main
from metaroce_agent.discover import DiscoveryError, verbs_backend
from metaroce_agent.host import Host


def _config(tmp_path: Path) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(make_config(nics={"drivers": ["igb"]}).to_yaml())
    return str(path)


def test_a_root_other_than_slash_is_refused_unless_asked_for_as_a_fixture(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tree, _ = no_rdma_node(tmp_path / "root")
    rc = run_main(
        ["--config", _config(tmp_path), "--root", str(tree.root), "--no-report", "--once"]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "--fixture-root" in err, err
    assert doctor_main(["--root", str(tree.root)]) == 2
    assert "--fixture-root" in capsys.readouterr().err


def test_a_fixture_with_require_pyverbs_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tree, _ = no_rdma_node(tmp_path / "root")
    argv = ["--config", _config(tmp_path), "--fixture-root", str(tree.root), "--require-pyverbs"]
    assert run_main([*argv, "--no-report", "--once"]) == 2
    err = capsys.readouterr().err
    assert "--fixture-root" in err and "--require-pyverbs" in err, err
    with pytest.raises(DiscoveryError, match="fixture"):
        verbs_backend(Host(tree.root, fixture=True), require_pyverbs=True)


def test_host_over_a_tree_must_say_it_is_a_fixture(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="fixture=True"):
        Host(tmp_path)
    backend, warnings = verbs_backend(Host(tmp_path, fixture=True))
    assert backend.source == "sysfs" and warnings == []
