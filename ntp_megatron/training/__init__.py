"""GPT pretraining on Megatron-Core: one rank's process (``ntp-pretrain``), started by the launcher.

:mod:`.pretrain` (the rank's entry point) and :mod:`.runtime` (process set-up); :mod:`.builder`, :mod:`.model` and
:mod:`.components` (model, optimizer and scheduler of a generation); :mod:`.parallel` (process groups and Megatron's
globals for NTP and for uniform TP); :mod:`.loop`, :mod:`.loop_state` and :mod:`.steps` (the training loop, its
state, one iteration's schedule); :mod:`.data` and :mod:`.preprocess` (datasets, Megatron's indexed format);
:mod:`.evaluation`; :mod:`.checkpoint` (save and load, a subpackage) and :mod:`.saving` (when the loop saves);
:mod:`.memory` (measured state bytes against the plan); :mod:`.verification` and :mod:`.inspect_state` (state
checksums and dumps); :mod:`.comm_stats`; :mod:`.boosting` (power boost of a degraded replica); :mod:`.spare` (a
warm spare waiting for its slot).

May import: :mod:`ntp_megatron.config`, :mod:`ntp_megatron.plan`, :mod:`ntp_megatron.core`,
:mod:`ntp_megatron.speed`, :mod:`ntp_megatron.elastic`, the patches and the cross-cutting top-level modules; never
:mod:`ntp_megatron.launch`, :mod:`ntp_megatron.sim` or :mod:`ntp_megatron.bench`.
"""
