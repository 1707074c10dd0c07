"""KV cache groups: how a model whose layers attend over different windows shares one block pool.

A model whose layers all attend over the same window (or all globally) keeps one block table per
sequence. A model that interleaves sliding-window and global layers (Gemma 2 and 3) could only free a
block once no layer reads it, which for its global layers is never. So its layers are split into groups of
equal size, each group made of layers with the same window; a sequence has one block table per group, and
a sliding group releases the blocks that fall out of its window while a global group keeps them all.

The groups share one pool of block ids, and the pool holds as many cache tensors as a group has layers
(its *slots*): layer ``i`` of every group uses cache tensor ``i``. A block id belongs to one group's table
at a time, so groups never write over each other, and a block released by a sliding group serves any
group next. A block therefore costs ``slots`` layers of KV rather than every layer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.interfaces.attention import AttentionMetadata


@dataclass(frozen=True, slots=True)
class KVGroup:
    """Layers that share a block table.

    Attributes:
        window: the layers' attention window, None for global attention.
        layers: the model's layer indices, in order; at most the layout's ``slots``.
    """

    window: int | None
    layers: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class KVGroupLayout:
    """The groups of a model with mixed windows, and where each layer's cache lives.

    Attributes:
        groups: every group; sliding groups of one window may be several.
        slots: cache tensors in the pool (the size of the largest group).
        layer_group: per layer, the index of its group.
        layer_slot: per layer, the cache tensor it uses.
    """

    groups: tuple[KVGroup, ...]
    slots: int
    layer_group: tuple[int, ...]
    layer_slot: tuple[int, ...]

    @property
    def windows(self) -> list[int | None]:
        """Each group's window, in group order."""
        return [group.window for group in self.groups]

    def layer_caches(self, caches: Sequence[Any]) -> list[Any]:
        """Each layer's cache tensor out of the pool's ``slots`` tensors."""
        if len(caches) != self.slots:
            raise ValueError(f"the layout has {self.slots} cache slots, the pool {len(caches)} tensors")
        return [caches[slot] for slot in self.layer_slot]


def plan_kv_groups(layer_windows: Sequence[int | None]) -> KVGroupLayout | None:
    """Group the layers of a model by window.

    Every group has ``slots`` layers (the last group of a window may have fewer), where ``slots`` is the
    layer count of the rarest window: Gemma 2's alternating layers make two groups of half the layers,
    Gemma 3's five sliding layers per global one make one global group and five or six sliding ones.

    Args:
        layer_windows: each layer's window (None: global).

    Returns:
        The layout, or None when every layer has the same window (one table per sequence suffices).
    """
    by_window: dict[int | None, list[int]] = {}
    for index, window in enumerate(layer_windows):
        by_window.setdefault(window, []).append(index)
    if len(by_window) < 2:
        return None
    slots = min(len(layers) for layers in by_window.values())
    groups: list[KVGroup] = []
    layer_group = [0] * len(layer_windows)
    layer_slot = [0] * len(layer_windows)
    # global layers first, so group 0 is the one whose table covers every token
    for window in sorted(by_window, key=lambda w: (w is not None, w or 0)):
        layers = by_window[window]
        for start in range(0, len(layers), slots):
            members = tuple(layers[start : start + slots])
            for slot, layer in enumerate(members):
                layer_group[layer] = len(groups)
                layer_slot[layer] = slot
            groups.append(KVGroup(window, members))
    return KVGroupLayout(tuple(groups), slots, tuple(layer_group), tuple(layer_slot))


@dataclass(slots=True)
class GroupedAttentionMetadata:
    """One step's attention metadata per KV group (same rows and lengths; own tables, slots and window).

    The core hands this to models with a :class:`KVGroupLayout` in place of one
    :class:`AttentionMetadata`; a layer attends with the metadata of its group. Backends only ever see
    the per-group :class:`AttentionMetadata`.

    Attributes:
        by_group: the metadata of each group, in group order.
        layer_group: per layer, the index of its group.
    """

    by_group: list[AttentionMetadata]
    layer_group: tuple[int, ...]

    @property
    def primary(self) -> AttentionMetadata:
        """Group 0's metadata (a global group when there is one): rows, lengths and positions."""
        return self.by_group[0]

    def for_layers(self, soft_cap: float | None) -> list[AttentionMetadata]:
        """Each layer's metadata, with the model's attention soft-cap set; one copy per group."""
        variants = [dataclasses.replace(meta, logits_soft_cap=soft_cap, extras={}) for meta in self.by_group]
        return [variants[group] for group in self.layer_group]


def grouped_metadata(
    base: AttentionMetadata,
    layout: KVGroupLayout,
    block_tables: Sequence[Any],
    slot_mappings: Sequence[Any],
) -> GroupedAttentionMetadata:
    """Per-group copies of ``base`` with each group's block tables, slot mapping and window.

    Args:
        base: the step's metadata (rows, lengths, scale); its tables and slots are replaced.
        layout: the model's groups.
        block_tables: per group, int32 ``[num_seqs, width]``.
        slot_mappings: per group, int64 ``[num_tokens]``.
    """
    by_group = [
        dataclasses.replace(base, block_tables=tables, slot_mapping=slots, sliding_window=group.window, extras={})
        for group, tables, slots in zip(layout.groups, block_tables, slot_mappings, strict=True)
    ]
    return GroupedAttentionMetadata(by_group, layout.layer_group)
