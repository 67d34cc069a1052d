"""Reference results: numbers measured on a GPU, kept in data/reference/ with where they came from.

Most learners have no H100. So every chapter that measures something on a GPU also records
it (`python -m course_lib.chapters.ch00.bench --json data/reference/bench_<gpu>.json`, ...) and
shows the recorded file next to the learner's own measurement. Every file carries the same
provenance: device, torch, CUDA, cuDNN, Python, date, the exact command and the code it ran (the
course's git commit, the recording file's git blob id: course_lib/_provenance.py). Until a file is
recorded, a chapter says once, in its own words, what the GPU run would show and how to record
it (docs/gpu.md lists every command); each cell that would show a file then prints one line.

    show_reference("bench_*.json", lambda ref: format_precision_table(ref["rows"]))
"""

from __future__ import annotations

import datetime
import json
import platform
import textwrap
from pathlib import Path
from typing import Callable

import torch

from ._provenance import code_of, current_command  # plumbing: not for reading
from .data import DATA_DIR
from .device import pick_device

__all__ = ["REFERENCE_DIR", "record", "show_reference"]

REFERENCE_DIR = DATA_DIR / "reference"


def provenance(command: str) -> dict:
    """Where and how a number was measured; stored with every reference result."""
    dev = pick_device()
    where = (
        torch.cuda.get_device_name(dev)
        if dev.type == "cuda"
        else f"{dev.type}: {platform.processor() or platform.machine()}"
    )
    return {
        "device": where,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
        "command": command,
        **code_of(command),  # the course's commit, the file the command runs and its git blob id
    }


def _headline(prov: dict) -> str:
    return f"{prov['device']} | torch {prov['torch']} | CUDA {prov['cuda']} | {prov['date']}"


def record(command: str, text: str, json_path: str | Path | None, **payload: object) -> dict:
    """Chapter 00: print a measured table under its provenance line; with json_path, also save
    {"provenance": ..., **payload} there. Every CLI that records a reference result uses this."""
    prov = provenance(command)
    print(_headline(prov))
    print(text)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)  # data/reference/ on a fresh clone
        Path(json_path).write_text(json.dumps({"provenance": prov, **payload}, indent=2) + "\n")
        print(f"wrote {json_path}")
    return prov


def load_references(pattern: str = "*.json", folder: Path | None = None) -> list[dict]:
    """The recorded results matching `pattern` in data/reference/ (or `folder`), each with its file name."""
    return [{"file": p.name, **json.loads(p.read_text())} for p in sorted(Path(folder or REFERENCE_DIR).glob(pattern))]


def show_reference(pattern: str, describe: Callable[[dict], str]) -> None:
    """Chapter 00: print every recorded result matching `pattern` in full, with its provenance,
    formatted by `describe(record)`, and its erratum, if a later finding withdrew some of its values.
    If there is none, print one short line: the chapter itself says, once, what the GPU run would
    show and how to record it.

    It returns None, so a cell that ends with this call shows only what it printed: a returned
    list of records would be the cell's result, shown whole wherever IPython's trailing-`;`
    suppression does not apply (nbval runs cells without input history, so `make test`'s executed
    copies would carry it). A cell that needs the records reads them with `load_references(pattern)`."""
    refs = load_references(pattern)
    for ref in refs:
        prov = ref["provenance"]
        print(f"recorded on {_headline(prov)}  ({ref['file']})\n  command: {prov['command']}")
        if now := current_command(prov["command"]):  # recorded before its module moved: what runs it now
            print(f"  now:     {now}")
        if ref.get("erratum"):  # a measurement found wrong later: its values are null, and this says why
            print(textwrap.fill(f"erratum: {ref['erratum']}", 100, initial_indent="  ", subsequent_indent="    "))
        print(describe(ref))
    if not refs:
        print(f"No GPU reference recorded yet (data/reference/{pattern}).")
