"""Checkpoints with ``megatron.core.dist_checkpointing``: model, optimizer, scheduler, RNG, progress — for
plain Megatron (NTP off) and for NTP runs under any topology, degraded ones included.

On disk (one format for both)::

    <save>/iter_0000010/                     one checkpoint, Megatron's torch_dist format (PyTorch DCP):
        metadata.json                        written last by dist_checkpointing: the directory is complete
        .metadata, __<rank>_<n>.distcp       tensors: global shapes and chunks (DCP metadata), data
        common.pt                            what every rank holds alike (below)
    <save>/latest_checkpointed_iteration.txt the newest complete checkpoint's iteration

``checkpoint.load`` also reads Megatron-LM's other layouts: ``latest_checkpointed_iteration.txt`` holding
``release`` and a ``release/`` directory (what checkpoint converters write), and a path straight to one
checkpoint directory (``iter_*``, ``release``, or any directory with ``metadata.json``).

Tensors, under the keys of plain Megatron-Core's ``GPTModel`` and optimizer (global shapes and element order
those of a TP1 model, as uniform TP writes them):

- ``model``: ``embedding.word_embeddings.weight``, ``decoder.layers.<param>`` with the layer as a leading
  axis, ``decoder.final_layernorm.*``, ``output_layer.weight`` when untied;
- ``optimizer``: ``optimizer.state.exp_avg.<model key>`` and ``optimizer.state.exp_avg_sq.<model key>``
  (fp32, the model tensor's shape), Adam's step as ``common_step`` and the parameter groups in ``common.pt``;
  with the distributed optimizer Megatron's ``fully_reshardable`` format: the same moments, the fp32 main
  parameters as ``optimizer.state.param.<model key>``, the step in the parameter groups, and Megatron-LM's content
  metadata naming the format. Each rank writes the pieces of its shard as boxes of those tensors, without
  gathering (:func:`.sharded._distributed_optimizer_state`; a degraded NTP rank the pieces of its shadows'
  shards); a load reads them into any optimizer, the distributed one or not, and plain Megatron-LM's
  ``dp_reshardable`` (bucket space) into a distributed-optimizer run of its layout (``docs/checkpoints.md``, "The
  distributed optimizer");
- ``scheduler`` (OptimizerParamScheduler state), ``iteration`` (completed iterations; the data order is a
  function of it), ``consumed_samples`` and ``parallel`` (``tp``, ``dp``; under NTP also the TP width of every
  replica and a digest of the unit layout) in ``common.pt``;
- ``rng_state``: one object per rank, restored only when the layout is the same as at save time.

What a load restores is Megatron-LM's choice (:class:`LoadPlan`): always the model weights; the iteration and
consumed samples unless ``checkpoint.finetune`` or the checkpoint has none (a model-only or ``release``
checkpoint: the run starts at iteration 0); optimizer and scheduler state only with the iteration, unless
``checkpoint.no_load_optim`` or the checkpoint has none (both start fresh); the RNG streams likewise, unless
``checkpoint.no_load_rng``. The launcher decides it once from the checkpoint's ``common.pt`` and metadata, says
it in one line, and pins it into the config the ranks read (:func:`read_progress`).

Under NTP each rank describes its units as fragments of the global tensors and exactly one replica writes
each piece (:mod:`ntp_megatron.core.checkpoint_map`), so what is on disk does not depend on the topology that wrote it:
any topology — another ``tp_base``, other dead slots, NTP off at any uniform TP, plain Megatron-Core code —
reads it, and NTP reads what plain Megatron-Core writes.

Crash safety: a checkpoint is written into its ``iter_*`` directory; only when every rank has finished does
rank 0 replace ``latest_checkpointed_iteration.txt`` atomically (temporary file, ``os.replace``). A kill
during a save leaves the previous latest checkpoint as it was.

Async saves (``checkpoint.async_save``, NTP off): the data written by a forked writer while training goes on, the
save completed on every rank once every writer has finished (:mod:`.save`).

The modules, each importing only modules named before it: :mod:`.format` (what is on disk and what a load
restores, as data: names, :class:`LoadPlan`, :class:`Progress`, :func:`plan_load`, :class:`CheckpointError`),
:mod:`.files` (directories, ``latest_checkpointed_iteration.txt``, finding a checkpoint, whether its files are
whole), :mod:`.sharded` (the sharded state dicts a save writes and a load requests, the layout's ``parallel``
entry), :mod:`.load` (:func:`read_progress` and :func:`load_checkpoint`), :mod:`.save` (:func:`save_checkpoint`,
sync and async). The names below are the package's public ones; everything else is imported from its module, and a
name with a leading underscore is this package's own (its modules share it; tests may reach it).

May import: :mod:`ntp_megatron.core`, :mod:`ntp_megatron.elastic.errors`, :mod:`ntp_megatron.patches`,
:mod:`ntp_megatron.phases` and Megatron-Core; nothing else of :mod:`ntp_megatron.training`.
"""

from ntp_megatron.training.checkpoint.files import (
    LATEST_FILE,
    iteration_dir,
    resolve_load_dir,
    restart_checkpoint,
    verify_checkpoint,
)
from ntp_megatron.training.checkpoint.format import FULL, CheckpointError, LoadPlan, ParallelCoords, Progress, plan_load
from ntp_megatron.training.checkpoint.load import check_shapes, load_checkpoint, read_progress
from ntp_megatron.training.checkpoint.save import save_checkpoint

__all__ = [
    "FULL",
    "LATEST_FILE",
    "CheckpointError",
    "LoadPlan",
    "ParallelCoords",
    "Progress",
    "check_shapes",
    "iteration_dir",
    "load_checkpoint",
    "plan_load",
    "read_progress",
    "resolve_load_dir",
    "restart_checkpoint",
    "save_checkpoint",
    "verify_checkpoint",
]
