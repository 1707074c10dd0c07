"""Assertions shared by the engine tests."""

from __future__ import annotations


def assert_all_blocks_free(llm) -> None:
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.num_free_blocks == engine.num_total_blocks, (
        f"{engine.num_total_blocks - engine.num_free_blocks} KV blocks leaked"
    )
