"""polyspec.bench: measuring chains, kept out of the engine (:mod:`polyspec.decode` imports nothing from here).

- :mod:`polyspec.bench.bench`: ``polyspec bench`` -- ar, dual, chain, hf, hf-assisted on the same prompts
- :mod:`polyspec.bench.prompts`: the built-in prompt categories and JSONL prompt files
- :mod:`polyspec.bench.report`: the table, JSON and plots of a bench run
- :mod:`polyspec.bench.shape_bench`: ``polyspec shape-bench`` -- a random model at a named shape
- :mod:`polyspec.bench.roofline`: measured read bandwidth and the batch-1 memory roofline

``python -m polyspec.bench ...`` is ``polyspec bench ...``.
"""
