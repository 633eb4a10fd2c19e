"""Optimizers, parameter grouping, gradient clipping and learning-rate schedules."""

from collage_train.optim.adamw import AdamW
from collage_train.optim.blockwise_adamw import BlockwiseAdamW
from collage_train.optim.clipping import clip_grad_norm
from collage_train.optim.collage.adamw import CollageAdamW
from collage_train.optim.collage.eight_bit import Collage8bitAdamW
from collage_train.optim.kahan_adamw import KahanAdamW
from collage_train.optim.param_groups import decay_param_groups
from collage_train.optim.schedule import warmup_cosine_lr
from collage_train.optim.split_adamw import SplitMasterAdamW
from collage_train.optim.sr_adamw import StochasticRoundingAdamW

__all__ = [
    "AdamW",
    "BlockwiseAdamW",
    "Collage8bitAdamW",
    "CollageAdamW",
    "KahanAdamW",
    "SplitMasterAdamW",
    "StochasticRoundingAdamW",
    "clip_grad_norm",
    "decay_param_groups",
    "warmup_cosine_lr",
]
