"""The job's configuration: typed sections (schema.py), read from YAML and overrides once (loading.py), documented
from the code (docs.py). `from colocate.config import JobConfig, load_config` is the way in."""

from colocate.config.docs import config_docs_markdown, field_docs
from colocate.config.loading import from_dict, load_config, to_dict
from colocate.config.schema import (
                                    AlgoConfig,
                                    CheckpointConfig,
                                    DataConfig,
                                    EngineConfig,
                                    EvalConfig,
                                    FaultConfig,
                                    JobConfig,
                                    LoggingConfig,
                                    ModelConfig,
                                    PlacementConfig,
                                    RolloutConfig,
                                    SyncConfig,
                                    TrainerConfig,
                                    chat_template_kwargs,
                                    engine_extra_args,
)
from colocate.config.critic import CriticConfig
from colocate.config.reward_model import RewardModelConfig
from colocate.errors import ConfigError

__all__ = ["AlgoConfig", "CheckpointConfig", "ConfigError", "CriticConfig", "DataConfig", "EngineConfig", "EvalConfig",
           "FaultConfig",
           "JobConfig", "LoggingConfig", "ModelConfig", "PlacementConfig", "RewardModelConfig", "RolloutConfig",
           "SyncConfig", "TrainerConfig", "chat_template_kwargs", "config_docs_markdown", "engine_extra_args",
           "field_docs", "from_dict", "load_config", "to_dict"]
