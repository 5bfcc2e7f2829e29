"""Training of the models the evaluation suite measures (installed as ``kvpress_phase.training``).

- :mod:`.loop`: the training loop both trainers run (schedule, checkpoints, progress bar, export);
- :mod:`.train_builtin_model`: the built-in model, from scratch, with a curriculum
  (``python -m kvpress_phase.training.train_builtin_model``);
- :mod:`.finetune`: compression-aware fine-tuning of any causal LM with a press in the loop
  (``kvpress-phase train``);
- :mod:`.model_card`: the cards of the trained models, from their training logs and held-out evaluations.

Nothing is imported here, so that ``import kvpress_phase.training.loop`` stays light.
"""
