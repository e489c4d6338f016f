"""Topologies a plan compiles for: their names, their devices, and the one-line errors."""

from __future__ import annotations

import pytest

from asyncopd_jax.scale.chips import CHIPS, get_topology, libtpu_available, parse_topology, proxy_devices_needed
from tests.tpu_compiler import needs_libtpu


@pytest.mark.parametrize(
    ("name", "expected"),
    [("v5e-16", ("v5e", 16)), ("V6E-8", ("v6e", 8)), ("v5p-8", ("v5p", 4)), ("h100-8", ("h100", 8))],
)
def test_names_count_chips_or_tensorcores_as_cloud_tpu_names_do(name, expected):
    assert parse_topology(name) == expected


@pytest.mark.parametrize(
    ("name", "says"),
    [("v5e", "expected <chip>-<count>"), ("a100-8", "chip one of"), ("v5p-3", "2 per chip")],
)
def test_a_bad_topology_name_is_one_line_naming_the_argument(name, says):
    with pytest.raises(ValueError, match=says) as err:
        parse_topology(name)
    assert "--topology" in str(err.value) and "\n" not in str(err.value)


def test_a_gpu_node_is_stood_in_for_by_cpu_devices_and_says_so():
    assert proxy_devices_needed("h100-8") == 8 and proxy_devices_needed("v5e-16") == 0
    topology = get_topology("h100-4")  # the tests have 8 virtual CPU devices (conftest)
    assert [d.platform for d in topology.devices] == ["cpu"] * 4
    assert topology.proxy and topology.chip is CHIPS["h100"]
    with pytest.raises(ValueError, match="xla_force_host_platform_device_count=16"):
        get_topology("h100-16")


@needs_libtpu
@pytest.mark.parametrize(("name", "chips", "kind"), [("v5e-8", 8, "TPU v5 lite"), ("v5p-8", 4, "TPU v5")])
def test_a_tpu_slice_is_libtpus_description_of_its_chips(name, chips, kind):
    topology = get_topology(name)
    assert len(topology.devices) == chips and {d.device_kind for d in topology.devices} == {kind}
    assert not topology.proxy


@pytest.mark.skipif(
    libtpu_available(), reason="checks the message given where libtpu is missing (runs in the README's test command)"
)
def test_without_libtpu_a_tpu_slice_says_what_to_install():
    with pytest.raises(ValueError, match=r"asyncopd-jax\[tpu\]"):
        get_topology("v5e-8")
