"""The two training stages: the cold-start SFT (`sft`) and GSPO (`gspo`, with its resumable
`checkpoints`).

- `trainer/`: TRL's trainers subclassed, and everything the subclasses hook in (configs, the
  non-finite guard, compiled layers, the training attention, logs); both stages train with it.
- `rollout/`: the decoding speed-ups that only GSPO's rollouts run, a DVC dependency of
  train_gspo alone, so that editing them reruns no other stage."""
