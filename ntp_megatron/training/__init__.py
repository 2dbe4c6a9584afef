"""GPT pretraining on Megatron-Core: one rank's process (``ntp-pretrain``), started by the launcher."""
