"""``python -m agent.checks.child '<json>'``: check one path in a child process and print the report as JSON.

The daemon checks capture files this way so that torch/numpy (deep checks) never load into it.
The argument: {"path", "layers"?, "hidden_size"?, "model"?, "layer_ids"?, "deep"? (default true)}.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def expectation(arg: dict[str, Any]) -> Any:
    """The Expectation for ``arg``: explicit values first, the model's config.json for the rest."""
    from agent.checks.checker import Expectation, expectation_from_model

    layers = arg.get("layers")
    hidden = arg.get("hidden_size")
    from_model = Expectation()
    if arg.get("model"):  # read even when layers and hidden size are given: it also names kv_lora_rank
        try:
            from_model = expectation_from_model(arg["model"], arg.get("layer_ids"))
        except Exception:  # no or odd config.json: check what can be checked without it
            from_model = Expectation()
        layers = layers if layers is not None else from_model.layers
        hidden = hidden if hidden is not None else from_model.hidden_size
    if layers is None and arg.get("layer_ids"):
        layers = len(arg["layer_ids"])
    return Expectation(layers=layers, hidden_size=hidden, kv_lora_rank=from_model.kv_lora_rank)


def main(argv: list[str]) -> int:
    """Entry point; exit 0 with a report on stdout, 2 on a bad argument."""
    try:
        arg = json.loads(argv[0])
        if not isinstance(arg, dict) or not isinstance(arg.get("path"), str):
            raise ValueError("expected a JSON object with a string 'path'")
    except (IndexError, ValueError) as exc:
        print(f"usage: python -m agent.checks.child '{{\"path\": ...}}': {exc}", file=sys.stderr)
        return 2
    from agent.checks.checker import check_path

    report = check_path(arg["path"], expectation(arg), deep=bool(arg.get("deep", True)))
    print(json.dumps(report.to_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
