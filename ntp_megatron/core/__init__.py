"""NTP on Megatron-Core: the pieces one rank builds from a topology.

:mod:`.layers` and :mod:`.gpt` (unit-aware TP layers and the GPT model), :mod:`.init` (layout-free initial weights),
:mod:`.groups` (the planned torch.distributed groups made, installed into Megatron-Core), :mod:`.grad_sync`
(canonical-block gradient sync; a degraded rank's part in :mod:`.degraded_sync` over the slot-shaped shadows of
:mod:`.shadows`; the grad norm's tables in :mod:`.grad_norm`), :mod:`.pipeline` (boundaries between stages of different
TP degrees), :mod:`.unit_moves` (moving units' weights and optimizer state between layouts), :mod:`.checkpoint_map`
(units as dist_checkpointing fragments; which replica writes), :mod:`.adam_step` (where Adam's step counter lives).

May import: :mod:`ntp_megatron.plan`, :mod:`ntp_megatron.patches`, :mod:`ntp_megatron.config.files` and the
cross-cutting top-level modules; never elastic/, training/, launch/ (nothing here knows about failures).
"""
