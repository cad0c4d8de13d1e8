"""The New-run form for backends speculators and specforge: options reach the spec, errors their field."""

from __future__ import annotations

from web import forms

BASE = {"name": "r1", "host": "h1", "model": "/m", "dataset": "/d", "output_dir": "/out"}


def test_speculators_options_round_trip() -> None:
    form = {**BASE, "backend": "speculators", "pipeline_scripts_dir": "/opt/speculators/scripts",
            "pipeline_args": "--validate-outputs\n--world-size\n2\n--rank\n1", "server_port": "8123",
            "nproc_per_node": "4"}  # fmt: skip
    spec, errors = forms.check_form(form)
    assert errors == {}
    assert spec["speculators"] == {
        "scripts_dir": "/opt/speculators/scripts",
        "client_args": ["--validate-outputs", "--world-size", "2", "--rank", "1"],
        "port": 8123,
    }  # nproc_per_node is SpecForge's: not sent for speculators
    back = forms.spec_to_form(spec)
    assert back["server_port"] == "8123" and back["pipeline_args"].splitlines()[0] == "--validate-outputs"
    assert forms.check_form({**back, "backend": "speculators"})[0] == spec


def test_specforge_needs_its_scripts_dir_and_errors_land_on_the_field() -> None:
    spec, errors = forms.check_form({**BASE, "backend": "specforge"})
    assert "pipeline_scripts_dir" in errors and "Field required" in errors["pipeline_scripts_dir"]
    _, errors = forms.check_form({**BASE, "backend": "specforge", "pipeline_scripts_dir": "rel/scripts"})
    assert "absolute path" in errors["pipeline_scripts_dir"]
    _, errors = forms.check_form(
        {
            **BASE,
            "backend": "specforge",
            "pipeline_scripts_dir": "/sf/scripts",
            "pipeline_args": "--tp-size 2",
        }
    )
    assert "holds several words" in errors["pipeline_args"]
    _, errors = forms.check_form({**BASE, "backend": "specforge", "nproc_per_node": "two"})
    assert "whole number" in errors["nproc_per_node"]
    spec, errors = forms.check_form(
        {**BASE, "backend": "specforge", "pipeline_scripts_dir": "/sf/scripts", "nproc_per_node": "8"}
    )
    assert errors == {} and spec["specforge"] == {"scripts_dir": "/sf/scripts", "nproc_per_node": 8}


def test_pipeline_fields_are_ignored_for_other_backends() -> None:
    spec, errors = forms.check_form({**BASE, "backend": "vllm-native", "pipeline_scripts_dir": "/x"})
    assert errors == {} and "speculators" not in spec and "specforge" not in spec
