"""The job's configuration: the YAML schema and its files, Megatron-LM's flags, the generated reference.

:mod:`.files` (YAML reading, ``--set`` overrides, one-line errors, exit code 2: the bottom of the package, imported
by anything that reports bad input), :mod:`.schema` (the pydantic schema of a training job), :mod:`.flags`
(Megatron-LM's command-line flags as overrides; unsupported ones refused by name), :mod:`.docs`
(docs/configuration.md from the schema's field docstrings).

May import: :mod:`ntp_megatron.plan` (a config computes its starting topology and memory plan). Pure: no torch.
"""
