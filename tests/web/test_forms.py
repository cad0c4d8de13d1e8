"""The New-run form's pure conversion: fields → spec, and errors shown next to the right field."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from agent.spec import parse_spec
from web import forms
from web.run_templates import TemplateStore, fresh_output_dir

BASE = {"name": "r1", "host": "h1", "backend": "worker-extension", "model": "/m", "dataset": "/d.jsonl",
        "output_dir": "/out"}  # fmt: skip


def test_full_form_to_spec_and_back() -> None:
    form = {**BASE, "layers": "2, 30 ,58,61", "tensor_parallel_size": "8", "max_samples": "100",
            "seq_len": "4096", "env": "CUDA_VISIBLE_DEVICES=0,1\nHF_HOME=/hf",
            "vllm_args": "--enforce-eager\n--max-model-len\n4096",
            "expect_hidden_size": "7168", "on_shape_failure": "stop"}  # fmt: skip
    spec, errors = forms.check_form(form)
    assert errors == {} and spec is not None
    assert spec.layers == [2, 30, 58, 61] and spec.tensor_parallel_size == 8
    assert spec.env == {"CUDA_VISIBLE_DEVICES": "0,1", "HF_HOME": "/hf"}
    assert spec.vllm_args == ["--enforce-eager", "--max-model-len", "4096"]
    assert spec.expect is not None and spec.expect.hidden_size == 7168 and spec.expect.layers is None
    back = forms.spec_to_form(spec.model_dump(mode="json"))  # a run's stored spec, as "again" reads it
    assert back["layers"] == "2, 30, 58, 61" and back["expect_hidden_size"] == "7168"
    assert forms.check_form(back)[0] == spec


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        ({"layers": "2, x"}, "layers", "whole numbers"),
        ({"layers": "2, 2"}, "layers", "unique"),
        ({"tensor_parallel_size": "0"}, "tensor_parallel_size", "greater than or equal to 1"),
        ({"seq_len": "lots"}, "seq_len", "whole number"),
        ({"model": "relative/path"}, "model", "absolute path"),
        ({"model": ""}, "model", "needs model"),
        ({"env": "NOEQUALS"}, "env", "NAME=value"),
        ({"env": "1BAD=x"}, "env", "not valid"),
        ({"name": "bad name!"}, "name", "name must be"),
        ({"backend": "command"}, "command", "needs 'command'"),
        ({"expect_layers": "x"}, "expect_layers", "whole number"),
        ({"expect_layers": "0"}, "expect_layers", "greater than"),
        ({"inject_fault": "melt"}, "inject_fault", "drop_layer"),
        ({"env": "A=1\nB=2\n\nA=3"}, "env", "A is set twice (lines 1 and 4)"),
        ({"tensor_parallel_size": "1_0"}, "tensor_parallel_size", "whole number"),
        ({"max_samples": "\u0663"}, "max_samples", "whole number"),
        ({"layers": "2, 9223372036854775808"}, "layers", "at most 65535"),
        ({"max_samples": "18446744073709551616"}, "max_samples", "less than or equal"),
        ({"command": "sh -c 'rm -rf ~/x'", "backend": "command"}, "command", "shell command line"),
        ({"vllm_args": "--dtype float32; rm -rf /"}, "vllm_args", "own item"),
    ],
)
def test_errors_land_on_their_field(change: dict[str, str], field: str, words: str) -> None:
    spec, errors = forms.check_form({**BASE, **change})
    assert spec is None and field in errors, errors
    assert words in errors[field]


def test_fault_choice_reaches_the_spec_and_none_leaves_it_out() -> None:
    spec, errors = forms.check_form({**BASE, "inject_fault": "drop_layer"})
    assert errors == {} and spec is not None and spec.inject_fault == "drop_layer"
    assert forms.spec_to_form(spec.model_dump(mode="json"))["inject_fault"] == "drop_layer"
    spec, errors = forms.check_form({**BASE, "inject_fault": ""})
    assert errors == {} and spec is not None and spec.inject_fault is None


def test_controller_errors_are_mapped_to_fields() -> None:
    mapped = forms.errors_by_form_field(
        [{"field": "host", "message": "no host 'x'"}, {"field": "", "message": "something global"}]
    )
    assert mapped["host"] == "no host 'x'"
    assert mapped[forms.GENERAL_ERROR_KEY] == "something global"


def test_form_text_becomes_strict_integers() -> None:
    """The model refuses "8" for tensor_parallel_size; the form converts its text before validating."""
    spec, errors = forms.check_form({**BASE, "tensor_parallel_size": " 8 ", "expect_layers": "+4"})
    assert errors == {} and spec is not None
    assert spec.tensor_parallel_size == 8 and spec.expect is not None and spec.expect.layers == 4


def test_disk_fields_round_trip() -> None:
    spec, errors = forms.check_form({**BASE, "allow_disk_overrun": "true", "disk_low_gib": "50"})
    assert errors == {} and spec is not None and spec.allow_disk_overrun is True and spec.disk_low_gib == 50
    back = forms.spec_to_form(spec.model_dump(mode="json"))
    assert (back["allow_disk_overrun"], back["disk_low_gib"]) == ("true", "50")
    spec, errors = forms.check_form({**BASE, "allow_disk_overrun": ""})
    assert spec is not None and spec.allow_disk_overrun is False
    spec, errors = forms.check_form({**BASE, "disk_low_gib": "-1"})
    assert spec is None and "disk_low_gib" in errors


def test_a_field_that_does_not_convert_fails_the_form_though_the_rest_is_valid() -> None:
    """An unconvertible optional field is left out of the spec dict, which would validate without it."""
    spec, errors = forms.check_form({**BASE, "seq_len": "lots"})
    assert spec is None and list(errors) == ["seq_len"]


def test_a_template_gives_each_run_a_fresh_output_dir(tmp_path: Path) -> None:
    store = TemplateStore(tmp_path)
    store.save("t", {"name": "dsv3", "output_dir": "/data/hs/"})
    loaded = store.get("t")
    assert loaded is not None and re.fullmatch(r"/data/hs/dsv3-\d{8}-\d{6}", loaded["output_dir"])
    store.save("t", loaded)  # saved again from the loaded form: the template keeps the parent
    assert json.loads((tmp_path / "run-templates.json").read_text())["t"]["output_dir"] == "/data/hs"
    assert fresh_output_dir({"name": "r"}, 0.0) == {"name": "r"}
    assert fresh_output_dir({"output_dir": "/o"}, 0.0) == {"output_dir": "/o/run-19700101-000000"}


def test_a_misspelled_field_names_the_nearest_known_one() -> None:
    errors = forms.errors_by_form_field(
        [{"field": "modle", "message": "not a spec field: did you mean model?"}]
    )
    assert errors == {forms.GENERAL_ERROR_KEY: "modle: not a spec field: did you mean model?"}
    with pytest.raises(ValidationError) as caught:
        parse_spec({**BASE, "host": "h1", "modle": "/m", "expect": {"layrs": 4}, "zzz": 1})
    assert {e["field"]: e["message"] for e in forms.validation_errors(caught.value)} == {
        "modle": "not a spec field: did you mean model?",
        "expect.layrs": "not a spec field: did you mean layers?",
        "zzz": "not a spec field",
    }
