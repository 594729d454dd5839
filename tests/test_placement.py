import pytest

from embodirl.errors import ConfigError
from embodirl.placement import parse_device_set, parse_placement


@pytest.mark.parametrize("spec, ids", [
    ("all", (0, 1, 2, 3, 4, 5, 6, 7)), ("3", (3,)), (5, (5,)), ("0-3", (0, 1, 2, 3)),
    ("0-3,5", (0, 1, 2, 3, 5)), (" 1 - 2 , 7 ", (1, 2, 7)), ("2,2,1", (1, 2)),
])
def test_device_sets(spec, ids):
    assert parse_device_set(spec, 8) == ids


@pytest.mark.parametrize("spec, message", [
    ("0-", "cannot parse"), ("a", "cannot parse"), ("3-1", "ends before it starts"),
    ("0-8", "names device 8 but only 8"), ("", "cannot parse"),
])
def test_bad_device_sets(spec, message):
    with pytest.raises(ConfigError, match=message):
        parse_device_set(spec, 8)


def test_collocated_and_hybrid():
    p = parse_placement({"actor,rollout,env": "all"}, 4, "gpu")
    assert p.devices["env"] == (0, 1, 2, 3) and p.is_collocated("actor", "rollout")
    p = parse_placement({"env": "0-3", "rollout": "4-7", "actor": "0-7"}, 8, "gpu")
    assert not p.is_collocated("env", "rollout") and p.is_collocated("env", "actor")
    assert parse_placement("all", 2).devices["actor"] == (0, 1)


@pytest.mark.parametrize("spec, message", [
    ({"actor,rollout": "all"}, "env have no devices"),
    ({"actor,rollout,env": "all", "env": "0"}, "placed twice"),
    ({"actor,rollout,envs": "all"}, "unknown component 'envs'"),
])
def test_bad_placements(spec, message):
    with pytest.raises(ConfigError, match=message):
        parse_placement(spec, 4)


def test_command_line_string_form():
    p = parse_placement("env: 0-1; rollout: 2-3; actor: 0-3", 4, "gpu")
    assert p.devices == {"env": (0, 1), "rollout": (2, 3), "actor": (0, 1, 2, 3)}
    with pytest.raises(ConfigError, match="components: devices"):
        parse_placement("env: 0; rollout 1", 4)
