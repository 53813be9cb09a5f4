"""polyspec.train: EAGLE-style draft heads trained on ShareGPT with Lightning (the chain's bottom level).

``train_stage(recipe.train, TrainInputs(...), tracker=None) -> Path`` trains (or finds) the head and returns its folder;
``python -m polyspec.train RECIPE [a.b=v ...]`` runs it from the shell. Lightning is imported only when training
starts (see :mod:`polyspec.train.stage`).
"""

from polyspec.train.stage import train_stage

__all__ = ["train_stage"]
