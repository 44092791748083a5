"""mmreuse.errors: ConfigError, the one configuration error of the simulator and the proxy."""

from __future__ import annotations

import pickle

import pytest

from mmreuse.errors import ConfigError, ConfigTypeError, InvalidArgument, field_name


def test_a_template_names_its_fields_by_path_and_shows_its_values():
    err = ConfigError("{instances/1/demand}: {ep!r} is not a ZMQ endpoint", ep="x")
    assert str(err) == "instances[1].demand: 'x' is not a ZMQ endpoint"
    assert err.field == "instances[1].demand"
    assert (
        err.named(lambda path: f"--{path.split('/')[-1]}") == "--demand: 'x' is not a ZMQ endpoint"
    )
    assert isinstance(err, InvalidArgument) and isinstance(err, ValueError)


def test_the_field_is_the_first_path_that_is_not_a_value():
    err = ConfigError("{value} acts on {instances/*/demand}", value="split")
    assert str(err) == "split acts on instances[].demand" and err.field == "instances[].demand"


def test_on_names_a_field_as_given_and_located_prefixes_the_source():
    err = ConfigError.on("cluster.routing", "must be 'affine' or 'random', got 'x'")
    assert (err.field, err.problem) == ("cluster.routing", "must be 'affine' or 'random', got 'x'")
    at = err.located("f.json")
    assert str(at) == "f.json: cluster.routing: must be 'affine' or 'random', got 'x'"
    assert at.source == "f.json" and at.field == "cluster.routing" and type(at) is ConfigError


def test_a_key_with_braces_or_dots_cannot_break_the_message():
    err = ConfigError.on("'a.{b}[0]'", "unknown key")
    assert str(err) == "'a.{b}[0]': unknown key"


def test_a_wrong_type_is_also_a_type_error_and_stays_one_when_located_and_pickled():
    err = ConfigTypeError.on("cluster.num_prefills", "must be an int, got str '2'")
    assert isinstance(err, TypeError) and isinstance(err, ConfigError)
    back = pickle.loads(pickle.dumps(err.located("c.json")))
    assert type(back) is ConfigTypeError and str(back) == str(err.located("c.json"))
    with pytest.raises(TypeError):
        raise back


def test_field_paths_read_as_the_records_name_them():
    assert field_name("instances/1/demand") == "instances[1].demand"
    assert field_name("instances/*/demand") == "instances[].demand"
    assert field_name("PrefillInstance/demand") == "PrefillInstance.demand"
