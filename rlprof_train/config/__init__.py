"""The trainer's configuration: typed schema (:mod:`.schema`), defaults (``ppo_trainer.yaml``), loading."""

from rlprof_train.config.load import DEFAULTS, as_dict, load_trainer_config, merged_yaml, validate
from rlprof_train.config.schema import TrainerConfig

__all__ = ["DEFAULTS", "TrainerConfig", "as_dict", "load_trainer_config", "merged_yaml", "validate"]
