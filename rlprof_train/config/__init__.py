"""The trainer's configuration: the typed schema (:mod:`.schema`) and its defaults (``ppo_trainer.yaml``); loading
and validation are in :mod:`.load`."""

from rlprof_train.config.schema import TrainerConfig, as_dict

__all__ = ["TrainerConfig", "as_dict"]
