"""baseline_eval and post_eval: one evaluation (`evaluate`) for the model GSPO starts from and
the trained one, scored by the reward functions training optimised, and the before/after
report of post_eval (`report`)."""
