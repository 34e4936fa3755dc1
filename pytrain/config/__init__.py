"""Run configuration: a TOML file (plus ``--set section.key=value`` overrides) as dataclasses.

Why strict: a misspelt key (``learning_rate`` for ``lr``) or a quoted number silently falling
back to a default is the same class of quiet bug as an unmasked loss, so every unknown key and
every wrong type is an error that names the key, the file and, when it can be found, the line.
Each field carries its help text in ``metadata["help"]`` (:func:`describe` prints them all).

Paths written in a file resolve against that file's folder, so a config and its data can move
together; paths given as overrides resolve against the working directory, as a shell user
expects.  Seeds left unset (``data.shuffle_seed``, ``lora.seed``) follow ``train.seed`` and are
stored resolved, so the saved config (:meth:`Config.to_toml`) reproduces the run.
"""

from pytrain.config.load import load_config
from pytrain.config.schema import (FORMATS, MASKS, MASKS_FOR_FORMAT, OUTPUT_FORMATS, REQUIRED,
                                   SECTIONS, Config, ConfigError, DataConfig, LoraConfig,
                                   ModelConfig, OutputConfig, TrainConfig, describe,
                                   mask_for)

__all__ = ["Config", "ConfigError", "DataConfig", "FORMATS", "LoraConfig", "MASKS",
           "MASKS_FOR_FORMAT", "ModelConfig", "OUTPUT_FORMATS", "OutputConfig", "REQUIRED",
           "SECTIONS", "TrainConfig", "describe", "load_config", "mask_for"]
