"""A markdown table of ``nvidia_h200_quantized.py bench --decode ... --grouped-tiles ...`` output: each decode
variant's batch-1 rate (and 4 sequences' where measured) against its weights' defaults, against bf16 and, for a
GGUF plan, against its dequantized copy, all from the one JSON (one process, one machine): issue 25's ratios and
which tile switches win.

    python benchmarks/decode_variants_table.py $OUT/next_decode.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def rows(results: dict[str, Any]) -> list[list[str]]:
    """The table's rows: variant, tok/s, vs its defaults, vs bf16, vs the dequantized copy, 4 sequences."""
    decode = {key.removeprefix("decode_"): value for key, value in results.items() if key.startswith("decode_")}
    bf16 = decode.get("bf16", {}).get("decode_tok_s")
    table = []
    for label, value in decode.items():
        rate = value["decode_tok_s"]
        plan, _, tiles = _split(label, decode)
        base = decode.get(plan, {}).get("decode_tok_s")
        copy = decode.get(f"{plan}_dequantized", {}).get("decode_tok_s") if plan.startswith("gguf") else None
        four = value.get("batch_4_tok_s")
        table.append([
            label, f"{rate:.1f}",
            f"{rate / base:.3f}" if base and tiles else "",
            f"{rate / bf16:.2f}x" if bf16 and label != "bf16" else "",
            f"{rate / copy:.2f}x" if copy and not label.endswith("_dequantized") else "",
            f"{four:.1f}" if four else "",
        ])  # fmt: skip
    return table


def _split(label: str, decode: dict[str, Any]) -> tuple[str, str, str]:
    """``(plan, "_", tiles)`` of a label: the longest plan (a label without tile fields, which hold ``=``) that it
    is or extends."""
    plans = [name for name in decode if "=" not in name and (label == name or label.startswith(name + "_"))]
    plan = max(plans, key=len) if plans else label
    return plan, "_", label[len(plan) + 1 :]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", help="the bench's --json output")
    args = parser.parse_args()
    results = json.loads(Path(args.json).read_text(encoding="utf-8"))
    print("| variant | batch 1, tok/s | vs its defaults | vs bf16 | vs its dequantized copy | 4 sequences |")
    print("|---|---|---|---|---|---|")
    for row in rows(results):
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
