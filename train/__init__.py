"""polyspec.train: EAGLE-style draft heads trained on ShareGPT (issue: train/). Not implemented yet."""
