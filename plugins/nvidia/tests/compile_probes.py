"""Runs the compile probes named on the command line one after another in this one process and prints, as one JSON
line, what each printed (its last line, JSON): probe name -> that. Starting a process with torch and Triton costs
about as much as a probe's compiles, so ``test_fragment_kernel_compiles.py`` runs its probes here together. Exits as
the first probe that exits (3, with its reason, where this Triton has no bundled ``ptxas``)."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import sys


def main() -> None:
    printed = {}
    for name in sys.argv[1:]:
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                importlib.import_module(name).main()  # run as a script: this folder is on sys.path
        except SystemExit:
            sys.stdout.write(out.getvalue())
            raise
        printed[name] = json.loads(out.getvalue().strip().splitlines()[-1])
    print(json.dumps(printed))


if __name__ == "__main__":
    main()
