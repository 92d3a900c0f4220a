"""xtrain: a minimal PyTorch trainer core that does gradient accumulation right."""
from .config import PRESETS, ModelConfig, OptimConfig, TrainConfig
from .data import TokenStream, split_micro
from .model import GPT, build_model
from .trainer import AccumTrainer, make_optimizer, plain_step

__all__ = [
    "PRESETS", "ModelConfig", "OptimConfig", "TrainConfig", "TokenStream", "split_micro",
    "GPT", "build_model", "AccumTrainer", "make_optimizer", "plain_step",
]
