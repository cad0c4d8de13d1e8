"""The host paths a launch needs, checked before anything starts: model, dataset, scripts and output dir;
for an attach, the job it names (pid, log, output dir, Slurm job)."""

from __future__ import annotations

import os
from typing import Any

from agent.backends import OWN, Backend
from agent.jobs import attached
from agent.runs.jobspec import AttachSpec

#: Pipeline options whose ``scripts_dir`` must hold this script (None: the directory is enough).
_SCRIPTS = {Backend.SPECFORGE.value: "prepare_hidden_states.py", Backend.SPECULATORS.value: None}


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def path_error(spec: dict[str, Any], backend: Backend) -> str | None:
    """``field: why`` for the first path of ``spec`` (run by ``backend``) this host cannot use; None when
    every one is usable.  A watched command names its own paths in its argv: only extractions are checked."""
    if backend == Backend.COMMAND:
        return None
    if (model := _text(spec.get("model"))) is not None:
        if not os.path.isdir(model):
            return f"model: model directory {model} does not exist on this host"
        if not os.path.isfile(os.path.join(model, "config.json")):
            return f"model: {model} has no config.json: it is not a model directory"
    if (dataset := _text(spec.get("dataset"))) is not None:
        if not os.path.exists(dataset):
            return f"dataset: dataset {dataset} does not exist on this host"
        if backend in OWN and not os.path.isfile(dataset):
            return f"dataset: dataset {dataset} is not a file (a JSONL file of samples)"
        if not os.access(dataset, os.R_OK):
            return f"dataset: dataset {dataset} cannot be read"
    for key, script in _SCRIPTS.items():
        options = spec.get(key)
        scripts = _text(options.get("scripts_dir")) if isinstance(options, dict) else None
        if scripts is None:
            continue
        if not os.path.isdir(scripts):
            return f"{key}.scripts_dir: scripts_dir {scripts} does not exist on this host"
        if script is not None and not os.path.isfile(os.path.join(scripts, script)):
            return f"{key}.scripts_dir: scripts_dir {scripts} has no {script}"
    if (out := _text(spec.get("output_dir"))) is not None:
        # it exists writable, or its nearest existing ancestor is a writable directory
        path = os.path.normpath(out)
        while not os.path.lexists(path):
            path = os.path.dirname(path)
        if not os.path.isdir(path):
            return f"output_dir: cannot create output_dir {out}: {path} is not a directory"
        if not os.access(path, os.W_OK | os.X_OK):
            verb = "write into" if path == os.path.normpath(out) else "create"
            return f"output_dir: cannot {verb} output_dir {out}: {path} is not writable"
    return None


def attach_error(spec: dict[str, Any], attach: AttachSpec) -> str | None:
    """``field: why`` for the first thing an attach names that this host does not have: its pid running,
    its log a readable file, its model's config.json, its output_dir a directory, its Slurm job known to
    Slurm; None when all are."""
    if attach.pid is not None and (why := attached.pid_refusal(attach.pid, attach.allow_stop)):
        return f"attach.pid: {why}"
    if attach.log is not None:
        if not os.path.isfile(attach.log):
            return f"attach.log: log file {attach.log} does not exist on this host (or is not a file)"
        if not os.access(attach.log, os.R_OK):
            return f"attach.log: log file {attach.log} cannot be read"
    if (model := _text(spec.get("model"))) is not None and not os.path.isfile(
        os.path.join(model, "config.json")
    ):
        return f"model: {model} has no config.json on this host: the expectations are read from it"
    if (out := _text(spec.get("output_dir"))) is not None and not os.path.isdir(out):
        return (
            f"output_dir: output_dir {out} does not exist on this host: attach to a directory the job writes"
        )
    if attach.slurm_job is not None and (why := attached.slurm_refusal(attach.slurm_job)):
        return f"attach.slurm_job: {why}"
    return None
