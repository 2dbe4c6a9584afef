"""Uneven ShardedTensors with a prepended (layer) axis, in PyTorch DCP
(upstream: ``megatron.core.dist_checkpointing.strategies.checkpointable``).

A ``ShardedTensor`` with ``axis_fragmentations=None`` (an uneven grid — every NTP fragment) goes to DCP as a
``CheckpointableShardedTensor``. Upstream sizes its chunk with ``local_shape`` alone, while its offset has the
prepended axes too (``decoder.layers.*`` tensors carry a layer axis): a 2-D chunk at a 3-D offset, which DCP
cannot write or read. Megatron's older path for regular grids views the data as ``(1,) * prepend_axis_num +
local_shape`` and writes chunks of that shape; these methods do the same, so a fragment is stored exactly as a
plain Megatron chunk of the same box would be (and loads land in the tensor's memory through the view).
Identity when nothing is prepended.
"""

from __future__ import annotations

import torch
from megatron.core.dist_checkpointing.strategies import checkpointable as upstream
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType


def _chunk_shape(sh_ten) -> torch.Size:
    return torch.Size((1,) * sh_ten.prepend_axis_num + tuple(sh_ten.local_shape))


def _chunk_data(sh_ten) -> torch.Tensor:
    data = sh_ten.data
    if tuple(data.shape) != tuple(sh_ten.local_shape):
        raise ValueError(f"{sh_ten.key}: data of shape {tuple(data.shape)} for local shape {sh_ten.local_shape}")
    return data.view(_chunk_shape(sh_ten)) if sh_ten.prepend_axis_num else data


def _create_write_items(self, fqn: str, sh_ten, index: int = None) -> list[WriteItem]:
    inner = sh_ten._sh_ten
    offsets = torch.Size(inner.global_offset)
    return [
        WriteItem(
            index=MetadataIndex(fqn, offsets, index),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=offsets, sizes=_chunk_shape(inner)),
                properties=TensorProperties.create_from_tensor(inner.data),
                size=torch.Size(inner.global_shape),
            ),
        )
    ]


def _create_chunk_list(self) -> list[ChunkStorageMetadata]:
    inner = self._sh_ten
    return [ChunkStorageMetadata(offsets=torch.Size(inner.global_offset), sizes=_chunk_shape(inner))]


def _get_tensor_shard(self, index: MetadataIndex) -> torch.Tensor:
    return _chunk_data(self._sh_ten)


def apply() -> None:
    cls = upstream.CheckpointableShardedTensor
    cls.__create_write_items__ = _create_write_items
    cls.__create_chunk_list__ = _create_chunk_list
    cls.__get_tensor_shard__ = _get_tensor_shard
