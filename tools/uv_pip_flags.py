"""Print the `uv pip install` options that give uv this machine's pip configuration.

uv reads no pip configuration, so an install through uv on a machine whose pip is pointed at mirrors, local
wheel folders or a constraints file would reach past them. The Makefile's installs add what this prints:
the indexes, wheel folders and constraints pip would use (its configuration files and ``PIP_*`` variables,
as ``pip config list`` shows them), and pip's rule of taking the best version across every index.

    uv pip install --python .venv/bin/python $(.venv/bin/python tools/uv_pip_flags.py) PACKAGES
"""

from __future__ import annotations

import shlex
import subprocess
import sys

#: pip option -> uv option, for options whose values carry over as they are (each value its own flag)
VALUE_OPTIONS = {
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
    "trusted-host": "--allow-insecure-host",
}
#: pip's sections in the order they override each other (``pip config list`` names the environment ``:env:``)
SECTIONS = ("global", "install", ":env:")


def uv_flags(config_lines: list[str]) -> list[str]:
    """uv options equivalent to ``pip config list`` output.

    Args:
        config_lines: lines such as ``global.find-links='/opt/wheels'``.

    Returns:
        The options, each value a separate flag; empty for a pip with no configuration.
    """
    settings: dict[str, dict[str, str]] = {}
    for line in config_lines:
        name, sep, quoted = line.strip().partition("=")
        section, dot, key = name.rpartition(".")
        if not sep or not dot or section not in SECTIONS:
            continue
        values = shlex.split(quoted)
        settings.setdefault(section, {})[key] = values[0] if values else ""
    merged: dict[str, str] = {}
    for section in SECTIONS:
        merged.update(settings.get(section, {}))
    flags: list[str] = []
    for key, option in VALUE_OPTIONS.items():
        for value in merged.get(key, "").split():
            flags += [option, value]
    if merged.get("no-index", "").lower() in ("1", "true", "yes", "on"):
        flags.append("--no-index")
    if merged.get("cert"):
        flags.append("--native-tls")  # the system's certificate store, where a configured bundle usually lives
    if any(flag in ("--extra-index-url", "--find-links") for flag in flags):
        flags += ["--index-strategy", "unsafe-best-match"]  # pip's rule: the best version across all indexes
    return flags


def main() -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False)
    print(shlex.join(uv_flags(proc.stdout.splitlines() if proc.returncode == 0 else [])))


if __name__ == "__main__":
    main()
