"""One result row of a benchmark: printed as a `RESULT {json}` line (the suite greps them) and, given a
path, appended to a JSON-lines file in the format of ../shared/peers (its report.py reads both)."""
from __future__ import annotations

import json
from typing import Optional


def emit(row: dict, out: Optional[str] = None) -> None:
    print("RESULT", json.dumps(row), flush=True)
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")
