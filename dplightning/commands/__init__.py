"""The commands of ``dplightning`` besides LightningCLI's own (each module has a ``main(argv) -> int``).

* :mod:`~dplightning.commands.export`: ``dplightning export``, Hugging Face folders carrying the run's (ε, δ);
* :mod:`~dplightning.commands.report`: ``dplightning privacy-report``, a checkpoint's privacy claim, recomputed;
* :mod:`~dplightning.commands.audit`: ``dplightning audit``, an empirical lower bound on ε from canaries;
* :mod:`~dplightning.commands.calibrate`: ``dplightning calibrate``, σ for a target ε without training;
* :mod:`~dplightning.commands.memory_plan`: ``dplightning memory-plan``, the per-GPU memory of a DP step;
* :mod:`~dplightning.commands.configs`: ``dplightning configs``, the shipped configs by name.

Nothing is imported here, so that one command loads only what it needs.
"""
